"""fp16 autocast with a GradScaler: the scaler's scale and growth tracker are committed state, a
step whose scaled gradients overflow is skipped in recording and in replay alike, and a loop that
scales with a GradScaler of its own is stopped at record time. (On the CPU: torch's CPU autocast
and GradScaler; the same code runs on a GPU.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from witness.bundle.checkpoint import read_checkpoint
from witness.bundle.reader import open_bundle
from witness.cli import main
from witness.commit.signing import generate_key
from witness.record import Commitments, Recorder
from witness.record.selfcheck import SelfCheckFailed
from witness.task import StepOutput, build_task, registry
from witness.task.base import clip_whole
from witness.task.generic import GenericTask
from witness.verify import Policy, Verifier


class Loud(nn.Module):
    """Logits a hundred times too large: at the GradScaler's first scale (65536) the fp16 gradients
    overflow, so its first steps are skipped and the scale backs off."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 32), nn.Linear(32, 3)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x))) * 100.0


class HalfTask(GenericTask):
    name = "fp16-test"

    def make_model(self):
        return Loud()

    def make_dataset(self):
        g = torch.Generator().manual_seed(4)
        x = torch.randn(64, 8, generator=g)
        return [{"x": x[i], "y": x[i, :3].argmax()} for i in range(64)]

    def example_losses(self, outputs, batch):
        return F.cross_entropy(outputs.float(), batch["y"], reduction="none")


@pytest.fixture
def half(monkeypatch):
    monkeypatch.setitem(registry.BUILTIN, HalfTask.name, HalfTask)  # as a plugin would register it
    registry._built.cache_clear()
    yield build_task(HalfTask.name, {"steps": 8, "batch_size": 8, "precision": "fp16", "lr": 0.01})
    registry._built.cache_clear()


def _own_loop(rec, scaler):
    """nanoGPT's fp16 step: scale, backward, unscale, clip, step, update."""
    task = rec.task
    for t in range(task.config.steps):
        batch = rec.batch(t)
        for g in rec.optimizer.param_groups:
            g["lr"] = rec.lr(t)
        rec.optimizer.zero_grad(set_to_none=True)
        rec.model.train()
        loss = task.step_loss(rec.model, batch, rec.step_seed(t))
        scaler.scale(loss).backward()
        scaler.unscale_(rec.optimizer)
        gn = clip_whole([p for p in rec.model.parameters() if p.grad is not None], task.config.grad_clip)
        scaler.step(rec.optimizer)
        scaler.update()
        rec.log_step(t, StepOutput(float(loss.detach()), rec.lr(t), float(gn)))
    rec.finish()


def test_an_fp16_loop_with_the_runs_scaler_replays_its_skipped_steps_bit_for_bit(half, tmp_path):
    rec = Recorder.create(half, tmp_path / "run", generate_key(), r=b"\x01" * 32,
                          commit=Commitments(checkpoint_every=4))
    assert rec.scaler is not None and rec.scaler.get_scale() == 65536.0
    _own_loop(rec, rec.scaler)
    b = open_bundle(tmp_path / "run")
    skipped = [r.step for r in b.steps if not math.isfinite(r.grad_norm)]
    assert skipped and skipped[0] == 0 and len(skipped) < 8  # overflowed, backed off, then trained
    final = read_checkpoint(b.checkpoints[8])
    assert float(final["scaler.scale"]) < 65536.0  # the backed-off scale is committed state
    v = Verifier(policy=Policy(challenges=8, nonce=b"h")).verify(tmp_path / "run")
    assert v.accepted and v.replayed_steps == 8


def test_an_fp16_loop_with_a_scaler_of_its_own_is_stopped_at_step_0(half, tmp_path):
    rec = Recorder.create(half, tmp_path / "run", generate_key(), r=b"\x02" * 32,
                          commit=Commitments(checkpoint_every=4))
    with pytest.raises(SelfCheckFailed, match=r"loss scale \(scaler\.growth_tracker\)|rec\.scaler"):
        _own_loop(rec, torch.amp.GradScaler("cpu"))  # its state is nobody's commitment


def test_a_tinygpt_fp16_run_trains_and_verifies(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--task", "tinygpt", "--steps", "4", "--checkpoint-every", "2", "--quiet",
                 "--key", str(tmp_path / "k.pem"), "--out", str(out), "--config", "precision=fp16",
                 *[f"--config={k}={v}" for k, v in {"batch_size": 4, "block": 32, "n_layer": 1, "d_model": 32,
                                                    "n_head": 2, "probes": 2, "probe_len": 8,
                                                    "corpus_max_bytes": 100_000}.items()]]) == 0
    assert main(["verify", "--allow-weak", str(out), "--challenges", "4", "--json"]) == 0
    assert '"accepted": true' in capsys.readouterr().out
