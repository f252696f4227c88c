"""A seeded linear sketch of the parameters: linear, so sketches of shards sum to the whole."""

from __future__ import annotations

import torch

from ..commit.hashing import tagged_hash


class ParameterSketch:
    """``k`` Gaussian projections of every parameter tensor, accumulated in float64."""

    def __init__(self, seed: bytes, k: int = 8):
        self.seed, self.k = seed, k
        self._rows: dict[str, torch.Tensor] = {}

    def rows(self, name: str, numel: int) -> torch.Tensor:
        """The (k x numel) projection for one named tensor; drawn once, then cached."""
        r = self._rows.get(name)
        if r is None or r.shape[1] != numel:
            s = int.from_bytes(tagged_hash("witness/sketch/v1", self.seed, name.encode())[:8], "big") >> 1
            g = torch.Generator().manual_seed(s)
            r = torch.randn(self.k, numel, generator=g, dtype=torch.float32).to(torch.float64)
            self._rows[name] = r
        return r

    @torch.no_grad()
    def __call__(self, named_tensors: dict[str, torch.Tensor]) -> list[float]:
        """The sketch of a state, as ``k`` floats."""
        acc = torch.zeros(self.k, dtype=torch.float64)
        for name in sorted(named_tensors):
            t = named_tensors[name].detach().reshape(-1)
            if not t.is_floating_point():
                continue
            acc += self.rows(name, t.numel()) @ t.to(torch.float64)
        return [float(x) for x in acc.tolist()]
