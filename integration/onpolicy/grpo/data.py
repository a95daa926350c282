"""The dataset task's data: the `[data]` table, local JSONL/Parquet files read through HF
`datasets`, prompts through the checkpoint's own tokenizer and chat template, and the order the
loop walks them in.

A row holds a prompt (`data.prompt_key`: a string, or a list of chat messages
`{"role": ..., "content": ...}`) and a label (`data.label_key`: what the reward compares the
response with); every other column is the row's metadata, handed to the reward as is.

A prompt becomes token ids like this: a string is one user message; `data.system_prompt`, when
set, is put before the messages of a row that has no system message of its own; the messages go
through the tokenizer's `apply_chat_template` with the generation prompt (and Qwen3's
`enable_thinking`), and the text through the tokenizer without added special tokens. With
`data.apply_chat_template = false` a string prompt is tokenized as it is (a base model). Prompts
longer than `data.max_prompt_tokens` are dropped, and how many is reported.

The order: the stream of training prompts is the rows in epochs; epoch e is the rows in file
order, or (`data.shuffle`) in a permutation seeded by (run seed, e). Stream position p is row
`order(p // N)[p % N]`; step s of a run without group filtering takes positions
[(s - 1) P, s P), P = grpo.prompts_per_step. So the prompts of a step are a function of the
config and the step alone, and a resumed run continues where it stopped.

Every problem with the files is a `ContractError` naming its rule (`data_file`, `data_keys`,
`data_prompt`, `data_empty`, `data_epochs`, `data_template`); the driver checks all of them
before any engine starts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onpolicy.contract.errors import ContractError

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""A data file's suffix -> the HF `datasets` builder that reads it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """The dataset task's prompts (the `[data]` table; read by `[task] name = "dataset"`)."""

    train_file: str = ""
    """The training prompts: a local .jsonl, .json or .parquet file. A relative path is taken
    from the current directory. Required by the dataset task; the band task refuses it."""
    eval_file: str = ""
    """Prompts for evaluation (`[eval]`), every row labelled; "" evaluates nothing."""
    prompt_key: str = "prompt"
    """The column holding each prompt: a string, or a list of chat messages."""
    label_key: str = "label"
    """The column holding each prompt's label (the reward's reference answer)."""
    system_prompt: str = ""
    """A system message put before the messages of every row that has none; "" adds none."""
    apply_chat_template: bool = True
    """Render the messages with the tokenizer's chat template and its generation prompt; false
    tokenizes a string prompt as it is (chat-message prompts then are refused)."""
    enable_thinking: bool = True
    """Qwen3's `enable_thinking`, passed to the chat template (false: an empty think block)."""
    shuffle: bool = True
    """Walk each epoch in a permutation seeded by (grpo.seed, epoch); false: file order."""
    epochs: int = 1
    """Passes over the training rows the run may take (>= 1); a run that needs more prompts is
    refused before it starts."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this many tokens (after the chat template) are dropped."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One prompt of a data file, rendered and tokenized."""

    row: int
    """The row's index in its file (0-based)."""
    ids: list[int]
    """The prompt's token ids, as the engines receive them."""
    text: str
    """The prompt's text as the model reads it (after the chat template)."""
    label: Any
    """The label column's value."""
    metadata: dict = field(default_factory=dict)
    """The row's other columns."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptSet:
    """The usable rows of one data file and what was dropped."""

    path: str
    rows: list[Row]
    total: int
    """Rows in the file."""
    dropped_long: int
    """Rows dropped for a prompt longer than max_prompt_tokens."""


def data_format(path: str, key: str) -> str:
    """The `datasets` builder for a data file; refused unless it is a local file we read."""
    p = Path(path)
    fmt = FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise ContractError(
            "data_file",
            f"{key} = {path!r} is not a .jsonl, .json or .parquet file",
            "convert it to JSONL or Parquet",
        )
    if not p.is_file():
        raise ContractError(
            "data_file",
            f"{key} = {path!r}: no such file ({p.resolve()})",
            f"point {key} at a local file (nothing is fetched from a hub)",
        )
    return fmt


def read_table(path: str, key: str) -> Any:
    """A local data file as a `datasets.Dataset` (one split, every column)."""
    fmt = data_format(path, key)
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        return datasets.load_dataset(fmt, data_files=str(Path(path).resolve()), split="train")
    except Exception as err:  # a file the reader cannot parse
        raise ContractError(
            "data_file",
            f"{key} = {path!r} cannot be read as {fmt}: {type(err).__name__}: {err}",
            "fix the file",
        ) from None


def to_messages(value: Any, system_prompt: str, where: str) -> list[dict]:
    """A prompt cell as chat messages (a string is one user message); the system prompt first
    unless the row has its own."""
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
    else:
        raise ContractError(
            "data_prompt",
            f"{where}: the prompt is {str(value)[:120]!r} ({type(value).__name__})",
            "write each prompt as a string or a list of {role, content} string messages",
        )
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def render(tokenizer: Any, value: Any, cfg: DataConfig, where: str) -> str:
    """A prompt cell as the text the model reads."""
    if not cfg.apply_chat_template:
        if not isinstance(value, str):
            raise ContractError(
                "data_prompt",
                f"{where}: a chat-message prompt with data.apply_chat_template = false",
                "set data.apply_chat_template = true, or use string prompts",
            )
        return cfg.system_prompt + value if cfg.system_prompt else value
    messages = to_messages(value, cfg.system_prompt, where)
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=cfg.enable_thinking
    )


def load_prompts(path: str, key: str, cfg: DataConfig, tokenizer: Any) -> PromptSet:
    """Every row of a data file, rendered, tokenized and length-filtered; refused by rule when a
    column is missing, a prompt or label is malformed or absent, or no row is left."""
    table = read_table(path, key)
    where = f"{key} = {path!r}"
    missing = [k for k in (cfg.prompt_key, cfg.label_key) if k not in table.column_names]
    if missing:
        names = {cfg.prompt_key: "data.prompt_key", cfg.label_key: "data.label_key"}
        raise ContractError(
            "data_keys",
            f"{where} has no column {', '.join(repr(m) for m in missing)} (columns: "
            f"{', '.join(table.column_names) or 'none'})",
            f"set {' and '.join(names[m] for m in missing)} to the file's column names",
        )
    if (tokenizer.chat_template is None) and cfg.apply_chat_template:
        raise ContractError(
            "data_template",
            "the checkpoint's tokenizer has no chat template",
            "add one to its tokenizer_config.json, or set data.apply_chat_template = false",
        )
    texts, labels, metas = [], [], []
    for i, rec in enumerate(table):
        here = f"{where}, row {i}"
        if rec[cfg.prompt_key] is None:
            raise ContractError(
                "data_keys", f"{here} has no {cfg.prompt_key!r}", "give every row a prompt"
            )
        if rec[cfg.label_key] is None:
            raise ContractError(
                "data_keys", f"{here} has no {cfg.label_key!r} (label)", "give every row a label"
            )
        texts.append(render(tokenizer, rec[cfg.prompt_key], cfg, here))
        labels.append(rec[cfg.label_key])
        metas.append({k: v for k, v in rec.items() if k not in (cfg.prompt_key, cfg.label_key)})
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    rows = [
        Row(row=i, ids=list(t), text=x, label=lab, metadata=m)
        for i, (t, x, lab, m) in enumerate(zip(ids, texts, labels, metas, strict=True))
        if len(t) <= cfg.max_prompt_tokens
    ]
    if not rows:
        raise ContractError(
            "data_empty",
            f"{where}: no prompt left of {len(texts)} rows (longer than data.max_prompt_tokens "
            f"= {cfg.max_prompt_tokens}: {len(texts)})",
            "raise data.max_prompt_tokens or supply prompts",
        )
    return PromptSet(path=path, rows=rows, total=len(texts), dropped_long=len(texts) - len(rows))


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The row order of one epoch: file order, or a permutation seeded by (seed, epoch)."""
    order = list(range(n))
    if shuffle:
        # A str seed goes through SHA-512: the same on every run and Python, unlike hash().
        random.Random(f"data/{seed}/{epoch}").shuffle(order)
    return order


class Stream:
    """The training prompts as one stream of positions over `epochs` passes."""

    def __init__(self, rows: list[Row], *, seed: int, shuffle: bool, epochs: int) -> None:
        self.rows, self.seed, self.shuffle, self.epochs = rows, seed, shuffle, epochs
        self._orders: dict[int, list[int]] = {}

    @property
    def length(self) -> int:
        """Positions in the stream (rows x epochs)."""
        return len(self.rows) * self.epochs

    def at(self, position: int) -> Row:
        """The row at a stream position; IndexError past the last epoch."""
        n = len(self.rows)
        if not 0 <= position < self.length:
            raise IndexError(
                f"data stream position {position} is outside [0, {self.length}) "
                f"({n} rows x data.epochs {self.epochs})"
            )
        epoch = position // n
        if epoch not in self._orders:
            self._orders[epoch] = epoch_order(n, epoch, self.seed, self.shuffle)
        return self.rows[self._orders[epoch][position % n]]


# --- the generated arithmetic set (tests and configs/tiny-cpu-math.toml) --------------------
def arithmetic_rows(count: int, seed: int = 0) -> list[dict]:
    """`count` arithmetic questions with their answers, a function of (count, seed).

    Sums, differences, products and fractions of small numbers; every third row's prompt is a
    list of chat messages, the others a string; the answer is a string (a fraction as a/b)."""
    from fractions import Fraction

    rng = random.Random(f"arith/{seed}")
    out = []
    for i in range(count):
        a, b = rng.randint(0, 20), rng.randint(1, 20)
        kind = rng.choice("+-*/")
        if kind == "+":
            q, ans = f"What is {a} + {b}?", str(a + b)
        elif kind == "-":
            q, ans = f"What is {a} - {b}?", str(a - b)
        elif kind == "*":
            q, ans = f"What is {a} * {b}?", str(a * b)
        else:
            f = Fraction(a, b)
            q, ans = (
                f"What is {a} / {b}, as a reduced fraction?",
                (f"{f.numerator}/{f.denominator}" if f.denominator != 1 else str(f.numerator)),
            )
        q += " Put the final answer in \\boxed{}."
        prompt: Any = [{"role": "user", "content": q}] if i % 3 == 2 else q
        out.append({"prompt": prompt, "label": ans, "id": i, "op": kind})
    return out


def write_arithmetic(path: str | Path, count: int, seed: int = 0) -> Path:
    """The arithmetic set written to a .jsonl or .parquet file (through `datasets`)."""
    import json

    path = Path(path)
    rows = arithmetic_rows(count, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        # A Parquet column holds one type: every prompt is a list of messages there.
        import datasets

        datasets.disable_progress_bars()
        msgs = [
            r
            | {
                "prompt": r["prompt"]
                if isinstance(r["prompt"], list)
                else [{"role": "user", "content": r["prompt"]}]
            }
            for r in rows
        ]
        datasets.Dataset.from_list(msgs).to_parquet(str(path))
    else:
        raise ValueError(f"write_arithmetic: {path} must end in .jsonl or .parquet")
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m onpolicy.grpo.data OUT_FILE [COUNT] [SEED]`: write the arithmetic set."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 3:
        print(main.__doc__, file=sys.stderr)
        return 2
    count = int(args[1]) if len(args) > 1 else 64
    seed = int(args[2]) if len(args) > 2 else 0
    print(write_arithmetic(args[0], count, seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
