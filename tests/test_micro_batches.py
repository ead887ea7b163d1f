"""Micro-batch cutting: exactly the agreed count, every row once, balanced, within the budget."""

import itertools
import random

import pytest

from trainer.micro_batches import local_count, split


def cost(lengths, mb):
    return len(mb.rows) * max((lengths[i] for i in mb.rows.tolist()), default=0)


def best_max_cost(lengths, count):
    """Brute force: the smallest largest cost over cuts of the longest-first order into count runs."""
    s = sorted(lengths, reverse=True)
    n, best = len(s), float("inf")
    for cuts in itertools.combinations(range(1, n), min(count, n) - 1):
        bounds = [0, *cuts, n]
        best = min(best, max((e - b) * s[b] for b, e in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_token_budget_split_is_exact_complete_balanced(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 9))]
    budget = rng.randint(20, 120)
    need = local_count(lengths, max_responses=4, max_tokens=budget)
    for count in (need, need + 1, need + 5):  # another rank may need more
        plan = split(lengths, count, budget)
        assert len(plan) == count
        rows = sorted(i for mb in plan for i in mb.rows.tolist())
        assert rows == list(range(len(lengths)))
        for mb in plan:
            assert mb.width == max((lengths[i] for i in mb.rows.tolist()), default=0)
            assert len(mb.rows) == 1 or cost(lengths, mb) <= budget
        assert max(cost(lengths, mb) for mb in plan) == best_max_cost(lengths, count)
        assert sum(mb.empty for mb in plan) == max(0, count - len(lengths))


def test_response_split_sizes_differ_by_at_most_one():
    plan = split([5] * 10, 4, max_tokens=0)
    assert [len(mb.rows) for mb in plan] == [3, 3, 2, 2]
    assert [i for mb in plan for i in mb.rows.tolist()] == list(range(10))  # order kept
    assert local_count([5] * 10, max_responses=3, max_tokens=0) == 4


def test_a_rank_with_no_rows_runs_empty_micro_batches():
    assert local_count([], 4, 100) == 0
    for budget in (0, 100):
        plan = split([], 3, budget)
        assert len(plan) == 3 and all(mb.empty and mb.width == 0 for mb in plan)


def test_a_row_longer_than_the_budget_runs_alone():
    plan = split([300, 10, 10], local_count([300, 10, 10], 4, 100), 100)
    assert [sorted(mb.rows.tolist()) for mb in plan] == [[0], [1, 2]]
