"""A witness task plugin: a small BatchNorm CNN telling horizontal from vertical bars."""

from dataclasses import dataclass

import torch
from torch import nn
from witness.task.generic import GenericConfig, GenericTask


@dataclass(frozen=True)
class Config(GenericConfig):
    steps: int = 40
    lr: float = 0.01
    channels: int = 8


def bars(n: int, seed: int) -> list[dict]:
    """``n`` noisy 12x12 images of a horizontal (label 0) or vertical (label 1) bar."""
    g, out = torch.Generator().manual_seed(seed), []
    for i in range(n):
        x, at = torch.randn(1, 12, 12, generator=g) * 0.3, int(torch.randint(0, 12, (1,), generator=g))
        (x[0, at, :] if i % 2 == 0 else x[0, :, at]).add_(1.0)
        out.append({"x": x, "y": torch.tensor(i % 2)})
    return out


class ShapesCNN(GenericTask):
    name = "example-cnn"
    Config = Config

    def make_model(self) -> nn.Module:
        c = self.config.channels
        return nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 2))

    def make_dataset(self) -> list[dict]:
        return bars(512, seed=1)

    def make_eval_dataset(self) -> list[dict]:
        return bars(128, seed=2)
