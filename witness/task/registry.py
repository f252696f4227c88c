"""The registered tasks: the only recipes a verifier will build (it never runs submitted code)."""

from __future__ import annotations

from functools import lru_cache

from ..commit.hashing import canonical_json
from .base import Task
from .tiny import TinyTask
from .tinycnn import TinyCNNTask
from .tinygpt import TinyGPTTask

TASKS: dict[str, type[Task]] = {t.name: t for t in (TinyTask, TinyCNNTask, TinyGPTTask)}


def task_names() -> list[str]:
    """Names of the registered tasks."""
    return sorted(TASKS)


def build_task(name: str, config: dict | None = None) -> Task:
    """Build a registered task from its name and (partial) config."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; registered tasks: {', '.join(task_names())}")
    return _built(name, canonical_json(config or {}))


@lru_cache(maxsize=8)
def _built(name: str, config: bytes) -> Task:
    # A task is immutable (a frozen recipe); building it again would hash its whole dataset again,
    # which repeated audits of one run (a leaderboard worker, the statistical tests) would pay
    # every time.
    import json

    return TASKS[name].from_config(json.loads(config))
