"""``tinycnn``: a small convolutional classifier with BatchNorm, on synthetic 8x8 images.

It has what the other reference tasks lack: buffers (BatchNorm's running statistics, which the
state hash must cover and the probes must not touch) and a kernel whose gradients depend on the
thread count (the first convolution's weight and bias gradients), so exact replay needs the
run's own thread count.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from ..data.synthetic import SyntheticClassification
from .base import Task, init_parameters


@dataclass(frozen=True)
class TinyCNNConfig:
    """Recipe of the ``tinycnn`` task."""

    steps: int = 40
    batch_size: int = 16
    dataset_size: int = 1024
    side: int = 8
    channels: int = 8
    classes: int = 4
    lr: float = 0.01
    warmup: int = 5
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    fingerprint_dims: int = 4
    sketch_dims: int = 8


class CNN(nn.Module):
    """Two convolutions, each with BatchNorm and ReLU, global average pooling, a linear head."""

    def __init__(self, c: TinyCNNConfig):
        super().__init__()
        # no bias before BatchNorm: it would only learn from rounding noise (BN removes the mean)
        self.conv1 = nn.Conv2d(1, c.channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c.channels)
        self.conv2 = nn.Conv2d(c.channels, 2 * c.channels, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * c.channels)
        self.head = nn.Linear(2 * c.channels, c.classes)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Logits (no randomness: ``generator`` is unused)."""
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return self.head(h.mean(dim=(2, 3)))


class TinyCNNTask(Task):
    """CNN on ``SyntheticClassification`` samples read as square images."""

    name = "tinycnn"
    Config = TinyCNNConfig

    def check_limits(self) -> None:
        """Refuse shapes no verifier should be made to build."""
        super().check_limits()
        c = self.config
        if not (4 <= c.side <= 64 and 1 <= c.channels <= 64 and 2 <= c.classes <= 16):
            raise ValueError("tinycnn shape out of range")

    @cached_property
    def _dataset(self) -> SyntheticClassification:
        c = self.config
        return SyntheticClassification(c.dataset_size, c.side * c.side, c.classes, seed=b"tinycnn")

    def dataset(self) -> SyntheticClassification:
        """The synthetic training images."""
        return self._dataset

    @cached_property
    def _eval(self) -> SyntheticClassification:
        c = self.config
        return SyntheticClassification(256, c.side * c.side, c.classes, seed=b"tinycnn", split=b"eval")

    def eval_dataset(self) -> SyntheticClassification:
        """256 held-out images of the same teacher."""
        return self._eval

    def build_model(self, seed: bytes) -> nn.Module:
        """CNN with seed-derived weights; BatchNorm starts as the identity (gain 1, bias 0)."""
        model = CNN(self.config)
        init_parameters(model, seed, std=0.3)
        with torch.no_grad():
            for bn in (model.bn1, model.bn2):
                bn.weight.fill_(1.0)
        return model

    def collate(self, samples: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixels scaled to about [-2, 2] as ``[B, 1, side, side]``, and labels."""
        n = self.config.side * self.config.side
        raw = torch.tensor([list(s[:n]) for s in samples], dtype=torch.uint8).view(torch.int8)
        x = (raw.to(torch.float32) / 64.0).view(-1, 1, self.config.side, self.config.side)
        return x, torch.tensor([s[n] for s in samples], dtype=torch.long)

    def loss(self, model, batch, generator):
        """Cross-entropy."""
        x, y = batch
        return F.cross_entropy(model(x), y)

    def probe_bytes(self) -> list[bytes]:
        """Eight fixed probe images, with a label byte for the probe loss."""
        n = self.config.side * self.config.side
        return [bytes(((i * 53 + j * 29) % 256) for j in range(n)) + bytes([i % self.config.classes]) for i in range(8)]

    def probe_outputs(self, model, probes):
        """Logits on the probe images."""
        return model(probes[0])

    def probe_losses(self, outputs, probes):
        """Per-probe cross-entropy."""
        return F.cross_entropy(outputs, probes[1], reduction="none")

    @torch.no_grad()
    def eval_example(self, model, sample: bytes) -> dict:
        """Loss, predicted class, correctness."""
        x, y = self.collate([sample])
        logits = model(x)
        pred = int(logits.argmax(dim=-1))
        return {"loss": float(F.cross_entropy(logits, y)), "prediction": pred, "correct": pred == int(y)}

    def flops_per_step(self) -> float:
        """Forward multiply-adds of both convolutions and the head, times 6 (forward and backward)."""
        c = self.config
        conv1 = c.side * c.side * 9 * c.channels
        conv2 = (c.side // 2) ** 2 * 9 * c.channels * 2 * c.channels
        return 6.0 * (conv1 + conv2 + 2 * c.channels * c.classes) * c.batch_size
