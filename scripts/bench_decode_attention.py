"""Time the split-K decode-attention kernel alone against its floor, over its launch settings.

    python scripts/bench_decode_attention.py                       # Qwen3-4B's heads, batch 512
    python scripts/bench_decode_attention.py --batch 64 --length 2304 --cols 256:2304:256

One decode step of one layer: each sequence reads the filled columns 0 .. col of its K and V
cache once. Floor: those bytes (B x Hkv x (col + 1) x D x 2 tensors x 2 bytes) over the copy
bandwidth, measured as scripts/bench.py measures it (an eager copy), averaged over the columns a
decode writes (`--cols`: a single column flatters a split that happens to end there). Each row
is one setting of trainer/decode_attention.py's SPLIT, BLOCK, WARPS, STAGES and V_FIRST (the
module's defaults are marked); the time is the mean over those columns of the median of
CUDA-graph replays of the whole op (split kernel and merge), as the engine runs it. GPU only.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from scripts.bench import copy_bandwidth  # noqa: E402
from trainer import decode_attention as da  # noqa: E402


def replay_s(fn, repeat: int = 50) -> float:
    """Seconds per call of fn, captured once in a CUDA graph and replayed `repeat` times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / repeat)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--length", type=int, default=384, help="cache columns (the buffer)")
    ap.add_argument("--cols", default="160:384:64",
                    help="the columns written, START:STOP:STEP (a decode's steps); times and floors are their means")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention.py: needs a GPU")
    dev, b, h, g, d, n = "cuda", args.batch, args.kv_heads, args.group, args.head_dim, args.length
    bandwidth = copy_bandwidth(torch.device(dev))
    q = torch.randn(b, h, g, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    valid = torch.ones(b, n, dtype=torch.bool, device=dev)
    cols = range(*map(int, args.cols.split(":")))
    col = torch.zeros(1, dtype=torch.long, device=dev)
    floor = sum(b * h * (c + 1) * d * 2 * 2 for c in cols) / len(cols) / bandwidth
    da.load()
    knobs = ("SPLIT", "BLOCK", "WARPS", "STAGES", "V_FIRST")
    kept = tuple(getattr(da, k) for k in knobs)  # SPLIT None: the default marks the split it picks
    default = (da.settings(b * h, q.device)[0], *kept[1:])
    print(f"batch {b}, {h} KV heads x {g} query heads, head_dim {d}, cache {n}, columns "
          f"{args.cols}: floor {floor * 1e6:.1f} us (mean) at {bandwidth / 1e12:.2f} TB/s")  # fmt: skip
    print("split 0: one program per sequence and KV head over the whole cache, no merge")
    print("split  block  warps  stages  v_first      us  x floor")
    grid = itertools.product((0, 128, 256), (64, 128), (4, 8), (1, 2, 3), (False, True))
    for setting in grid:  # every BLOCK here fits in every SPLIT
        for knob, value in zip(knobs, setting):
            setattr(da, knob, value)
        t = 0.0
        for c in cols:
            col.fill_(c)
            t += replay_s(lambda: da.decode_attention(q, k, v, valid, col)) / len(cols)
        mark = "  (default)" if setting == default else ""
        split, block, warps, stages, v_first = setting
        print(f"{split:5d}  {block:5d}  {warps:5d}  {stages:6d}  {v_first!s:>7}  {t * 1e6:6.1f}  "
              f"{t / floor:7.2f}{mark}", flush=True)  # fmt: skip
    for knob, value in zip(knobs, kept):
        setattr(da, knob, value)


if __name__ == "__main__":
    main()
