"""The registered tasks: the only recipes a verifier will build (it never runs submitted code)."""

from __future__ import annotations

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
    return TASKS[name].from_config(config or {})
