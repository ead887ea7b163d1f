"""Reward functions, by registered name: `reward(completion, answer) -> float`.

`data.rewards` maps names to weights; a response's reward is the weighted sum. Config can
only name functions in `REWARDS`, never an arbitrary callable.
"""

from __future__ import annotations

import re
from collections.abc import Callable

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}

HASH_ANSWER = re.compile(r"####\s*([-+]?[\d,]*\.?\d+)")
NUMBER = re.compile(r"[-+]?\d[\d,]*\.?\d*|[-+]?\.\d+")


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def wrap(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return wrap


class RewardError(RuntimeError):
    """A reward function raised; the message names it."""


def score(completion: str, answer: str, weights: dict[str, float]) -> float:
    total = 0.0
    for name, weight in weights.items():
        try:
            total += weight * float(REWARDS[name](completion, answer))
        except Exception as e:
            raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e}") from e
    return total


@register("digit_echo")
def digit_echo(completion: str, answer: str) -> float:
    """Synthetic task: echo the prompt's digits. Dense partial credit, in [0, 1].

    Half the reward is the share of the first len(answer) characters that are digits at
    all, half the share that are the right digit in the right place. A random model
    rarely emits digits (about 10 of its vocabulary), so the first half gives a signal
    from step one; the second needs the model to read the prompt.
    """
    head = completion[: len(answer)]
    digits = sum(c.isdigit() for c in head) / len(answer)
    exact = sum(c == a for c, a in zip(head, answer)) / len(answer)
    return 0.5 * digits + 0.5 * exact


def gold_number(answer: str) -> str:
    """GSM8K's answer field ends in `#### 42`; plain answers are taken as they are."""
    match = HASH_ANSWER.search(answer)
    return (match[1] if match else answer).replace(",", "").strip()


def boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...}, with nested braces."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def predicted_answer(completion: str) -> str | None:
    match = HASH_ANSWER.search(completion)
    if match:
        return match[1].replace(",", "")
    return boxed(completion)


def same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a.replace(",", "")) - float(b.replace(",", ""))) < 1e-6
    except ValueError:
        return False


@register("math_answer")
def math_answer(completion: str, answer: str) -> float:
    """1 if the final answer (`#### X` or `\\boxed{X}`) equals the gold answer, else 0.

    Numbers are compared as numbers; anything else (fractions, LaTeX) goes to math-verify.
    """
    pred = predicted_answer(completion)
    if pred is None:
        return 0.0
    gold = gold_number(answer)
    if same_number(pred, gold):
        return 1.0
    from math_verify import parse, verify

    return float(verify(parse(f"${gold}$"), parse(f"${pred}$")))


@register("format")
def format_reward(completion: str, answer: str) -> float:
    """1 if the completion states a final answer as `#### X` or `\\boxed{X}`."""
    return float(predicted_answer(completion) is not None)
