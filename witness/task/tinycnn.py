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
from .base import init_parameters
from .tiny import SyntheticClassifierTask


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


class TinyCNNTask(SyntheticClassifierTask):
    """CNN on ``SyntheticClassification`` samples read as square images."""

    name = "tinycnn"
    Config = TinyCNNConfig
    SEED = b"tinycnn"
    PROBE_MIX = (53, 29)

    @property
    def features(self) -> int:
        """One byte per pixel."""
        return self.config.side * self.config.side

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Pixels as ``[B, 1, side, side]`` images."""
        return x.view(-1, 1, self.config.side, self.config.side)

    def check_limits(self) -> None:
        """Refuse shapes no verifier should be made to build."""
        super().check_limits()
        c = self.config
        if not (4 <= c.side <= 64 and 1 <= c.channels <= 64 and 2 <= c.classes <= 16):
            raise ValueError("tinycnn shape out of range")

    @cached_property
    def _dataset(self) -> SyntheticClassification:
        c = self.config
        return SyntheticClassification(c.dataset_size, self.features, c.classes, seed=self.SEED)

    def dataset(self) -> SyntheticClassification:
        """The synthetic training images."""
        return self._dataset

    def build_model(self, seed: bytes) -> nn.Module:
        """CNN with seed-derived weights; BatchNorm starts as the identity (gain 1, bias 0)."""
        model = CNN(self.config)
        init_parameters(model, seed, std=0.3)
        with torch.no_grad():
            for bn in (model.bn1, model.bn2):
                bn.weight.fill_(1.0)
        return model

    def flops_per_step(self) -> float:
        """Forward multiply-adds of both convolutions and the head, times 6 (forward and backward)."""
        c = self.config
        conv1 = c.side * c.side * 9 * c.channels
        conv2 = (c.side // 2) ** 2 * 9 * c.channels * 2 * c.channels
        return 6.0 * (conv1 + conv2 + 2 * c.channels * c.classes) * c.batch_size
