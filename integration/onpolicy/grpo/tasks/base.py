"""What the GRPO loop asks of a task: prompts with their labels, and a reward per response.

The loop knows nothing else about a task. A task is a class registered by name in
`onpolicy.grpo.tasks.TASKS`; its `Config` is the dataclass of its own `[task]` keys (every key
but `name`), read and checked by `onpolicy.grpo.tasks.task_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True, kw_only=True, slots=True)
class Prompt:
    """One prompt of a step and what its reward needs."""

    ids: list[int]
    """Prompt token ids, as the engines receive them."""
    index: int
    """Position in the step's batch of prompts (0-based)."""
    label: Any = None
    """What the task's reward compares the response with (the band task: the target band)."""


class Task(Protocol):
    """A prompt source and its reward rule, on one model's vocabulary."""

    name: ClassVar[str]
    """The `[task] name` that selects it."""
    Config: ClassVar[type]
    """The frozen dataclass of the task's own `[task]` keys."""

    def __init__(self, config: Any, vocab_size: int, eos_token_id: int) -> None: ...

    def prompts(self, step: int, count: int, seed: int) -> list[Prompt]:
        """`count` prompts for `step`, a function of (seed, step, count) alone."""
        ...

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        """The reward of one response (its generated ids) to `prompt`."""
        ...
