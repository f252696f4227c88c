"""What the self-check and its background check share: the failure they stop a run with, and the
global generators' states they compare (a step that drew from one outside its randomness)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class SelfCheckFailed(ValueError):
    """A recorded step does not replay: the verifier would reject the run."""


def rng_states() -> tuple:
    """torch's, Python's and NumPy's global generators' states."""
    return torch.random.get_rng_state(), random.getstate(), np.random.get_state()


def same_rng(a: Any, b: Any) -> bool:  # noqa: ANN401 - generator states of three kinds
    """Whether two states of one generator (as ``rng_states`` gives them) are the same."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and a and isinstance(a[0], str):  # NumPy's (name, keys, pos, ...)
        return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]
    return a == b


def drawn_generators(before: tuple | None) -> list[str]:
    """The global generators a step drew from since ``before`` (``rng_states()`` then; None: not
    taken), by name: a step whose draws fall outside its randomness replays otherwise."""
    if before is None:
        return []
    return [name for name, a, b in zip(("torch's global", "Python's random", "NumPy's global"), before,
                                        rng_states(), strict=True) if not same_rng(a, b)]
