"""Rewards by hand; the prompt order each rank sees; GSM8K-style files through `datasets`."""

import json

import pytest
from conftest import compose_config

from trainer import rewards
from trainer.data import PromptSampler, load_prompts, synthetic_prompts
from trainer.errors import RunError
from trainer.model import load_tokenizer
from trainer.rewards import RewardError, digit_echo, format_reward, math_answer, score


def test_digit_echo_partial_credit():
    assert digit_echo("7203", "7203") == 1.0
    assert digit_echo("7203<junk>", "7203") == 1.0  # only the first len(answer) characters count
    assert digit_echo("1111", "7203") == 0.5  # all digits, none in place
    assert digit_echo("7x0y", "7203") == pytest.approx(0.5 * 0.5 + 0.5 * 0.5)
    assert digit_echo("ab", "7203") == 0.0
    assert digit_echo("", "7203") == 0.0


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("so 40 + 2 = 42\n#### 42", "Natalia ... #### 42", 1.0),
        ("#### 1,234", "#### 1234", 1.0),
        ("the answer is \\boxed{42}.", "#### 42", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # math-verify compares the values
        ("#### 41", "#### 42", 0.0),
        ("42", "#### 42", 0.0),  # no final-answer marker
    ],
)
def test_math_answer(completion, answer, expected):
    assert math_answer(completion, answer) == expected


def test_format_reward():
    assert format_reward("... #### 7", "") == 1.0
    assert format_reward("\\boxed{x+1}", "") == 1.0
    assert format_reward("seven", "") == 0.0


def test_weighted_sum_and_a_raising_reward_is_named(monkeypatch):
    assert score("#### 42", "#### 42", {"math_answer": 1.0, "format": 0.1}) == pytest.approx(1.1)

    def broken(completion, answer):
        raise KeyError("oops")

    monkeypatch.setitem(rewards.REWARDS, "broken", broken)
    with pytest.raises(RewardError, match="reward 'broken' raised KeyError"):
        score("x", "y", {"digit_echo": 1.0, "broken": 1.0})


def test_sampler_splits_distinct_prompts_over_all_dp_ranks():
    dp, per_step = 4, 8
    samplers = [PromptSampler(50, per_step, rank, dp, seed=3) for rank in range(dp)]
    for step in range(20):
        taken = [i for s in samplers for i in s.indices(step)]
        assert len(taken) == per_step and len(set(taken)) == per_step  # distinct across ranks
        assert taken == samplers[0].global_indices(step)  # ranks take consecutive slices
    # epoch-aware: 6 steps of 8 take 48 distinct prompts of 50, then a new permutation starts
    epoch0 = [i for step in range(6) for i in samplers[0].global_indices(step)]
    epoch1 = [i for step in range(6, 12) for i in samplers[0].global_indices(step)]
    assert len(set(epoch0)) == 48 and len(set(epoch1)) == 48 and epoch0 != epoch1
    assert PromptSampler(50, 8, 0, 4, seed=3).indices(5) == samplers[0].indices(5)
    assert PromptSampler(50, 8, 0, 4, seed=4).global_indices(0) != samplers[0].global_indices(0)


def test_synthetic_prompts_are_seeded():
    d = compose_config().data
    a, b = synthetic_prompts(d, 0), synthetic_prompts(d, 0)
    assert a == b and len(a) == d.num_examples
    assert a[0].text == a[0].answer + "=" and len(a[0].answer) == d.num_digits


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_gsm8k_style_local_file(tmp_path, suffix):
    rows = [
        {"question": "What is 2+3?", "answer": "2+3=5\n#### 5"},
        {"question": "And 1+1?", "answer": "#### 2"},
    ]
    path = tmp_path / f"train{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    cfg = compose_config("data=gsm8k", f"data.path={path}")
    tok = load_tokenizer(cfg.model)
    prompts = load_prompts(cfg.data, tok, seed=0)
    assert [p.answer for p in prompts] == [r["answer"] for r in rows]
    assert prompts[0].text.startswith("<|im_start|>user\nWhat is 2+3?")
    assert prompts[0].text.endswith("<|im_start|>assistant\n")
    assert math_answer("#### 5", prompts[0].answer) == 1.0


def test_gsm8k_missing_column_is_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"q": "x", "answer": "1"}) + "\n")
    cfg = compose_config("data=gsm8k", f"data.path={path}")
    with pytest.raises(RunError, match=r"no column\(s\) \[.question.\]"):
        load_prompts(cfg.data, load_tokenizer(cfg.model), seed=0)
