"""The Task protocol: everything a verifier needs to re-run a step of a recipe."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..commit.hashing import tagged_hash
from ..data.dataset import Dataset
from .limits import check_fields, config_from
from .probing import TaskProbes


@dataclass(frozen=True)
class StepOutput:
    """What one optimizer step reports: the loss before the update, the lr used, the gradient norm."""

    loss: float
    lr: float
    grad_norm: float


@dataclass(frozen=True)
class Schedule:
    """Linear warm-up, then cosine decay to ``min_ratio * lr`` at ``total`` steps."""

    lr: float
    warmup: int
    total: int
    min_ratio: float = 0.1

    def at(self, step: int) -> float:
        """The learning rate of ``step`` (pure Python arithmetic: identical everywhere)."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


ClipFn = Callable[[list[torch.Tensor], float], torch.Tensor]


def clip_whole(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip gradients by their total 2-norm over whole tensors (one process, or DDP)."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)


def shard_sq_norms(grads: list[torch.Tensor], shards: int) -> torch.Tensor:
    """``[shards, P]``: the squared 2-norm of each gradient's dim-0 shard, as FSDP2 shards it
    (``torch.chunk``; a shard past the end of a short tensor is empty and counts 0)."""
    rows = [[torch.zeros((), dtype=torch.float32)] * len(grads) for _ in range(shards)]
    for i, g in enumerate(grads):
        for r, part in enumerate(torch.chunk(g, shards, dim=0) if g.dim() else (g,)):
            rows[r][i] = torch.linalg.vector_norm(part, 2) ** 2
    return torch.stack([torch.stack(row) for row in rows])


@torch.no_grad()
def clip_by_shard_norms(grads: list[torch.Tensor], sq: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Clip ``grads`` in place by the total norm whose per-shard squares are ``sq`` ``[shards, P]``.

    Each parameter's squares are added in shard (rank) order and its norm is their root; the total
    is the norm of those norms. One process and every rank of a sharded run compute it from the
    same numbers in the same order, so the clipping coefficient has the same bits everywhere.
    """
    norms = []
    for i in range(sq.shape[1]):
        total = sq[0, i]
        for r in range(1, sq.shape[0]):
            total = total + sq[r, i]
        norms.append(total ** 0.5)
    total_norm = torch.linalg.vector_norm(torch.stack(norms), 2)
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total_norm


def clip_like_fsdp(params: list[torch.Tensor], max_norm: float, shards: int) -> torch.Tensor:
    """Clip gradients on one process exactly as a run sharded over ``shards`` ranks does."""
    grads = [p.grad for p in params]
    return clip_by_shard_norms(grads, shard_sq_norms(grads, shards), max_norm)


def micro_seed(seed: int, k: int) -> int:
    """The seed of micro-batch ``k`` of a step whose seed is ``seed`` (gradient accumulation)."""
    return int.from_bytes(tagged_hash("witness/micro-seed/v1", seed.to_bytes(8, "big") + k.to_bytes(4, "big"))[:8],
                          "big") >> 1


def mean_of_ranks(losses: list[float]) -> float:
    """The step loss of a data-parallel step: the ranks' losses summed in rank order, divided."""
    total = 0.0
    for v in losses:
        total += v
    return total / len(losses)


def scaler_of(optimizer: torch.optim.Optimizer) -> Any:  # noqa: ANN401 - a torch.amp.GradScaler or None
    """The fp16 run's ``GradScaler`` that goes with ``optimizer`` (``TrainingSession`` attaches it),
    or None."""
    return getattr(optimizer, "witness_scaler", None)


def to_device(batch: Any, device: torch.device) -> Any:
    """A batch (tensors, or tuples, lists and dicts of them) on ``device``; a no-op on the same device."""
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def model_device(model: nn.Module) -> torch.device:
    """Where a model's parameters live (the CPU for a model without any)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


PRECISIONS = ("fp32", "bf16", "fp16")
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):  # noqa: ANN201 - a context manager
    """The recipe's precision: fp32, or bf16 or fp16 autocast over fp32 master weights (AdamW steps in
    fp32; fp16's loss is scaled by the run's committed ``GradScaler``)."""
    return torch.autocast(device_type=device.type, dtype=AUTOCAST.get(precision, torch.bfloat16),
                          enabled=precision in AUTOCAST)


def seed_int(seed: bytes, tag: str) -> int:
    """A 63-bit torch seed derived from a byte seed."""
    return int.from_bytes(tagged_hash(tag, seed)[:8], "big") >> 1


class Task(TaskProbes):
    """A registered recipe. Subclasses set ``Config`` and implement the model-specific parts.

    The step function here is the one the recorder runs and the verifier replays; the probes, the
    fingerprint and the evaluation metric come from ``TaskProbes``.
    """

    name: ClassVar[str]
    Config: ClassVar[type]
    # What a document of the training data is (``data/dataset.py``): "self" (each sample is one)
    # or "prefix32" (a sample's first 32 bytes name its documents). The task decides it, never a
    # bundle: every data-usage claim is checked under this rule, and a run claiming another is
    # rejected. The dataset the task builds must follow it.
    document_rule: ClassVar[str] = "self"
    # Whether the probes are the first training samples (a generic task's): then a verifier without
    # the training data takes them from the bundle and checks each against the committed leaves.
    probes_are_samples: ClassVar[bool] = False
    # Whether the task generates its training data from its recipe alone (synthetic data): then any
    # verifier rebuilds it and checks the run's data root against it, in every mode, at little cost.
    rebuilds_data: ClassVar[bool] = False

    def __init__(self, config: Any):
        self.config = config
        self.schedule = Schedule(config.lr, config.warmup, config.steps, config.min_lr_ratio)
        self._proj: torch.Tensor | None = None
        self._probes: Any = None

    # --- recipe -------------------------------------------------------------------------
    @classmethod
    def from_config(cls, obj: dict) -> Task:
        """Build from a config dict, refusing unknown or ill-typed fields."""
        task = cls(config_from(cls.Config, obj, cls.name))
        task.check_limits()
        return task

    def check_limits(self) -> None:
        """Refuse recipes too large for a verifier to build (a manifest may come from a liar)."""
        c = self.config
        if c.steps < 1 or c.batch_size < 1:
            raise ValueError("a recipe needs at least one step and one sample per batch")
        if self.grad_accum < 1 or c.batch_size % self.grad_accum:
            raise ValueError(f"grad_accum ({self.grad_accum}) must divide the batch ({c.batch_size} samples) into "
                             "equal micro-batches")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision is one of {', '.join(PRECISIONS)}")
        check_fields(c)

    @property
    def compiles(self) -> bool:
        """Whether the recipe runs the step through ``torch.compile`` (its ``compile`` field)."""
        return bool(getattr(self.config, "compile", False))

    def step_model(self, model: nn.Module) -> nn.Module:
        """What the step runs: the model, or ``torch.compile(model)`` where the recipe compiles (the
        same parameters; what every recording path and replay step through).

        A compiling recipe turns on torch's deterministic algorithms for the process: inductor
        otherwise lowers an embedding's backward (an index_put with accumulate) to a parallel loop of
        atomic adds, whose order, and so whose rounding, changes from run to run at 2 threads or
        more; in deterministic mode it calls ATen's serial kernel instead (measured: 11 distinct
        gradients in 12 backward passes of one Embedding+Linear at 2 threads, then 1)."""
        if not self.compiles:
            return model
        # warn_only: a CPU op with no deterministic kernel warns rather than stopping the run
        torch.use_deterministic_algorithms(True, warn_only=True)
        return torch.compile(model)

    @property
    def precision(self) -> str:
        """The recipe's training precision (``fp32`` unless its config says ``bf16``)."""
        return getattr(self.config, "precision", "fp32")

    def config_json(self) -> dict:
        """The recipe as JSON. A field added to a recipe after runs were recorded without it is left
        out at its default (the Config's ``LATER_FIELDS``), so those runs' recipes stay canonical."""
        out = dataclasses.asdict(self.config)
        defaults = self.Config()
        for name in getattr(self.Config, "LATER_FIELDS", ()):
            if out[name] == getattr(defaults, name):
                del out[name]
        return out

    def dataset(self) -> Dataset:
        """The training dataset in its own order."""
        raise NotImplementedError

    def build_model(self, seed: bytes) -> nn.Module:
        """The model with initial weights that are a function of ``seed`` only."""
        raise NotImplementedError

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """The submodules FSDP2 shards as units of their own (gathered one at a time), inside the
        root unit; none by default (the whole model is one unit)."""
        return []

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW with the recipe's hyper-parameters (single-tensor loop: same kernels everywhere)."""
        c = self.config
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        other = [p for n, p in model.named_parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": other, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=c.lr, betas=(0.9, 0.95), foreach=False)

    def collate(self, samples: list[bytes]) -> Any:
        """Canonical sample bytes -> batch tensors."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any, generator: torch.Generator | None) -> torch.Tensor:
        """Mean training loss of a batch; ``generator`` drives dropout."""
        raise NotImplementedError

    def loss_from(self, outputs: Any, batch: Any) -> torch.Tensor:  # noqa: ANN401 - a forward's outputs
        """The loss in what a loop's own forward returned on ``batch`` (what ``loss`` computes, for a
        loop witnessed by hooks): an output's ``loss`` (Hugging Face's), the 0-dim tensor of a
        tuple (nanoGPT's ``(logits, loss)``), or a 0-dim tensor itself."""
        found = getattr(outputs, "loss", None)
        if torch.is_tensor(found) and found.dim() == 0:
            return found
        if torch.is_tensor(outputs) and outputs.dim() == 0:
            return outputs
        if isinstance(outputs, (tuple, list)):
            for x in outputs:
                if torch.is_tensor(x) and x.dim() == 0 and x.is_floating_point():
                    return x
        raise ValueError(f"the task {self.name!r} finds no loss in the forward's output ({type(outputs).__name__}): "
                         "override its loss_from(outputs, batch)")

    @classmethod
    def recipe_from(cls, settings: dict, model: nn.Module | None = None) -> dict:
        """The recipe from a loop's own settings (and its model), for ``witness.record.start_run``: by
        default the settings are the recipe; a plugin maps its loop's names (nanoGPT's ``max_iters``)."""
        return dict(settings)

    # --- the step -----------------------------------------------------------------------
    def step_loss(self, model: nn.Module, batch: Any, seed: int) -> torch.Tensor:
        """The loss of a batch under the step's randomness: the task's own dropout generator and
        the global generators (torch's, Python's, NumPy's) all seeded from the committed step seed,
        so a model that draws from the global ones (``nn.Dropout``, SDPA's ``dropout_p``) replays
        bit for bit. Every recording path and replay computes the loss through here."""
        device = model_device(model)
        # The dropout generator stays on the CPU: the masks are then the same bits on any device,
        # so a replay on other hardware (tolerance mode) draws the masks the run drew.
        generator = torch.Generator().manual_seed(seed)
        with step_randomness(seed, device), autocast(device, self.precision):
            return self.loss(model, to_device(batch, device), generator)

    def train_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, lr: float, seed: int,
        clip: ClipFn | None = None,
    ) -> StepOutput:
        """One optimizer step: set lr, forward, backward, clip, update.

        ``clip`` clips the gradients in place and returns their norm; a sharded run passes one
        that reduces the norm across ranks in a fixed order.
        """
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        model.train()
        accum = self.grad_accum
        # fp16: the run's GradScaler (its scale is committed state) scales each backward, unscales
        # before the clipping, and skips the update of a step whose gradients overflowed
        scaler = scaler_of(optimizer)
        scaled = scaler.scale if scaler is not None else (lambda x: x)
        if accum == 1:
            loss = self.step_loss(model, batch, seed)
            scaled(loss).backward()
            value = float(loss.detach())
        else:
            # nanoGPT's and Lightning's accumulation: each micro-batch's mean loss, divided by the
            # number of micro-batches, is backpropagated; the step's loss is the micro losses' mean
            losses = []
            for k, micro in enumerate(self.split_batch(batch, accum)):
                loss = self.step_loss(model, micro, micro_seed(seed, k))
                scaled(loss / accum).backward()
                losses.append(float(loss.detach()))
            value = mean_of_ranks(losses)
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for p in model.parameters() if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        gn = (clip or clip_whole)(params, max_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        return StepOutput(value, lr, float(gn))

    @property
    def grad_accum(self) -> int:
        """Micro-batches a step's batch is split into, their gradients accumulated (the recipe's
        ``grad_accum``; 1 unless it says otherwise)."""
        return getattr(self.config, "grad_accum", 1)

    def split_batch(self, batch: Any, parts: int) -> list[Any]:  # noqa: ANN401 - a collated batch
        """A collated batch as ``parts`` micro-batches of equal size, in order (along the first
        dimension of every tensor of a tensor, tuple, list or dict batch)."""
        def split(x: Any) -> list[Any]:  # noqa: ANN401
            if isinstance(x, torch.Tensor):
                return list(torch.chunk(x, parts, dim=0))
            if isinstance(x, dict):
                cols = {k: split(v) for k, v in x.items()}
                return [{k: cols[k][i] for k in x} for i in range(parts)]
            if isinstance(x, (tuple, list)):
                cols = [split(v) for v in x]
                return [type(x)(c[i] for c in cols) for i in range(parts)]
            raise TypeError(f"cannot split a batch of {type(x).__name__} into micro-batches (override split_batch)")

        return split(batch)

    def accumulated_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, micro: list[Any], lr: float,
                         seeds: list[int], sharded_norm: bool = False) -> StepOutput:
        """One step over the ranks' micro-batches on one process: what a data-parallel step computes.

        Gradients accumulate in rank order and are divided by the world size (DDP's all-reduce
        of the ranks' mean-loss gradients); the reported loss is the mean of the ranks' losses.
        ``sharded_norm`` computes the gradient norm for clipping as FSDP2 does, shard by shard.
        """
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        model.train()
        losses = []
        for batch, seed in zip(micro, seeds, strict=True):
            loss = self.step_loss(model, batch, seed)  # each rank's micro-batch under its own seed
            loss.backward()
            losses.append(float(loss.detach()))
        params = [p for p in model.parameters() if p.grad is not None]
        with torch.no_grad():
            for p in params:
                p.grad.div_(len(micro))
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        if sharded_norm:
            gn = clip_like_fsdp(params, max_norm, len(micro))
        else:
            gn = clip_whole(params, max_norm)
        optimizer.step()
        return StepOutput(mean_of_ranks(losses), lr, float(gn))

    # --- probes (the rest, and evaluation, in ``probing.TaskProbes``) ----------------------
    @torch.no_grad()
    def recorded_probe_outputs(self, model: nn.Module, probes: Any) -> torch.Tensor:
        """Probe outputs as the fingerprint takes them: on the model's device, at the recipe's
        precision, returned as float32 on the host (whatever the device)."""
        device = model_device(model)
        with autocast(device, self.precision):
            outputs = self.probe_outputs(model, to_device(probes, device))
        return outputs.float().cpu()

    def flops_per_step(self) -> float:
        """Approximate training FLOPs of one step (6 * params * tokens), for cost reports."""
        raise NotImplementedError


@contextmanager
def step_randomness(seed: int, device: torch.device | None = None) -> Iterator[None]:
    """Run the block with torch's global CPU generator (and the CUDA one of ``device``), Python's
    ``random`` and NumPy's global generator seeded from ``seed``, and give them back their state
    after: the step's randomness is then a function of the committed step seed alone, whoever
    draws it, and the caller's own streams go on as if the step had drawn nothing."""
    import random

    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    cuda = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        for d in cuda:
            with torch.cuda.device(d):
                torch.cuda.manual_seed(seed)
        random.seed(seed)
        np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def init_parameters(model: nn.Module, seed: bytes, std: float = 0.02) -> None:
    """Deterministic init in name order: normal weights, ones for norm gains, zeros for biases."""
    g = torch.Generator().manual_seed(seed_int(seed, "witness/init/v1"))
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("gain"):
                p.fill_(1.0)
            elif p.dim() < 2:
                p.zero_()
            else:
                p.normal_(0.0, std, generator=g)
