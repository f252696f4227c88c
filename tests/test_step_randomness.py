"""Every step's randomness is the committed step seed: a model that draws from torch's global
generator (``nn.Dropout``, SDPA's ``dropout_p``) or Python's or NumPy's replays bit for bit, and
the caller's own streams go on as if the step had drawn nothing."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch

from witness.cli import main
from witness.task import registry
from witness.task.base import step_randomness

PLUGIN = '''"""A plugin task whose model draws dropout masks from torch's global generator."""

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from witness.task.generic import GenericTask


class Noisy(nn.Module):
    """Dropout as people write it: nn.Dropout, SDPA's dropout_p, and a little noise from Python's
    and NumPy's global generators."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = self.drop(torch.relu(self.inp(x)))
        q = h.view(-1, 1, 2, 4)
        h = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3 if self.training else 0.0).reshape(-1, 8)
        if self.training:
            h = h * (1 + 0.01 * random.random()) * float(1 + 0.01 * np.random.rand())
        return self.out(h)


class DropoutTask(GenericTask):
    """Two-class toy data through the noisy model."""

    name = "dropout-test"

    def make_model(self):
        return Noisy()

    def make_dataset(self):
        g = torch.Generator().manual_seed(0)
        return [{"x": torch.randn(4, generator=g), "y": torch.tensor(i % 2)} for i in range(64)]
'''


@pytest.fixture
def site(tmp_path, monkeypatch):
    """The plugin, installed on a path the registry sees."""
    path = tmp_path / "site"
    pkg = path / "witness_dropout_demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(PLUGIN)
    info = path / "witness_dropout_demo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: witness-dropout-demo\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[witness.tasks]\ndropout-test = witness_dropout_demo:DropoutTask\n")
    monkeypatch.syspath_prepend(str(path))
    yield path
    sys.modules.pop("witness_dropout_demo", None)
    registry._built.cache_clear()


def test_a_step_that_draws_global_randomness_repeats_bit_for_bit(site):
    task = registry.build_task("dropout-test", {"steps": 4, "batch_size": 8})
    batch = task.collate([task.dataset().sample_bytes(i) for i in range(8)])

    def step(seed: int) -> tuple[float, list[torch.Tensor]]:
        model = task.build_model(b"\x01" * 32)
        opt = task.build_optimizer(model)
        out = task.train_step(model, opt, batch, 0.1, seed)
        return out.loss, [p.detach().clone() for p in model.parameters()]

    runs = [step(7) for _ in range(5)]
    assert len({loss for loss, _ in runs}) == 1  # before: five different losses
    assert all(torch.equal(a, b) for _, ps in runs[1:] for a, b in zip(runs[0][1], ps, strict=True))
    assert step(8)[0] != runs[0][0]  # another step seed, other masks


def test_the_callers_own_streams_go_on_as_if_the_step_drew_nothing():
    def draws() -> tuple:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    want = draws()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with step_randomness(123):
        inside = draws()
    assert draws() == want
    with step_randomness(123):
        assert draws() == inside  # the block's draws are a function of the seed alone
    with step_randomness(124):
        assert draws() != inside


def test_a_run_with_global_dropout_is_recorded_and_verified_exactly(site, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--task", "dropout-test", "--steps", "8", "--checkpoint-every", "4", "--quiet",
                 "--config", "batch_size=8", "--key", str(tmp_path / "k.pem"), "--out", str(out)]) == 0
    capsys.readouterr()
    for extra in ([], ["--tolerance"]):
        assert main(["verify", str(out), "--challenges", "8", "--json", *extra]) == 0, capsys.readouterr().err
        capsys.readouterr()
    assert main(["verify", str(out), "--mode", "offline", "--challenges", "8"]) == 0
    assert "ACCEPTED" in capsys.readouterr().out
