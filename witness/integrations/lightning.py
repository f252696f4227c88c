"""PyTorch Lightning: the ``Callback`` that records a Lightning run so that ``witness verify``
replays it bit for bit, with either of two modules.

**Your own ``LightningModule``** (``LightningTask``): a plugin names the module and its data; the
module's ``training_step`` and ``configure_optimizers`` are the recipe's step, and replay runs
them as Lightning's automatic optimisation does, without a ``Trainer``::

    rec = Recorder.create(build_task("my-lit", recipe), "run", key, r=os.urandom(32))
    trainer = L.Trainer(max_steps=recipe["steps"], callbacks=[WitnessCallback(rec)], ...)
    trainer.fit(rec.model, train_dataloaders=committed_loader(rec))   # rec.model: your module

**A task's own step** (``TaskModule``): any registered task as Lightning sees it: the recorder's
model and optimizer, the committed order as its data loader, each step's committed learning rate
and dropout generator, and the task's gradient clipping (whose norm the record keeps)::

    trainer.fit(TaskModule(rec))
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import fields
from functools import cached_property
from typing import Any, ClassVar

import lightning as L
import torch
from torch import nn

from ..task.base import (
    StepOutput,
    clip_whole,
    mean_of_ranks,
    micro_seed,
    model_device,
    step_randomness,
)
from ..task.generic import GenericTask
from .committed import CommittedDataset, CommittedOrder, check_same_dataset, same_batch


class LightningTask(GenericTask):
    """A task whose step is a ``LightningModule``'s own: set ``module`` to its class (built with the
    recipe fields its ``__init__`` takes, weights drawn from the run seed) and ``make_dataset`` to its
    data (a ``collate``/``samples`` that gives the batches its ``training_step`` takes).

    Replay runs what Lightning's automatic optimisation runs: ``training_step(batch, 0)`` under the
    step's randomness (its loss, or a dict's ``"loss"``), divided by the recipe's ``grad_accum``
    before each backward; the gradient norm over the optimizer's parameters in its order, clipped by
    the recipe's ``grad_clip`` (Lightning's ``gradient_clip_val``) as Lightning clips; then
    ``optimizer.step()``. The optimizer is the one ``configure_optimizers`` returns, and the learning
    rate of each step is what its scheduler gives there (stepped per step, or per epoch: a witnessed
    run is one epoch), recorded and checked against the optimizer at every step. A step's recorded
    loss is the sum of the micro-batch losses so divided (Lightning's loss, summed over the window).
    ``training_step`` must not read ``self.trainer``: replay has none.
    """

    module: ClassVar[type[L.LightningModule]]

    def module_args(self) -> dict[str, Any]:
        """The recipe fields the module's ``__init__`` takes, by name."""
        taken = inspect.signature(self.module.__init__).parameters
        return {f.name: getattr(self.config, f.name) for f in fields(self.config) if f.name in taken}

    @classmethod
    def recipe_from(cls, settings: dict, model: nn.Module | None = None) -> dict:
        """The recipe from the run's own objects: the module's hyperparameters (``save_hyperparameters``)
        that are recipe fields, and from ``settings``, a ``"trainer"`` (its ``max_steps``,
        ``accumulate_grad_batches``, ``gradient_clip_val``), a ``"loader"`` (its ``batch_size``, a
        micro-batch) and any recipe field by name."""
        names = {f.name for f in fields(cls.Config)}
        hparams = dict(getattr(model, "hparams", {}) or {})
        out = {k: v for k, v in hparams.items() if k in names}
        trainer, loader = settings.get("trainer"), settings.get("loader")
        accum = 1
        if trainer is not None:
            accum = trainer.accumulate_grad_batches
            out.update(steps=trainer.max_steps, grad_accum=accum, grad_clip=float(trainer.gradient_clip_val or 0.0))
        if loader is not None:
            out["batch_size"] = loader.batch_size * accum
        return out | {k: v for k, v in settings.items() if k in names}

    def make_model(self) -> nn.Module:
        """The user's module, from the recipe."""
        return self.module(**self.module_args())

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer the module's ``configure_optimizers`` returns. The module keeps what it
        returned: when Lightning asks again it gets the same optimizer (whose state the log commits)
        and scheduler, not new ones."""
        out = model.configure_optimizers()
        model.configure_optimizers = lambda: out
        return _configured(out)[0]

    def loss(self, model: nn.Module, batch: Any, generator: torch.Generator | None) -> torch.Tensor:
        """The module's ``training_step`` loss."""
        with warnings.catch_warnings():  # self.log without a Trainer warns, and does nothing
            warnings.filterwarnings("ignore", message=".*self.log.*")
            out = model.training_step(batch, 0)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise ValueError("training_step must return the loss (a tensor, or a dict with 'loss') at every step")
        return loss

    @cached_property
    def _lrs(self) -> list[float]:
        # the scheduler's learning rate at every step, stepped as Lightning steps it
        module = self.build_model(b"\0" * 32)
        opt, sched, interval, frequency = _configured(module.configure_optimizers())
        out = []
        for t in range(self.config.steps):
            rates = {float(g["lr"]) for g in opt.param_groups}
            if len(rates) != 1:
                raise ValueError(f"the optimizer's parameter groups have learning rates {sorted(rates)} at step {t}: "
                                 "a witnessed step has one learning rate")
            out.append(rates.pop())
            opt.step()
            if sched is not None and interval == "step" and (t + 1) % frequency == 0:
                sched.step()
        return out

    def lr_at(self, step: int) -> float:
        """The learning rate ``configure_optimizers`` gives at ``step``."""
        return self._lrs[step]

    def train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, lr: float, seed: int,
                   clip: Any = None) -> StepOutput:
        """Lightning's automatic optimisation of one step (see the class)."""
        if clip is not None:
            raise ValueError("a Lightning module's run is replayed on one process")
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        model.train()
        accum, value = self.grad_accum, 0.0
        parts = [batch] if accum == 1 else self.split_batch(batch, accum)
        for k, micro in enumerate(parts):
            loss = self.step_loss(model, micro, seed if accum == 1 else micro_seed(seed, k)) / accum
            loss.backward()
            value += float(loss.detach())
        gn = lightning_clip(optimizer, self.config.grad_clip)
        optimizer.step()
        return StepOutput(value, lr, float(gn))


def lightning_clip(optimizer: torch.optim.Optimizer, clip: float) -> torch.Tensor:
    """The gradient norm over the optimizer's parameters in its order, and clipping by it where
    ``clip`` is set, as Lightning's ``gradient_clip_val`` does (``clip_grad_norm_``)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
    return norm


def _configured(out: Any) -> tuple[torch.optim.Optimizer, Any, str, int]:  # noqa: ANN401 - what it returned
    """The one optimizer a ``configure_optimizers`` returned, its scheduler (or None), the
    scheduler's interval and frequency."""
    sched: Any = None
    if isinstance(out, Mapping):
        opt, sched = out.get("optimizer"), out.get("lr_scheduler")
    elif isinstance(out, (list, tuple)) and len(out) == 2 and isinstance(out[0], (list, tuple)):
        (opts, scheds) = out
        if len(opts) != 1 or len(scheds) > 1:
            raise ValueError("a witnessed Lightning module has one optimizer and at most one scheduler")
        opt, sched = opts[0], scheds[0] if scheds else None
    elif isinstance(out, (list, tuple)):
        if len(out) != 1:
            raise ValueError("a witnessed Lightning module has one optimizer")
        opt = out[0]
    else:
        opt = out
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError("configure_optimizers must give a torch.optim optimizer")
    interval, frequency = "epoch", 1
    if isinstance(sched, Mapping):
        interval, frequency = sched.get("interval", "epoch"), int(sched.get("frequency", 1))
        sched = sched.get("scheduler")
    return opt, sched, interval, frequency


def committed_loader(rec: Any, loader: torch.utils.data.DataLoader | None = None) -> torch.utils.data.DataLoader:
    """The committed order as a data loader: one (micro-)batch per step and ``grad_accum``, collated
    by the task (pass it as ``trainer.fit(model, train_dataloaders=committed_loader(rec, loader))``).
    ``loader``: the script's own, whose dataset must be the committed one (checked here) and whose
    micro-batch size must be the recipe's."""
    task = rec.task
    if loader is not None:
        if loader.batch_size != task.config.batch_size // task.grad_accum:
            raise ValueError(f"the loader's batch_size is {loader.batch_size}; the recipe's micro-batch is "
                             f"{task.config.batch_size // task.grad_accum}")
        if loader.collate_fn is not torch.utils.data.default_collate:
            raise ValueError("the loader's collate_fn is the script's own: a witnessed run collates the committed "
                             "samples as the task does (replay can do no other); leave collate_fn unset and give "
                             "the plugin samples that collate to what it gave")
        check_same_dataset(rec, loader.dataset)
    return torch.utils.data.DataLoader(CommittedDataset(rec), batch_size=task.config.batch_size // task.grad_accum,
                                       sampler=CommittedOrder(rec), collate_fn=task.collate)


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
        return committed_loader(self.rec)

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


PRECISIONS = {"fp32": ("32-true", "32"), "bf16": ("bf16-mixed",)}


class WitnessCallback(L.Callback):
    """Check each batch against the commitment, record each step, sign the end."""

    def __init__(self, rec: Any):
        self.rec = rec
        self.own = isinstance(rec.task, LightningTask)  # the user's module, not a TaskModule
        self._randomness = ExitStack()
        self._loss, self._norm = 0.0, None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Refuse settings that would make the run differ from the task's step."""
        c = self.rec.task.config
        clip = trainer.gradient_clip_val
        if self.rec.task.precision == "fp16":
            raise ValueError("fp16 under Lightning is not replayed (its GradScaler is not the run's committed one): "
                             "train in fp32 or bf16, or fp16 in your own loop with rec.scaler")
        if self.rec.task.compiles:
            raise ValueError("a recipe with compile=True is for witness's own step and your loop (rec.step_model); "
                             "under Lightning, leave it out")
        if self.own:
            if module is not self.rec.model:
                raise ValueError("train the recorder's model (rec.model: your LightningModule, built from the recipe "
                                 "with the run seed's weights): its step is what the log commits")
            if (clip or 0) != c.grad_clip or trainer.gradient_clip_algorithm not in (None, "norm"):
                raise ValueError(f"gradient_clip_val must be the recipe's grad_clip ({c.grad_clip}; 0 or unset for "
                                 "none), by norm: Lightning clips, and replay clips as it does")
            if str(trainer.precision) not in PRECISIONS[self.rec.task.precision]:
                raise ValueError(f"the Trainer's precision {trainer.precision!r} is not the recipe's "
                                 f"{self.rec.task.precision!r} ({PRECISIONS[self.rec.task.precision][0]})")
        elif not isinstance(module, TaskModule) or module.rec is not self.rec:
            raise ValueError("train the recorder's TaskModule: its step is what the log commits")
        elif clip not in (None, 0, 0.0, c.grad_clip) or trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(f"gradient_clip_val must be the recipe's grad_clip ({c.grad_clip}), by norm, or unset "
                             "(the task clips either way)")
        if trainer.accumulate_grad_batches != self.rec.task.grad_accum or trainer.max_steps != c.steps:
            raise ValueError(f"use max_steps={c.steps} and accumulate_grad_batches={self.rec.task.grad_accum} "
                             "(the recipe's grad_accum: its micro-batches are what replay accumulates)")
        self._micro: list[Any] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        """The (micro-)batch must be the committed one; your module's step runs under its seed."""
        t, accum = trainer.global_step, self.rec.task.grad_accum
        if batch_idx % accum == 0:  # rec.batch also notes what the record commits
            whole = self.rec.batch(t)
            self._micro = [whole] if accum == 1 else self.rec.task.split_batch(whole, accum)
            self._loss, self._norm = 0.0, None
            if self.own:
                rates = sorted({float(g["lr"]) for g in self.rec.optimizer.param_groups})
                if rates != [self.rec.lr(t)]:
                    raise ValueError(f"step {t}: the optimizer's learning rate is {rates}, the committed schedule's "
                                     f"{self.rec.lr(t)!r} (configure_optimizers' scheduler, stepped per step)")
        if not same_batch(batch, self._micro[batch_idx % accum]):
            raise ValueError(f"step {t}: the batch is not the committed one")
        if self.own:
            seed = self.rec.step_seed(t)
            seed = seed if accum == 1 else micro_seed(seed, batch_idx % accum)
            self._randomness.enter_context(step_randomness(seed, model_device(module)))

    def on_before_backward(self, trainer, module, loss) -> None:
        """Your module's loss, as Lightning divided it: the step's randomness ends with it."""
        if self.own:
            self._randomness.close()
            self._loss += float(loss.detach())

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        """The gradient norm Lightning's clipping is about to compute (the same, over the same)."""
        if self.own:
            self._norm = float(lightning_clip(optimizer, 0.0))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        """Record the step that was just taken (after its last micro-batch)."""
        self._randomness.close()
        if (batch_idx + 1) % self.rec.task.grad_accum:
            return
        t = trainer.global_step - 1
        if self.own:
            if self._norm is None:
                raise ValueError(f"step {t} took no optimizer step (training_step returned None?): a witnessed step "
                                 "updates the model")
            self.rec.log_step(t, StepOutput(self._loss, self.rec.lr(t), self._norm))
            return
        seen = module.seen
        losses = seen.pop("losses")
        loss = losses[0] if len(losses) == 1 else mean_of_ranks(losses)
        self.rec.log_step(t, StepOutput(loss, self.rec.lr(t), seen.pop("grad_norm")))

    def on_train_end(self, trainer, module) -> None:
        """The end record and the final signed head."""
        self.rec.finish()
