"""A training loop as it is written, under torchrun: ``start_run`` on every rank, the loop's own DDP.

nanoGPT's ``train.py`` started by ``torchrun --nproc_per_node=W`` runs the same witness lines as
in one process (``start_run(..., model=model, optimizer=optimizer)``, ``get_batch =
rec.batches(get_batch)``, ``rec.finish()``), and wraps the model in ``DistributedDataParallel``
itself, after ``start_run``. Then, on every rank:

* the model and optimizer are adopted as in one process (``witness.record.loop.adopt``): every
  rank's model takes the seed's initial state;
* ``rec.batches`` hands rank ``r`` its share of each step's micro-batches: the recipe's
  ``grad_accum`` G (nanoGPT's ``gradient_accumulation_steps`` before it divides it by W) splits
  the committed batch as one process splits it, and rank ``r`` trains parts ``r·G/W …``, each
  under the seed of its place in the step (``witness.task.ranks``);
* at the first forward on a committed micro-batch, the DDP wrapper the forward runs in
  (``DistributedDataParallel._active_ddp_module``) gets the rank-ordered all-reduce
  (``ordered_allreduce_hook``), so that one process can add the ranks' gradients as they were
  added; a loop that does not wrap its model in DDP, wraps another object, or brings a
  communication hook of its own is stopped there;
* the gradient norm is taken once DDP has averaged the gradients, and ``optimizer.step()``
  returning records the step with the collectives of ``DistRecorder.log_step`` (the loss is the
  ranks' mean losses in rank order; the state is hashed by rows, a share on every rank; online
  challenges and the every-step check keep and write each rank's share).

Rank 0 signs the one log, with the key file; ``r`` is drawn on rank 0 and broadcast. Under
``WITNESS_BEACON`` (or ``beacon=URL``) the run goes online as in one process.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import os
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..commit.signing import load_or_create_key
from ..record.loop import Batches, Hooked
from ..record.options import Online, option
from ..record.recorder import BEACON_ENV, Recorder
from ..record.recorder import start_run as start_one
from ..task.registry import build_task, task_class
from .recorder import DistRecorder
from .session import ordered_allreduce_hook


def torchrun_world() -> int:
    """The world size of the process group this process is in (1 where there is none)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def start_run(task: str, settings: dict, out: str, *, model: nn.Module,
              optimizer: torch.optim.Optimizer | None = None, key: str = "witness-key.pem",
              beacon: str | None = None, **kwargs: Any) -> Recorder | LoopRecorder:  # noqa: ANN401
    """Witness a loop in one line (``witness.record.recorder.start_run``), in one process or on every
    rank of a torchrun job whose loop wraps its model in DDP (see the module). ``kwargs``:
    ``commit=``, ``self_check=`` (and in one process the rest of ``Recorder.create``'s)."""
    if torchrun_world() == 1:
        return start_one(task, settings, out, model=model, optimizer=optimizer, key=key, beacon=beacon, **kwargs)
    unknown = set(kwargs) - {"commit", "self_check", "online"}
    if unknown:
        raise ValueError(f"start_run under torchrun takes commit=, self_check= and online=, not {sorted(unknown)}")
    built = build_task(task, task_class(task).recipe_from(settings, model))
    rank = dist.get_rank()
    online = option(kwargs.pop("online", None), Online, "online")
    if rank == 0 and online.beacon is None and (beacon or os.environ.get(BEACON_ENV)):
        from ..beacon.client import BeaconClient

        online = dataclasses.replace(online, beacon=BeaconClient(beacon or os.environ[BEACON_ENV]))
    r = [os.urandom(32) if rank == 0 else None]
    dist.broadcast_object_list(r, src=0)  # the run seed is derived from it on every rank
    signing = load_or_create_key(Path(key)) if rank == 0 else None
    return LoopRecorder(built, out, signing, r=r[0], model=model, optimizer=optimizer, online=online, **kwargs)


class LoopRecorder(DistRecorder):
    """``DistRecorder`` for a loop of its own under torchrun (DDP): see the module."""

    def __init__(self, task: Any, out: str | os.PathLike, key: Any, *, r: bytes, model: nn.Module,  # noqa: ANN401
                 optimizer: torch.optim.Optimizer | None, **kwargs: Any) -> None:  # noqa: ANN401
        """As ``DistRecorder``, with the loop's own ``model`` and ``optimizer`` adopted on every rank."""
        self._own = (model, optimizer)
        self._hooked: Hooked | None = None
        self._wrapper_checked = False
        super().__init__(task, out, key, r=r, parallelism="ddp", **kwargs)
        shared = [self.inner.manifest if self.inner is not None else None]
        dist.broadcast_object_list(shared, src=0)
        self.manifest: dict = shared[0]  # the run's manifest, on every rank (a framework's data is checked by it)

    def batches(self, source: Any = None) -> Batches:  # noqa: ANN401 - the loop's get_batch or loader
        """This rank's committed micro-batches, as ``Recorder.batches`` hands one process its own."""
        if self._hooked is None:
            self._hooked = Hooked(self, self.session.module, self.session.optimizer,
                                  ranks=(self.rank, self.session.world_size))
        return Batches(self._hooked, source)

    @property
    def ranks(self) -> tuple[int, int]:
        """This rank, and the world size: each rank trains ``grad_accum / world`` micro-batches a step."""
        return self.rank, self.session.world_size

    def step_seed(self, step: int) -> int:
        """The committed seed of the randomness inside ``step``."""
        return self.session.step_seed(step)

    def lr(self, step: int) -> float:
        """The schedule's learning rate at ``step``."""
        return self.session.lr(step)

    def committed_batch(self, step: int) -> Any:  # noqa: ANN401 - a collated batch
        """The whole committed batch of ``step`` (each rank takes its share of its micro-batches)."""
        return self.task.collate(self.session.batch_samples(step))

    def batch(self, step: int) -> Any:  # noqa: ANN401 - a collated batch
        """As ``Recorder.batch``: ``step`` is next (rank 0 notes it), and its whole committed batch."""
        if self.inner is not None:
            self.inner.ready_for(step)
        return self.committed_batch(step)

    def ready_for(self, step: int) -> None:
        """Before the first forward of ``step`` (inside DDP's forward): the wrapper's hook, rank 0's notes."""
        if not self._wrapper_checked:
            from torch.nn.parallel import DistributedDataParallel

            self.use_wrapper(DistributedDataParallel._get_active_ddp_module())
        if self.inner is not None:
            self.inner.ready_for(step)

    def check_sync(self, ddp: nn.Module | None, last: bool) -> None:
        """Before a forward on this rank's micro-batch (``last``: its last of the step): the DDP wrapper
        must add the ranks' gradients at the last micro-batch only, as replay adds them."""
        if ddp is None:
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel._get_active_ddp_module()
        if ddp is not None and ddp.require_backward_grad_sync != last:
            raise ValueError("DDP must add the ranks' gradients once a step, after each rank's last micro-batch: run "
                             "the others under model.no_sync() (or set model.require_backward_grad_sync = False, as "
                             "nanoGPT does); a sum of averages rounds differently, and a verifier replays one sum")

    def use_wrapper(self, ddp: nn.Module | None) -> None:
        """Give the loop's DDP wrapper the rank-ordered all-reduce, or refuse it (see the module)."""
        rank_ordered(ddp, self.session.module)
        self._wrapper_checked = True
        atexit.register(release, weakref.ref(ddp))


def release(ddp_ref: weakref.ref) -> None:
    """At exit, while Python still runs: let go of the process group that the loop's DDP wrapper holds
    (its reducer and its own reference), destroy it, and collect, so that the backend's threads are
    joined now. Left to the interpreter's teardown, a gloo thread could need the GIL after CPython
    stopped handing it out, and the rank aborts ("terminate called without an active exception",
    SIGABRT) after a run that finished: 1 nanoGPT run in 10 under load, before this."""
    ddp = ddp_ref()
    try:
        if ddp is not None:
            for name in ("reducer", "logger", "process_group"):
                ddp.__dict__.pop(name, None)
            del ddp
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
    except Exception as e:  # noqa: BLE001 - at exit, a failure to tidy up must not hide the run's own outcome
        print(f"witness: releasing the process group at exit: {e}", file=sys.stderr)

    def finish(self) -> None:
        """The hooks come off, then ``DistRecorder.finish``."""
        if self._hooked is not None:
            self._hooked.close()
        super().finish()


def rank_ordered(ddp: nn.Module | None, module: nn.Module) -> None:
    """Give ``ddp``, the loop's wrapper of ``module``, the rank-ordered all-reduce, or refuse it."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        raise ValueError("under torchrun, wrap the model start_run adopted in DistributedDataParallel (as nanoGPT's "
                         "train.py does) before training it: each rank would otherwise step on its own gradients")
    if ddp.module is not module:
        raise ValueError(f"the DDP wrapper holds a {type(ddp.module).__name__}, not the model start_run adopted "
                         "(compile=True wraps it: a data-parallel run is replayed eagerly, use compile=False)")
    hooks = [h for h, _ in ddp._comm_hooks]
    if not hooks:
        ddp.register_comm_hook(dist.group.WORLD, ordered_allreduce_hook)
    elif hooks != [ordered_allreduce_hook]:
        raise ValueError(f"the DDP wrapper has a communication hook of its own ({hooks[0].__qualname__}): a verifier "
                         "adds the ranks' gradients in rank order, as witness's hook does; remove it")
