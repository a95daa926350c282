"""GRPO tasks: the `Task` protocol, the registry, and the `[task]` table's reader.

`[task] name` picks a task from `TASKS`; the table's other keys are that task's own config
(`Task.Config`). Adding a task is a module with a class that meets `Task`, and a line here.

- "band" (the default): generated token-id prompts, rewarded on ids; CI's tiny task.
- "dataset": prompts from `[data]`'s files through the checkpoint's tokenizer and chat
  template, rewards from `[reward]` (math or a user function) on the decoded text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from onpolicy.contract.config import from_dict
from onpolicy.contract.errors import ContractError
from onpolicy.grpo.tasks.band import BandConfig, BandTask
from onpolicy.grpo.tasks.base import Prompt, Score, Task, TaskContext
from onpolicy.grpo.tasks.dataset import DatasetConfig, DatasetTask

TASKS: dict[str, type[Task]] = {BandTask.name: BandTask, DatasetTask.name: DatasetTask}
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


def make_task(config: Any, vocab_size: int, eos_token_id: int,
              context: TaskContext | None = None) -> Task:  # fmt: skip
    """The task whose config `config` is, checked against the vocabulary; `context`: what it
    needs beyond its config (the dataset task: the checkpoint, [data], [reward], the seed)."""
    return TASKS[config.name](config, vocab_size, eos_token_id, context)


__all__ = ["DEFAULT", "TASKS", "BandConfig", "BandTask", "DatasetConfig", "DatasetTask", "Prompt",
           "Score", "Task", "TaskContext", "make_task", "task_config", "task_table"]  # fmt: skip
