"""Time the split-K decode-attention kernel alone against its floor, over its launch settings.

    python scripts/bench_decode_attention.py                       # Qwen3-4B's heads, batch 512
    python scripts/bench_decode_attention.py --batch 64 --length 2304 --col 2000

One decode step of one layer: each sequence reads the filled columns 0 .. col of its K and V
cache once. Floor: those bytes (B x Hkv x (col + 1) x D x 2 tensors x 2 bytes) over the copy
bandwidth, measured as scripts/bench.py measures it (an eager copy). Each row is one setting of
trainer/decode_attention.py's SPLIT, BLOCK and WARPS (the module's defaults are marked); the time
is the median of CUDA-graph replays of the whole op (split kernel and merge), as the engine runs
it. GPU only.
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
    ap.add_argument("--col", type=int, default=255, help="the column written this step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_attention.py: needs a GPU")
    dev, b, h, g, d, n = "cuda", args.batch, args.kv_heads, args.group, args.head_dim, args.length
    bandwidth = copy_bandwidth(torch.device(dev))
    q = torch.randn(b, h, g, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    valid = torch.ones(b, n, dtype=torch.bool, device=dev)
    col = torch.tensor([args.col], device=dev)
    floor = b * h * (args.col + 1) * d * 2 * 2 / bandwidth
    da.load()
    default = (da.SPLIT, da.BLOCK, da.WARPS)
    print(f"batch {b}, {h} KV heads x {g} query heads, head_dim {d}, cache {n}, col {args.col}: "
          f"floor {floor * 1e6:.1f} us at {bandwidth / 1e12:.2f} TB/s")  # fmt: skip
    print("split  block  warps      us  x floor")
    for split, block, warps in itertools.product((64, 128, 256), (32, 64, 128), (2, 4, 8)):
        if block > split:
            continue
        da.SPLIT, da.BLOCK, da.WARPS = split, block, warps
        t = replay_s(lambda: da.decode_attention(q, k, v, valid, col))
        mark = "  (default)" if (split, block, warps) == default else ""
        print(
            f"{split:5d}  {block:5d}  {warps:5d}  {t * 1e6:6.1f}  {t / floor:7.2f}{mark}",
            flush=True,
        )
    da.SPLIT, da.BLOCK, da.WARPS = default


if __name__ == "__main__":
    main()
