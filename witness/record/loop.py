"""Witnessing a training loop as it is written: the user's own model, optimizer and batches.

``Recorder.create(..., training=Training(model=model, optimizer=optimizer))`` (or ``start_run``)
adopts the loop's own objects: the model's weights are set, in place, to the initial state the
task's plugin builds from the run seed (what a verifier rebuilds), and the optimizer is checked
against the recipe's. Then
``get_batch = rec.batches(get_batch)`` (or ``loader = rec.batches(loader)``) hands the loop the
committed batches, and the loop needs nothing else: hooks on the model and the optimizer record
each step when ``optimizer.step()`` returns.

What the hooks do, each because replay must compute what the loop computed:

* a batch handed out is the committed one of its step, split into the recipe's micro-batches in
  order (the loop asks for them one at a time, as nanoGPT's ``get_batch`` is asked, prefetching
  included);
* a forward on a handed-out micro-batch runs with torch's, Python's and NumPy's global generators
  seeded from that micro-batch's committed seed (so ``nn.Dropout`` draws the masks replay draws);
  they get their own state back when the step is recorded;
* the forward's output gives the micro-batch's loss (``task.loss_from``), and at the end of the
  last micro-batch's backward the gradients' total norm is taken, as the clipping takes it, before
  the loop clips;
* ``optimizer.step()`` returning writes the step's record: the micro losses' mean, the learning
  rate the optimizer held, the norm.

A forward or a batch asked for without gradients (an evaluation, ``@torch.no_grad()``), or a call
``get_batch("val")``, is the loop's own: it goes to the original function and nothing is seeded.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..task.base import mean_of_ranks, micro_seed, model_device, to_device
from .adopted import adopt_model, check_optimizer

# the hooks on a model or optimizer (by the object): at most one recorder's at a time
HOOKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def off_by_one_hint(steps: int) -> str:
    """What to say when a loop takes a step beyond its recipe (nanoGPT's loop takes max_iters + 1)."""
    return (f"the recipe has {steps} steps (0..{steps - 1}). nanoGPT's train.py takes max_iters + 1 steps: it "
            "breaks when iter_num > max_iters, after training step max_iters; give the recipe steps = max_iters + 1, "
            "or break at iter_num >= max_iters")


def unhook(*objs: Any) -> None:  # noqa: ANN401 - a model or an optimizer (or None)
    """Take down any recorder's hooks still on these objects: a run that failed before (a notebook's
    second start) gives its hooks up, and the global generators their own state."""
    for obj in objs:
        old = HOOKED.get(obj) if obj is not None else None
        if old is not None:
            old.close()


def adopt(session: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:  # noqa: ANN401
    """Make the loop's own model (and optimizer) the session's: the model takes the initial state
    the session built, and the optimizer (the recipe's, built on the loop's model, where the loop
    has none) must step as the recipe's does."""
    task = session.task
    unhook(model, optimizer)
    adopt_model(model, session.model)
    if optimizer is None:
        optimizer = task.build_optimizer(model)
        optimizer.witness_built = True  # the loop's own, built inside its loop, may take its place (Hooked)
    else:
        check_optimizer(optimizer, model, session.optimizer, session.model)
    scaler = getattr(session.optimizer, "witness_scaler", None)
    if scaler is not None:
        optimizer.witness_scaler = scaler
    session.model, session.optimizer = model, optimizer
    session.step_model = task.step_model(model)


def _no_hook(*args: Any, **kwargs: Any) -> None:  # noqa: ANN401 - any hook's arguments
    """What a recording hook is in a pickled copy of the model: nothing."""


class _Hook:
    """A recording hook that a pickle leaves out: ``torch.save(model)`` of a hooked model saves the
    model, not the recorder (its key, its files, its threads), and the copy loaded records nothing."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - the hook's own
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple:
        return _no_hook_factory, ()


def _no_hook_factory() -> Callable[..., None]:
    return _no_hook


class Hooked:
    """The hooks that record a loop's steps from its own model and optimizer (see the module)."""

    def __init__(self, rec: Any, model: torch.nn.Module,  # noqa: ANN401 - the Recorder
                 optimizer: torch.optim.Optimizer, ranks: tuple[int, int] = (0, 1)):
        """``ranks``: this process's rank and the world size, under torchrun (DDP): each rank trains
        its own ``grad_accum / world`` of each step's micro-batches (``witness.task.ranks``)."""
        task = rec.task
        if task.precision == "fp16":
            raise ValueError("an fp16 loop scales its gradients: take the batches with rec.batch(t) and record each "
                             "step with rec.log_step (the hooks cannot see the unscaled gradient norm)")
        self.rec, self.model, self.optimizer = rec, model, optimizer
        rank, self.world = ranks
        self.parts_of_step = task.grad_accum  # the step's batch, split as one process splits it
        if self.parts_of_step % self.world:
            raise ValueError(f"gradient_accumulation_steps ({self.parts_of_step}) must be a multiple of the "
                             f"{self.world} ranks: each rank trains an equal share of every step's micro-batches")
        self.accum = self.parts_of_step // self.world  # this rank's micro-batches of a step
        self.first = rank * self.accum  # the first of them, in the step's order
        self.steps = task.config.steps
        self.device = model_device(model)
        self.handed = rec.start_step * self.accum  # micro-batches handed out so far, counting from step 0
        self.parts: dict[int, list[Any]] = {}  # step -> its micro-batches, while they are handed out
        # a handed-out tensor, by id, -> (it, step, micro-batch index, the micro-batch, its version when handed
        # out): kept until its step is recorded
        self.live: dict[int, tuple[torch.Tensor, int, int, Any, int]] = {}
        self.losses: dict[int, float] = {}  # this step's micro-batch -> its loss
        self.norm: float | None = None
        self.saved: tuple | None = None  # the generators' own states while a step owns them
        self.step = rec.start_step  # the step the optimizer takes next
        self.ready = -1  # the last step whose committed batch the recorder was told of
        self.queued = False  # the gradient norm's callback, queued by the step's last backward
        unhook(model, optimizer)
        HOOKED[model] = HOOKED[optimizer] = self
        self.params = {id(p) for p in model.parameters()}
        self.handles = [
            model.register_forward_pre_hook(_Hook(self._pre), with_kwargs=True),
            model.register_forward_hook(_Hook(self._post), with_kwargs=True),
            register_optimizer_step_pre_hook(_Hook(self._any_step)),
            optimizer.register_step_post_hook(_Hook(self._stepped)),
        ]

    def close(self) -> None:
        """Remove the hooks and give the generators back their own state."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for obj in (self.model, self.optimizer):
            if HOOKED.get(obj) is self:
                del HOOKED[obj]
        self._give_back()

    # --- batches --------------------------------------------------------------------------
    def next_micro(self) -> Any:  # noqa: ANN401 - a collated micro-batch
        """The next committed micro-batch, on the model's device (None past the recipe's steps)."""
        step, k = divmod(self.handed, self.accum)
        if step >= self.steps:
            return None
        if step not in self.parts:
            batch = self.rec.committed_batch(step)
            whole = self.parts_of_step
            self.parts[step] = self.rec.task.split_batch(batch, whole)[self.first:self.first + self.accum] \
                if whole > 1 else [batch]
        part = to_device(self.parts[step][k], self.device)
        if k == self.accum - 1:
            del self.parts[step]
        self.handed += 1
        for t in _tensors(part):
            self.live[id(t)] = (t, step, k, part, t._version)
        return part

    # --- the model's hooks ------------------------------------------------------------------
    def _which(self, args: tuple, kwargs: dict) -> tuple | None:
        for t in _tensors((args, kwargs)):
            hit = self.live.get(id(t))
            if hit is not None and hit[0] is t:
                if any(x._version != v for x, v in self._versions(hit[3])):
                    raise ValueError(f"step {hit[1]}'s committed micro-batch {hit[2]} was changed in place before the "
                                     "forward (e.g. targets masked): a verifier replays the committed batch as it "
                                     "was handed out; change it in the model's forward or the task's loss instead")
                return hit[1:4]
        return None

    def _versions(self, part: Any) -> list[tuple[torch.Tensor, int]]:  # noqa: ANN401 - a micro-batch
        return [(v[0], v[4]) for v in self.live.values() if v[3] is part]

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return
        hit = self._which(args, kwargs)
        if hit is None:
            return
        step, k, _ = hit
        if step != self.step:
            raise ValueError(f"a forward on step {step}'s batch while step {self.step} is being trained: take the "
                             "batches in order, one step's micro-batches before the next step's")
        if self.ready != step:  # once a step, before its first forward: the state it starts from
            self.rec.ready_for(step)
            self.ready = step
        if self.world > 1:  # DDP adds the ranks' gradients once a step, after each rank's last micro-batch
            self.rec.check_sync(None, k == self.accum - 1)
        if self.saved is None:
            self.saved = _generators()
        seed = self.rec.step_seed(step)
        _seed_generators(seed if self.parts_of_step == 1 else micro_seed(seed, self.first + k), self.device)

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, outputs: Any) -> None:  # noqa: ANN401
        if not torch.is_grad_enabled():
            return
        hit = self._which(args, kwargs)
        if hit is None or hit[0] != self.step:
            return
        _, k, batch = hit
        with torch.no_grad():
            self.losses[k] = float(self.rec.task.loss_from(outputs, batch).detach())
        if k == self.accum - 1:  # the last micro-batch: its backward leaves the step's gradients
            self.queued = False
            for t in _tensors(outputs):
                if t.requires_grad:  # whichever output the loop's loss is made from
                    t.register_hook(self._backward_started)

    def _backward_started(self, grad: torch.Tensor) -> None:
        # runs as the last micro-batch's backward reaches an output; the engine calls the callback when
        # that whole backward is done, with every gradient in place and before the loop clips them
        if not self.queued:
            self.queued = True
            queue = torch.autograd.Variable._execution_engine.queue_callback
            # under DDP the gradients are the ranks' mean only once the reducer's own callback, queued
            # later in this backward, has run: queued from a callback, the norm is taken after it
            queue(self._take_norm if self.world == 1 else lambda: queue(self._take_norm))

    def _take_norm(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.norm = float(torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)) if grads else 0.0

    # --- the optimizer's hooks --------------------------------------------------------------------
    def _any_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Before any optimizer steps: one the recorder was not given that steps this model (a Trainer
        that builds its own inside its loop, as minGPT's ``Trainer.run`` does) is adopted at its first
        step where the loop gave none and it is the recipe's, and refused at once otherwise (it would
        train steps that no record covers)."""
        if optimizer is self.optimizer or not any(id(p) in self.params for g in optimizer.param_groups
                                                  for p in g["params"]):
            return
        if not getattr(self.optimizer, "witness_built", False) or self.step != self.rec.start_step \
                or self.optimizer.state:
            raise ValueError(
                f"the loop stepped an optimizer ({type(optimizer).__name__}) that the recorder was not given: a "
                "Trainer that builds its own optimizer inside its loop (minGPT's Trainer.run) steps one that no "
                "record covers. Give start_run no optimizer (the loop's own is then adopted at its first step), "
                "or the very one the loop steps: docs/recorder.md, 'Loops built inside a Trainer'")
        check_optimizer(optimizer, self.model, self.optimizer, self.model)
        self.handles.pop().remove()  # the post hook of the recipe's own, which the loop never steps
        HOOKED.pop(self.optimizer, None)
        scaler = getattr(self.optimizer, "witness_scaler", None)
        if scaler is not None:
            optimizer.witness_scaler = scaler
        self.optimizer = self.rec.session.optimizer = optimizer
        HOOKED[optimizer] = self
        self.handles.append(optimizer.register_step_post_hook(_Hook(self._stepped)))

    def _stepped(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        step = self.step
        if step >= self.steps:
            raise ValueError(f"the loop took step {step}: {off_by_one_hint(self.steps)}")
        if len(self.losses) == self.accum and self.norm is None:
            raise ValueError(f"step {step}: the backward of its last micro-batch did not reach the model's output "
                             "(no gradient norm was taken before the optimizer stepped)")
        if len(self.losses) != self.accum:
            raise ValueError(f"step {step} ran a forward and backward on {len(self.losses)} of its {self.accum} "
                             "committed micro-batch(es): the loop must train each step on the batches "
                             "rec.batches hands it, in order (a batch asked for under torch.no_grad(), or for "
                             "another split than 'train', is the loop's own, for evaluation)")
        rates = {g["lr"] for g in optimizer.param_groups}
        if len(rates) != 1:
            raise ValueError(f"step {step} ran with {len(rates)} learning rates in its parameter groups; the recipe "
                             "has one schedule")
        from ..task.base import StepOutput

        out = StepOutput(mean_of_ranks([self.losses[k] for k in range(self.accum)]), float(rates.pop()), self.norm)
        self.losses, self.norm = {}, None
        self.live = {i: v for i, v in self.live.items() if v[1] > step}
        self._give_back()
        self.step = step + 1
        self.rec.log_step(step, out)

    def _give_back(self) -> None:
        if self.saved is not None:
            _set_generators(self.saved)
            self.saved = None


def _tensors(x: Any) -> Iterator[torch.Tensor]:  # noqa: ANN401 - a batch or a model's outputs
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, dict) or hasattr(x, "items") and hasattr(x, "keys"):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def _generators() -> tuple:
    import random

    import numpy as np

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def _set_generators(saved: tuple) -> None:
    import random

    import numpy as np

    cpu, cuda, py, npy = saved
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(npy)


def _seed_generators(seed: int, device: torch.device) -> None:
    """As ``step_randomness`` seeds them for replay (torch's CPU and the device's, Python's, NumPy's)."""
    import random

    import numpy as np

    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])


class Batches:
    """What ``rec.batches(source)`` gives a loop: called like its ``get_batch``, or iterated like
    its DataLoader, it yields the committed micro-batches in order; an evaluation's call (no
    gradients, or a split other than ``"train"``) goes to the loop's own ``source``."""

    def __init__(self, hooked: Hooked, source: Callable[..., Any] | Iterable[Any] | None):
        self.hooked, self.source = hooked, source

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - the loop's own batch
        split = args[0] if args and isinstance(args[0], str) else kwargs.get("split", "train")
        if not torch.is_grad_enabled() or split != "train":
            return self._own(*args, **kwargs)
        part = self.hooked.next_micro()
        if part is None:  # past the last step (a loop that prefetches): never trained on, or refused
            return self._own(*args, **kwargs)
        return part

    def _own(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        if not callable(self.source):
            raise ValueError("rec.batches was given no function of the loop's own to ask for this batch")
        return self.source(*args, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        while (part := self.hooked.next_micro()) is not None:
            yield part

    def __len__(self) -> int:
        h = self.hooked
        return h.steps * h.accum - h.handed

