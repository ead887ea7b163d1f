"""Skinny matmuls of the decode step, y = x W^T with few rows, split over K (Triton).

A decode step multiplies B rows (64 to 512 sequences, one token each) by each layer's weights:
the time is the weights' read, and what matters is that every SM streams weights the whole
time. cuBLAS's heuristics pick tiles that leave SMs idle at these shapes (on an H200 at batch
64, 96 to 101 programs for 132 SMs on three of Qwen3-4B's four projections: 1.3x to 2x the
weights' read, docs/benchmarks.md), and its split-K pays a reduction kernel of its own.

Here each program multiplies all rows (up to BM of them) by BN weight rows over one split of
the K dim, and the splits are *not* reduced by this kernel: with SPLITS > 1 it returns fp32
partial products (SPLITS, M, N) and the caller sums them where it next reads the output (in the
decode layer, torch.compile fuses the sum into the elementwise kernel that follows: the
residual add, the q/k norm, the SiLU), so a split costs no launch. With SPLITS 1 the output is
written in x's dtype, shape (1, M, N).

Triton is imported by `load()`, not by importing this module; the op is opaque to torch.compile
(like trainer/decode_attention.py), so the captured decode step launches it as eager code does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from trainer.decode_attention import pow2, sm_count

_kernels: Any = None  # (the @triton.jit function,), once load() has built it


class Config(NamedTuple):
    """One launch: BN weight rows and BK columns per tile, SPLITS programs along K."""

    bn: int = 64
    bk: int = 128
    splits: int = 1
    warps: int = 4
    stages: int = 4


def load():
    """Build the kernel (imports Triton); outside torch.compile, so the traced step sees a global."""
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def linear_kernel(X, W, Y, M, N, K, sxm, swn, sys, sym,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STEPS: tl.constexpr,
                      EVEN: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        rows, cols = rm < M, rn < N
        x_at = X + rm[:, None] * sxm + (ps * STEPS * BK + rk)[None, :]
        w_at = W + rn[:, None] * swn + (ps * STEPS * BK + rk)[None, :]
        acc = tl.zeros((BM, BN), tl.float32)
        for i in range(STEPS):
            if EVEN:  # K is STEPS x BK x SPLITS: no column mask
                x = tl.load(x_at, mask=rows[:, None], other=0.0)
                w = tl.load(w_at, mask=cols[:, None], other=0.0)
            else:
                k = ps * STEPS * BK + i * BK + rk
                x = tl.load(x_at, mask=rows[:, None] & (k[None, :] < K), other=0.0)
                w = tl.load(w_at, mask=cols[:, None] & (k[None, :] < K), other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
            x_at += BK
            w_at += BK
        y_at = Y + ps * sys + rm[:, None] * sym + rn[None, :]
        tl.store(y_at, acc.to(Y.dtype.element_ty), mask=rows[:, None] & cols[None, :])

    _kernels = (linear_kernel,)
    return _kernels


def launch(x_MK: torch.Tensor, w_NK: torch.Tensor, cfg: Config) -> torch.Tensor:
    """x W^T as (SPLITS, M, N): fp32 partial sums over SPLITS slices of K, or (1, M, N) in x's
    dtype where SPLITS is 1. x (M, K), w (N, K) with unit stride along K."""
    m, k = x_MK.shape
    n = w_NK.shape[0]
    assert w_NK.shape[1] == k and w_NK.stride(1) == 1
    if x_MK.stride(1) != 1:  # a layout torch.compile chose for the input (a few hundred KB)
        x_MK = x_MK.contiguous()
    bm = pow2(m, 16)  # every row in one tile: each weight byte is read once
    steps = -(-k // (cfg.bk * cfg.splits))  # BK tiles per split; the last split may run short
    out_dtype = x_MK.dtype if cfg.splits == 1 else torch.float32
    y = torch.empty((cfg.splits, m, n), dtype=out_dtype, device=x_MK.device)
    grid = (1, -(-n // cfg.bn), cfg.splits)
    load()[0][grid](
        x_MK, w_NK, y, m, n, k, x_MK.stride(0), w_NK.stride(0), y.stride(0), y.stride(1),
        BM=bm, BN=cfg.bn, BK=cfg.bk, STEPS=steps, EVEN=k == steps * cfg.bk * cfg.splits,
        PRECISION="ieee" if x_MK.dtype == torch.float32 else "tf32",
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return y


SHARED_BYTES = 200 * 1024  # of an SM's 227 KB (H100, H200), for the pipelined tiles
MAX_ROWS = 256  # more rows: cuBLAS (one tile of every row no longer fits the registers)


def projections(config) -> list[tuple[int, int]]:
    """(N, K) of a Qwen3 decoder layer's matmuls as the engine runs them: q/k/v fused, o,
    gate/up fused, down."""
    hidden, hd = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    inter = config.intermediate_size
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]


def config_for(m: int, n: int, k: int, sms: int) -> Config:
    """The launch for (M, N, K) on a GPU of `sms` SMs: tiles of 64 weight rows, and the fewest
    splits of K (each at least 512 columns) that give every SM a program."""
    bn = 64
    tiles = -(-n // bn)
    splits = 1
    while tiles * splits < sms and k // (2 * splits) >= 512:
        splits *= 2
    return setting(m, bn, splits)


def setting(m: int, bn: int, splits: int) -> Config:
    """A launch of BN-row tiles and `splits` splits for m rows: 128-column K tiles up to 64 rows,
    64 beyond, and as many pipeline stages (up to 4) as shared memory holds."""
    bk = 128 if m <= 64 else 64
    return Config(bn=bn, bk=bk, splits=splits, warps=4 if m <= 64 else 8,
                  stages=max(2, min(4, SHARED_BYTES // stage_bytes(m, bn, bk))))  # fmt: skip


def stage_bytes(m: int, bn: int, bk: int) -> int:
    """Shared memory of one pipeline stage: the x tile (every row) and the weight tile, bf16."""
    return (pow2(m, 16) + bn) * bk * 2


# An opaque op to torch.compile (see trainer/decode_attention.py's): the captured decode step
# launches the kernel as eager code does, and the sum of the partials that follows is fused by
# Inductor into the elementwise kernel that reads it.
@torch.library.custom_op("hsdp_grpo::decode_linear", mutates_args=())
def decode_linear(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """x W^T as (S, M, N) partial sums over S splits of K (fp32 where S > 1, else x's dtype):
    `.sum(0)` is the product. `load()` must have run first."""
    (m, k), n = x_MK.shape, w_NK.shape[0]
    return launch(x_MK, w_NK, config_for(m, n, k, sm_count(x_MK.device)))


@decode_linear.register_fake
def _(x_MK, w_NK):
    (m, k), n = x_MK.shape, w_NK.shape[0]
    cfg = config_for(m, n, k, sm_count(x_MK.device))
    dtype = x_MK.dtype if cfg.splits == 1 else torch.float32
    return x_MK.new_empty((cfg.splits, m, n), dtype=dtype)


def linear(x: torch.Tensor, w_NK: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) by the kernel, for x of at most MAX_ROWS rows in all."""
    rows = x.shape[:-1]
    y = decode_linear(x.reshape(-1, x.shape[-1]), w_NK).sum(0).to(x.dtype)
    y = y.view(*rows, w_NK.shape[0])
    return y if bias is None else y + bias
