"""What the GRPO loop asks of a task: prompts with their labels, and a reward per response.

The loop knows nothing else about a task. A task is a class registered by name in
`onpolicy.grpo.tasks.TASKS`; its `Config` is the dataclass of its own `[task]` keys (every key
but `name`), read and checked by `onpolicy.grpo.tasks.task_config`. What else it may need (the
checkpoint's tokenizer, the `[data]` and `[reward]` tables, the run's seed) comes in a
`TaskContext` when it is made.

The loop asks a task for a step's prompts (`prompts`), scores a batch of responses at once
(`score`: a `Score` per response, with the decoded text when the task decodes), stops sampling
at the task's stop ids (`stop_token_ids`; None: the engine's own EOS), and closes it when the
run ends (`close`: a reward pool's processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
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
    text: str = ""
    """The prompt as text, as the model reads it (after the chat template); "" for a task that
    has no text (band)."""
    row: int = -1
    """The data file's row it came from (-1: generated)."""
    metadata: dict = field(default_factory=dict)
    """The row's other columns (the reward's `metadata`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Score:
    """One response's reward and what else the task reports about it."""

    reward: float
    """The reward."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Extra per-sample metrics (logged per step as reward/<key>, their mean)."""
    text: str | None = None
    """The decoded response the reward read (None: the task scores ids)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskContext:
    """What a task may need beyond its own config, given when it is made."""

    checkpoint: Path | None = None
    """The run's HF checkpoint folder: its tokenizer (and chat template) and generation config."""
    data: Any = None
    """The `[data]` table (`onpolicy.grpo.data.DataConfig`)."""
    reward: Any = None
    """The `[reward]` table (`onpolicy.grpo.rewards.RewardConfig`)."""
    seed: int = 0
    """The run's seed (grpo.seed)."""


class Task(Protocol):
    """A prompt source and its reward rule, on one model's vocabulary."""

    name: ClassVar[str]
    """The `[task] name` that selects it."""
    Config: ClassVar[type]
    """The frozen dataclass of the task's own `[task]` keys."""

    def __init__(
        self, config: Any, vocab_size: int, eos_token_id: int, context: TaskContext | None = None
    ) -> None: ...

    def prompts(self, step: int, count: int, seed: int) -> list[Prompt]:
        """`count` prompts for `step`, a function of (seed, step, count) alone."""
        ...

    def score(self, prompts: list[Prompt], responses: list[list[int]]) -> list[Score]:
        """The score of each response (its generated ids) to its prompt; `prompts[i]` is the
        prompt of `responses[i]`."""
        ...

    def stop_token_ids(self) -> list[int] | None:
        """Ids that end a response besides max_new_tokens; None: the engine's own EOS."""
        ...

    def close(self) -> None:
        """Free what the task holds (processes); the run calls it once at the end."""
        ...
