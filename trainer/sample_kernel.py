"""Sampling without a cut (top-k 0, top-p 1) in two Triton kernels: the engine's `sample_full`
(trainer/engine.py) without torch.compile.

The same draw as `sample_full`, by inverting the CDF of softmax(logits / T) with one uniform per
row, over chunks of CHUNK columns:

- `chunk_kernel`, one program per (row, chunk): the chunk's max, its exp-sum under that max and
  its first argmax. It reads the bf16 logits once; nothing [B, V] is written.
- `pick_kernel`, one program per row: the chunks' weights (exp-sums under the row's max), their
  cumulative sum, the chunk holding u x total, then a cumulative sum over that chunk alone (one
  more read of CHUNK columns) for the column; greedy rows take the first maximum instead. The
  token's log-prob is z_token - logsumexp(z), z = logits / T.

Why not Inductor: compiling `sample_full` (its chunked reductions, a gather and two cumulative
sums) took 4.4 s of a first launch on the H200 and 0.2 s from the cache; these two kernels are
plain Triton, compiled once per machine into Triton's cache. They launch outside torch.compile,
so the decode step's CUDA graph captures them as they are.

Triton is imported by `load()`, not by importing this module (CPU runs never need it).
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK = 2048  # columns per chunk (a power of two): 75 chunks for Qwen3's 151,936
WARPS = 4

_kernels: Any = None  # (chunk_kernel, pick_kernel), once load() has built them


def load():
    """Build the kernels (imports Triton)."""
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_kernel(Logits, M, S, A, stride_row, V, C, temperature, CHUNK: tl.constexpr):
        row, c = tl.program_id(0), tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(Logits + row.to(tl.int64) * stride_row + cols, mask=cols < V,
                    other=float("-inf"))  # fmt: skip
        z = tl.math.div_rn(x.to(tl.float32), temperature)  # as torch divides: IEEE, rounded
        m = tl.max(z, 0)
        shift = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf only: mass 0, no NaN
        at = row * C + c
        tl.store(M + at, m)
        tl.store(S + at, tl.sum(tl.exp(z - shift), 0))
        tl.store(A + at, c * CHUNK + tl.argmax(z, 0, tie_break_left=True))

    @triton.jit
    def pick_kernel(Logits, M, S, A, U, Greedy, Token, Logp, stride_row, V, C, temperature,
                    CP: tl.constexpr, CHUNK: tl.constexpr, GREEDY: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        j = tl.arange(0, CP)
        m = tl.load(M + row * C + j, mask=j < C, other=float("-inf"))
        s = tl.load(S + row * C + j, mask=j < C, other=0.0)
        mx = tl.max(m, 0)
        w = s * tl.exp(m - mx)  # each chunk's exp-sum / e^mx
        total = tl.sum(w, 0)
        cum = tl.cumsum(w, 0)
        u = tl.load(U + row) * total
        # the first chunk whose cumulative mass passes u; where rounding leaves u at or past the
        # row's total, the last chunk with mass (the first place the non-decreasing sums peak)
        pick = tl.minimum(
            tl.sum((cum <= u).to(tl.int32), 0), tl.argmax(cum, 0, tie_break_left=True)
        )
        # u's place inside that chunk, at least 0: the compiler may round the cumulative sum's
        # first term apart from w itself, and a negative r would land on a leading token of no mass
        r = tl.maximum(u - tl.sum(tl.where(j == pick, cum - w, 0.0), 0), 0.0)
        k = tl.arange(0, CHUNK)
        base = Logits + row.to(tl.int64) * stride_row
        cols = pick * CHUNK + k
        x = tl.load(base + cols, mask=cols < V, other=float("-inf"))
        cp = tl.cumsum(tl.exp(tl.math.div_rn(x.to(tl.float32), temperature) - mx), 0)
        at = tl.minimum(tl.sum((cp <= r).to(tl.int32), 0), tl.argmax(cp, 0, tie_break_left=True))
        token = pick * CHUNK + at
        if GREEDY:  # the first maximum: the first chunk holding it, its first column
            best = tl.argmax(m, 0, tie_break_left=True)
            token = tl.where(tl.load(Greedy + row) != 0, tl.load(A + row * C + best), token)
        z = tl.math.div_rn(tl.load(base + token).to(tl.float32), temperature)
        tl.store(Token + row, token.to(tl.int64))
        tl.store(Logp + row, z - (mx + tl.log(total)))

    _kernels = (chunk_kernel, pick_kernel)
    return _kernels


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def sample_full(
    logits_BV: torch.Tensor,
    temperature: float,
    greedy_B: torch.Tensor | None = None,
    u_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A draw from softmax(logits / T) per row and its log-prob, as `engine.sample_full`; rows
    where `greedy_B` is set take the first argmax. `u_B`: the uniforms in [0, 1) to invert
    (default: drawn here, on the device's generator, which a CUDA graph capture records).
    `load()` must have run first."""
    b, v = logits_BV.shape
    logits = logits_BV if logits_BV.stride(-1) == 1 else logits_BV.contiguous()
    c = -(-v // CHUNK)
    dev = logits.device
    m = torch.empty((b, c), dtype=torch.float32, device=dev)
    s = torch.empty((b, c), dtype=torch.float32, device=dev)
    a = torch.empty((b, c), dtype=torch.int32, device=dev)
    u = torch.rand(b, device=dev) if u_B is None else u_B.float().contiguous()
    token = torch.empty(b, dtype=torch.long, device=dev)
    logp = torch.empty(b, dtype=torch.float32, device=dev)
    chunk_kernel, pick_kernel = _kernels
    t = float(temperature)
    chunk_kernel[(b, c)](logits, m, s, a, logits.stride(0), v, c, t, CHUNK=CHUNK, num_warps=WARPS)
    greedy = u if greedy_B is None else greedy_B  # unread without GREEDY
    pick_kernel[(b,)](logits, m, s, a, u, greedy, token, logp, logits.stride(0), v, c, t,
                      CP=max(16, pow2(c)), CHUNK=CHUNK, GREEDY=greedy_B is not None, num_warps=WARPS)  # fmt: skip
    return token, logp
