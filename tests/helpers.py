"""Helpers shared by the tests: honest and dishonest runs of the small task."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from witness.commit.signing import generate_key
from witness.record import Recorder
from witness.task import build_task

TINY = {"steps": 40}


def train_tiny(out: Path, key=None, *, r: bytes = b"\x07" * 32, checkpoint_every: int = 10,
               config: dict | None = None, cheat: Callable | None = None) -> Path:
    """Train the tiny task; ``cheat(rec, t, batch) -> StepOutput | None`` may replace any step."""
    task = build_task("tiny", dict(TINY, **(config or {})))
    rec = Recorder.create(task, out, key or generate_key(), r=r, checkpoint_every=checkpoint_every)
    for t in range(task.config.steps):
        batch = rec.batch(t)
        out_ = cheat(rec, t, batch) if cheat else None
        if out_ is None:
            out_ = task.train_step(rec.model, rec.optimizer, batch, rec.lr(t), rec.step_seed(t))
        rec.log_step(t, out_)
    rec.finish()
    return out


def resign_certificate(cert: dict, key) -> dict:
    """An evaluation certificate with its body (possibly edited) signed again by ``key``."""
    from witness.evals.certificate import sign_certificate

    return sign_certificate({k: v for k, v in cert.items() if k not in ("signature", "evaluator")}, key)
