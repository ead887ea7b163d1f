"""How one update's rows are cut into forward/backward passes, the same count on every rank.

Every micro-batch is a forward and a backward through the FSDP model, so it is a fixed
sequence of all-gathers and reduce-scatters: ranks that ran different numbers of them would
pair one rank's layer-3 all-gather with another's reduce-scatter and hang. The count is
therefore agreed over the data-parallel group (`agreed_count`: an all-reduce MAX of what
each rank needs on its own), and each rank then cuts its rows into exactly that many
(`split`). A rank with fewer rows than the count runs empty micro-batches: one padding row
with zero weight (`Batch.rows` makes it), so its collectives still pair and its gradient is
unchanged.

Two ways of cutting, chosen by `rl.micro_batch_tokens`:
- 0: by responses. A rank needs ceil(rows / micro_batch_responses); the rows are cut into
  `count` consecutive groups whose sizes differ by at most one.
- > 0: by tokens. Rows are sorted longest first and a micro-batch of m rows whose longest has
  length L costs m x L tokens (it is cut to its longest row). A rank needs as many as greedy
  packing under the budget makes (a row longer than the budget runs alone); the rows are then
  cut into `count` consecutive runs of the sorted order minimising the largest cost (binary
  search on the cap, greedy check), then cut as evenly as that cap allows (`_even_runs`), so the
  work is balanced across the count, not packed to the budget and left with a small remainder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class MicroBatch:
    """Rows of the batch run in one forward/backward, and the columns they need (their longest).

    An empty micro-batch (no rows, width 0) still runs: one zero-weight padding row."""

    rows: torch.Tensor  # indices into the batch
    width: int  # tokens per row in this micro-batch (the longest prompt + response among rows)

    @property
    def empty(self) -> bool:
        return self.rows.numel() == 0

    @property
    def tokens(self) -> int:
        return len(self.rows) * self.width


def _run_end(lengths_sorted: list[int], start: int, cap: int) -> int:
    """End of the longest run from `start` of the longest-first lengths whose cost (rows x its
    first, longest, length) is within `cap`; a row longer than `cap` runs alone."""
    return min(len(lengths_sorted), start + max(1, cap // max(1, lengths_sorted[start])))


def _runs_under_cap(lengths_sorted: list[int], cap: int) -> list[tuple[int, int]]:
    """Greedy runs [start, end) of the longest-first lengths, each as long as `cap` allows."""
    runs, start = [], 0
    while start < len(lengths_sorted):
        runs.append((start, end := _run_end(lengths_sorted, start, cap)))
        start = end
    return runs


def _even_runs(lengths_sorted: list[int], cap: int, k: int) -> list[tuple[int, int]]:
    """Exactly k runs [start, end) of the longest-first lengths (k <= len), each within `cap`
    (a row longer than it alone), as even as that allows: each run takes its share of what is
    left (tokens left over runs left), then more if the rest would not fit the runs after it.
    Packing each run to the cap instead leaves a small last one (512 rows of 384 tokens under
    8,192 tokens: 24 runs of 21 rows and one of 8, against 12 of 21 and 13 of 20 here)."""
    n = len(lengths_sorted)
    # after[e]: how many runs the greedy packing under `cap` needs for rows e.. (the fewest any
    # packing needs), right to left
    after = [0] * (n + 1)
    for e in range(n - 1, -1, -1):
        after[e] = 1 + after[_run_end(lengths_sorted, e, cap)]
    left = sum(lengths_sorted)
    runs, start = [], 0
    for m in range(k, 1, -1):  # m runs left, this one included
        most = min(_run_end(lengths_sorted, start, cap), n - (m - 1))
        share = max(1, round(left / m / max(1, lengths_sorted[start])))
        end = min(start + share, most)
        while after[end] > m - 1:  # the rest must fit the runs after this one
            end += 1
        runs.append((start, end))
        left -= sum(lengths_sorted[start:end])
        start = end
    return [*runs, (start, n)] if k else []


def local_count(lengths: list[int], max_responses: int, max_tokens: int) -> int:
    """Micro-batches this rank needs on its own for rows of these lengths (0 for no rows)."""
    if not lengths:
        return 0
    if max_tokens <= 0:
        return -(-len(lengths) // max_responses)
    return len(_runs_under_cap(sorted(lengths, reverse=True), max_tokens))


def split(lengths: list[int], count: int, max_tokens: int) -> list[MicroBatch]:
    """Exactly `count` micro-batches of these rows (trailing ones empty if rows run out).

    `count` must be at least `local_count(lengths, ...)`, which the agreed count is."""
    n = len(lengths)
    if max_tokens <= 0:  # consecutive groups, sizes differing by at most one
        base, extra = divmod(n, count)
        bounds, start = [], 0
        for k in range(count):
            size = base + (k < extra)
            bounds.append(list(range(start, start + size)))
            start += size
        groups = bounds
    else:
        order = sorted(range(n), key=lambda i: -lengths[i])
        lengths_sorted = [lengths[i] for i in order]
        lo, hi = 1, max([max_tokens, *lengths_sorted]) if n else 1
        while lo < hi:  # the smallest cap that needs no more than `count` runs
            mid = (lo + hi) // 2
            if len(_runs_under_cap(lengths_sorted, mid)) <= count:
                hi = mid
            else:
                lo = mid + 1
        runs = _even_runs(lengths_sorted, lo, min(count, n))
        groups = [order[s:e] for s, e in runs]
        groups += [[] for _ in range(count - len(groups))]
    return [
        MicroBatch(torch.tensor(g, dtype=torch.long), max((lengths[i] for i in g), default=0))
        for g in groups
    ]


def agreed_count(local: int, group, device: torch.device) -> int:
    """The micro-batch count of one update, agreed by every rank of `group` (all-reduce MAX),
    at least 1: every rank runs this many forward/backward passes, whatever its own rows."""
    t = torch.tensor([max(local, 1)], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
