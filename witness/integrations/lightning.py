"""PyTorch Lightning: a ``LightningModule`` that runs a task's committed steps, and the
``Callback`` that records them, so that ``witness verify`` replays a Lightning run bit for bit.

    rec = Recorder.create(build_task("tinygpt", recipe), "run", key, r=os.urandom(32))
    trainer = L.Trainer(max_steps=recipe["steps"], callbacks=[WitnessCallback(rec)], ...)
    trainer.fit(TaskModule(rec))

``TaskModule`` is the task as Lightning sees it: the recorder's model and optimizer, the
committed order as its data loader, each step's committed learning rate and dropout generator,
and the task's gradient clipping (whose norm the record keeps). Lightning's automatic
optimisation then computes exactly the task's step: forward, backward, clip, update.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from ..task.base import StepOutput, clip_whole, mean_of_ranks, micro_seed
from .committed import CommittedDataset, CommittedOrder, same_batch


class TaskModule(L.LightningModule):
    """A recorder's task, trained by Lightning."""

    def __init__(self, rec: Any):
        super().__init__()
        self.rec, self.task = rec, rec.task
        self.net = rec.model  # registered as a submodule: Lightning puts it in train mode
        self.seen: dict[str, float] = {}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        """The committed order, one batch per step (one micro-batch per ``accumulate_grad_batches``
        of a recipe that accumulates), collated by the task."""
        c = self.task.config
        return torch.utils.data.DataLoader(CommittedDataset(self.rec), batch_size=c.batch_size // self.task.grad_accum,
                                           sampler=CommittedOrder(self.rec), collate_fn=self.task.collate)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The recorder's optimizer; the learning rate is set per step from the committed schedule."""
        return self.rec.optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The task's loss on the committed (micro-)batch, at the committed learning rate and seed;
        Lightning divides it by ``accumulate_grad_batches`` before the backward, as replay does."""
        t, accum = self.global_step, self.task.grad_accum
        for group in self.rec.optimizer.param_groups:
            group["lr"] = self.rec.lr(t)
        seed = self.rec.step_seed(t) if accum == 1 else micro_seed(self.rec.step_seed(t), batch_idx % accum)
        # the step's randomness and the recipe's precision, exactly as Task.train_step (which replay runs)
        loss = self.task.step_loss(self.net, batch, seed)
        self.seen.setdefault("losses", []).append(float(loss.detach()))
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """The task's clipping (Lightning's ``gradient_clip_val``, where set, is the recipe's: the
        callback checks it), keeping the norm for the record."""
        params = [p for p in self.net.parameters() if p.grad is not None]
        max_norm = self.task.config.grad_clip if self.task.config.grad_clip > 0 else float("inf")
        self.seen["grad_norm"] = float(clip_whole(params, max_norm))


class WitnessCallback(L.Callback):
    """Check each batch against the commitment, record each step, sign the end."""

    def __init__(self, rec: Any):
        self.rec = rec

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Refuse settings that would make the run differ from the task's step."""
        if not isinstance(module, TaskModule) or module.rec is not self.rec:
            raise ValueError("train the recorder's TaskModule: its step is what the log commits")
        c = self.rec.task.config
        clip = trainer.gradient_clip_val
        if clip not in (None, 0, 0.0, c.grad_clip) or trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(f"gradient_clip_val must be the recipe's grad_clip ({c.grad_clip}), by norm, or unset "
                             "(the task clips either way)")
        if trainer.accumulate_grad_batches != self.rec.task.grad_accum or trainer.max_steps != c.steps:
            raise ValueError(f"use max_steps={c.steps} and accumulate_grad_batches={self.rec.task.grad_accum} "
                             "(the recipe's grad_accum: its micro-batches are what replay accumulates)")
        self._micro: list[Any] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        """The (micro-)batch must be the committed one."""
        t, accum = trainer.global_step, self.rec.task.grad_accum
        if batch_idx % accum == 0:  # rec.batch also notes what the record commits
            whole = self.rec.batch(t)
            self._micro = [whole] if accum == 1 else self.rec.task.split_batch(whole, accum)
        if not same_batch(batch, self._micro[batch_idx % accum]):
            raise ValueError(f"step {t}: the batch is not the committed one")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        """Record the step that was just taken (after its last micro-batch)."""
        if (batch_idx + 1) % self.rec.task.grad_accum:
            return
        t = trainer.global_step - 1
        seen = module.seen
        losses = seen.pop("losses")
        loss = losses[0] if len(losses) == 1 else mean_of_ranks(losses)
        self.rec.log_step(t, StepOutput(loss, self.rec.lr(t), seen.pop("grad_norm")))

    def on_train_end(self, trainer, module) -> None:
        """The end record and the final signed head."""
        self.rec.finish()
