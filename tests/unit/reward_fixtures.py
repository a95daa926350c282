"""Custom reward functions for the reward tests (`reward.path = "reward_fixtures:NAME"`; tests/unit
is on pytest's Python path)."""

from __future__ import annotations

import time


def digits(prompt: str, response: str, label, metadata: dict) -> dict:
    """A dict reward: 1.0 when the label appears in the response, with two extra metrics."""
    return {
        "score": 1.0 if str(label) in response else 0.0,
        "chars": len(response),
        "has_row_id": float("id" in metadata),
    }


def has_digit(prompt: str, response: str, label, metadata: dict) -> dict:
    """A dict reward a random model earns now and then: 1.0 when the response holds a digit
    (tests/e2e/test_grpo_dataset.py's filtered run: some groups differ, most do not)."""
    digits = sum(ch.isdigit() for ch in response)
    return {"score": float(digits > 0), "digits": float(digits)}


def length(prompt: str, response: str, label, metadata: dict) -> float:
    """A float reward: the response's length in characters."""
    return float(len(response))


def raises(prompt: str, response: str, label, metadata: dict) -> float:
    if "boom" in response:
        raise ZeroDivisionError("the reward fell over")
    return 0.0


def sleeps(prompt: str, response: str, label, metadata: dict) -> float:
    time.sleep(float(metadata.get("sleep", 0.0)))
    return 1.0


def returns_text(prompt: str, response: str, label, metadata: dict) -> str:
    return "one"


def returns_nan(prompt: str, response: str, label, metadata: dict) -> float:
    return float("nan")


def two_args(prompt: str, response: str) -> float:
    return 0.0


async def coroutine(prompt: str, response: str, label, metadata: dict) -> float:
    return 0.0


NOT_A_FUNCTION = 3
