"""The "band" task: answer with token ids from the band that the prompt's last token names.

A prompt-and-reward task that a tiny model with random weights can learn by GRPO in a few dozen
steps. It is generated in code (nothing comes from a hub) and scored by a rule. The model never
has to produce text. Its answer is scored by which ids it emits, so the task works with any
tokenizer whose low ids are ordinary tokens.

Ids, with B = num_bands and W = band_width:
    band k   = [k * W, (k + 1) * W)       for k in 0 .. B - 1
    marker k = B * W + k                  (the prompt's last token; it names band k)
    every id < id_limit = min(vocab_size, eos_token_id + 1) - reserved_ids, so the EOS and the
    specials just below it (the tiny tokenizer's pad, im_start and EOS) never appear.

Prompt: L - 1 filler ids, then marker k. L is drawn from [prompt_min_tokens, prompt_max_tokens]
and k from 0 .. B - 1. The fillers are drawn uniformly from band k when `filler_from_band` is
set, which gives a second cue that every attention head can see. Otherwise they are drawn from
all bands, and only the marker names the target.

Reward: the response is cut at its first EOS (the EOS and anything after it are not counted).
    reward = (number of its ids inside band k) / max(its length, min_response_tokens)
It always lies in [0, 1]. An empty response scores 0. With `min_response_tokens` a policy can't
reach 1 by stopping after one good token.

Uniform random policy over V = vocab_size ids, with R response tokens that end before EOS: each
token hits band k with probability p = W / V. So the reward has mean p and standard deviation
sqrt(p (1 - p) / R) within a group. The defaults on the tiny vocab (V = 1000, W = 200) give
p = 0.2 and a std of 0.4 / sqrt(R), which is 0.1 at R = 16. With groups of n samples, a group of
equal rewards is rare: the advantages are not zero from the first step on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from onpolicy.grpo.tasks.base import Prompt, Score, TaskContext


@dataclass(frozen=True, kw_only=True, slots=True)
class BandConfig:
    """The band task's knobs (the `[task]` table of a run config, `name = "band"`)."""

    name: ClassVar[str] = "band"
    prompt_min_tokens: int = 4
    """Shortest prompt, in tokens, counting the marker (>= 1)."""
    prompt_max_tokens: int = 12
    """Longest prompt, in tokens, counting the marker (>= prompt_min_tokens)."""
    num_bands: int = 4
    """Number of target bands, one marker id each; 1 makes the task unconditional."""
    band_width: int = 200
    """Ids per band; p = band_width / vocab_size is a random policy's hit rate."""
    filler_from_band: bool = True
    """Draw the filler ids from the target band (a cue in every position), else from all bands."""
    min_response_tokens: int = 1
    """The reward's smallest denominator: shorter responses cannot score 1 (>= 1)."""
    reserved_ids: int = 3
    """Ids at the top of the id range, up to and including EOS, that the task never uses."""

    def __post_init__(self) -> None:
        for field in ("prompt_min_tokens", "num_bands", "band_width", "min_response_tokens",
                      "reserved_ids"):  # fmt: skip
            value = getattr(self, field)
            if value < 1:
                raise ValueError(f"BandConfig: {field} must be >= 1, got {value}")
        if self.prompt_max_tokens < self.prompt_min_tokens:
            raise ValueError(
                f"BandConfig: prompt_max_tokens ({self.prompt_max_tokens}) must be >= "
                f"prompt_min_tokens ({self.prompt_min_tokens})"
            )


class BandTask:
    """The band task on a vocabulary: prompts for a step, and the reward of a response.

    A prompt's label is its target band k (the last id is k's marker): the reward counts
    response ids in [k * W, (k + 1) * W)."""

    name: ClassVar[str] = "band"
    Config: ClassVar[type] = BandConfig

    def __init__(self, config: BandConfig, vocab_size: int, eos_token_id: int,
                 context: TaskContext | None = None) -> None:  # fmt: skip
        if not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"band task: eos_token_id ({eos_token_id}) must be in "
                             f"[0, vocab_size={vocab_size})")  # fmt: skip
        self.config = config
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.id_limit = min(vocab_size, eos_token_id + 1) - config.reserved_ids
        """Every id the task uses is below this one."""
        used = config.num_bands * config.band_width + config.num_bands
        if used > self.id_limit:
            raise ValueError(
                f"band task: num_bands ({config.num_bands}) * band_width ({config.band_width}) "
                f"+ num_bands markers = {used} ids do not fit below id_limit {self.id_limit} "
                f"= min(vocab_size {vocab_size}, eos_token_id {eos_token_id} + 1) - "
                f"reserved_ids {config.reserved_ids}"
            )

    def band_range(self, band: int) -> range:
        """The response ids that score in `band`."""
        w = self.config.band_width
        return range(band * w, (band + 1) * w)

    def marker(self, band: int) -> int:
        """The prompt token that names `band`."""
        return self.config.num_bands * self.config.band_width + band

    def prompts(self, step: int, count: int, seed: int) -> list[Prompt]:
        """`count` prompts for `step`, a function of (seed, step, count) alone.

        Each prompt has its own generator seeded by (seed, step, index), so a larger `count` extends
        a smaller one's list instead of reshuffling it.
        """
        if count < 0:
            raise ValueError(f"band task: count must be >= 0, got {count}")
        c = self.config
        all_bands = range(c.num_bands * c.band_width)
        out = []
        for index in range(count):
            # A str seed goes through SHA-512: the same on every run, unlike hash().
            rng = random.Random(f"band/{seed}/{step}/{index}")
            band = rng.randrange(c.num_bands)
            length = rng.randint(c.prompt_min_tokens, c.prompt_max_tokens)
            pool = self.band_range(band) if c.filler_from_band else all_bands
            ids = [pool[rng.randrange(len(pool))] for _ in range(length - 1)]
            out.append(Prompt(ids=[*ids, self.marker(band)], index=index, label=band))
        return out

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        """The fraction of the response (cut at its first EOS) inside the prompt's band."""
        if self.eos_token_id in response_ids:
            response_ids = response_ids[: response_ids.index(self.eos_token_id)]
        target = self.band_range(prompt.label)
        hits = sum(1 for t in response_ids if t in target)
        return hits / max(len(response_ids), self.config.min_response_tokens)

    def score(self, prompts: list[Prompt], responses: list[list[int]]) -> list[Score]:
        """`reward` of each response, on its ids (nothing is decoded)."""
        return [Score(reward=float(self.reward(p, r)))
                for p, r in zip(prompts, responses, strict=True)]  # fmt: skip

    def stop_token_ids(self) -> None:
        """None: the engine stops at the model's EOS (`grpo.ignore_eos` aside)."""
        return None

    def close(self) -> None:
        """Nothing to free."""
