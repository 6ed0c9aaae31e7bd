"""Evaluation tasks; each runs through `forward`, so the cache policy is live.

`get_task(name, **options)` builds one; `TASKS` maps names to classes.
"""

from __future__ import annotations

from kvjax.registry import lookup
from kvjax.tasks import agreement, needle, passkey, perplexity, qa, serve  # noqa: F401  (registration)
from kvjax.tasks.base import TASKS, Task, TaskContext, TaskResult


def get_task(name: str, **options) -> Task:
    """Build a task by name; unknown names and options get an error listing the choices."""
    cls = lookup("task", "tasks", TASKS, name, options)
    for key in ("lengths", "depths"):
        if isinstance(options.get(key), list):
            options[key] = tuple(options[key])
    task = cls(**options)
    task.validate()
    return task


__all__ = ["TASKS", "Task", "TaskContext", "TaskResult", "get_task"]
