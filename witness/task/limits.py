"""Recipe fields a task's config may hold under common names, each refused where it is out of range
(a manifest may come from a liar, and a recipe is refused before the first step, not after)."""

from __future__ import annotations

import dataclasses
from typing import Any

MAX_CONFIG_NUMBER = 10_000_000
# integer recipe fields that may be 0 although their default is not (a Config adds its own)
MAY_BE_ZERO = frozenset({"warmup"})


def _number(x: object) -> bool:
    """An int or a float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_fields(c: Any) -> None:  # noqa: ANN401 - a task's Config
    """Refuse a schedule that rises after its warm-up and a dropout that is no probability."""
    # a schedule may rise only in its warm-up: a floor above the peak would make the rate climb after it,
    # up to a spike at the last step, where a step's allowed move (lr x B) holds a whole swapped model
    ratio, floor = getattr(c, "min_lr_ratio", None), getattr(c, "min_lr", None)
    if _number(ratio) and ratio > 1:
        raise ValueError(f"min_lr_ratio {ratio!r} is above 1: the rate would rise after its warm-up, to "
                         f"{ratio:g} times the recipe's lr at the last step (a schedule decays after its peak)")
    if _number(floor) and _number(getattr(c, "lr", None)) and floor > c.lr:
        raise ValueError(f"min_lr {floor!r} is above lr {c.lr!r}: the rate would rise after its warm-up (a "
                         "schedule decays after its peak)")
    dropout = getattr(c, "dropout", None)  # a recipe's dropout, where it has one (tinygpt's, a plugin's)
    if _number(dropout) and not 0 <= dropout < 1:
        # at 1 every activation is dropped and rescaled by 1/(1-p): the outputs are NaN from step 0
        raise ValueError(f"dropout is a probability in [0, 1), not {dropout!r}")


def config_from(config_cls: type, obj: dict, task: str) -> Any:  # noqa: ANN401 - a task's Config
    """The ``config_cls`` instance a config dict describes (the defaults where it says nothing), refusing
    unknown fields, ill-typed ones, numbers out of range and zero sizes."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    unknown = set(obj) - set(fields)
    if unknown:
        raise ValueError(f"unknown config fields for task {task}: {sorted(unknown)}")
    defaults = config_cls()
    values = {}
    for k, v in obj.items():
        want = type(getattr(defaults, k))
        if want is float and type(v) is int:
            v = float(v)
        if type(v) is not want:
            raise ValueError(f"config field {k} of task {task} must be {want.__name__}")
        if want in (int, float) and not 0 <= v <= MAX_CONFIG_NUMBER:
            raise ValueError(f"config field {k} of task {task} is out of range")
        # a size (a width, a count of layers, classes or steps) is at least 1: zero builds a
        # model with nothing in it, which trains without a word and certifies nothing
        if want is int and v == 0 and getattr(defaults, k) > 0 and k not in MAY_BE_ZERO | set(
                getattr(config_cls, "MAY_BE_ZERO", ())):
            raise ValueError(f"config field {k} of task {task} must be at least 1, not 0")
        values[k] = v
    return dataclasses.replace(defaults, **values)
