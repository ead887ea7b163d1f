"""Time the rollout prefill's attention under each way of passing the left-padding mask.

    python scripts/bench_prefill_attention.py                  # Qwen3-4B's heads, 512 x 128
    python scripts/bench_prefill_attention.py --batch 256 --width 256

Why: on the H200 (2026-12-05 profile, docs/benchmarks.md) the engine's compiled prefill spent
5.95 ms per layer at 512 x 128 in one elementwise kernel that turns the boolean mask, repeated
over the query heads of a KV head (`engine.FusedQwen3.decoder_layer`'s layout), into cuDNN's
additive bias: 0.21 s a rollout, against 0.03 s for the attention itself. Each row here is one
layout of the same attention (causal within the prompt, padded keys hidden), eager and compiled
as the engine compiles its prefill (`dynamic=True`), with its error against the engine's layout
in fp32 and its time. GPU only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from scripts.bench import timed  # noqa: E402
from trainer.engine import prefill_mask  # noqa: E402


def layouts(nkv: int, g: int):
    """name -> (attention(q (B, Hq, T, D), k, v (B, Hkv, T, D), mask), wants an additive bias)."""

    def grouped(q, k, v, mask):  # the engine's: G query heads of a KV head as G x T rows
        b, _, t, d = q.shape
        q = q.reshape(b, nkv, g * t, d)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(1, 1, g, 1))

    def grouped_efficient(q, k, v, mask):
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return grouped(q, k, v, mask)

    def grouped_expand(q, k, v, mask):  # a view over the G copies instead of `repeat`
        b, _, t, d = q.shape
        m = mask[:, :, None].expand(b, 1, g, t, mask.shape[-1]).reshape(b, 1, g * t, -1)
        return F.scaled_dot_product_attention(q.reshape(b, nkv, g * t, d), k, v, attn_mask=m)

    def native_gqa(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def repeat_kv(q, k, v, mask):
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    table = {"grouped": grouped, "grouped, efficient backend": grouped_efficient,
             "grouped, expanded mask": grouped_expand, "enable_gqa": native_gqa,
             "K/V repeated": repeat_kv}  # fmt: skip
    out = {}
    for name, fn in table.items():
        out[f"{name}, bool mask"] = (fn, False)
        out[f"{name}, bias built once"] = (fn, True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--width", type=int, default=128, help="prompt columns (left-padded)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_prefill_attention.py: needs a GPU")
    b, t, nkv, g, d, dev = args.batch, args.width, args.kv_heads, args.group, args.head_dim, "cuda"
    torch.manual_seed(0)
    q = torch.randn(b, nkv * g, t, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(b, nkv, t, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    cols = torch.arange(t, device=dev)
    valid = cols[None, :] >= torch.randint(0, t // 2, (b,), device=dev)[:, None]  # left padding
    mask = prefill_mask(valid)  # the engine's
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=dev).masked_fill(~mask, float("-inf"))
    table = layouts(nkv, g)
    ref = table["grouped, bool mask"][0](q.float(), k.float(), v.float(), mask)
    ref = ref.reshape(b, nkv * g, t, d)
    print(f"batch {b}, prompt {t}, {nkv} KV heads x {g}, head_dim {d}")
    print(f"{'layout':44s} {'eager ms':>9s} {'compiled ms':>12s} {'max error':>10s}")
    for name, (fn, wants_bias) in table.items():
        m = bias if wants_bias else mask
        row, err = [], float("nan")
        for f in (fn, torch.compile(fn, fullgraph=True, dynamic=True)):
            try:
                err = (f(q, k, v, m).reshape(ref.shape).float() - ref).abs().max().item()
                row.append(f"{timed(lambda: f(q, k, v, m), q.device, repeat=10) * 1e3:.3f}")  # noqa: B023
            except Exception as e:  # noqa: BLE001 (a backend that refuses a layout is a result)
                row.append(type(e).__name__)
        print(f"{name:44s} {row[0]:>9s} {row[1]:>12s} {err:10.2e}", flush=True)


if __name__ == "__main__":
    main()
