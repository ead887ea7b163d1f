"""Split-K decode attention for grouped-query heads over a static KV cache (Triton).

One decode step has one query token per sequence. Its attention is bound by reading the K/V
cache once, so the kernel's job is to read exactly the filled columns (0 .. col, masked by a
per-sequence key mask), each byte once, with enough programs to keep every SM streaming:

- one program per (sequence, KV head, split of SPLIT cache columns): the G query heads sharing a
  KV head are the rows of one tile, so K/V are read once for all of them (no repeat_interleave);
- the filled length comes from a device tensor (`col`), so one compiled kernel and one captured
  CUDA graph serve every step: columns past the filled length are not read;
- each split leaves its softmax-normalised partial output and log-sum-exp (fp32, a few MB); a
  second kernel, one program per (sequence, KV head), merges the splits with a softmax over
  their log-sum-exps and writes the output in q's dtype (one launch, not five eager ops);
- where one split covers the cache (SPLIT 0, or a cache no longer than SPLIT) its program writes
  the output itself and nothing is merged: where B x Hkv programs already fill the GPU (the
  default, SPLIT None, splits only where they do not), the fp32 partials (a fifth of the KV
  bytes at 4 query heads and 3 splits) and the merge are waste.

The cache length is a run-time argument, so one compile serves every cache length up to the
one-program kernel's `span` (the length rounded up to a power of two; the length was a constexpr:
a compile per buffer size, 7.1 s each, cold, on an H100 machine, and prompt widths vary by step).
On a GPU the column loop runs over the filled blocks only (its bound read from `col`), which lets
Triton pipeline the K/V loads; Triton's interpreter takes no loop bound from a tensor, so there
the loop runs over the span and skips the blocks past the filled columns (one block body for both). Triton is imported
by `load()` (the engine calls it when it is built with this attention), not by importing this
module: CPU runs and machines without Triton never need it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

# Launch settings; scripts/bench_decode_attention.py sweeps them. Chosen on an H100 (2026-12-05,
# docs/benchmarks.md): one program over the whole cache, 64-column tiles, 4 warps, V loaded with
# K: 1.07x / 1.08x / 1.25x the KV read's floor at batch 512 / 256 / 64, against 1.32x / 1.31x /
# 1.55x for splits of 128 columns and 128-column tiles, V loaded after the scores. Swept again
# with the pipelined loop (H100, 2026-12-07, docs/sweep_2026-12-07_decode_attention_h100.txt):
# 2 stages 1.12x / 1.21x / 1.41x, Triton's default 3 stages 1.16x / 1.27x / 1.72x.
SPLIT: int | None = None  # cache columns per program; 0: the whole cache; None: by the grid
BLOCK = 64  # cache columns per inner tile
WARPS = 4  # warps per program
STAGES = 2  # software-pipelining stages of the column loop (one K/V tile loaded ahead)
V_FIRST = True  # issue the V tile's load with K's, before the scores
SMALL_GRID_SPLIT = 128  # SPLIT None: the split where B x Hkv programs are fewer than the SMs
# The fused kernel (`decode_attention_qkv`: the q/k norm, RoPE and cache write as its prologue)
# pays where few programs share an SM, with its first K/V tile loaded before the prologue (PEEL)
# so that the tile's read overlaps the prologue's loads and arithmetic. Where many programs share
# an SM, other programs already hide the prologue's latency and its registers cost occupancy: the
# engine then runs the three elementwise kernels and `decode_attention`, unpeeled. Measured on one
# H100 (2026-12-07, docs/benchmarks.md, decode (a)): at batch 64 (512 programs, 3.9 per SM) the
# peel -2.0% and fused-and-peeled 1.380 s against 1.395-1.399 s unfused; at batch 256 (15.5 per
# SM) the peel +2.1% and unfused 2.628-2.630 s against 2.666-2.671 s fused.
FUSE: bool | None = None  # None: by the grid (few_per_sm)
PEEL: bool | None = None  # None: by the grid (few_per_sm)
FEW_PROGRAMS_PER_SM = 8  # few_per_sm: at most this many programs per SM (between 3.9 and 15.5)


_kernels: Any = None  # (split, merge) @triton.jit functions, once load() has built them
# compiled kernels (not Triton's interpreter, which takes no loop bound from a tensor): the column
# loop bounded by the filled blocks; fixed by load(), as Triton fixes the kernels' interpretation
_pipelined = True


def supports(head_dim: int) -> bool:
    """tl.dot tiles need a power-of-two head_dim of at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def load():
    """Build the kernels (imports Triton); outside torch.compile, so the traced step sees a global."""
    global _kernels, _pipelined
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    _pipelined = os.environ.get("TRITON_INTERPRET") != "1"

    @triton.jit
    def norm_rope(X, off, d, mask, W, cs, sn, S: tl.constexpr, sqs, D: tl.constexpr,
                  EPS: tl.constexpr, DT: tl.constexpr):  # fmt: skip
        """Heads at X + off (+ i sqs for each of the S partials) summed, RMS-normed with weight W
        and rotated by cos/sin (Qwen3's q/k norm then RoPE; rounded to DT where the unfused
        layer rounds: the projection's output, the norm's, the result)."""
        half = (d + D // 2) % D  # rotate_half: x[d + D/2] negated in the first half, x[d - D/2]
        x = tl.zeros(off.shape, tl.float32)
        xr = tl.zeros(off.shape, tl.float32)
        for i in tl.static_range(S):
            x += tl.load(X + i * sqs + off + d, mask=mask, other=0.0).to(tl.float32)
            xr += tl.load(X + i * sqs + off + half, mask=mask, other=0.0).to(tl.float32)
        x = x.to(DT).to(tl.float32)
        xr = xr.to(DT).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, -1, keep_dims=True) / D + EPS)
        x = (x * rstd).to(DT).to(tl.float32) * tl.load(W + d).to(tl.float32)
        xr = (xr * rstd).to(DT).to(tl.float32) * tl.load(W + half).to(tl.float32)
        x = x.to(DT).to(tl.float32)
        xr = tl.where(d < D // 2, -xr, xr).to(DT).to(tl.float32)
        return (x * cs + xr * sn).to(DT)

    @triton.jit
    def prologue(QKV, QW, KW, COS, SIN, sqs, sqb, scb, b, h, g, d, rows,
                 G: tl.constexpr, D: tl.constexpr, S: tl.constexpr, KOFF: tl.constexpr,
                 VOFF: tl.constexpr, EPS: tl.constexpr, DT: tl.constexpr):  # fmt: skip
        """This step's q (the G query heads of KV head h, GP x D), k and v (D) for row b, from
        the q/k/v projection's partial sums: what the unfused layer computes with its q/k norm,
        RoPE and the K/V cache write (three elementwise kernels) before the attention."""
        base = QKV + b * sqb
        cs = tl.load(COS + b * scb + d).to(tl.float32)
        sn = tl.load(SIN + b * scb + d).to(tl.float32)
        q_off = (h * G + g)[:, None] * D + tl.zeros((1, D), tl.int32)
        q = norm_rope(base, q_off, d[None, :], rows[:, None], QW, cs[None, :], sn[None, :],
                      S, sqs, D, EPS, DT)  # fmt: skip
        k_new = norm_rope(base, KOFF + h * D + tl.zeros((D,), tl.int32), d, d < D, KW, cs, sn,
                          S, sqs, D, EPS, DT)  # fmt: skip
        v = tl.zeros((D,), tl.float32)
        for i in tl.static_range(S):
            v += tl.load(base + i * sqs + VOFF + h * D + d).to(tl.float32)
        return q, k_new, v.to(DT)

    @triton.jit
    def tile(K, V, Valid, start, hi, d, D: tl.constexpr, BLOCK: tl.constexpr,
             V_LOAD: tl.constexpr):  # fmt: skip
        """Cache columns start .. start + BLOCK of one sequence and KV head: which are below hi
        and valid, their K tile, and their V tile where V_LOAD (else V's pointers)."""
        c = start + tl.arange(0, BLOCK)
        inb = c < hi
        ok = inb & (tl.load(Valid + c, mask=inb, other=0) != 0)
        k = tl.load(K + c[:, None] * D + d[None, :], mask=inb[:, None], other=0.0)
        v = V + c[:, None] * D + d[None, :]
        if V_LOAD:
            v = tl.load(v, mask=inb[:, None], other=0.0)
        return ok, inb, k, v

    @triton.jit
    def attend(q, ok, inb, k, v, m, denom, acc, SCALE: tl.constexpr, V_LOADED: tl.constexpr,
               PRECISION: tl.constexpr):  # fmt: skip
        """The online softmax's update by one tile from `tile` (V loaded here where it was not):
        (m, denom, acc) updated."""
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * SCALE
        qk = tl.where(ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: no NaN
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.sum(p, 1)
        if not V_LOADED:
            v = tl.load(v, mask=inb[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, denom, acc

    # Triton resolves a kernel's callees among its module's globals, not the closure of load()
    # (a helper calling tile/attend failed to compile for sm_90, `tl` not found: call them here)
    globals().update(norm_rope=norm_rope, prologue=prologue, tile=tile, attend=attend)

    @triton.jit
    def split_kernel(Q, K, V, Valid, Col, Out, LSE,
                     sqb, sqh, skb, skh, svb, svh, sab, sob, soh, sos, slb, slh, sls,
                     L, QW, KW, COS, SIN, sqs, scb,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
                     SPLIT: tl.constexpr, BLOCK: tl.constexpr, V_FIRST: tl.constexpr,
                     DIRECT: tl.constexpr,
                     # FUSED: Q is the q/k/v projection's (S, B, N) partial sums; see `prologue`
                     FUSED: tl.constexpr, S: tl.constexpr,
                     KOFF: tl.constexpr, VOFF: tl.constexpr, EPS: tl.constexpr,
                     PEEL: tl.constexpr, PIPELINED: tl.constexpr,
                     PRECISION: tl.constexpr):  # fmt: skip
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = tl.minimum(tl.load(Col) + 1, L)  # columns 0 .. col are filled
        lo = s * SPLIT  # DIRECT: SPLIT spans the whole cache, s is 0
        # lo >= hi: a split past the filled columns reads nothing. FUSED: column col is this
        # step's own K/V, which the prologue computes: attended from registers, not the cache
        hi = tl.minimum(n - 1 if FUSED else n, lo + SPLIT)
        g, d = tl.arange(0, GP), tl.arange(0, D)
        rows = g < G
        k_b, v_b, valid_b = K + b * skb + h * skh, V + b * svb + h * svh, Valid + b * sab
        if PEEL:  # the first tile's loads issued before the prologue's (columns < col: no hazard)
            ok0, inb0, k0, v0 = tile(k_b, v_b, valid_b, lo, hi, d, D, BLOCK, True)
        if FUSED:
            q, k_new, v_new = prologue(Q, QW, KW, COS, SIN, sqs, sqb, scb, b, h, g, d, rows,
                                       G, D, S, KOFF, VOFF, EPS, K.dtype.element_ty)  # fmt: skip
            col = n - 1
            own = (lo <= col) & (col < lo + SPLIT)  # the one program that writes column col
            tl.store(k_b + col * D + d, k_new, mask=own & (d < D))
            tl.store(v_b + col * D + d, v_new, mask=own & (d < D))
        else:
            q = tl.load(
                Q + b * sqb + h * sqh + g[:, None] * D + d[None, :], mask=rows[:, None], other=0.0
            )
        m = tl.full((GP,), float("-inf"), tl.float32)
        denom = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        first = lo  # the loop's first tile
        if PEEL:
            m, denom, acc = attend(q, ok0, inb0, k0, v0, m, denom, acc, SCALE, True, PRECISION)
            first = lo + BLOCK
        if PIPELINED:  # the filled blocks as the loop's bound: Triton pipelines their loads
            for start in tl.range(first, hi, BLOCK):
                ok, inb, k, v = tile(k_b, v_b, valid_b, start, hi, d, D, BLOCK, V_FIRST)
                m, denom, acc = attend(q, ok, inb, k, v, m, denom, acc, SCALE, V_FIRST, PRECISION)
        else:  # Triton's interpreter takes no loop bound from a tensor: each block, skipped past hi
            for off in range(0, SPLIT, BLOCK):
                if first + off < hi:
                    ok, inb, k, v = tile(k_b, v_b, valid_b, first + off, hi, d, D, BLOCK, V_FIRST)
                    m, denom, acc = attend(q, ok, inb, k, v, m, denom, acc, SCALE, V_FIRST,
                                           PRECISION)  # fmt: skip
        if FUSED:  # column col, from registers, where this program owns it and it is valid
            ok_new = own & (tl.load(valid_b + col) != 0)
            qk = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * SCALE
            qk = tl.where(ok_new, qk, float("-inf"))
            m_new = tl.maximum(m, qk)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_safe)
            alpha = tl.exp(m - m_safe)
            denom = denom * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
            m = m_new
        some = denom > 0
        out = acc / tl.where(some, denom, 1.0)[:, None]
        out_at = Out + b * sob + h * soh + s * sos + g[:, None] * D + d[None, :]
        if DIRECT:  # the only split: the output itself, in its dtype; nothing to merge
            tl.store(out_at, out.to(Out.dtype.element_ty), mask=rows[:, None])
        else:
            lse = tl.where(some, m + tl.log(tl.where(some, denom, 1.0)), float("-inf"))
            tl.store(out_at, out, mask=rows[:, None])
            tl.store(LSE + b * slb + h * slh + s * sls + g, lse, mask=rows)

    @triton.jit
    def merge_kernel(Part, LSE, Out, spb, sph, sps, slb, slh, sls, sob, soh,
                     S: tl.constexpr, SP: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                     D: tl.constexpr):  # fmt: skip
        b, h = tl.program_id(0), tl.program_id(1)
        s, g, d = tl.arange(0, SP), tl.arange(0, GP), tl.arange(0, D)
        ok = (s[:, None] < S) & (g[None, :] < G)
        lse = tl.load(LSE + b * slb + h * slh + s[:, None] * sls + g[None, :], mask=ok,
                      other=float("-inf"))  # fmt: skip
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key: zeros, not NaN
        denom = tl.maximum(tl.sum(tl.exp(lse - m[None, :]), 0), 1e-30)  # -inf splits weigh 0
        rows = g < G
        acc = tl.zeros((GP, D), tl.float32)
        for i in range(S):  # one split's [G, D] at a time: few registers at any cache length
            w = tl.exp(
                tl.load(LSE + b * slb + h * slh + i * sls + g, mask=rows, other=float("-inf")) - m
            )
            part = tl.load(Part + b * spb + h * sph + i * sps + g[:, None] * D + d[None, :],
                           mask=rows[:, None], other=0.0)  # fmt: skip
            acc += w[:, None] * part
        tl.store(Out + b * sob + h * soh + g[:, None] * D + d[None, :],
                 (acc / denom[:, None]).to(Out.dtype.element_ty), mask=rows[:, None])  # fmt: skip

    _kernels = (split_kernel, merge_kernel)
    return _kernels


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (1 elsewhere: Triton's interpreter on CPU); the decode kernels
    size their grids by it."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_for(programs: int, device: torch.device) -> int:
    """SPLIT None: one program per (sequence, KV head) over the whole cache (0) where those
    programs fill every SM (measured faster from batch 64, 512 programs); splits otherwise."""
    return 0 if programs >= sm_count(device) else SMALL_GRID_SPLIT


def few_per_sm(programs: int, sms: int) -> bool:
    """Where the fused kernel, peeled, pays: at most FEW_PROGRAMS_PER_SM programs per SM."""
    return programs <= FEW_PROGRAMS_PER_SM * sms


def fuse_for(programs: int, sms: int, biased: bool) -> bool:
    """Whether the engine's decode step launches `decode_attention_qkv` (the prologue fused) for
    `programs` (B x Hkv) programs on `sms` SMs: never for a biased q/k/v projection (the
    prologue adds no bias), else FUSE where set, else by the grid. The engine and the kernel
    warm-up's spec both ask here. Takes the SM count, not the device, so that the traced decode
    step decides it from ints alone."""
    if biased:
        return False
    return FUSE if FUSE is not None else few_per_sm(programs, sms)


def settings(programs: int, device: torch.device) -> tuple[int, bool]:
    """The split and the peel of a launch of `programs` (B x Hkv) programs: SPLIT and PEEL where
    they are set, else chosen by the grid. The engine's launches and the kernel warm-up's spec
    (trainer/kernel_warmup.py) both take them from here, so the warm-up compiles what runs."""
    split = SPLIT if SPLIT is not None else split_for(programs, device)
    return split, PEEL if PEEL is not None else few_per_sm(programs, sm_count(device))


def pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (n - 1).bit_length())


def span(length: int) -> int:
    """The one-program kernel's column loop bound (a compile-time constant): the cache length
    rounded up to a power of two, so that one compile serves every cache length up to it."""
    return pow2(length, BLOCK)


# An opaque op to torch.compile: the traced decode step calls the kernel exactly as eager code
# does (inductor does not re-type or re-wrap it), and the CUDA graph captures its launch.
@torch.library.custom_op("hsdp_grpo::decode_attention", mutates_args=())
def decode_attention(q_BHGD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor,
                     valid_BL: torch.Tensor, col_1: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T / sqrt(D), keys c <= col with valid[b, c]) v for one query token.

    q: (B, Hkv, G, D), the G query heads of each KV head; K/V cache: (B, Hkv, L, D), contiguous in
    their last two dims; valid: (B, L) bool; col: (1,) long. Returns (B, Hkv, G, D) in q's dtype.
    Every sequence must have a valid key at or before col (the engine marks col itself valid).
    `load()` must have run first."""
    b, h = q_BHGD.shape[:2]
    split, _ = settings(b * h, q_BHGD.device)  # no prologue: nothing to peel
    return launch(q_BHGD, k_BHLD, v_BHLD, valid_BL, col_1, split)


def launch(q_BHGD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor,
           valid_BL: torch.Tensor, col_1: torch.Tensor, split: int) -> torch.Tensor:  # fmt: skip
    """`decode_attention` with splits of `split` cache columns (0: one program per sequence and
    KV head over the whole cache). The cache length is a run-time argument: one compiled
    one-program kernel serves every cache length up to its `span` (prompt widths vary by step),
    whatever split led to it (trainer/kernel_warmup.py compiles it before the first call)."""
    b, h, g, d = q_BHGD.shape
    q = q_BHGD.contiguous()
    out = torch.empty_like(q)
    fused = (q, q, q, q, 0, 0, False, 1, 0, 0, 0.0)  # the prologue's pointers unread: q stands in
    return _attend(q, q.stride(0), q.stride(1), k_BHLD, v_BHLD, valid_BL, col_1, out, split, fused)


def launch_qkv(qkv_SBN: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
               cos_BD: torch.Tensor, sin_BD: torch.Tensor, k_BHLD: torch.Tensor,
               v_BHLD: torch.Tensor, valid_BL: torch.Tensor, col_1: torch.Tensor, heads: int,
               eps: float, split: int, peel: bool) -> torch.Tensor:  # fmt: skip
    """`decode_attention_qkv` with splits of `split` cache columns (as `launch`), its first
    tile loaded before the prologue where `peel`."""
    _, b, n = qkv_SBN.shape
    h, d = k_BHLD.shape[1], k_BHLD.shape[3]
    assert n == (heads + 2 * h) * d and heads % h == 0, (qkv_SBN.shape, heads, h, d)
    assert qkv_SBN.stride(2) == 1 and cos_BD.stride(1) == 1 and sin_BD.stride() == cos_BD.stride()
    out = torch.empty((b, h, heads // h, d), dtype=k_BHLD.dtype, device=k_BHLD.device)
    fused = (q_norm, k_norm, cos_BD, sin_BD, qkv_SBN.stride(0), cos_BD.stride(0), True,
             qkv_SBN.shape[0], heads * d, (heads + h) * d, eps)  # fmt: skip
    return _attend(
        qkv_SBN, qkv_SBN.stride(1), 0, k_BHLD, v_BHLD, valid_BL, col_1, out, split, fused, peel
    )


def _attend(q, sqb: int, sqh: int, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor,
            valid_BL: torch.Tensor, col_1: torch.Tensor, out: torch.Tensor, split: int,
            fused: tuple, peel: bool = False) -> torch.Tensor:  # fmt: skip
    """The split kernel (and the merge where there are splits) writing `out` (B, Hkv, G, D);
    `peel` (the fused kernel's only): its first tile loaded before the prologue."""
    b, h, g, d = out.shape
    length = k_BHLD.shape[2]
    assert k_BHLD.stride(3) == 1 and k_BHLD.stride(2) == d and v_BHLD.stride(2) == d
    assert supports(d), "head_dim must be a power of two >= 16"
    splits = -(-length // split) if split else 1
    split_kernel, merge_kernel = _kernels
    if splits == 1:  # one program per (sequence, KV head) writes the output: no partials
        part, lse = out[:, :, None], out.new_empty((1, 1, 1, 1), dtype=torch.float32)
    else:
        part = torch.empty((b, h, splits, g, d), dtype=torch.float32, device=out.device)
        lse = torch.empty((b, h, splits, g), dtype=torch.float32, device=out.device)
    qw, kw, cos, sin, sqs, scb, is_fused, s, koff, voff, eps = fused
    split_kernel[(b, h, splits)](
        q, k_BHLD, v_BHLD, valid_BL, col_1, part, lse,
        sqb, sqh, k_BHLD.stride(0), k_BHLD.stride(1), v_BHLD.stride(0),
        v_BHLD.stride(1), valid_BL.stride(0), part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2), length, qw, kw, cos, sin, sqs, scb,
        G=g, GP=pow2(g, 16), D=d, SCALE=d**-0.5, SPLIT=split if splits > 1 else span(length),
        BLOCK=BLOCK, V_FIRST=V_FIRST, DIRECT=splits == 1,
        FUSED=is_fused, S=s, KOFF=koff,
        VOFF=voff, EPS=eps, PEEL=peel, PIPELINED=_pipelined,
        # an fp32 cache gets fp32 products (tl.dot takes fp32 as TF32 by default on a GPU)
        PRECISION="ieee" if k_BHLD.dtype == torch.float32 else "tf32",
        num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
    if splits > 1:
        merge_kernel[(b, h)](
            part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
            lse.stride(1), lse.stride(2), out.stride(0), out.stride(1),
            S=splits, SP=pow2(splits), G=g, GP=pow2(g), D=d,
        )  # fmt: skip
    return out


@decode_attention.register_fake
def _(q_BHGD, k_BHLD, v_BHLD, valid_BL, col_1):
    return torch.empty_like(q_BHGD)


@torch.library.custom_op("hsdp_grpo::decode_attention_qkv", mutates_args=("k_BHLD", "v_BHLD"))
def decode_attention_qkv(qkv_SBN: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                         cos_BD: torch.Tensor, sin_BD: torch.Tensor, k_BHLD: torch.Tensor,
                         v_BHLD: torch.Tensor, valid_BL: torch.Tensor, col_1: torch.Tensor,
                         heads: int, eps: float) -> torch.Tensor:  # fmt: skip
    """A Qwen3 decode step's attention from its q/k/v projection: the q and k heads RMS-normed
    (weights q_norm, k_norm) and rotated (cos, sin of each row's position, (B, D)), this step's
    K/V written into cache column col, then `decode_attention` over columns 0 .. col. What the
    unfused layer does in three elementwise kernels before the attention is this kernel's
    prologue.

    qkv: (S, B, (heads + 2 Hkv) D), the projection as S partial sums over K (fp32 where S > 1,
    trainer/decode_matmul.py), or (1, B, N) in the model's dtype. Returns (B, Hkv, G, D) in the
    cache's dtype. `load()` must have run first."""
    b, h = qkv_SBN.shape[1], k_BHLD.shape[1]
    split, peel = settings(b * h, k_BHLD.device)
    return launch_qkv(qkv_SBN, q_norm, k_norm, cos_BD, sin_BD, k_BHLD, v_BHLD, valid_BL, col_1,
                      heads, eps, split, peel)  # fmt: skip


@decode_attention_qkv.register_fake
def _(qkv_SBN, q_norm, k_norm, cos_BD, sin_BD, k_BHLD, v_BHLD, valid_BL, col_1, heads, eps):
    b, (h, d) = qkv_SBN.shape[1], (k_BHLD.shape[1], k_BHLD.shape[3])
    return k_BHLD.new_empty((b, h, heads // h, d))
