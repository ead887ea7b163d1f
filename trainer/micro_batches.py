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
  search on the cap, greedy check), so the work is balanced across the count, not packed to
  the budget and left with a small remainder.
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


def _runs_under_cap(lengths_sorted: list[int], cap: int) -> list[tuple[int, int]]:
    """Greedy runs [start, end) of the longest-first lengths with (end - start) x first <= cap."""
    runs, start, n = [], 0, len(lengths_sorted)
    while start < n:
        end = start + 1
        while end < n and (end - start + 1) * lengths_sorted[start] <= cap:
            end += 1
        runs.append((start, end))
        start = end
    return runs


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
        runs = _runs_under_cap(lengths_sorted, lo) if n else []
        while len(runs) < min(count, n):  # more runs than needed: halve the costliest
            k = max(
                (k for k, (s, e) in enumerate(runs) if e - s > 1),
                key=lambda k: (runs[k][1] - runs[k][0]) * lengths_sorted[runs[k][0]],
            )
            s, e = runs[k]
            runs[k : k + 1] = [(s, (s + e) // 2), ((s + e) // 2, e)]
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
