"""A training session whose model is wrapped for data parallelism (DDP) or sharded (FSDP2).

Every cross-rank sum is taken in rank order, so a run over any number of ranks has the bits
that one process gets by accumulating the ranks' micro-batches in that order: the gradients
(a DDP communication hook, an FSDP2 reduce-scatter), the clipping norm, and the loss.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

from ..bundle.state import load_state, shard_rows, state_tensors
from ..fingerprint.probes import Fingerprint
from ..fingerprint.sketch import ParameterSketch
from ..record.loop import adopt
from ..session import TrainingSession, deterministic_device
from ..task.base import StepOutput, Task, clip_by_shard_norms, mean_of_ranks

PARALLELISMS = ("ddp", "fsdp")


def sum_in_rank_order(parts: list[torch.Tensor] | torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = ((parts[0] + parts[1]) + parts[2]) + …``: the order in which one process
    accumulates the ranks' micro-batch gradients (float addition is not associative)."""
    out.copy_(parts[0])
    for p in parts[1:]:
        out.add_(p)
    return out


def ordered_allreduce_hook(group, bucket):  # noqa: ANN001, ANN201 - DDP refuses string annotations here
    """DDP communication hook: the mean of the ranks' gradients, summed in rank order.

    A reduce-scatter in rank order, then an all-gather: each rank receives every rank's copy of its
    1/W of the bucket (``all_to_all_single``), adds them in rank order and divides, and the ranks'
    pieces are gathered. Every element is ``((g0 + g1) + …) / W``, as one process adds the ranks'
    gradients, for about the bytes of a ring all-reduce (an all-gather of whole buckets moved W − 1
    buckets a rank, and added whole buckets on every rank: 2.3× the all-reduce's time on gloo at
    484 MB, against 1.4× for this; docs/benchmarks.md)."""
    t = bucket.buffer()
    world = dist.get_world_size(group)
    n = t.numel()
    chunk = -(-n // world)
    send = t if chunk * world == n else torch.cat([t, t.new_zeros(chunk * world - n)])
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # row r: rank r's copy of this rank's piece
    mine = sum_in_rank_order(received.view(world, chunk), torch.empty_like(received[:chunk])).div_(world)
    gathered = torch.empty_like(send)
    dist.all_gather(list(gathered.view(world, chunk).unbind(0)), mine, group=group)
    t.copy_(gathered[:n])
    fut = torch.futures.Future()
    fut.set_result(t)
    return fut


class OrderedReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter: each rank receives every rank's chunk of its shard and sums them
    in rank order (then divides, for a mean), where the collective would add in its own order."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain buffer."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        world = group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)  # chunk r of `received` is rank r's
        sum_in_rank_order(received.view(world, -1), output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        elif op != dist.ReduceOp.SUM:
            raise NotImplementedError(f"reduce-scatter with {op} has no rank-ordered form here")


class DistSession(TrainingSession):
    """This rank's share of a data-parallel run. Methods that say "collective" run on every rank."""

    def __init__(self, task: Task, run_seed: bytes, dataset_size: int, parallelism: str,
                 own: tuple[nn.Module, torch.optim.Optimizer | None] | None = None):
        """``own``: the loop's own model and optimizer (``start_run`` under torchrun), adopted as in one
        process; the loop wraps the model in DDP itself (``witness.distributed.loop``)."""
        if parallelism not in PARALLELISMS:
            raise ValueError(f"parallelism is one of {PARALLELISMS}")
        if own is not None and parallelism != "ddp":
            raise ValueError("a loop of its own is recorded under torchrun with DDP; FSDP2 with "
                             "witness.distributed.DistRecorder's loop (docs/distributed.md)")
        if own is None and task.grad_accum > 1:  # (a loop of its own accumulates: witness.task.ranks)
            raise ValueError("DistRecorder's loop trains one micro-batch a rank: give the recipe grad_accum 1 and "
                             "a global batch of batch_size samples")
        if own is not None and task.compiles:
            raise ValueError("compile=True is for one process: a data-parallel step is replayed eagerly (compile=False)")
        self.task, self.run_seed, self.dataset_size = task, run_seed, dataset_size
        self.parallelism = parallelism
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        # gloo runs on the CPU; nccl on this rank's GPU (torchrun's LOCAL_RANK), with deterministic kernels
        if dist.get_backend() == "nccl":
            self.device = deterministic_device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if task.config.batch_size % self.world_size:
            raise ValueError(f"the global batch of {task.config.batch_size} does not split over {self.world_size} ranks")
        base = task.build_model(run_seed)  # identical on every rank: a function of the seed
        from torch.nn.modules.batchnorm import _NormBase

        if any(isinstance(m, _NormBase) and m.track_running_stats for m in base.modules()):
            # running statistics: DDP broadcasts rank 0's and FSDP2 leaves each rank its own, and
            # neither is what one process replaying the micro-batches in turn would hold. (Constant
            # buffers, such as GPT-2's attention masks, are the same bits on every rank.)
            raise NotImplementedError(f"task {task.name} keeps running statistics (BatchNorm): distributed "
                                      "recording supports models whose buffers do not change")
        self.init_state = state_tensors(base, None)
        # constant buffers are allowed (above); one that changes is found at the next record
        self._buffers = {n: b.clone() for n, b in base.named_buffers() if b.is_floating_point()}
        base.to(self.device)  # initialised on the host (the same bits everywhere), then moved
        self.module: nn.Module = base
        self.sketcher = ParameterSketch(run_seed, task.config.sketch_dims)
        self._shard_offsets: dict[str, int] | None = None
        self._rows_checked: set[str] = set()
        if own is not None:  # the loop's own objects take the initial state; the loop wraps them in DDP
            self.model, self.optimizer = base, task.build_optimizer(base)
            adopt(self, *own)
            self.module = self.model
            return
        if parallelism == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(base, device_ids=ids)
            self.model.register_comm_hook(dist.group.WORLD, ordered_allreduce_hook)
        else:
            from torch.distributed.fsdp import fully_shard

            units = [fully_shard(unit) for unit in task.fsdp_units(base)]
            self.model = fully_shard(base)
            for unit in (*units, self.model):  # each unit reduce-scatters its own gradients
                unit.set_custom_reduce_scatter(OrderedReduceScatter())
        self.optimizer = task.build_optimizer(self.model)

    def check_buffers(self) -> None:
        """Refuse a run whose model changed a floating buffer (an EMA, running statistics of its own):
        DDP broadcasts rank 0's buffers at every forward, FSDP2 leaves each rank its own, and one
        process replaying the micro-batches in turn would hold neither."""
        for name, first in self._buffers.items():
            if not torch.equal(self.module.get_buffer(name).detach().cpu(), first):
                raise NotImplementedError(f"the model changed its buffer {name} while training: distributed "
                                          "recording supports models whose buffers do not change (one process "
                                          "replaying the ranks' micro-batches would hold other values)")

    def my_share(self, indices: list[int]) -> list[int]:
        """This rank's micro-batch of the global batch (rank order)."""
        return self.micro_batches(indices)[self.rank]

    def local_step(self, step: int, batch) -> StepOutput:
        """This rank's forward and backward; the wrapper averages the gradients across ranks."""
        clip = self._clip_sharded if self.parallelism == "fsdp" else None
        return self.task.train_step(self.model, self.optimizer, batch, self.lr(step),
                                    self.step_seed(step, self.rank), clip=clip)

    def _clip_sharded(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Collective: clip sharded gradients by the global norm, its squares summed in rank order."""
        grads = [p.grad.to_local() for p in params]
        local = torch.stack([torch.linalg.vector_norm(g, 2) ** 2 for g in grads])
        rows = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(rows, local)
        return clip_by_shard_norms(grads, torch.stack(rows), max_norm)

    def global_output(self, out: StepOutput) -> StepOutput:
        """Collective: the step's loss is the mean of the ranks' losses, in rank order."""
        mine = torch.tensor([out.loss], dtype=torch.float64, device=self.device)  # nccl sends device tensors
        losses = [torch.zeros(1, dtype=torch.float64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(losses, mine)
        return StepOutput(mean_of_ranks([float(v) for v in losses]), out.lr, out.grad_norm)

    def fingerprint(self) -> Fingerprint | None:  # type: ignore[override]
        """Collective under FSDP (the probes run through the sharded model); the answer is on rank 0."""
        if self.parallelism == "ddp":
            return self.task.fingerprint(self.module) if self.rank == 0 else None
        fp = self.task.fingerprint(self.model)
        self.model.reshard()  # FSDP2 keeps the root unsharded after a forward; no backward follows here
        return fp if self.rank == 0 else None

    def sketch(self) -> list[float] | None:  # type: ignore[override]
        """Collective: each rank contributes the sampled coordinates of its shards; rank 0 projects."""
        if self.parallelism == "ddp":
            return self.sketcher(dict(self.module.named_parameters())) if self.rank == 0 else None
        if self._shard_offsets is None:  # a shard's place in its tensor is fixed for the whole run
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            self._shard_offsets = {}
            for name, p in self.model.named_parameters():
                _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                self._shard_offsets[name] = offset[0] * p[0].numel() if p.dim() else 0
        # the shards stay where they are: the sketch copies only its sampled coordinates off them
        pieces = {name: (p.to_local().detach(), self._shard_offsets[name], p.numel())
                  for name, p in self.model.named_parameters()}
        x = self.sketcher.gather(pieces).to(self.device)
        dist.all_reduce(x)  # every coordinate is held by exactly one rank: the sum is exact
        x = x.cpu()
        return self.sketcher.project(x) if self.rank == 0 else None

    def holds_whole_state(self) -> bool:
        """Whether rank 0's own tensors are the whole state (DDP, or FSDP2 on one rank): then
        committing it needs no gather, and ``full_state`` returns those tensors, not copies."""
        return self.parallelism == "ddp" or self.world_size == 1

    def shard_pieces(self) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
        """This rank's rows of every state tensor, where they lie (under FSDP2 its shards of the
        parameters and moments, checked against the row split of the sharded state digest; under
        DDP its share of the rows of its replica; 0-dimensional tensors whole), and every tensor's
        dtype and full shape (a sharded tensor's shape is the whole one's). Each rank hashes and
        keeps only these: about 1/world of the state, under DDP as under FSDP2."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        pieces = {}
        state = state_tensors(self.module if self.parallelism == "ddp" else self.model, self.optimizer)
        for name, t in state.items():
            if t.dim() == 0:
                pieces[name] = t.to_local() if isinstance(t, DTensor) else t
                continue
            start, end = shard_rows(t.shape[0], self.world_size)[self.rank]
            if not isinstance(t, DTensor):
                pieces[name] = t[start:end]
                continue
            local = t.to_local()
            if name not in self._rows_checked:  # a shard's rows are fixed for the whole run
                first = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1][0]
                if local.shape[0] != end - start or (local.shape[0] and first != start):
                    raise RuntimeError(f"{name}: FSDP2 holds rows {first}..{first + local.shape[0]} on rank "
                                       f"{self.rank}, the sharded state digest expects {start}..{end}")
                self._rows_checked.add(name)
            pieces[name] = local
        return pieces, {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}

    def load_full_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Every rank: put a whole state (a checkpoint every rank read) into this rank's model and
        optimizer: under DDP the whole replica, under FSDP2 this rank's rows of every sharded
        tensor (the moments as DTensors placed like their parameters), the rest whole."""
        if self.parallelism == "ddp" or self.world_size == 1 and not any(
                isinstance(p, DTensor) for p in self.model.parameters()):
            load_state(self.module, self.optimizer, tensors)
            return
        params = dict(self.model.named_parameters())
        names = set(state_tensors(self.model, None))
        if {k for k in tensors if k.startswith("model.")} != names:
            raise ValueError("the checkpoint does not hold this model's tensors")
        with torch.no_grad():
            for key in names:
                name = key.removeprefix("model.")
                whole = tensors[key]
                p = params.get(name)
                if p is None:  # a buffer: FSDP2 leaves it whole on every rank
                    self.model.get_buffer(name).copy_(whole)
                    continue
                p.to_local().copy_(self._rows(whole, p))
            self.optimizer.state.clear()
            for key, value in tensors.items():
                if not key.startswith("optim."):
                    continue
                pname, _, field = key[6:].rpartition(".")
                p = params.get(pname)
                if p is None:
                    raise ValueError(f"the checkpoint has optimizer state for unknown parameter {pname}")
                if value.shape == p.shape and value.dim():  # a moment: this rank's rows, placed as its parameter
                    local = self._rows(value, p).to(self.device, copy=True)
                    value = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                else:  # a counter (AdamW's step) stays on the host, whole
                    value = value.clone()
                self.optimizer.state[p][field] = value

    def _rows(self, whole: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole tensor shaped like parameter ``p`` (FSDP2's split of dim 0)."""
        if whole.shape != p.shape or whole.dtype != p.dtype:
            raise ValueError(f"a checkpoint tensor of shape {list(whole.shape)} does not fit {list(p.shape)}")
        if whole.dim() == 0:
            return whole
        start, end = shard_rows(whole.shape[0], self.world_size)[self.rank]
        return whole[start:end]

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full (unsharded) model and optimizer state, on rank 0."""
        if self.parallelism == "ddp":
            return state_tensors(self.module, self.optimizer) if self.rank == 0 else None
        if self.world_size == 1:  # one shard is the whole tensor (no padding): hash it where it lies
            return {k: v.to_local() if isinstance(v, DTensor) else v
                    for k, v in state_tensors(self.model, self.optimizer).items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        out = {f"model.{k}": v for k, v in msd.items()}
        for fqn, st in osd["state"].items():
            for key, value in st.items():
                out[f"optim.{fqn}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
        return out
