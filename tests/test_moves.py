"""The bound on one optimizer step's move, checked against torch's own Adam and AdamW: no gradient
sequence, however adversarial, moves a coordinate past lr * B_t, and the sequence that Cauchy-Schwarz
names reaches it (so B_t is exact, and the usual (1 - b1) / sqrt(1 - b2) is exceeded)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from witness.fingerprint.moves import (
    MoveRule,
    adam_bound,
    adam_bounds,
    move_limits,
    move_rules,
    step_offset,
)

BETAS = [(0.9, 0.95), (0.9, 0.999), (0.8, 0.99), (0.0, 0.99), (0.95, 0.9), (0.9, 0.8)]


def limit_of(b1: float, b2: float) -> float:
    r = b1 * b1 / b2
    return (1 - b1) / math.sqrt(1 - b2) / math.sqrt(1 - r)


def test_the_bound_is_one_at_the_first_update_and_tends_to_its_limit():
    for b1, b2 in BETAS:
        assert adam_bound(b1, b2, 1) == pytest.approx(1.0, abs=1e-15)
    assert adam_bound(0.9, 0.95, 100_000) == pytest.approx(limit_of(0.9, 0.95), rel=1e-9)
    assert round(limit_of(0.9, 0.95), 3) == 1.165 and round(limit_of(0.9, 0.999), 2) == 7.27
    assert adam_bound(0.9, 0.999, 200_000) == pytest.approx(7.27, abs=0.005)
    # b1^2 > b2: the sum grows without end, and so does the bound (inf once it overflows)
    grows = adam_bounds(0.9, 0.8, 200_000)
    assert np.all(np.diff(grows[np.isfinite(grows)]) >= 0) and np.isinf(grows[-1])
    with pytest.raises(ValueError):
        adam_bounds(0.9, 0.0, 3)


def _run(opt_cls, grads: list[torch.Tensor], lrs: list[float], **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every (before, after) of a parameter stepped by ``opt_cls`` with these gradients and rates."""
    p = torch.nn.Parameter(torch.linspace(-1, 1, grads[0].numel(), dtype=grads[0].dtype).reshape(grads[0].shape))
    opt = opt_cls([p], **kw)
    out = []
    for g, lr in zip(grads, lrs, strict=True):
        opt.param_groups[0]["lr"] = lr
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        out.append((before, p.detach().clone()))
    return out


def _worst(pairs, lrs, b1, b2, decay) -> float:
    """The largest move beyond the decayed value, over every step and coordinate, in units of lr * B_t."""
    bounds = np.maximum.accumulate(adam_bounds(b1, b2, len(pairs)))
    worst = 0.0
    for t, ((a, b), lr) in enumerate(zip(pairs, lrs, strict=True)):
        moved, allowed = move_limits(a.numpy(), b.numpy(), np.float64(lr), np.float64(bounds[t]), decay,
                                     a.numpy().dtype)
        assert np.all(moved <= allowed), (t, float(moved.max()), float(allowed.max()))
        worst = max(worst, float((moved / (lr * bounds[t])).max()))
    return worst


@pytest.mark.parametrize("b1,b2", [(0.9, 0.95), (0.9, 0.999), (0.8, 0.99)])
def test_the_cauchy_schwarz_sequence_reaches_the_bound_and_passes_the_usual_one(b1, b2):
    steps = min(2000, int(300 / math.log(b2 / b1)))  # the gradients' squares stay finite in float64
    # |g_{t-k}| proportional to (b1 / b2)^k: gradients that grow as (b2 / b1)^j, all of one sign
    grads = [torch.full((4,), (b2 / b1) ** j, dtype=torch.float64) for j in range(1, steps + 1)]
    lrs = [1e-3] * steps
    pairs = _run(torch.optim.AdamW, grads, lrs, betas=(b1, b2), eps=1e-12, weight_decay=0.0, foreach=False)
    (a, b) = pairs[-1]
    reached = float((a - b).abs().max()) / 1e-3
    assert reached == pytest.approx(adam_bound(b1, b2, steps), rel=1e-6)
    assert reached > (1 - b1) / math.sqrt(1 - b2)  # the usual estimate is exceeded
    assert _worst(pairs, lrs, b1, b2, 0.0) <= 1 + 1e-6


@pytest.mark.parametrize("opt_cls,decay,kw", [
    (torch.optim.AdamW, 0.1, {}),
    (torch.optim.AdamW, 0.0, {"amsgrad": True}),
    (torch.optim.AdamW, 0.3, {"maximize": True}),
    (torch.optim.AdamW, 0.1, {"foreach": True}),
    (torch.optim.Adam, 0.0, {"weight_decay": 0.05}),  # L2: the decay goes into the gradient
])
@pytest.mark.parametrize("seed", range(4))
def test_no_gradient_sequence_moves_a_coordinate_past_the_bound(opt_cls, decay, kw, seed):
    gen = torch.Generator().manual_seed(seed)
    steps, n = 120, 512
    b1, b2 = [(0.9, 0.95), (0.9, 0.999), (0.5, 0.9), (0.0, 0.99)][seed]
    grads = []
    for j in range(steps):
        kind = (j + seed) % 6
        if kind == 0:  # heavy tails, over twelve orders of magnitude
            g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 5, (n,), generator=gen)
        elif kind == 1:  # a spike after quiet steps
            g = torch.zeros(n)
            g[torch.randint(0, n, (8,), generator=gen)] = 1e4
        elif kind == 2:  # tiny, near eps
            g = torch.randn(n, generator=gen) * 1e-9
        elif kind == 3:  # the growing sequence that reaches the bound
            g = torch.full((n,), (b2 / max(b1, 0.5)) ** (j % 40))
        elif kind == 4:
            g = torch.sign(torch.randn(n, generator=gen))  # signs that flip
        else:
            g = torch.zeros(n)  # no gradient signal at all
        grads.append(g.float())
    lrs = [3e-3 * min(1.0, (j + 1) / 10) for j in range(steps)]  # warm-up from the first step
    args = {"betas": (b1, b2), "weight_decay": decay, "foreach": False} | kw
    pairs = _run(opt_cls, grads, lrs, **args)
    # (each step is checked against the slack inside _worst; this ratio also holds the value's own rounding)
    assert _worst(pairs, lrs, b1, b2, decay if opt_cls is torch.optim.AdamW else 0.0) <= 1 + 1e-3


def test_the_first_update_is_lr_at_most_and_reaches_it():
    # B_1 = 1: at warm-up's first step every coordinate with a gradient moves by lr, up to rounding
    g = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 10.0
    pairs = _run(torch.optim.AdamW, [g], [1e-4], betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    assert _worst(pairs, [1e-4], 0.9, 0.95, 0.1) == pytest.approx(1.0, abs=2e-3)  # an ulp of 1 is 1e-3 of lr here


def test_a_swap_is_far_outside_the_bound():
    a = torch.randn(256, generator=torch.Generator().manual_seed(0)) * 0.02
    b = torch.randn(256, generator=torch.Generator().manual_seed(1)) * 0.02
    moved, allowed = move_limits(a.numpy(), b.numpy(), np.float64(3e-3), np.float64(adam_bound(0.9, 0.95, 20)), 0.1,
                                 np.dtype(np.float32))
    assert (moved > allowed).mean() > 0.7


def test_rules_come_from_the_optimizer_and_others_are_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    frozen = model[1].bias
    decay = [model[0].weight, model[1].weight]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": [model[0].bias], "weight_decay": 0.0}],
                            betas=(0.9, 0.95))
    rules = move_rules(model, opt)
    assert rules.rules["model.0.weight"] == MoveRule((0.9, 0.95), 0.1)
    assert rules.rules["model.0.bias"] == MoveRule((0.9, 0.95), 0.0)
    assert rules.rules["model.1.bias"] == MoveRule(None)  # no group holds it: it may not move
    assert frozen is model[1].bias and "AdamW (B <= 1" in rules.describe(100)
    # b1^2 >= b2: the sum does not converge, the bound grows with the step count: refused, not checked
    assert "grows without end" in move_rules(model, torch.optim.AdamW(model.parameters(), betas=(0.99, 0.2)))
    assert "grows without end" in move_rules(model, torch.optim.AdamW(model.parameters(), betas=(0.95, 0.9)))
    adam = move_rules(model, torch.optim.Adam(model.parameters(), weight_decay=0.1))
    assert adam.rules["model.0.weight"].decay == 0.0  # L2 into the gradient: no decoupled decay
    sgd = move_rules(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert isinstance(sgd, str) and "gradient" in sgd and "SGD" in sgd
    assert isinstance(move_rules(model, torch.optim.AdamW(model.parameters(), eps=1e-30)), str)
    half = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert "bfloat16" in move_rules(half, torch.optim.AdamW(half.parameters()))

    class MyAdam(torch.optim.AdamW):  # a subclass may step otherwise: refused
        pass

    assert isinstance(move_rules(model, MyAdam(model.parameters())), str)


def test_the_bound_table_takes_the_largest_b_up_to_each_step():
    rules = move_rules(torch.nn.Linear(2, 2), torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    assert isinstance(rules, str)  # another model's parameters
    lin = torch.nn.Linear(2, 2)
    rules = move_rules(lin, torch.optim.AdamW(lin.parameters(), betas=(0.9, 0.999)))
    table = rules.bounds((0.9, 0.999), 50)
    assert table[0] == pytest.approx(1.0) and np.all(np.diff(table) >= 0)
    assert rules.bounds((0.9, 0.999), 10, offset=5)[0] == pytest.approx(adam_bound(0.9, 0.999, 6))
    assert step_offset({"optim.w.step": torch.tensor(7.0), "model.w": torch.zeros(2)}) == 7
    assert step_offset({"model.w": torch.zeros(2)}) == 0


def test_a_step_of_rate_zero_is_held_to_no_move():
    a = np.array([0.5, -1.0], dtype=np.float32)
    moved, allowed = move_limits(a, a + np.float32(1e-7), np.float64(0.0), np.float64(1.0), 0.1, np.dtype(np.float32))
    assert (allowed == 0).all() and (moved > 0).all()


def test_a_coordinate_that_becomes_nan_is_not_a_move_but_leaving_it_is():
    a = np.array([0.5, np.nan, 1.0], dtype=np.float32)
    b = np.array([np.nan, 0.2, 1.0], dtype=np.float32)
    moved, allowed = move_limits(a, b, np.float64(1e-3), np.float64(1.0), 0.0, np.dtype(np.float32))
    assert not (moved[1] <= allowed[1]) and moved[2] == 0
