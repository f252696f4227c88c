"""A training session whose model is wrapped for data parallelism (DDP) or sharded (FSDP2)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..bundle.checkpoint import state_tensors
from ..fingerprint.probes import Fingerprint
from ..fingerprint.sketch import ParameterSketch
from ..record.session import TrainingSession
from ..task.base import StepOutput, Task, mean_of_ranks

PARALLELISMS = ("ddp", "fsdp")


class DistSession(TrainingSession):
    """This rank's share of a data-parallel run. Methods that say "collective" run on every rank."""

    def __init__(self, task: Task, run_seed: bytes, dataset_size: int, parallelism: str):
        if parallelism not in PARALLELISMS:
            raise ValueError(f"parallelism is one of {PARALLELISMS}")
        self.task, self.run_seed, self.dataset_size = task, run_seed, dataset_size
        self.parallelism = parallelism
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        if dist.get_backend() != "gloo":
            # The reference tasks build models, batches and dropout generators on the CPU.
            raise NotImplementedError("DistRecorder records CPU runs on gloo; GPU (nccl) recording is not built yet")
        if task.config.batch_size % self.world_size:
            raise ValueError(f"the global batch of {task.config.batch_size} does not split over {self.world_size} ranks")
        base = task.build_model(run_seed)  # identical on every rank: a function of the seed
        self.init_state = state_tensors(base, None)
        self.module: nn.Module = base
        if parallelism == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(base)
        else:
            from torch.distributed.fsdp import fully_shard

            self.model = fully_shard(base)
        self.optimizer = task.build_optimizer(self.model)
        self.sketcher = ParameterSketch(run_seed, task.config.sketch_dims)
        self._shard_offsets: dict[str, int] | None = None

    def my_share(self, indices: list[int]) -> list[int]:
        """This rank's micro-batch of the global batch (rank order)."""
        return self.micro_batches(indices)[self.rank]

    def local_step(self, step: int, batch) -> StepOutput:
        """This rank's forward and backward; the wrapper averages the gradients across ranks."""
        return self.task.train_step(self.model, self.optimizer, batch, self.lr(step), self.step_seed(step, self.rank))

    def global_output(self, out: StepOutput) -> StepOutput:
        """Collective: the step's loss is the mean of the ranks' losses, in rank order."""
        mine = torch.tensor([out.loss], dtype=torch.float64)
        losses = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world_size)]
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
        x = self.sketcher.gather(pieces)
        dist.all_reduce(x)  # every coordinate is held by exactly one rank: the sum is exact
        return self.sketcher.project(x) if self.rank == 0 else None

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full (unsharded) model and optimizer state, on rank 0."""
        if self.parallelism == "ddp":
            return state_tensors(self.module, self.optimizer) if self.rank == 0 else None
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
