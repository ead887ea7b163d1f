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


def test_token_budget_split_of_equal_rows_is_even():
    """512 rows of 384 tokens under 8,192 tokens need 25 micro-batches: 12 of 21 rows and 13 of
    20, not 24 of 21 and one of 8 (a small last micro-batch runs the GPU below its rate)."""
    plan = split([384] * 512, local_count([384] * 512, 4, 8192), 8192)
    assert sorted(len(mb.rows) for mb in plan) == [20] * 13 + [21] * 12
    plan = split([7] * 10, 4, 100)  # a count above the need: still even
    assert sorted(len(mb.rows) for mb in plan) == [2, 2, 3, 3]


@pytest.mark.parametrize("seed", range(10))
def test_token_budget_split_of_mixed_rows_has_no_small_remainder(seed):
    """Mixed lengths, as responses that end at EOS make them: every micro-batch within the
    budget, and none below half the mean cost (packing each to the budget left one that small)."""
    rng = random.Random(100 + seed)
    lengths = [rng.randint(50, 400) for _ in range(rng.randint(40, 200))]
    plan = split(lengths, local_count(lengths, 4, 4096), 4096)
    costs = [cost(lengths, mb) for mb in plan]
    assert max(costs) <= 4096 and sorted(i for mb in plan for i in mb.rows.tolist()) == list(
        range(len(lengths))
    )
    assert min(costs) >= 0.5 * sum(costs) / len(costs)


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
