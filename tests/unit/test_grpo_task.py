"""The band task: prompts (ids, layout, determinism), the reward on hand-made responses, a random
policy's reward statistics, and refused configs."""

from __future__ import annotations

import json
import random
import statistics

import pytest
from onpolicy.contract import ContractError
from onpolicy.grpo.tasks import BandConfig, BandTask, Prompt, make_task, task_config
from onpolicy.models.tiny import TINY, write_tokenizer

V, EOS = TINY.vocab_size, TINY.eos_token_id


@pytest.fixture
def task() -> BandTask:
    return make_task(BandConfig(), V, EOS)


def test_tiny_model_ids(task: BandTask):
    assert (V, EOS) == (1000, 999)
    assert task.id_limit == 997
    assert [task.marker(k) for k in range(4)] == [800, 801, 802, 803]
    assert task.band_range(2) == range(400, 600)


def test_prompt_layout(task: BandTask):
    prompts = task.prompts(step=3, count=200, seed=7)
    assert [p.index for p in prompts] == list(range(200))
    assert {p.label for p in prompts} == {0, 1, 2, 3}
    lengths = {len(p.ids) for p in prompts}
    assert min(lengths) == 4 and max(lengths) == 12
    for p in prompts:
        assert p.ids[-1] == task.marker(p.label)
        assert all(t in task.band_range(p.label) for t in p.ids[:-1])
        assert all(0 <= t < task.id_limit for t in p.ids) and EOS not in p.ids


def test_fillers_from_all_bands():
    t = BandTask(
        BandConfig(filler_from_band=False, prompt_min_tokens=30, prompt_max_tokens=30), V, EOS
    )
    prompts = t.prompts(step=0, count=20, seed=0)
    fillers = [i for p in prompts for i in p.ids[:-1]]
    assert all(0 <= i < 800 for i in fillers)
    # with 29 uniform fillers over 4 bands, some prompt has fillers outside its own band
    assert any(i not in t.band_range(p.label) for p in prompts for i in p.ids[:-1])


def test_prompts_avoid_the_tiny_tokenizers_added_tokens(task: BandTask, tmp_path):
    write_tokenizer(tmp_path, V)
    added = {a["id"] for a in json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"]}
    assert EOS in added and len(added) >= 3
    ids = {i for p in task.prompts(step=0, count=500, seed=0) for i in p.ids}
    assert not ids & added
    assert max(ids) < min(added)


def test_prompts_deterministic_and_varied(task: BandTask):
    a = task.prompts(step=5, count=16, seed=1)
    assert a == task.prompts(step=5, count=16, seed=1)
    assert a == make_task(BandConfig(), V, EOS).prompts(step=5, count=16, seed=1)
    assert [p.ids for p in a] != [p.ids for p in task.prompts(step=6, count=16, seed=1)]
    assert [p.ids for p in a] != [p.ids for p in task.prompts(step=5, count=16, seed=2)]
    # a longer batch extends a shorter one
    assert task.prompts(step=5, count=32, seed=1)[:16] == a
    assert task.prompts(step=5, count=0, seed=1) == []


def test_reward_hand_made(task: BandTask):
    p = Prompt(ids=[450, 410, 802], index=0, label=2)  # band 2 = [400, 600)
    assert task.reward(p, [400, 599, 401, 402]) == 1.0
    assert task.reward(p, [399, 600, 0, 803]) == 0.0
    assert task.reward(p, [400, 5, 500, 7]) == 0.5
    assert task.reward(p, [400, 5, 500]) == 2 / 3
    # the EOS and what follows it do not count
    assert task.reward(p, [400, 5, EOS]) == 0.5
    assert task.reward(p, [400, EOS, 5, 6, 7]) == 1.0
    assert task.reward(p, [EOS]) == 0.0
    assert task.reward(p, []) == 0.0


def test_reward_min_response_tokens():
    t = BandTask(BandConfig(min_response_tokens=4), V, EOS)
    p = Prompt(ids=[803], index=0, label=3)  # band 3 = [600, 800)
    assert t.reward(p, [600, EOS]) == 0.25
    assert t.reward(p, [600, 601, 602, 603, 604, 605]) == 1.0
    assert t.reward(p, [600, 1, 2, 3, 4, 5, 6, 7]) == 1 / 8


def test_reward_is_pure(task: BandTask):
    p = task.prompts(step=0, count=1, seed=0)[0]
    response = [1, 2, EOS, 3]
    before = (list(p.ids), list(response))
    assert task.reward(p, response) == task.reward(p, response)
    assert (p.ids, response) == before


def test_uniform_random_policy_gives_group_variance(task: BandTask):
    """R = 16 uniform tokens, groups of 8: mean p = 0.2, std sqrt(p (1 - p) / 16) = 0.1."""
    rng = random.Random(0)
    n, r_len = 8, 16
    rewards, groups_with_signal = [], 0
    prompts = task.prompts(step=0, count=200, seed=0)
    for p in prompts:
        group = [task.reward(p, [rng.randrange(V) for _ in range(r_len)]) for _ in range(n)]
        assert all(0.0 <= r <= 1.0 for r in group)
        groups_with_signal += len(set(group)) > 1
        rewards += group
    assert statistics.fmean(rewards) == pytest.approx(0.2, abs=0.01)
    assert statistics.pstdev(rewards) == pytest.approx(0.1, abs=0.01)
    assert groups_with_signal >= 0.99 * len(prompts)


def test_band_policy_scores_higher(task: BandTask):
    """A policy that leans towards the named band scores more: the signal GRPO climbs."""
    rng = random.Random(1)
    prompts = task.prompts(step=0, count=100, seed=0)

    def mean_reward(lean: float) -> float:
        total = 0.0
        for p in prompts:
            band = task.band_range(p.label)
            ids = [band[rng.randrange(len(band))] if rng.random() < lean else rng.randrange(V)
                   for _ in range(16)]  # fmt: skip
            total += task.reward(p, ids)
        return total / len(prompts)

    assert mean_reward(0.0) < mean_reward(0.5) < mean_reward(1.0) == 1.0


def test_one_band_is_unconditional():
    t = BandTask(BandConfig(num_bands=1, band_width=500), V, EOS)
    assert {p.label for p in t.prompts(step=0, count=50, seed=0)} == {0}
    assert {p.ids[-1] for p in t.prompts(step=0, count=50, seed=0)} == {500}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_min_tokens": 0}, "prompt_min_tokens must be >= 1, got 0"),
        ({"num_bands": 0}, "num_bands must be >= 1, got 0"),
        ({"band_width": -1}, "band_width must be >= 1, got -1"),
        ({"min_response_tokens": 0}, "min_response_tokens must be >= 1, got 0"),
        ({"reserved_ids": 0}, "reserved_ids must be >= 1, got 0"),
        ({"prompt_min_tokens": 5, "prompt_max_tokens": 4},
         r"prompt_max_tokens \(4\) must be >= prompt_min_tokens \(5\)"),
    ],
)  # fmt: skip
def test_config_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BandConfig(**kwargs)


def test_vocab_refusals():
    with pytest.raises(ValueError, match=r"num_bands \(4\) \* band_width \(250\).*1004 ids.*997"):
        make_task(BandConfig(band_width=250), V, EOS)
    # 4 * 248 + 4 = 996 ids fit below 997; one more band id does not
    make_task(BandConfig(band_width=248), V, EOS)
    with pytest.raises(ValueError, match="1000 ids do not fit below id_limit 997"):
        make_task(BandConfig(band_width=249), V, EOS)
    # an EOS below the top of the vocabulary lowers the limit
    with pytest.raises(ValueError, match="id_limit 497"):
        make_task(BandConfig(), V, 499)
    with pytest.raises(ValueError, match=r"eos_token_id \(1000\) must be in \[0, vocab_size=1000"):
        make_task(BandConfig(), V, 1000)
    known = r"unknown task name 'count'; known: \['band', 'dataset'\]"
    with pytest.raises(ContractError, match=known):
        task_config({"name": "count"})
    with pytest.raises(ContractError, match="unknown config key 'task.bands'"):
        task_config({"name": "band", "bands": 2})
    assert task_config({"name": "band", "num_bands": 2}) == BandConfig(num_bands=2)
