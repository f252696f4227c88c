"""The recorder under torchrun: every rank trains its micro-batch, rank 0 writes the one log.

Usage, inside a script started by ``torchrun`` after ``dist.init_process_group``::

    rec = DistRecorder(task, "run/", key, r=r, checkpoint_every=50, parallelism="fsdp")
    for t in range(task.config.steps):
        batch = rec.batch(t)                 # this rank's share of the committed global batch
        out = rec.train_step(t, batch)       # forward, backward (the wrapper averages), clip, step
        rec.log_step(t, out)                 # collectives, then rank 0 appends the record
    rec.finish()
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..bundle.layout import due
from ..data.order import derive_run_seed
from ..record.recorder import HeadCallback, Recorder
from ..task.base import StepOutput, Task
from .session import DistSession


class DistRecorder:
    """Witnesses a DDP or FSDP2 run: the global batch is the ranks' micro-batches in rank order."""

    def __init__(self, task: Task, out: str | os.PathLike, key: Ed25519PrivateKey | None, *, r: bytes,
                 checkpoint_every: int = 50, state_every: int | None = None, parallelism: str = "ddp",
                 on_head: HeadCallback | None = None):
        """``state_every`` defaults to every step under DDP (rank 0 holds the whole state) and to
        ``checkpoint_every`` under FSDP2, where committing a state gathers it from every rank."""
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed (torchrun) before the recorder")
        self.task = task
        dataset = task.dataset()
        self.session = DistSession(task, derive_run_seed(dataset.root, r), len(dataset), parallelism)
        self.rank = self.session.rank
        self.checkpoint_every = checkpoint_every
        self.state_every = state_every or (checkpoint_every if parallelism == "fsdp" else 1)
        self.inner: Recorder | None = None
        if self.rank == 0:
            if key is None:
                raise ValueError("rank 0 signs the log: it needs the key")
            self.inner = Recorder.create(task, out, key, r=r, checkpoint_every=checkpoint_every,
                                         state_every=self.state_every, session=self.session,
                                         init_state=self.session.init_state, parallelism=parallelism,
                                         on_head=on_head)
        dist.barrier()

    @property
    def model(self):
        """The wrapped model."""
        return self.session.model

    @property
    def optimizer(self):
        """Its optimizer."""
        return self.session.optimizer

    def batch(self, step: int) -> Any:
        """This rank's micro-batch of the committed global batch of ``step``, collated."""
        ds = self.task.dataset()
        idx = self.session.batch_indices(step)
        if self.inner is not None:
            self.inner.expect(step, idx, ds.batch_root(idx))
        return self.task.collate([ds.sample_bytes(i) for i in self.session.my_share(idx)])

    def train_step(self, step: int, batch: Any) -> StepOutput:
        """The task's step on this rank's micro-batch, with this rank's dropout seed."""
        return self.session.local_step(step, batch)

    def log_step(self, step: int, out: StepOutput) -> None:
        """Collectives (loss, fingerprint, sketch, the state where it is committed), then rank 0 records."""
        committed = due(step, self.state_every, self.task.config.steps)
        total = self.session.global_output(out)
        fp = self.session.fingerprint()
        sketch = self.session.sketch()
        state = self.session.full_state() if committed else None
        if self.inner is not None:
            self.inner.log_step(step, total, fingerprint=fp, sketch=sketch, state=state,
                                live=self.session.holds_whole_state())

    def finish(self) -> None:
        """Rank 0 signs the end; everyone waits for it."""
        if self.inner is not None:
            self.inner.finish()
        dist.barrier()
