"""What witnessing adds to a Lightning step: the same ``lightning.Trainer`` run of tinygpt with
and without the witness module and callback, alternated in one process.

The plain run is a ``LightningModule`` computing the same task step (same model, optimizer,
loss, clipping) on a shuffled ``DataLoader``; the witnessed one runs ``TaskModule`` on the
committed order with ``WitnessCallback`` recording every step (fingerprint, sketch, whole-state
hash, one log line). A step is timed from one batch-start callback to the next.

    python bench/lightning_overhead.py [--rounds 2] [--steps 10] [--batch-size 16] [--json out.json]
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import torch
from common import compare_runs, time_hooks

from witness.commit.signing import generate_key
from witness.integrations.lightning import TaskModule, WitnessCallback
from witness.record import Commitments, Recorder, SelfChecking
from witness.task import build_task
from witness.task.base import clip_whole

CONFIG = {"batch_size": 16, "block": 128, "n_layer": 4, "n_head": 8, "d_model": 256, "warmup": 2,
          "probes": 4, "probe_len": 16, "corpus_max_bytes": 2_000_000}


class StepTimes(L.Callback):
    """Wall time from one batch's start to the next one's (every callback inside)."""

    def __init__(self):
        self.times: list[float] = []
        self.last: float | None = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


class Plain(L.LightningModule):
    """The task's step as an ordinary LightningModule would write it."""

    def __init__(self, task):
        super().__init__()
        self.task, self.net = task, task.build_model(b"\x01" * 32)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([self.task.dataset().sample_bytes(i) for i in range(len(self.task.dataset()))],
                                           batch_size=self.task.config.batch_size, shuffle=True,
                                           collate_fn=self.task.collate)

    def configure_optimizers(self):
        return self.task.build_optimizer(self.net)

    def training_step(self, batch, batch_idx):
        for g in self.optimizers().param_groups:
            g["lr"] = self.task.schedule.at(self.global_step)
        return self.task.loss(self.net, batch, torch.Generator().manual_seed(self.global_step))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        clip_whole([p for p in self.net.parameters() if p.grad is not None], self.task.config.grad_clip)


def run(witnessed: bool, steps: int, out: Path) -> list[float]:
    """Per-step times of one run (the first two left out: warm-up)."""
    task = build_task("tinygpt", dict(CONFIG, steps=steps))
    timer = StepTimes()
    kw = dict(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
    if witnessed:
        rec = Recorder.create(task, out / "run", generate_key(), r=b"\x01" * 32,
                              commit=Commitments(checkpoint_every=steps),
                              self_check=SelfChecking(enabled=False))  # steady-state step cost only
        cb = WitnessCallback(rec)
        time_hooks(cb, ("on_train_batch_start", "on_train_batch_end"))
        L.Trainer(callbacks=[timer, cb], **kw).fit(TaskModule(rec))
    else:
        L.Trainer(callbacks=[timer], **kw).fit(Plain(task))
    return timer.times[2:]


def main() -> dict:
    return compare_runs(__doc__, run, CONFIG, rounds=2, steps=10)


if __name__ == "__main__":
    main()
