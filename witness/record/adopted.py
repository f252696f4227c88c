"""What a loop's own model and optimizer must be for the recorder to adopt them: the plugin's model
class (or its code, imported twice), and the recipe's optimizer class, groups and settings. Each
refusal says the way out (``witness.record.loop`` adopts them and records their steps)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from ..task.base import model_device

# the optimizer settings a loop's own optimizer may leave at torch's default where the recipe's sets
# them: ``None`` is "torch chooses", which on the CPU is the single-tensor kernel the recipe names
KERNEL_FLAGS = ("foreach", "fused")


def same_class(a: type, b: type) -> bool:
    """The same class, or the same class of the same code imported twice: a script run as
    ``__main__`` defines the class its plugin imports from it as a module, and a script's own
    ``model.py`` is the file its plugin's package links in (or a copy of it, byte for byte)."""
    if a is b:
        return True
    try:
        if a.__qualname__ != b.__qualname__:
            return False
        fa, fb = Path(inspect.getfile(a)), Path(inspect.getfile(b))
        return fa == fb or fa.resolve() == fb.resolve() or fa.read_bytes() == fb.read_bytes()
    except (TypeError, OSError):
        return False


def _where(cls: type) -> str:
    """A class by name and file, for messages."""
    try:
        return f"{cls.__qualname__} ({inspect.getfile(cls)})"
    except (TypeError, OSError):
        return f"{cls.__qualname__} ({cls.__module__})"


def adopt_model(model: torch.nn.Module, built: torch.nn.Module) -> None:
    """Give the loop's own ``model`` the initial state ``built`` (the task's, from the run seed), in
    place, so that the loop's references to its tensors (an optimizer built on them) stay valid."""
    if not same_class(type(model), type(built)):
        raise ValueError(f"the loop's model is a {_where(type(model))}; the task's plugin builds a "
                         f"{_where(type(built))}: a verifier would replay another model")
    mine, theirs = model.state_dict(), built.state_dict()
    missing, extra = sorted(set(theirs) - set(mine)), sorted(set(mine) - set(theirs))
    if missing or extra:
        raise ValueError(f"the loop's model does not have the task's tensors (missing {missing[:3]}, extra "
                         f"{extra[:3]}): build it with the recipe's settings")
    for k, v in theirs.items():
        if mine[k].shape != v.shape or mine[k].dtype != v.dtype:
            raise ValueError(f"the loop's model's {k} is {tuple(mine[k].shape)} {mine[k].dtype}; the task's is "
                             f"{tuple(v.shape)} {v.dtype}: build it with the recipe's settings")
    with torch.no_grad():
        for k, v in theirs.items():
            mine[k].copy_(v)


BUILD_OPTIMIZER = ("; the plugin's build_optimizer(model) builds the recipe's: a loop whose optimizer has groups "
                   "of its own has the plugin override build_optimizer to build the same groups (docs/recorder.md, "
                   "'Optimizer groups of your own')")


def check_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, want: torch.optim.Optimizer,
                    want_model: torch.nn.Module) -> None:
    """Refuse a loop's optimizer that would not step as the recipe's does (``want``, built on
    ``want_model``); a kernel flag left to torch (``None``) is set to the recipe's where they agree."""
    if type(optimizer) is not type(want):
        raise ValueError(f"the loop's optimizer is {type(optimizer).__name__}; the recipe's is {type(want).__name__}"
                         f"{BUILD_OPTIMIZER}")
    if optimizer.state:
        raise ValueError("the loop's optimizer has stepped already: adopt it before the first step")
    names = {id(p): n for n, p in model.named_parameters()}
    want_names = {id(p): n for n, p in want_model.named_parameters()}
    if len(optimizer.param_groups) != len(want.param_groups):
        raise ValueError(f"the loop's optimizer has {len(optimizer.param_groups)} parameter group(s); the recipe's "
                         f"has {len(want.param_groups)} (weight decay on matrices, none on vectors){BUILD_OPTIMIZER}")
    for i, (g, w) in enumerate(zip(optimizer.param_groups, want.param_groups, strict=True)):
        got, exp = [names.get(id(p), "?") for p in g["params"]], [want_names[id(p)] for p in w["params"]]
        if got != exp:
            raise ValueError(f"the loop's optimizer's group {i} holds {got[:3]}…; the recipe's holds {exp[:3]}… "
                             f"(a verifier would step other tensors with other settings){BUILD_OPTIMIZER}")
        for key in sorted(set(g) | set(w)):
            if key in ("params", "lr", "initial_lr"):
                continue  # the rate is the schedule's, set by the loop at every step and checked there
            mine, theirs = g.get(key), w.get(key)
            if key in KERNEL_FLAGS and mine is None and not theirs and model_device(model).type == "cpu":
                g[key] = theirs  # torch's own choice on the CPU is the single-tensor kernel: say so
                continue
            if _norm(mine) != _norm(theirs):
                raise ValueError(f"the loop's optimizer's {key} is {mine!r} (group {i}); the recipe's is {theirs!r}: "
                                 "put it in the recipe, or build the optimizer with the recipe's value")


def _norm(v: Any) -> Any:  # noqa: ANN401 - an optimizer setting
    return tuple(_norm(x) for x in v) if isinstance(v, (list, tuple)) else v
