"""The "dataset" task: prompts from local data files through the checkpoint's own tokenizer and
chat template, responses decoded to text and scored by a reward function in a process pool.

`[task] name = "dataset"` has no keys of its own: it reads `[data]` (`onpolicy.grpo.data`: the
files, the columns, the template, the order) and `[reward]` (`onpolicy.grpo.rewards`: "math" or
"custom"). Made at the start of the run, before any engine starts: the tokenizer is loaded from
the checkpoint folder, every row is rendered and tokenized, and every problem with the files is
refused by rule (`onpolicy.grpo.data`).

A response ends at the tokenizer's EOS or one of the generation config's `eos_token_id`s
(`stop_token_ids`), or at max_new_tokens; its text is the ids before the stop id, decoded with
special tokens skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from onpolicy.contract.errors import ContractError
from onpolicy.grpo.data import PromptSet, Stream, load_prompts
from onpolicy.grpo.rewards import RewardPool, reward_path
from onpolicy.grpo.tasks.base import Prompt, Score, TaskContext


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetConfig:
    """`[task] name = "dataset"`: no keys of its own; the task reads `[data]` and `[reward]`."""

    name: ClassVar[str] = "dataset"


class DatasetTask:
    """Prompts from `[data]`'s files, rewards from `[reward]`'s function."""

    name: ClassVar[str] = "dataset"
    Config: ClassVar[type] = DatasetConfig

    def __init__(
        self,
        config: DatasetConfig,
        vocab_size: int,
        eos_token_id: int,
        context: TaskContext | None = None,
    ) -> None:
        if context is None or context.checkpoint is None or context.data is None:
            raise ValueError("dataset task: needs a TaskContext with the checkpoint and [data]")
        from transformers import AutoTokenizer

        self.config, self.context = config, context
        data, reward = context.data, context.reward
        self.tokenizer = AutoTokenizer.from_pretrained(str(context.checkpoint))
        self.train: PromptSet = load_prompts(
            data.train_file, "data.train_file", data, self.tokenizer
        )
        self.eval: PromptSet | None = (
            load_prompts(data.eval_file, "data.eval_file", data, self.tokenizer)
            if data.eval_file
            else None
        )
        for ps in filter(None, (self.train, self.eval)):
            top = max(max(r.ids, default=0) for r in ps.rows)
            if top >= vocab_size:
                raise ContractError(
                    "data_template",
                    f"{ps.path}: the tokenizer gives id {top}, "
                    f"outside the model's vocab_size {vocab_size}",
                    "use the checkpoint's own tokenizer",
                )
        self.stream = Stream(
            self.train.rows, seed=context.seed, shuffle=data.shuffle, epochs=data.epochs
        )
        self._stop = self._stop_ids(eos_token_id)
        self.pool = RewardPool(reward_path(reward), reward.workers, reward.timeout_s)

    def _stop_ids(self, eos_token_id: int) -> list[int]:
        """The tokenizer's EOS and the generation config's eos_token_id(s) (the model's own when
        neither names one)."""
        ids = [self.tokenizer.eos_token_id]
        gen = self.context.checkpoint / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos]
        out = sorted({int(i) for i in ids if i is not None})
        return out or [eos_token_id]

    # --- prompts ------------------------------------------------------------------------------
    def check_length(self, positions: int) -> None:
        """Refuse a run that needs more than `positions` of the stream holds (data_epochs)."""
        if positions > self.stream.length:
            raise ContractError(
                "data_epochs",
                f"the run needs {positions} training prompts; data.train_file has "
                f"{len(self.train.rows)} usable rows x data.epochs {self.stream.epochs} = "
                f"{self.stream.length}",
                "raise data.epochs, or run fewer steps or prompts per step",
            )

    def prompts_at(self, position: int, count: int) -> list[Prompt]:
        """The `count` prompts at stream positions position .. position + count - 1."""
        self.check_length(position + count)
        return [self._prompt(self.stream.at(position + k), k) for k in range(count)]

    def prompts(self, step: int, count: int, seed: int) -> list[Prompt]:
        """Step `step`'s prompts: stream positions [(step - 1) count, step count). The seed is
        the one the task was made with (the stream's order)."""
        if seed != self.context.seed:
            raise ValueError(f"dataset task: made for seed {self.context.seed}, asked for {seed}")
        return self.prompts_at((step - 1) * count, count)

    def eval_prompts(self, limit: int = 0) -> list[Prompt]:
        """The eval file's prompts in file order (the first `limit`; 0: all)."""
        if self.eval is None:
            return []
        rows = self.eval.rows[:limit] if limit else self.eval.rows
        return [self._prompt(r, k) for k, r in enumerate(rows)]

    @staticmethod
    def _prompt(row: Any, index: int) -> Prompt:
        return Prompt(
            ids=list(row.ids),
            index=index,
            label=row.label,
            text=row.text,
            row=row.row,
            metadata=dict(row.metadata),
        )

    # --- responses ----------------------------------------------------------------------------
    def stop_token_ids(self) -> list[int]:
        return list(self._stop)

    def decode(self, response_ids: list[int]) -> str:
        """The response's text: the ids before its first stop id, special tokens skipped."""
        stop = set(self._stop)
        cut = next((i for i, t in enumerate(response_ids) if t in stop), len(response_ids))
        return self.tokenizer.decode(response_ids[:cut], skip_special_tokens=True)

    def score(self, prompts: list[Prompt], responses: list[list[int]]) -> list[Score]:
        """Decode every response and score it in the reward pool (RewardError names the sample
        whose reward failed)."""
        texts = [self.decode(r) for r in responses]
        jobs = [(p.text, t, p.label, p.metadata) for p, t in zip(prompts, texts, strict=True)]
        names = [f"sample {i} (prompt {p.index}, data row {p.row})" for i, p in enumerate(prompts)]
        results = self.pool.score(jobs, names)
        return [
            Score(reward=r, metrics=m, text=t) for (r, m), t in zip(results, texts, strict=True)
        ]

    def close(self) -> None:
        self.pool.close()
