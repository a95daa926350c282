"""Rewards (`onpolicy.grpo.rewards`): the math rule's final answer and its check by math-verify,
custom functions by import path (a dict reward's extra metrics), the process pool's refusals
(a raise, a bad value, a timeout: each names the sample and the function), and the checks of
`reward.path` when the config is read."""

from __future__ import annotations

import time

import pytest
from onpolicy.contract import ContractError
from onpolicy.grpo.rewards import (
    MATH,
    RewardError,
    RewardPool,
    check_value,
    final_answer,
    last_boxed,
    load_reward,
    math_reward,
    reward_metrics,
)


# --- the final answer -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("so the answer is \\boxed{7}.", "7"),
        ("first \\boxed{3}, no wait: \\boxed{4}", "4"),  # the last box counts
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
        ("\\boxed {12}", "12"),  # a space before the brace
        ("\\boxed{\\boxed{5}}", "5"),  # a box in a box: the last one opened
        ("I get 3, then 41.", "41"),  # no box: the last number
        ("total: 1,234 apples", "1234"),
        ("it is -3.5", "-3.5"),
        ("half is 3 / 4 of it", "3/4"),
        ("no number at all", None),
        ("\\boxed{12", None),  # a box never closed: malformed, not rescued by the number
        ("\\boxed{}", None),  # an empty box
        ("", None),
    ],
)
def test_final_answer(response, answer):
    assert final_answer(response) == answer


def test_last_boxed_skips_an_unclosed_box_after_a_closed_one():
    assert last_boxed("\\boxed{1} and \\boxed{2") == "1"
    assert last_boxed("\\boxed x") is None


# --- the math reward --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("response", "label", "score", "answered"),
    [
        ("The answer is \\boxed{36}.", "36", 1.0, 1.0),
        ("The answer is \\boxed{35}.", "36", 0.0, 1.0),  # wrong
        ("so 17 + 19 = 36", 36, 1.0, 1.0),  # last number; an int label
        ("so 17 + 19 = 36, or 37", "36", 0.0, 1.0),  # the last number is the answer
        ("\\boxed{\\frac{7}{19}}", "7/19", 1.0, 1.0),  # fractions, both spellings
        ("\\boxed{\\frac{14}{38}}", "7/19", 1.0, 1.0),  # equal values
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0, 1.0),
        ("\\boxed{\\frac{1}{3}}", "1/2", 0.0, 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0, 1.0),
        ("\\boxed{-3}", "-3", 1.0, 1.0),
        ("\\boxed{3}", "-3", 0.0, 1.0),
        ("\\boxed{1,000}", "1000", 1.0, 1.0),
        ("the answer is \\boxed{36", "36", 0.0, 0.0),  # malformed: no complete box
        ("no idea", "36", 0.0, 0.0),  # no answer
        ("\\boxed{\\frac{1}{}}", "1", 0.0, 1.0),  # malformed inside the box: not a match
        ("\\boxed{banana}", "36", 0.0, 1.0),
    ],
)
def test_math_reward(response, label, score, answered):
    assert math_reward("q", response, label, {}) == {"score": score, "answered": answered}


def test_math_reward_refuses_a_label_that_is_not_math():
    with pytest.raises(ValueError, match="the label '' does not parse"):
        math_reward("q", "\\boxed{1}", "", {})


# --- return values ----------------------------------------------------------------------------
def test_check_value():
    assert check_value(1) == (1.0, {})
    assert check_value(True) == (1.0, {})
    assert check_value({"score": 0.5, "n": 3, "ok": False}) == (0.5, {"n": 3.0, "ok": 0.0})
    for bad, message in [
        ("one", "the reward is 'one' \\(str\\), not a number"),
        (float("nan"), "the reward is nan, not finite"),
        (None, "not a number"),
        ({"n": 1}, "a dict without 'score'"),
        ({"score": "1"}, "its 'score' is '1'"),
        ({"score": 1, "mean": 1}, "the key 'mean'"),
        ({"score": 1, "a/b": 1}, "the key 'a/b'"),
        ({"score": 1, "n": [1]}, "its 'n' is \\[1\\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_value(bad)


def test_reward_metrics_are_means_over_the_samples_that_report_them():
    got = reward_metrics([{"a": 1.0, "b": 2.0}, {"a": 0.0}, {}])
    assert got == {"reward/a": 0.5, "reward/b": 2.0}
    assert reward_metrics([{}, {}]) == {}


# --- paths and signatures ---------------------------------------------------------------------
def test_load_reward():
    import reward_fixtures

    assert load_reward("reward_fixtures:digits") is reward_fixtures.digits
    assert load_reward(MATH) is math_reward


@pytest.mark.parametrize(
    ("path", "rule", "needle"),
    [
        ("reward_fixtures.digits", "reward_path", "is not 'package.module:function'"),
        ("no_such_module_xyz:fn", "reward_path", "ModuleNotFoundError"),
        ("reward_fixtures:missing", "reward_path", "AttributeError"),
        ("reward_fixtures:two_args", "reward_signature", "too many positional arguments"),
        ("reward_fixtures:coroutine", "reward_signature", "not a plain function"),
        ("reward_fixtures:NOT_A_FUNCTION", "reward_signature", "not a plain function"),
    ],
)
def test_bad_reward_paths_are_refused_by_rule(path, rule, needle):
    with pytest.raises(ContractError) as e:
        load_reward(path)
    assert e.value.rule == rule and needle in str(e.value) and path in str(e.value)


# --- the pool ---------------------------------------------------------------------------------
def test_pool_scores_a_dict_reward_and_the_math_rule():
    jobs = [("p", "it is 36", "36", {"id": 1}), ("p", "it is 35", "36", {}), ("p", "", 0, {})]
    names = ["s0", "s1", "s2"]
    with RewardPool("reward_fixtures:digits", workers=2, timeout_s=30) as pool:
        got = pool.score(jobs, names)
        assert got == [
            (1.0, {"chars": 8.0, "has_row_id": 1.0}),
            (0.0, {"chars": 8.0, "has_row_id": 0.0}),
            (0.0, {"chars": 0.0, "has_row_id": 0.0}),
        ]
        assert pool.score(jobs[:1], names[:1]) == got[:1]  # the pool serves more than one call
    with RewardPool(MATH, workers=1, timeout_s=30) as pool:
        got = pool.score(
            [("p", "\\boxed{\\frac{2}{4}}", "1/2", {}), ("p", "7", "8", {})], names[:2]
        )
        assert got == [(1.0, {"answered": 1.0}), (0.0, {"answered": 1.0})]


def test_pool_names_the_sample_of_a_reward_that_raises():
    jobs = [("p", "fine", 1, {}), ("p", "boom", 1, {}), ("p", "fine", 1, {})]
    with RewardPool("reward_fixtures:raises", workers=2, timeout_s=30) as pool:
        with pytest.raises(RewardError) as e:
            pool.score(jobs, ["sample 0", "sample 1 (row 7)", "sample 2"])
    msg = str(e.value)
    assert "reward reward_fixtures:raises raised on sample 1 (row 7)" in msg, msg
    assert "ZeroDivisionError: the reward fell over" in msg and "reward_fixtures.py" in msg, msg


@pytest.mark.parametrize(
    ("fn", "needle"),
    [
        ("returns_text", "the reward is 'one' (str), not a number"),
        ("returns_nan", "the reward is nan, not finite"),
    ],
)
def test_pool_refuses_a_bad_return_value(fn, needle):
    with RewardPool(f"reward_fixtures:{fn}", workers=1, timeout_s=30) as pool:
        with pytest.raises(RewardError) as e:
            pool.score([("p", "r", 1, {})], ["sample 0"])
    assert f"reward_fixtures:{fn} raised on sample 0" in str(e.value) and needle in str(e.value)


def test_pool_times_out_per_sample_and_names_it():
    jobs = [("p", "r", 1, {}), ("p", "r", 1, {"sleep": 60}), ("p", "r", 1, {})]
    with RewardPool("reward_fixtures:sleeps", workers=2, timeout_s=1.5) as pool:
        pool.start()
        t0 = time.monotonic()
        with pytest.raises(RewardError) as e:
            pool.score(jobs, ["sample 0", "sample 1", "sample 2"])
        took = time.monotonic() - t0
    assert "reward reward_fixtures:sleeps timed out on sample 1" in str(e.value)
    assert "reward.timeout_s = 1.5 s" in str(e.value)
    assert 1.5 <= took < 10, took
    # the pool's processes are gone after close (the stuck one was killed)
    assert pool._procs == []


def test_pool_reports_a_function_its_processes_cannot_load(tmp_path):
    with pytest.raises(RewardError, match="could not load it: .*ModuleNotFoundError"):
        with RewardPool("no_such_module_xyz:fn", workers=1, timeout_s=5) as pool:
            pool.start()
