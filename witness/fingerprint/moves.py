"""How far one optimizer step can move a parameter, whatever the gradient.

Adam and AdamW divide the bias-corrected first moment by the root of the bias-corrected second,
so a step moves every coordinate by at most ``lr_t * B_t`` (after AdamW's decoupled decay),
coordinate by coordinate and for any gradients, where for the optimizer's t-th update

    B_t = (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2)) * sqrt(sum_{k<t} (b1^2 / b2)^k)

(Cauchy-Schwarz on the moments' sums; ``docs/threat-model.md`` derives it, and it is reached by
gradients that grow as (b2 / b1)^t). B_1 = 1; for betas (0.9, 0.95) B_t tends to about 1.165, for
(0.9, 0.999) to 7.27. The usual ``lr * (1 - b1) / sqrt(1 - b2)`` is an approximation and is exceeded.

A parameter no optimizer group holds must not move at all. Other optimizers have no bound that
holds for any gradient (SGD's momentum sums the gradients, which nothing bounds): the check is
refused for them, with the reason, rather than claimed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .chunks import dtype_name

# Rounding: torch's AdamW computes in the parameter's dtype, so a step's move may exceed the exact
# bound by a few roundings of the update (each 2^-24 of it in float32) and of the new value (an ulp
# of it). The check allows the move lr * B * (1 + REL_SLACK) + ULP_SLACK ulps of the larger of the two
# values: 2^-16 is over a hundred times the update's roundings, and far below anything a swap moves.
REL_SLACK = 2.0 ** -16
ULP_SLACK = 4
# Below this eps a second moment that underflows (a subnormal float32) could let the update pass the
# bound; at 1e-16 and above eps dominates such a moment a thousandfold (the bound then holds with room).
MIN_EPS = 1e-16
SUPPORTED_DTYPES = (torch.float32, torch.float64)


def adam_bound(beta1: float, beta2: float, t: int) -> float:
    """B_t: the most one Adam update (its t-th, t >= 1) moves a coordinate, in units of lr."""
    return float(adam_bounds(beta1, beta2, t)[-1])


def adam_bounds(beta1: float, beta2: float, steps: int) -> np.ndarray:
    """B_1 .. B_steps (float64; inf where the bound overflows, as it may when b1^2 > b2)."""
    if not (0.0 <= beta1 < 1.0 and 0.0 < beta2 < 1.0):
        raise ValueError(f"betas ({beta1}, {beta2}) have no bound: each must lie in [0, 1), and b2 > 0")
    t = np.arange(1, steps + 1, dtype=np.float64)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        # 1 - b^t and (1 - r^t) / (1 - r) through expm1, exact where b or r is close to 1
        c1 = -np.expm1(t * math.log(beta1)) if beta1 > 0 else np.ones_like(t)
        c2 = -np.expm1(t * math.log(beta2))
        r = beta1 * beta1 / beta2
        if r == 0:
            s = np.ones_like(t)
        elif r == 1:
            s = t
        else:
            s = np.expm1(t * math.log(r)) / math.expm1(math.log(r))
        out = (1 - beta1) / c1 * np.sqrt(c2 / (1 - beta2)) * np.sqrt(s)
    return np.where(np.isfinite(out), out, np.inf)


@dataclass(frozen=True)
class MoveRule:
    """How one parameter may move in a step of learning rate lr: ``|new - old * (1 - lr * decay)| <=
    lr * B``, B from ``betas`` (None: no optimizer group holds it, so it may not move at all)."""

    betas: tuple[float, float] | None
    decay: float = 0.0  # AdamW's decoupled weight decay (Adam's L2 goes into the gradient: 0 here)

    def to_json(self) -> dict:
        """For the verdict."""
        return {"betas": list(self.betas) if self.betas else None, "decay": self.decay}


@dataclass(frozen=True)
class MoveRules:
    """Every parameter's rule (by its state name, ``model.<name>``), and the optimizer they come from."""

    optimizer: str
    rules: dict[str, MoveRule]

    def bounds(self, betas: tuple[float, float], steps: int, offset: int = 0) -> np.ndarray:
        """For run steps 0 .. steps - 1, the largest B the step may use: the optimizer's update count
        after run step t is at most offset + t + 1 (fewer where an fp16 step was skipped or a parameter
        had no gradient), so the bound is the largest B_s over s <= offset + t + 1."""
        table = np.maximum.accumulate(adam_bounds(*betas, steps + offset))
        return table[offset:offset + steps]

    def describe(self, steps: int, offset: int = 0) -> str:
        """One line: the optimizer and the largest bound a run of ``steps`` steps reaches."""
        betas = sorted({r.betas for r in self.rules.values() if r.betas is not None})
        limits = ", ".join(f"B <= {self.bounds(b, steps, offset).max():.4g} for betas {b}" for b in betas)
        return f"{self.optimizer} ({limits})" if limits else self.optimizer


# Muon's orthogonalisation (torch.optim.Muon): five steps of x -> a x + b x^3 + c x^5 on the singular values of
# the momentum scaled to Frobenius norm 1 (so each starts in [0, 1]), with (a, b, c) = (3.4445, -4.775, 2.0315).
# In exact arithmetic (tests/test_muon_bound.py recomputes both): no value in [0, 1] goes past MUON_SUP in any
# number of steps, and every value up to MUON_MARGIN_TO maps back under MUON_SUP, the margin a rounding error
# would have to stay within for the bound to survive it.
MUON_SUP = 1.2024
MUON_MARGIN_TO = 1.2539


def muon_refusal() -> str:
    """Why no bound on one Muon step holds for every gradient (the bounded-move check refuses Muon)."""
    return (f"Muon: in exact arithmetic its Newton-Schulz orthogonalisation keeps every singular value of the update "
            f"at most {MUON_SUP} (its quintic maps [0, {MUON_MARGIN_TO}] into [0, {MUON_SUP}]), so a coordinate would "
            f"move at most lr x adjust x {MUON_SUP} after the decay; but torch runs the iteration in bfloat16, and the "
            "worst case of one step's rounding of the Gram matrix A, 2^-8 (|b| + 2|c| |A|) |A|_F >= 0.06, is past "
            f"that margin of {MUON_MARGIN_TO - MUON_SUP:.3f} for a matrix of any size (torch's own updates do exceed the "
            "exact bound): no bound holds for every gradient, so the bounded-move check needs torch's Adam or AdamW")


def move_rules(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> MoveRules | str:
    """The rule of every parameter of ``model`` under ``optimizer``, or why no bound holds."""
    kind = type(optimizer)
    if kind.__name__ == "Muon" and kind.__module__.startswith("torch.optim"):
        return muon_refusal()
    if kind not in (torch.optim.AdamW, torch.optim.Adam):
        why = ("its momentum sums the gradients, so a step is bounded only given a bound on the gradient"
               if isinstance(optimizer, torch.optim.SGD) else "no bound that holds for any gradient is derived for it")
        return f"{kind.__name__}: {why} (the bounded-move check needs torch's Adam or AdamW)"
    names = {id(p): n for n, p in model.named_parameters()}
    rules: dict[str, MoveRule] = {}
    for group in optimizer.param_groups:
        b1, b2 = (float(b) for b in group["betas"])
        if not (0.0 <= b1 < 1.0 and 0.0 < b2 < 1.0):
            return f"{kind.__name__} with betas ({b1}, {b2}): no bound holds (b1 in [0, 1), b2 in (0, 1) needed)"
        if b1 * b1 >= b2:  # the sum of (b1^2 / b2)^k does not converge: B_t grows without end, as the steps may
            return (f"{kind.__name__} with betas ({b1}, {b2}): b1^2 >= b2, so a step's bound grows without end with "
                    "its count (the optimizer's own steps are as unbounded), and checking against it proves nothing")
        if float(group["eps"]) < MIN_EPS:
            return (f"{kind.__name__} with eps {group['eps']}: below {MIN_EPS:g} an underflowing second moment "
                    "could pass the bound")
        decoupled = kind is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))
        for p in group["params"]:
            if id(p) not in names:
                return f"{kind.__name__} steps a tensor that is not one of the model's parameters"
            if p.dtype not in SUPPORTED_DTYPES:
                return (f"parameter {names[id(p)]} is {dtype_name(p.dtype)}: the bound's rounding is "
                        "checked for float32 and float64 parameters only")
            rules[f"model.{names[id(p)]}"] = MoveRule((b1, b2), float(group["weight_decay"]) if decoupled else 0.0)
    for n, p in model.named_parameters():
        if f"model.{n}" not in rules:
            if p.dtype not in SUPPORTED_DTYPES:
                return f"parameter {n} is {dtype_name(p.dtype)}: float32 or float64 parameters only"
            rules[f"model.{n}"] = MoveRule(None)
    return MoveRules(kind.__name__, rules)


def step_ranges(mask: np.ndarray) -> list[list[int]]:
    """The steps where ``mask`` holds, as inclusive ranges ``[first, last]`` (for a verdict)."""
    out: list[list[int]] = []
    for t in np.nonzero(mask)[0].tolist():
        if out and out[-1][1] == t - 1:
            out[-1][1] = t
        else:
            out.append([t, t])
    return out


def tensor_rms(t: torch.Tensor) -> float:
    """A tensor's root mean square, in float64 (0 for an empty one)."""
    return math.sqrt(float(t.detach().to(torch.float64).pow(2).mean())) if t.numel() else 0.0


def one_rate(optimizer: torch.optim.Optimizer, step: int, lr: float) -> None:
    """Refuse a step whose optimizer groups trained at different rates (a task's own per-group rates):
    the move check holds every parameter to the step record's one rate. (One rate other than the
    record's is a loop's own business: replay judges it.)"""
    rates = sorted({float(g["lr"]) for g in optimizer.param_groups})
    if len(rates) > 1:
        raise ValueError(f"step {step}: the optimizer's groups trained at rates {rates}, the step's record says lr "
                         f"{lr}; the bounded-move check holds every parameter to the record's one rate, so a run with "
                         "per-group rates takes online challenges without it (--online-chunks 0, "
                         "OnlineSpec(chunks=0))")


def step_offset(init_state: dict[str, torch.Tensor]) -> int:
    """The largest optimizer step counter in a run's initial state (0 for a fresh optimizer)."""
    counts = [int(v.max()) for k, v in init_state.items() if k.startswith("optim.") and k.endswith(".step")
              and v.numel()]
    return max(counts, default=0)


def move_limits(before: np.ndarray, after: np.ndarray, lr: np.ndarray, bound: np.ndarray, decay: float,
                dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(how far each coordinate moved beyond its decayed value, how far it may), elementwise, in float64.

    ``before`` and ``after`` are the values in the parameter's ``dtype``, a row of one tensor's coordinates
    along the last axis (a chunk: chunks never mix tensors); ``lr`` and ``bound`` broadcast against them
    (one per step). torch's Adam and AdamW skip a parameter without a gradient altogether, decay
    included (a frozen parameter, one a step did not use, every parameter of an fp16 step the scaler
    skipped): a row whose every bit is unchanged moved 0. A row that changed was stepped, decay and all,
    so every coordinate of it is measured from its decayed value (one whose bits stayed is then a move
    of its decay, within the bound in an honest step). A parameter that may not move (``bound`` 0, no
    decay), or a step of rate 0, is allowed a move of 0."""
    a, b = before.astype(np.float64), after.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # inf and NaN values move by NaN: out of bounds
        moved = np.where(skipped(before, after), 0.0, np.abs(b - a * (1.0 - lr * decay)))
        ulp = np.spacing(np.maximum(np.abs(before), np.abs(after)).astype(dtype)).astype(np.float64)
        # a step of rate 0 moves nothing (the decay is 1, the update 0): it is held to no move at all
        allowed = np.where((bound > 0) & (lr > 0), lr * bound * (1.0 + REL_SLACK) + ULP_SLACK * ulp, 0.0)
    return moved, allowed


def skipped(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Whether each row (the last axis: a chunk of one tensor) kept every bit: a step that did not update it."""
    return unchanged(before, after).all(axis=-1, keepdims=True)


def unchanged(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Where a coordinate's bits are the same before and after (NaN stays NaN; 0.0 to -0.0 is a change)."""
    width = f"u{before.dtype.itemsize}"
    return before.view(width) == after.view(width)
