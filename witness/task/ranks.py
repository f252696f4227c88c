"""A data-parallel step whose ranks each accumulate several micro-batches, replayed on one process.

nanoGPT's ``train.py`` under torchrun (and any loop written like it) divides the recipe's
``gradient_accumulation_steps`` (``grad_accum``, G) by the world size W: rank ``r`` trains the
micro-batches ``r·G/W … (r+1)·G/W − 1`` of the step's batch (split into G in order, as one process
splits it), backpropagates each micro-batch's mean loss divided by G/W into its own gradients, and
DDP's rank-ordered all-reduce (``witness.distributed.session.ordered_allreduce_hook``) adds the W
ranks' accumulated gradients in rank order and divides by W. Float addition is not associative,
so one process must add the same way: each rank's micro-batches into a gradient of that rank's
own, then the ranks' gradients in rank order. Each micro-batch draws its randomness from its
index in the whole step (``micro_seed(seed, j)``), as in one process, so the micro-batches and
their dropout masks are the same whether the run had one rank or W.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import StepOutput, Task, clip_whole, mean_of_ranks, micro_seed


def accumulation_replays(grad_accum: int, world: int, parallelism: str) -> bool:
    """Whether gradient accumulation over ``world`` ranks under ``parallelism`` has a replay rule: none
    to apply (``grad_accum`` 1), one process, or DDP with ``grad_accum`` a multiple of the ranks."""
    if grad_accum == 1:
        return True
    if parallelism == "fsdp":
        return False
    return world == 1 or parallelism == "ddp" and grad_accum % world == 0


def ranks_accumulated_step(task: Task, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,  # noqa: ANN401
                           lr: float, seed: int, world: int) -> StepOutput:
    """One step of ``world`` ranks, each accumulating its ``grad_accum / world`` micro-batches (see
    the module); the loss is the ranks' mean losses, averaged in rank order."""
    accum = task.grad_accum
    if accum % world:
        raise ValueError(f"grad_accum {accum} does not split over {world} ranks")
    local = accum // world
    for group in optimizer.param_groups:
        group["lr"] = lr
    model.train()
    params = list(model.parameters())
    parts = task.split_batch(batch, accum)
    total: list[torch.Tensor | None] = [None] * len(params)
    used = [False] * len(params)  # a parameter no rank's loss reaches keeps no gradient, as under DDP
    rank_losses = []
    for r in range(world):
        optimizer.zero_grad(set_to_none=True)  # each rank accumulates from no gradient
        losses = []
        for k in range(local):
            j = r * local + k
            loss = task.step_loss(model, parts[j], micro_seed(seed, j))
            (loss / local).backward()  # nanoGPT's loss / gradient_accumulation_steps (per rank)
            losses.append(float(loss.detach()))
        rank_losses.append(mean_of_ranks(losses))
        with torch.no_grad():
            for i, p in enumerate(params):
                used[i] |= p.grad is not None
                g = p.grad if p.grad is not None else torch.zeros_like(p)  # DDP reduces a zero for it
                total[i] = g if total[i] is None else total[i].add_(g)  # type: ignore[union-attr]
    with torch.no_grad():
        for p, g, u in zip(params, total, used, strict=True):
            p.grad = g.div_(world) if u else None  # type: ignore[union-attr]
    max_norm = task.config.grad_clip if task.config.grad_clip > 0 else float("inf")
    gn = clip_whole([p for p in params if p.grad is not None], max_norm)
    optimizer.step()
    return StepOutput(mean_of_ranks(rank_losses), lr, float(gn))
