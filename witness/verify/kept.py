"""What an online run kept for its selected steps: their states and samples, read strictly for replay."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..bundle.checkpoint import read_checkpoint
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
        """The supplied state after ``step`` updates."""
        path = self.bundle.online_states.get(step) or self.bundle.checkpoints.get(step)
        if path is None:
            raise VerificationError(f"the trainer kept no state after {step} update(s), which a selected step "
                                    "starts or ends at", step=step, check="online")
        return read_checkpoint(path)


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
