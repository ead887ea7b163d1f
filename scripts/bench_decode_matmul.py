"""Time the decode step's skinny matmuls: cuBLAS (F.linear) against trainer/decode_matmul.py.

    python scripts/bench_decode_matmul.py                    # Qwen3-4B's projections, batch 64, 256
    python scripts/bench_decode_matmul.py --batch 64 --quick # the grid sweep only

For each projection of a decoder layer (q/k/v fused, o, gate/up fused, down) and each batch:
the floor (weights, input and output bytes over the copy bandwidth, measured as scripts/bench.py
does), cuBLAS's time, and the Triton kernel's over its launch settings, best first. Each time is
the median of CUDA-graph replays of one call per copy of the weights, over enough copies that
they do not fit in L2 (a decode step reads 36 layers' weights; none is in L2 when it is read).
A split kernel's time leaves out the sum of its fp32 partials, which the decode layer fuses into
the elementwise kernel that reads the output; their bytes are in the time (written here). GPU only.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from scripts.bench import copy_bandwidth  # noqa: E402
from scripts.bench_decode_attention import replay_s  # noqa: E402
from trainer import decode_matmul as dm  # noqa: E402

# Qwen3-4B: hidden 2560, 32 query and 8 KV heads of 128, intermediate 9728
SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}


def grid_configs(m: int, n: int, k: int, sms: int) -> list[dm.Config]:
    """Tiles of 32 to 128 weight rows, 1 to 8 splits of K, where the programs number between
    half the SMs and 8 waves (the other settings as decode_matmul.setting picks them)."""
    out = []
    for bn, splits in itertools.product((32, 64, 128), (1, 2, 3, 4, 6, 8)):
        programs = -(-n // bn) * splits
        if sms // 2 <= programs <= 8 * sms and k // splits >= 128:
            out.append(dm.setting(m, bn, splits))
    return out


def refine(best: dm.Config, m: int) -> list[dm.Config]:
    warps = (4, 8) if m > 64 else (4,)
    fits = [(bk, st) for bk, st in itertools.product((64, 128, 256), (2, 3, 4, 6))
            if dm.stage_bytes(m, best.bn, bk) * st <= dm.SHARED_BYTES]  # fmt: skip
    return [
        best._replace(bk=bk, stages=st, warps=w) for (bk, st), w in itertools.product(fits, warps)
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, action="append", help="rows (default 64 and 256)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="which of " + ",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="the grid sweep only, no refinement")
    ap.add_argument("--top", type=int, default=2, help="grid settings refined per shape")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_matmul.py: needs a GPU")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, copy bandwidth {bw / 1e12:.2f} TB/s")
    dm.load()
    for m in args.batch or [64, 256]:
        for name in args.shapes.split(","):
            sweep(m, name, bw, sms, args.quick, args.top)


def sweep(m: int, name: str, bw: float, sms: int, quick: bool, top: int) -> None:
    """cuBLAS and the kernel's settings at batch m for one projection, printed best first."""
    dev = torch.device("cuda")
    n, k = SHAPES[name]
    copies = min(16, max(2, -(-(256 << 20) // (n * k * 2))))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    floor = (n * k + m * k + m * n) * 2 / bw
    ref = F.linear(x.float(), ws[0].float())
    base = replay_s(lambda: [F.linear(x, w) for w in ws]) / copies
    print(f"\nbatch {m} {name} (N {n}, K {k}): floor {floor * 1e6:.1f} us, "
          f"cuBLAS {base * 1e6:.1f} us = {base / floor:.2f}x")  # fmt: skip
    results: list[tuple[float, dm.Config]] = []

    def run(cfg: dm.Config) -> None:
        try:
            err = (dm.launch(x, ws[0], cfg).float().sum(0) - ref).abs().max().item()
            assert err < 0.05 * ref.abs().max().item(), f"wrong: max error {err}"
            t = replay_s(lambda: [dm.launch(x, w, cfg) for w in ws]) / copies
        except Exception as e:  # noqa: BLE001 - a setting that does not compile or fit
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:120]}")
            return
        results.append((t, cfg))

    started = time.perf_counter()
    for cfg in grid_configs(m, n, k, sms):
        run(cfg)
    if not quick:
        seen = {c for _, c in results}
        for _, best in sorted(results)[:top]:
            for cfg in refine(best, m):
                if cfg not in seen:
                    seen.add(cfg)
                    run(cfg)
    chosen = dm.config_for(m, n, k, sms)
    run(chosen)  # the module's own choice, reported beside the best
    mine = [t for t, c in results if c == chosen]
    if mine:
        print(f"  config_for's {chosen}: {mine[0] * 1e6:.1f} us = {mine[0] / floor:.2f}x floor")
    for t, cfg in sorted(results)[:6]:
        programs = -(-n // cfg.bn) * cfg.splits
        print(f"  {t * 1e6:6.1f} us = {t / floor:.2f}x floor, {base / t:.2f}x cuBLAS's speed  "
              f"bn {cfg.bn} bk {cfg.bk} splits {cfg.splits} warps {cfg.warps} "
              f"stages {cfg.stages} ({programs} programs)")  # fmt: skip
    print(f"  ({len(results)} settings in {time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
