"""GRPO tasks: the `Task` protocol, the registry, and the `[task]` table's reader.

`[task] name` picks a task from `TASKS`; the table's other keys are that task's own config
(`Task.Config`). Adding a task is a module with a class that meets `Task`, and a line here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from onpolicy.contract.config import from_dict
from onpolicy.contract.errors import ContractError
from onpolicy.grpo.tasks.band import BandConfig, BandTask
from onpolicy.grpo.tasks.base import Prompt, Task

TASKS: dict[str, type[Task]] = {BandTask.name: BandTask}
"""The tasks by `[task] name`."""

DEFAULT = BandTask.name


def task_config(table: dict) -> Any:
    """The `[task]` table as the named task's config; unknown names and keys are refused."""
    name = table.get("name", DEFAULT)
    if name not in TASKS:
        raise ContractError("task_config", f"unknown task name {name!r}; known: {sorted(TASKS)}",
                            "set [task] name to one of them")  # fmt: skip
    rest = {k: v for k, v in table.items() if k != "name"}
    try:
        return from_dict(TASKS[name].Config, rest, "task.")
    except ContractError:
        raise
    except ValueError as err:  # the task config's own range check (__post_init__)
        raise ContractError("task_config", str(err), "fix [task]") from None


def task_table(config: Any) -> dict:
    """`config` back as its `[task]` table (the inverse of `task_config`)."""
    return {"name": config.name, **dataclasses.asdict(config)}


def make_task(config: Any, vocab_size: int, eos_token_id: int) -> Task:
    """The task whose config `config` is, checked against the vocabulary."""
    return TASKS[config.name](config, vocab_size, eos_token_id)


__all__ = ["DEFAULT", "TASKS", "BandConfig", "BandTask", "Prompt", "Task", "make_task",
           "task_config", "task_table"]  # fmt: skip
