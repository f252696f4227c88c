"""A task assembled from the user's own parts: a model factory, a dataset, an optimizer, a
schedule, a loss. Subclass ``GenericTask``, set ``name`` and ``Config``, and override what
differs from a classifier trained with AdamW on a warmup-cosine schedule:

* ``make_model()`` (required): the model; its default initialisation is made a function of the
  run seed (the global RNG is seeded from it while the model is built);
* ``make_dataset()`` (required), ``make_eval_dataset()``: samples as the codec takes them;
* ``samples``: the codec to canonical bytes (``TensorSamples`` by default, or ``TextSamples``,
  or a ``TokenWindows`` dataset that is its own codec);
* ``predict(model, batch)`` and ``example_losses(outputs, batch)``: the model's outputs on a
  batch and the per-example losses from them (cross-entropy on ``batch["y"]`` by default);
* ``lr_at(step)``: the learning rate as a pure function of the step (``warmup_cosine``,
  ``step_decay``, or ``torch_schedule`` to replay any ``torch.optim.lr_scheduler``);
* the optimizer: any ``torch.optim`` class named in the recipe, with its hyperparameters.

Everything that shapes the run is in the recipe (``Config``), which the manifest records.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..data.dataset import Dataset
from ..data.locate import asked, no_data
from ..errors import VerificationError
from .base import Task, seed_int
from .samples import SampleList, TensorSamples, TokenWindows

# optimizer hyperparameters a recipe may set: plain JSON values only (never code)
JSON_SCALARS = (bool, int, float, str)


@dataclass(frozen=True)
class GenericConfig:
    """The recipe fields every generic task has; a subclass adds its own (with defaults)."""

    steps: int = 100
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    optimizer: str = "AdamW"
    optimizer_args: dict = field(default_factory=dict)  # e.g. {"betas": [0.9, 0.95]}
    fingerprint_dims: int = 4
    sketch_dims: int = 8
    # micro-batches a step's batch is split into, their gradients accumulated (nanoGPT's
    # gradient_accumulation_steps, Lightning's accumulate_grad_batches); left out of a recipe at 1
    grad_accum: int = 1
    # the step runs through torch.compile (default options) when recording and in replay: compiled
    # kernels round differently from eager ones, so replay must compile too; left out at False
    compile: bool = False
    # "fp32", or "bf16" / "fp16" autocast over fp32 weights (fp16 with the run's GradScaler: rec.scaler)
    precision: str = "fp32"

    LATER_FIELDS: ClassVar[tuple[str, ...]] = ("grad_accum", "compile", "precision")


class FunctionSchedule:
    """A schedule given as a function of the step (what ``Task.schedule`` must offer)."""

    def __init__(self, fn: Callable[[int], float]):
        self.fn = fn

    def at(self, step: int) -> float:
        """The learning rate of ``step``, as a Python float."""
        return float(self.fn(step))


def warmup_cosine(lr: float, step: int, steps: int, warmup: int = 0, min_ratio: float = 0.1) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_ratio * lr`` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def nanogpt_lr(step: int, lr: float, warmup: int, decay_steps: int, min_lr: float) -> float:
    """nanoGPT's ``get_lr``, operation for operation (so its floats are the same bits): linear warmup
    as ``lr * (step + 1) / (warmup + 1)``, cosine decay to ``min_lr`` at ``decay_steps``, then ``min_lr``."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step > decay_steps:
        return min_lr
    decay_ratio = (step - warmup) / (decay_steps - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (lr - min_lr)


def step_decay(lr: float, step: int, every: int, gamma: float = 0.1) -> float:
    """``StepLR``: ``lr * gamma ** (step // every)``."""
    return lr * gamma ** (step // every)


def torch_schedule(lr: float, steps: int, make: Callable[[torch.optim.Optimizer], Any]) -> list[float]:
    """The learning rates that a ``torch.optim.lr_scheduler`` gives at steps 0..steps-1, for a
    base rate ``lr`` (stepped once per optimizer step, as in the usual loop): e.g.
    ``torch_schedule(c.lr, c.steps, lambda o: OneCycleLR(o, max_lr=c.lr, total_steps=c.steps))``."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    return out


class GenericTask(Task):
    """A task from the user's parts (see the module's docstring)."""

    Config: ClassVar[type] = GenericConfig
    samples: ClassVar[Any] = TensorSamples()
    probes: ClassVar[int] = 8  # the first samples of the training set are the committed probes
    max_dataset: ClassVar[int] = 10_000_000
    probes_are_samples = True

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        # a task that chooses its own probes does not take them from its data (nor from a bundle)
        if cls.probe_bytes is not GenericTask.probe_bytes:
            cls.probes_are_samples = False

    def __init__(self, config: Any):
        super().__init__(config)
        self.schedule = FunctionSchedule(self.lr_at)
        self._datasets: dict[str, Dataset] = {}

    # --- the user's parts ---------------------------------------------------------------
    def make_model(self) -> nn.Module:
        """The model (its default initialisation is seeded by ``build_model``)."""
        raise NotImplementedError

    def make_dataset(self) -> Sequence[Any] | Dataset:
        """The training samples, in order (as ``samples`` encodes them), or a ready ``Dataset``."""
        raise NotImplementedError

    def make_eval_dataset(self) -> Sequence[Any] | Dataset:
        """The evaluation samples (none by default: ``witness eval`` then has nothing to do)."""
        return []

    def predict(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The model's outputs on a batch (by default on ``batch["x"]``, or on the inputs of an
        ``(inputs, targets)`` batch such as ``TokenWindows`` gives)."""
        return model(batch["x"] if isinstance(batch, dict) else batch[0])

    def example_losses(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        """Per-example losses from the outputs: by default cross-entropy on ``batch["y"]`` (or the
        targets of an ``(inputs, targets)`` batch), per token for outputs ``[B, T, classes]``."""
        targets = batch["y"] if isinstance(batch, dict) else batch[1]
        if outputs.dim() == 3:  # a language model's logits: [B, T, V] against targets [B, T]
            return F.cross_entropy(outputs.transpose(1, 2), targets, reduction="none")
        return F.cross_entropy(outputs, targets, reduction="none")

    def loss_from(self, outputs: Any, batch: Any) -> torch.Tensor:  # noqa: ANN401 - a forward's outputs
        """The loss in a loop's forward output: ``Task.loss_from``'s, or the mean of the per-example
        losses of outputs that are predictions (what ``loss`` computes by default)."""
        try:
            return super().loss_from(outputs, batch)
        except ValueError:
            if not torch.is_tensor(outputs):
                raise
            return self.example_losses(outputs, batch).mean()

    def lr_at(self, step: int) -> float:
        """The learning rate at ``step``: warmup, then cosine decay, from the recipe."""
        c = self.config
        return warmup_cosine(c.lr, step, c.steps, c.warmup, c.min_lr_ratio)

    # --- the Task protocol, from the parts -----------------------------------------------
    def check_limits(self) -> None:
        """Refuse recipes no verifier should build, and optimizers that are not torch's."""
        super().check_limits()
        self._optimizer_class()
        for k, v in self.config.optimizer_args.items():
            if k in ("params", "lr", "weight_decay", "foreach", "fused", "capturable", "differentiable"):
                raise ValueError(f"optimizer_args may not set {k!r} (the recipe or witness sets it)")
            items = v if isinstance(v, list) else [v]
            if not all(type(x) in JSON_SCALARS for x in items):
                raise ValueError(f"optimizer_args[{k!r}] must be a number, string, boolean or a list of them")

    def _optimizer_class(self) -> type[torch.optim.Optimizer]:
        cls = getattr(torch.optim, self.config.optimizer, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            raise ValueError(f"optimizer {self.config.optimizer!r} is not a torch.optim optimizer")
        return cls

    @property
    def _dataset(self) -> Dataset:
        return self._made("train", self.make_dataset)

    @property
    def _eval(self) -> Dataset:
        return self._made("eval", self.make_eval_dataset)

    def _made(self, split: str, make: Callable[[], Sequence[Any] | Dataset]) -> Dataset:
        # built once, and shared with the copies ``with_probes`` makes (a shallow copy keeps this
        # dict): a verifier that audits many runs of one recipe hashes its dataset once
        made = self.__dict__.setdefault("_datasets", {})  # (a plugin's __init__ may not call ours)
        if split not in made:
            with asked() as names:  # what it read: a recorder pins the small files by content
                made[split] = self._as_dataset(make(), split)
            self.__dict__.setdefault("_data_names", []).extend(n for n in names if n not in self.data_names())
        return made[split]

    def data_names(self) -> list[str]:
        """The data names this task's datasets read when they were built (and a ``TokenWindows``'s own,
        which it reads when first asked for a sample)."""
        names = list(self.__dict__.get("_data_names", []))
        for d in self.__dict__.get("_datasets", {}).values():
            if isinstance(d, TokenWindows) and isinstance(d.source, str) and d.source not in names:
                names.append(d.source)
        return names

    def _as_dataset(self, data: Sequence[Any] | Dataset, split: str) -> Dataset:
        if isinstance(data, Dataset):
            return data
        if len(data) > self.max_dataset:
            raise ValueError(f"the {split} set has {len(data)} samples, over {self.max_dataset}")
        return SampleList([self.samples.encode(s) for s in data], f"{self.name}-{split}")

    def dataset(self) -> Dataset:
        """The training set as canonical samples."""
        return self._dataset

    def eval_dataset(self) -> Dataset:
        """The evaluation set as canonical samples."""
        return self._eval

    def collate(self, samples: list[bytes]) -> Any:
        """Canonical bytes -> a batch, by the codec (a ``TokenWindows`` dataset is its own). Samples
        that do not decode (a bundle's, which may lie) are a ``VerificationError`` naming why."""
        try:
            return self._codec().collate(samples)
        except Exception as e:  # noqa: BLE001 - whatever the codec raised on bytes it did not expect
            raise VerificationError(f"the samples do not decode as the task {self.name!r} decodes them "
                                    f"({type(e).__name__}: {e})", check="samples") from None

    def _codec(self) -> Any:  # noqa: ANN401 - TokenWindows or the task's ``samples``
        # How samples decode follows from the recipe alone, never from which files this machine holds
        # (else a verifier with no data, or other data at the recipe's name, would decode a bundle's
        # samples otherwise than the trainer did): the dataset is built with every data name missing,
        # and only a TokenWindows (which opens its file when a sample is read) is its own codec. A
        # dataset that must read its data to be built (a list from a file, a TokenCorpus) is coded by
        # ``samples`` (a TokenCorpus plugin sets ``samples = CorpusWindows(dtype)``).
        chosen = self.__dict__.get("_codec_choice")
        if chosen is None:
            try:
                with no_data():
                    made = self.make_dataset()
            except Exception:  # noqa: BLE001 - it needs its data (or fails without it): the declared codec
                made = None
            chosen = made if isinstance(made, TokenWindows) else self.samples
            self.__dict__["_codec_choice"] = chosen
        return chosen

    def build_model(self, seed: bytes) -> nn.Module:
        """``make_model()`` with the global RNG seeded from the run seed (restored afterwards)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_int(seed, "witness/generic-init/v1"))
            return self.make_model()

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The recipe's optimizer; weight decay on matrices only; single-tensor kernels."""
        cls, c = self._optimizer_class(), self.config
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in c.optimizer_args.items()}
        accepted = inspect.signature(cls).parameters
        if "foreach" in accepted:
            kwargs["foreach"] = False  # the same kernel on every machine and for every tensor count
        decay = [p for p in model.parameters() if p.dim() >= 2]
        other = [p for p in model.parameters() if p.dim() < 2]
        if "weight_decay" in accepted:
            groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": other, "weight_decay": 0.0}]
        else:
            groups = [{"params": decay + other}]
        return cls([g for g in groups if g["params"]], lr=c.lr, **kwargs)

    def loss(self, model: nn.Module, batch: Any, generator: torch.Generator | None) -> torch.Tensor:
        """Mean of the per-example losses."""
        return self.example_losses(self.predict(model, batch), batch).mean()

    def probe_bytes(self) -> list[bytes]:
        """The first ``probes`` training samples (or a bundle's copy of them, checked by the verifier)."""
        given = getattr(self, "_given_probes", None)
        if given is not None:
            return given
        d = self._dataset
        return [d.sample_bytes(i) for i in range(min(self.probes, len(d)))]

    def probe_outputs(self, model: nn.Module, probes: Any) -> torch.Tensor:
        """The model's outputs on the probes."""
        return self.predict(model, probes)

    def probe_losses(self, outputs: torch.Tensor, probes: Any) -> torch.Tensor:
        """Per-probe losses, reduced to one number per probe."""
        losses = self.example_losses(outputs, probes)
        return losses.reshape(losses.shape[0], -1).mean(dim=1)

    @torch.no_grad()
    def eval_example(self, model: nn.Module, sample: bytes) -> dict:
        """Loss, and for class outputs ``[1, classes]`` the prediction and whether it is right."""
        batch = self.collate([sample])
        outputs = self.predict(model, batch)
        out: dict = {"loss": float(self.probe_losses(outputs, batch)[0])}
        if outputs.dim() == 2 and isinstance(batch, dict) and "y" in batch and batch["y"].dim() == 1:
            pred = int(outputs.argmax(dim=-1)[0])
            out.update(prediction=pred, correct=pred == int(batch["y"][0]))
        return out

    def flops_per_step(self) -> float:
        """About 6 x parameters x samples per step (a dense model's forward and backward)."""
        params = sum(p.numel() for p in self.build_model(b"\0" * 32).parameters())
        return 6.0 * params * self.config.batch_size

    def config_json(self) -> dict:
        """The recipe as JSON (a later field at its default left out, as ``Task.config_json`` does)."""
        return super().config_json()
