"""What an online run kept for its selected steps: their states and samples, read strictly for replay."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..bundle.checkpoint import read_checkpoint
from ..bundle.layout import MAX_CHECKPOINT_BYTES
from ..bundle.reader import Bundle
from ..commit.hashing import parse_canonical_json
from ..data.leaves import DatasetLeaves
from ..errors import MalformedInput, VerificationError
from .response import MAX_SAMPLE_BYTES, ResponseSamples, ResponseStep

MAX_SAMPLES_JSON = 64 * 1024 * 1024


class OnlineStates:
    """The states a trainer kept for its selected steps (and the checkpoints, where one falls there)."""

    def __init__(self, bundle: Bundle):
        self.bundle = bundle

    def state(self, step: int) -> dict[str, torch.Tensor]:
        """The supplied state after ``step`` updates (a run over several ranks: its ranks' shares,
        joined; the caller checks what it gets against the committed hash either way)."""
        shares = self.bundle.online_shards.get(step)
        if shares is not None and step not in self.bundle.checkpoints:
            return join_shares(shares, self.bundle.manifest.world_size, step)
        path = self.bundle.online_states.get(step) or self.bundle.checkpoints.get(step)
        if path is None:
            raise VerificationError(f"the trainer kept no state after {step} update(s), which a selected step "
                                    "starts or ends at", step=step, check="online")
        return read_checkpoint(path)


def join_shares(shares: dict[int, Path], world: int, step: int) -> dict[str, torch.Tensor]:
    """A state from every rank's share of its rows: each tensor's shares joined along dim 0 in rank
    order (a 0-dimensional tensor is held whole by every rank, and must be the same on each). How
    the rows were split is not trusted: the joined state must hash to the committed root."""
    missing = [r for r in range(world) if r not in shares]
    if missing:
        raise VerificationError(f"the trainer kept no share of rank {missing[0]} of the state after {step} "
                                f"update(s), which a selected step starts or ends at ({len(missing)} of {world} "
                                "ranks' shares missing)", step=step, check="online")
    total = sum(shares[r].stat().st_size for r in range(world))
    if total > MAX_CHECKPOINT_BYTES:
        raise MalformedInput(f"the shares of the state after {step} update(s) are over {MAX_CHECKPOINT_BYTES} bytes")
    parts = [read_checkpoint(shares[r]) for r in range(world)]
    names = set(parts[0])
    if any(set(p) != names for p in parts[1:]):
        raise VerificationError(f"the ranks' shares of the state after {step} update(s) hold different tensors",
                                step=step, check="online")
    out = {}
    for name in sorted(names):
        pieces = [p[name] for p in parts]
        first = pieces[0]
        if any(t.dtype != first.dtype or t.dim() != first.dim() or t.shape[1:] != first.shape[1:] for t in pieces):
            raise VerificationError(f"the ranks' shares of {name} in the state after {step} update(s) do not fit "
                                    "together (dtype or shape)", step=step, check="online")
        if first.dim() == 0:
            # the same bytes on every rank (a NaN every rank holds is the same value, though NaN != NaN)
            if any(t.reshape(1).view(torch.uint8).tolist() != first.reshape(1).view(torch.uint8).tolist()
                   for t in pieces[1:]):
                raise VerificationError(f"the ranks hold different values of {name} in the state after {step} "
                                        "update(s)", step=step, check="online")
            out[name] = first
        else:
            out[name] = torch.cat(pieces)
    return out


class OnlineSamples:
    """The samples a trainer kept for its selected steps, each checked against the dataset's leaves."""

    def __init__(self, bundle: Bundle, leaves: DatasetLeaves, rule: str):
        self.bundle = bundle
        self.steps: dict[int, ResponseStep] = {}
        self._check = ResponseSamples(self, bundle.manifest.data_root, bundle.manifest.dataset_size,  # type: ignore[arg-type]
                                      bundle.end, leaves, rule)

    def samples(self, step: int, indices: Sequence[int], root: bytes) -> list[bytes]:
        """The batch of ``step`` from its samples file, every sample its committed leaf's."""
        path = self.bundle.online_samples.get(step)
        if path is None:
            raise VerificationError("the trainer kept no samples for this selected step", step=step, check="online")
        if path.stat().st_size > MAX_SAMPLES_JSON:
            raise MalformedInput(f"{path.name} is over {MAX_SAMPLES_JSON} bytes")
        try:
            obj = parse_canonical_json(path.read_bytes())
        except ValueError as e:
            raise MalformedInput(f"{path.name}: {e}") from None
        if not isinstance(obj, dict) or set(obj) != {"step", "indices", "samples"} or obj["step"] != step \
                or not isinstance(obj["indices"], list) or not isinstance(obj["samples"], list):
            raise MalformedInput(f"{path.name}: not the samples of step {step}")
        try:
            samples = [bytes.fromhex(s) for s in obj["samples"]]
        except (ValueError, TypeError) as e:
            raise MalformedInput(f"{path.name}: {e}") from None
        if any(len(s) > MAX_SAMPLE_BYTES for s in samples) or not all(type(i) is int for i in obj["indices"]):
            raise MalformedInput(f"{path.name}: bad indices or an oversized sample")
        self.steps[step] = ResponseStep(obj["indices"], samples, [[] for _ in samples], None)
        return self._check.samples(step, indices, root)
