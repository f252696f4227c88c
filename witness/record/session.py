"""One training state and the committed way to advance it: shared by recorder and verifier."""

from __future__ import annotations

import platform
from typing import Any

import torch

from ..data.order import batch_indices, step_seed
from ..fingerprint.probes import Fingerprint
from ..fingerprint.sketch import ParameterSketch
from ..task.base import StepOutput, Task


class TrainingSession:
    """A model, its optimizer, and the seed-bound data order of one run."""

    def __init__(self, task: Task, run_seed: bytes, dataset_size: int):
        self.task = task
        self.run_seed = run_seed
        self.dataset_size = dataset_size
        self.model = task.build_model(run_seed)
        self.optimizer = task.build_optimizer(self.model)
        self.sketcher = ParameterSketch(run_seed, task.config.sketch_dims)

    def batch_indices(self, step: int) -> list[int]:
        """The committed batch of ``step``: a function of the run seed only."""
        return batch_indices(self.run_seed, step, self.task.config.batch_size, self.dataset_size)

    def step_seed(self, step: int) -> int:
        """Seed of the randomness inside ``step``."""
        return step_seed(self.run_seed, step)

    def lr(self, step: int) -> float:
        """The schedule's learning rate at ``step``."""
        return self.task.schedule.at(step)

    def step(self, step: int, batch: Any) -> StepOutput:
        """Run the task's step function exactly as recorded runs do."""
        return self.task.train_step(self.model, self.optimizer, batch, self.lr(step), self.step_seed(step))

    def fingerprint(self) -> Fingerprint:
        """Behavioral fingerprint of the current model."""
        return self.task.fingerprint(self.model)

    def sketch(self) -> list[float]:
        """Parameter sketch of the current model."""
        return self.sketcher(dict(self.model.named_parameters()))


def environment() -> dict:
    """Library versions and determinism settings, for the manifest."""
    return {
        "versions": {"python": platform.python_version(), "torch": torch.__version__.split("+")[0]},
        "determinism": {
            "device": "cpu",
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "layernorm": "hand-written (thread-invariant)",
        },
    }
