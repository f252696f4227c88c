"""Hugging Face ``transformers``: a GPT-2 task built from a config, and the hooks that make a
stock ``Trainer`` run exactly the step that ``witness verify`` replays.

A ``Trainer`` script is witnessed by building the model and optimizer from the task (through
the recorder) and attaching the recorder::

    rec = Recorder.create(build_task("hf-gpt2", {...}), "run", key, r=os.urandom(32))
    trainer = Trainer(model=rec.model, args=args, train_dataset=committed_dataset(rec),
                      optimizers=(rec.optimizer, None))
    attach(trainer, rec)      # the committed data order, the task's loss, a callback per step
    trainer.train()

``attach`` installs small hooks, each because replay must compute what the Trainer computed:
the sampler yields the committed order; the loss is the task's (HF's own normalises by a
token count the replay would have to reconstruct); a wrapper reads the loss and the gradient
norm the Trainer computed, and a ``TrainerCallback`` checks the learning rate against the
committed schedule and writes the record after every optimizer step.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..task.base import StepOutput, mean_of_ranks, micro_seed
from ..task.tinygpt import TinyGPTConfig, TinyGPTTask
from .committed import (
    CommittedDataset,
    CommittedOrder,
    check_same_dataset,
    committed_dataset,
    same_batch,
)

__all__ = ["HFGPT2Task", "attach", "committed_dataset", "trainer_lr", "trainer_recipe"]


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("the hf-gpt2 task needs transformers: pip install 'witness[hf]'") from None
    return transformers


@dataclass(frozen=True)
class HFGPT2Config(TinyGPTConfig):
    """Recipe of ``hf-gpt2``: tinygpt's corpus and shapes, HF's GPT-2 and linear schedule."""

    steps: int = 200
    lr: float = 0.001
    # GPT-2's resid, embd and attn dropout; transformers draws the masks from torch's global
    # generator, which every step seeds from the committed step seed (Task.step_loss)
    dropout: float = 0.0
    weight_decay: float = 0.0


class HFGPT2Task(TinyGPTTask):
    """``transformers.GPT2LMHeadModel`` (random init from a config) on stdlib source bytes."""

    name = "hf-gpt2"
    Config = HFGPT2Config

    def __init__(self, config: HFGPT2Config):
        super().__init__(config)
        self.schedule = _LinearSchedule(config)  # transformers' linear warmup and decay

    def check_limits(self) -> None:
        """tinygpt's limits, and fp32."""
        super().check_limits()
        if self.precision != "fp32":
            # the Trainer chooses its own mixed precision (args.bf16): its step is not Task.train_step's
            raise ValueError("hf-gpt2 trains in fp32 (the Trainer's own mixed precision is not replayed)")

    def build_model(self, seed: bytes) -> nn.Module:
        """A GPT-2 of the recipe's shape, byte vocabulary, eager attention, weights from the seed."""
        from ..task.base import seed_int

        t, c = _transformers(), self.config
        cfg = t.GPT2Config(vocab_size=256, n_positions=c.block, n_embd=c.d_model, n_layer=c.n_layer,
                           n_head=c.n_head, resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout,
                           attn_implementation="eager")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_int(seed, "witness/hf-init/v1"))
            return t.GPT2LMHeadModel(cfg)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW as the Trainer builds it: decay on all but biases and LayerNorm weights."""
        c = self.config
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        other = [p for n, p in model.named_parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay},
                                  {"params": other, "weight_decay": 0.0}], lr=c.lr, foreach=False)

    def _logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens).logits

    def collate(self, samples: list[bytes]) -> dict[str, torch.Tensor]:
        """Windows of ``block + 1`` bytes as ``{"input_ids": [B, block + 1]}`` (a Trainer's batch)."""
        return {"input_ids": super().collate(samples)}

    def loss(self, model, batch, generator):
        """Next-byte cross-entropy (the Trainer's loss, through ``attach``)."""
        tokens = batch["input_ids"]
        logits = self._logits(model, tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))

    def probe_outputs(self, model, probes):
        """Next-byte logits on the probe texts."""
        return self._logits(model, probes[:, :-1])

    @torch.no_grad()
    def eval_example(self, model, sample: bytes) -> dict:
        """Mean next-byte loss of one held-out window."""
        tokens = self.collate([sample])
        return {"loss": float(self.loss(model, tokens, None))}


class _LinearSchedule:
    def __init__(self, c: HFGPT2Config):
        from transformers.optimization import _get_linear_schedule_with_warmup_lr_lambda as lam

        self.c, self.lam = c, lam

    def at(self, step: int) -> float:
        # LambdaLR: base_lr * lambda(step), the same expression, so the same bits
        return self.c.lr * self.lam(step, num_warmup_steps=self.c.warmup, num_training_steps=self.c.steps)


TRAINER_ADAMW = ("adamw_torch", "adamw_torch_fused")  # the Trainer's own AdamW, under its two names


def trainer_recipe(args: Any) -> dict:  # noqa: ANN401 - TrainingArguments, or vars() of them
    """The part of a recipe that a ``Trainer``'s ``TrainingArguments`` set (what ``attach`` checks):
    steps, the batch a step and its accumulation, the rate, warm-up, weight decay and clipping."""
    a = args if isinstance(args, dict) else vars(args)
    # under torchrun a step is every rank's accumulation: its batch and micro-batches are the world's
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    accum = a["gradient_accumulation_steps"] * world
    return dict(steps=a["max_steps"], batch_size=a["per_device_train_batch_size"] * accum, grad_accum=accum,
                lr=a["learning_rate"], warmup=a["warmup_steps"], weight_decay=a["weight_decay"],
                grad_clip=a["max_grad_norm"],
                optimizer_args={"betas": [a["adam_beta1"], a["adam_beta2"]], "eps": a["adam_epsilon"]})


def trainer_lr(config: Any, step: int) -> float:  # noqa: ANN401 - a recipe
    """The learning rate of ``step`` under the ``Trainer``'s linear schedule with warm-up (its
    ``LambdaLR``: the base rate times the same lambda, so the same bits)."""
    from transformers.optimization import _get_linear_schedule_with_warmup_lr_lambda as lam

    return config.lr * lam(step, num_warmup_steps=config.warmup, num_training_steps=config.steps)


def attach(trainer: Any, rec: Any) -> None:
    """Make ``trainer`` run the committed steps of ``rec`` and record each one."""
    t = _transformers()
    c, args = rec.task.config, trainer.args
    accum = rec.task.grad_accum
    rank, world = getattr(rec, "ranks", (0, 1))  # under torchrun, each rank trains accum / world micro-batches
    local = accum // world
    # refused before the first step: the self-check would stop the run at step 0 anyway, with advice
    # (train rec.step_model) that a Trainer cannot follow
    if getattr(args, "torch_compile", False):
        raise ValueError("the Trainer's torch_compile=True runs the step compiled, and replay runs the hf-gpt2 step "
                         "eagerly (compiled kernels round differently: the verifier would reject the run): leave "
                         "torch_compile out of TrainingArguments (False, its default)")
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")
    if backend.lower() not in ("no", ""):
        # accelerate compiles the model when this is set (TrainingArguments(torch_compile=True) sets it, for
        # the process and every process it starts): the Trainer's step would not be the one replay runs
        raise ValueError(f"ACCELERATE_DYNAMO_BACKEND={backend} in the environment makes accelerate compile the model, "
                         "and replay runs the step eagerly: unset it (or set it to 'no') before training")
    if rec.task.compiles:
        raise ValueError("a recipe with compile=True is for witness's own step and your own loop (rec.step_model); "
                         "under the Trainer, leave compile out of the recipe and torch_compile out of TrainingArguments")
    if args.per_device_train_batch_size * accum != c.batch_size or args.gradient_accumulation_steps != local:
        raise ValueError(f"set per_device_train_batch_size={c.batch_size // accum} and gradient_accumulation_steps="
                         f"{local}: the task's {c.batch_size} samples a step, in its grad_accum micro-batches "
                         f"over {world} rank(s)")
    if args.max_steps != c.steps or args.lr_scheduler_type != "linear" or args.warmup_steps != c.warmup:
        raise ValueError(f"set max_steps={c.steps}, warmup_steps={c.warmup} and the linear schedule, as the task")
    if args.max_grad_norm != c.grad_clip or args.learning_rate != c.lr:
        raise ValueError(f"set max_grad_norm={c.grad_clip} and learning_rate={c.lr}, as the task")
    optim = getattr(args.optim, "value", args.optim)
    if trainer.optimizer is None and optim not in TRAINER_ADAMW:
        raise ValueError(f"the Trainer's optim is {optim!r}; a witnessed Trainer steps the recipe's AdamW (optim "
                         "'adamw_torch' or its default 'adamw_torch_fused', run as the single-tensor kernel replay runs)")
    want = getattr(rec.task.config, "optimizer_args", {})
    if trainer.optimizer is None and (list(want.get("betas", [0.9, 0.999])) != [args.adam_beta1, args.adam_beta2]
                                      or want.get("eps", 1e-8) != args.adam_epsilon):
        raise ValueError(f"the Trainer's adam_beta1/adam_beta2/adam_epsilon ({args.adam_beta1}, {args.adam_beta2}, "
                         f"{args.adam_epsilon}) are not the recipe's optimizer_args {want}: build the recipe with "
                         "trainer_recipe(args)")
    if trainer.optimizer is None and trainer.model is rec.model:
        trainer.optimizer = rec.optimizer  # the recipe's AdamW (the Trainer's own), built on the script's model
    if trainer.model is not rec.model or trainer.optimizer is not rec.optimizer:
        raise ValueError("give the Trainer the model the recorder adopted (start_run(..., model=model)), and no "
                         "optimizer of its own: the recorder's is the recipe's, built on that model")
    if not isinstance(trainer.train_dataset, CommittedDataset):
        if trainer.data_collator is not t.default_data_collator and not isinstance(
                trainer.data_collator, t.DataCollatorWithPadding):
            # replay collates the committed samples with the task's codec: a collator of the script's own
            # (masking, padding to a multiple, ...) would be silently dropped, and the run not what it wrote
            raise ValueError(f"the Trainer's data_collator is the script's own ({type(trainer.data_collator).__name__}): "
                             "a witnessed Trainer collates the committed samples as the task does; give the plugin "
                             "samples that collate to what the collator gave, and leave data_collator unset")
        check_same_dataset(rec, trainer.train_dataset)
        trainer.train_dataset = committed_dataset(rec)  # the same samples, by index, as the task's bytes
    seen: dict[str, Any] = {}
    task = rec.task

    # the committed data order, batches collated by the task (replay collates the same way)
    part = c.batch_size // accum
    trainer._get_train_sampler = types.MethodType(lambda self, *a, **k: CommittedOrder(rec, part), trainer)
    trainer.data_collator = task.collate
    # the task's loss: transformers' own would normalise by a token count replay would have to rebuild
    trainer.model_accepts_loss_kwargs = False
    # under the micro-batch's randomness (the global generators seeded from its committed seed), as
    # replay runs it; the Trainer divides the loss by gradient_accumulation_steps before the backward,
    # as replay does, and the record keeps the micro losses' mean (replay's)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if world > 1:
            if not seen.get("wrapped"):  # the Trainer's DDP wrapper: the rank-ordered all-reduce
                rec.use_wrapper(model)
                seen["wrapped"] = True
            rec.check_sync(model, seen["micro"] == local - 1)
        seed = rec.step_seed(seen["step"])
        loss = task.step_loss(model, inputs, seed if accum == 1 else micro_seed(seed, rank * local + seen["micro"]))
        seen["losses"].append(float(loss.detach()))
        return loss

    trainer.compute_loss = types.MethodType(compute_loss, trainer)
    step = trainer.training_step

    def training_step(model, inputs, num_items_in_batch=None):
        # the batch the Trainer was handed must be the committed one (a reshuffling loader is an error)
        if not same_batch(inputs, seen["micro_batches"][seen["micro"]]):
            raise ValueError("the Trainer's batch is not the committed one: is another sampler in use?")
        loss = step(model, inputs, num_items_in_batch)
        seen["micro"] += 1
        return loss

    trainer.training_step = training_step
    clip = trainer.accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, *a, **k):
        norm = clip(parameters, max_norm, *a, **k)
        seen["grad_norm"] = float(norm)
        return norm

    trainer.accelerator.clip_grad_norm_ = clip_grad_norm_

    class Witness(t.TrainerCallback):
        """Check the step's learning rate, then record the step."""

        def on_step_begin(self, args, state, control, **kwargs):
            k = state.global_step
            whole = rec.batch(k)  # the committed batch, which the next record commits
            parts = [whole] if accum == 1 else task.split_batch(whole, accum)
            seen.update(step=k, micro=0, losses=[], micro_batches=parts[rank * local:(rank + 1) * local])
            lrs = {g["lr"] for g in rec.optimizer.param_groups}
            if lrs != {rec.lr(k)}:
                raise ValueError(f"step {k}: the Trainer's learning rate {lrs} is not the committed {rec.lr(k)}")

        def on_step_end(self, args, state, control, **kwargs):
            k = state.global_step - 1
            rec.log_step(k, StepOutput(mean_of_ranks(seen["losses"]), rec.lr(k), seen.pop("grad_norm")))

        def on_train_end(self, args, state, control, **kwargs):
            rec.finish()

    trainer.add_callback(Witness())
