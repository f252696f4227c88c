"""Tasks: the recipes a verifier can run, and the registry of reference tasks."""

from .base import StepOutput, Task
from .registry import build_task, task_names

__all__ = ["StepOutput", "Task", "build_task", "task_names"]
