"""``tiny``: a small MLP classifier on synthetic data; milliseconds per step, for fast tests."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..data.synthetic import SyntheticClassification
from .base import Task, init_parameters


@dataclass(frozen=True)
class TinyConfig:
    """Recipe of the ``tiny`` task."""

    steps: int = 60
    batch_size: int = 16
    dataset_size: int = 1024
    features: int = 8
    hidden: int = 32
    classes: int = 4
    dropout: float = 0.1
    lr: float = 0.01
    warmup: int = 5
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # A contaminated recipe, for tests and demonstrations: the last `leak_eval` training samples
    # are evaluation samples.
    leak_eval: int = 0
    fingerprint_dims: int = 4
    sketch_dims: int = 8


class MLP(nn.Module):
    """Two-layer perceptron with dropout driven by an explicit generator."""

    def __init__(self, c: TinyConfig):
        super().__init__()
        self.fc1 = nn.Linear(c.features, c.hidden)
        self.fc2 = nn.Linear(c.hidden, c.classes)
        self.p = c.dropout

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Logits."""
        h = F.gelu(self.fc1(x))
        if self.p > 0 and generator is not None:
            h = h * (torch.rand(h.shape, generator=generator) >= self.p) / (1 - self.p)
        return self.fc2(h)


class SyntheticClassifierTask(Task):
    """A classifier on ``SyntheticClassification`` samples: what ``tiny`` and ``tinycnn`` share.

    Subclasses say how many feature bytes a sample has, which seed draws the data, and how the
    features are shaped for their model (``inputs``).
    """

    SEED: ClassVar[bytes]
    PROBE_MIX: ClassVar[tuple[int, int]]  # probe j of feature i is (i * a + j * b) mod 256
    rebuilds_data = True  # the samples are drawn from SEED and the recipe: any verifier draws them again

    @property
    def features(self) -> int:
        """Feature bytes per sample."""
        raise NotImplementedError

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Features ``[B, features]`` as the model's input (a subclass may reshape them)."""
        return x

    @cached_property
    def _eval(self) -> SyntheticClassification:
        return SyntheticClassification(256, self.features, self.config.classes, seed=self.SEED, split=b"eval")

    def eval_dataset(self) -> SyntheticClassification:
        """256 held-out samples of the same teacher, drawn from a separate stream."""
        return self._eval

    def collate(self, samples: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """Features scaled to about [-2, 2], and labels."""
        f = self.features
        raw = torch.tensor([list(s[:f]) for s in samples], dtype=torch.uint8).view(torch.int8)
        return self.inputs(raw.to(torch.float32) / 64.0), torch.tensor([s[f] for s in samples], dtype=torch.long)

    def loss(self, model, batch, generator):
        """Cross-entropy."""
        x, y = batch
        return F.cross_entropy(model(x, generator), y)

    def probe_bytes(self) -> list[bytes]:
        """Eight fixed probe points (labels are part of the bytes but only used for the loss)."""
        a, b = self.PROBE_MIX
        return [bytes(((i * a + j * b) % 256) for j in range(self.features)) + bytes([i % self.config.classes])
                for i in range(8)]

    def probe_outputs(self, model, probes):
        """Logits on the probe points."""
        return model(probes[0])

    def probe_losses(self, outputs, probes):
        """Per-probe cross-entropy."""
        return F.cross_entropy(outputs, probes[1], reduction="none")

    # A contest track scores a submitted method here, with the targets kept from it: the method sees each
    # evaluation sample with its label byte zeroed (``hidden``) and sends its logits back; ``score`` reads
    # them against the true label, in the registered task's own code.
    hides_targets = True

    def hidden(self, sample: bytes) -> bytes:
        """The sample as a method being scored sees it: its features, its label byte zeroed."""
        return sample[: self.features] + b"\0"

    def score(self, outputs: torch.Tensor, sample: bytes) -> dict:
        """What ``eval_example`` gives, from the logits a method sent for ``hidden(sample)``."""
        if outputs.shape != (self.config.classes,) or not outputs.is_floating_point() \
                or not bool(torch.isfinite(outputs).all()):
            raise ValueError(f"the outputs are not {self.config.classes} finite logits")
        return _result(outputs.to(torch.float32).unsqueeze(0), torch.tensor([sample[self.features]]))

    @torch.no_grad()
    def eval_example(self, model, sample: bytes) -> dict:
        """Loss, predicted class, correctness."""
        x, y = self.collate([sample])
        return _result(model(x), y)


def _result(logits: torch.Tensor, y: torch.Tensor) -> dict:
    """One example's loss, predicted class and correctness, from its logits (a batch of one)."""
    pred = int(logits.argmax(dim=-1))
    return {"loss": float(F.cross_entropy(logits, y)), "prediction": pred, "correct": pred == int(y)}


class TinyTask(SyntheticClassifierTask):
    """MLP on ``SyntheticClassification``."""

    name = "tiny"
    Config = TinyConfig
    SEED = b"tiny"
    PROBE_MIX = (37, 11)

    @property
    def features(self) -> int:
        """The recipe's feature count."""
        return self.config.features

    @cached_property
    def _dataset(self) -> SyntheticClassification:
        c = self.config
        return SyntheticClassification(c.dataset_size, c.features, c.classes, leak=self._eval if c.leak_eval else None,
                                       leak_count=c.leak_eval)

    def dataset(self) -> SyntheticClassification:
        """The synthetic training set."""
        return self._dataset

    def check_limits(self) -> None:
        """Leaked samples must fit in both sets."""
        super().check_limits()
        if not 0 <= self.config.leak_eval <= min(self.config.dataset_size, 256):
            raise ValueError("leak_eval is out of range")

    def build_model(self, seed: bytes) -> nn.Module:
        """MLP with seed-derived weights."""
        model = MLP(self.config)
        init_parameters(model, seed, std=0.3)
        return model

    def flops_per_step(self) -> float:
        """6 * params * samples."""
        c = self.config
        params = c.features * c.hidden + c.hidden + c.hidden * c.classes + c.classes
        return 6.0 * params * c.batch_size
