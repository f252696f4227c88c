"""The behavioral fingerprint: a model's outputs on a small committed probe set."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..commit.hashing import tagged_hash


@dataclass(frozen=True)
class Fingerprint:
    """Per-probe loss, a seeded low-dimensional projection of the outputs, and a digest of them."""

    probe_loss: tuple[float, ...]
    projection: tuple[float, ...]
    digest: str

    def to_json(self) -> dict:
        """JSON form stored in a step record."""
        return {"probe_loss": list(self.probe_loss), "projection": list(self.projection), "digest": self.digest}

    def vector(self) -> list[float]:
        """The numeric part, for tolerance-mode distances."""
        return [*self.probe_loss, *self.projection]


def relative_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """||a - b|| / ||b||: how far a replayed (or served) vector is from the recorded one."""
    if len(a) != len(b):
        return math.inf
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    den = math.sqrt(sum(y * y for y in b))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def projection_matrix(seed: bytes, width: int, dims: int) -> torch.Tensor:
    """A fixed Gaussian (width x dims) matrix, derived from the probe-set hash."""
    g = torch.Generator().manual_seed(int.from_bytes(tagged_hash("witness/projection/v1", seed)[:8], "big") >> 1)
    return torch.randn(width, dims, generator=g, dtype=torch.float32) / width**0.5


def fingerprint_from_outputs(outputs: torch.Tensor, losses: torch.Tensor, proj: torch.Tensor) -> Fingerprint:
    """Build a fingerprint from probe outputs ``[P, ..., width]`` and per-probe losses ``[P]``."""
    out = outputs.detach().to(torch.float32).cpu().contiguous()
    flat = out.reshape(out.shape[0], -1, out.shape[-1])
    projected = (flat @ proj).mean(dim=1).reshape(-1)
    digest = hashlib.sha256(out.numpy().tobytes()).hexdigest()
    return Fingerprint(
        tuple(float(x) for x in losses.detach().to(torch.float32).tolist()),
        tuple(float(x) for x in projected.tolist()),
        digest,
    )
