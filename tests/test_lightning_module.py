"""Lightning with the user's own LightningModule: its training_step and configure_optimizers are
the recipe's step (a plugin names the module), trained by a stock Trainer with accumulation,
gradient_clip_val, a per-step scheduler and dropout, and replayed bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from witness.commit.signing import generate_key
from witness.integrations.lightning import LightningTask, WitnessCallback, committed_loader
from witness.record import Commitments, Recorder
from witness.task import build_task, registry
from witness.task.generic import GenericConfig
from witness.verify import Policy, Verifier


class LitClassifier(L.LightningModule):
    """A LightningModule as people write them (nothing of witness in it)."""

    def __init__(self, hidden: int = 16, lr: float = 0.01, dropout: float = 0.2, interval: str = "step"):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["x"]), batch["y"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + 0.25 * t))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.hparams.interval}}


@dataclass(frozen=True)
class LitConfig(GenericConfig):
    steps: int = 8
    batch_size: int = 8
    lr: float = 0.01
    hidden: int = 16
    dropout: float = 0.2
    interval: str = "step"


class LitTask(LightningTask):
    name = "lit-test"
    Config = LitConfig
    module = LitClassifier

    def make_dataset(self):
        g = torch.Generator().manual_seed(5)
        x = torch.randn(96, 8, generator=g)
        return [{"x": x[i], "y": (x[i, :3].argmax())} for i in range(96)]


@pytest.fixture
def lit(monkeypatch):
    monkeypatch.setitem(registry.BUILTIN, LitTask.name, LitTask)  # as a plugin would register it
    registry._built.cache_clear()
    yield
    registry._built.cache_clear()


KW = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
          enable_model_summary=False)


def _fit(rec, **trainer):
    trainer.setdefault("gradient_clip_val", rec.task.config.grad_clip)
    L.Trainer(max_steps=rec.task.config.steps, callbacks=[WitnessCallback(rec)], **KW, **trainer).fit(
        rec.model, train_dataloaders=committed_loader(rec))


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_your_own_lightning_module_replays_bit_for_bit(lit, tmp_path, interval):
    task = build_task("lit-test", {"grad_accum": 2, "grad_clip": 0.5, "interval": interval})
    rec = Recorder.create(task, tmp_path / "run", generate_key(), r=b"\x03" * 32,
                          commit=Commitments(checkpoint_every=4))
    assert isinstance(rec.model, LitClassifier)
    _fit(rec, accumulate_grad_batches=2)
    assert len(rec.self_check.report()["steps"]) == 2  # two of its steps replayed as they were recorded
    lrs = [task.lr_at(t) for t in range(8)]
    assert (lrs[0] == lrs[-1]) == (interval == "epoch")  # per step, the scheduler's; per epoch, one rate
    v = Verifier(policy=Policy(challenges=8, nonce=b"lit")).verify(tmp_path / "run")
    assert v.accepted and v.replayed_steps == 8
    assert len(rec.optimizer.state) == 4  # the optimizer Lightning stepped is the recorder's (its state committed)


def test_a_tampered_lightning_module_run_is_rejected(lit, tmp_path):
    from helpers import log_lines, resign

    from witness.commit.hashing import canonical_json
    from witness.errors import RunRejected

    key = generate_key()
    rec = Recorder.create(build_task("lit-test", {}), tmp_path / "run", key, r=b"\x04" * 32,
                          commit=Commitments(checkpoint_every=4))
    _fit(rec)
    lines = log_lines(tmp_path / "run")
    import json

    rec3 = json.loads(lines[3])
    rec3["loss"] = rec3["loss"] * 0.5  # a step that reports half its loss, re-signed by the trainer
    lines[3] = canonical_json(rec3)
    resign(tmp_path / "run", key, lines)
    with pytest.raises(RunRejected, match="replayed loss"):
        Verifier(policy=Policy(challenges=8, nonce=b"t")).verify(tmp_path / "run")


def test_lightning_settings_off_the_recipe_are_refused_before_the_first_step(lit, tmp_path):
    task = build_task("lit-test", {"grad_clip": 0.5})
    for i, (trainer, why) in enumerate([
        ({"gradient_clip_val": None}, "gradient_clip_val must be the recipe's grad_clip"),
        ({"gradient_clip_val": 0.5, "accumulate_grad_batches": 2}, "accumulate_grad_batches=1"),
        ({"gradient_clip_val": 0.5, "precision": "bf16-mixed"}, "precision 'bf16-mixed' is not the recipe's 'fp32'"),
    ]):
        rec = Recorder.create(task, tmp_path / f"r{i}", generate_key(), r=b"\x05" * 32,
                              commit=Commitments(checkpoint_every=4))
        with pytest.raises(ValueError, match=why):
            _fit(rec, **trainer)
    rec = Recorder.create(task, tmp_path / "other", generate_key(), r=b"\x05" * 32,
                          commit=Commitments(checkpoint_every=4))
    with pytest.raises(ValueError, match="train the recorder's model"):
        L.Trainer(max_steps=8, gradient_clip_val=0.5, callbacks=[WitnessCallback(rec)], **KW).fit(
            LitClassifier(), train_dataloaders=committed_loader(rec))
