"""Target log-probs and entropies of softmax(logits / T) in one read of the logits (Triton).

The update needs, per token, log p(target) and the entropy of softmax(z), z = logits / T, over
a 151,936-token vocabulary. Written in torch that is several fp32 passes over a copy of the
logits (convert, log-sum-exp, softmax, product, sum), recomputed in backward. Here:

- forward: one program per token row streams its logits once (in their own dtype, bf16 on a
  GPU), keeping per lane an online max m, sum of exp(z - m) and sum of exp(z - m) z; it writes
  three floats per row: log p(target) = z_t - lse, entropy H = lse - E_p[z], and lse;
- backward: d log p / dz = onehot(t) - p and dH / dz = -p (z - E_p[z]), with p = exp(z - lse)
  recomputed from the saved logits; one program per (row, block of the vocabulary) reads the
  logits once and writes the gradient once, in their dtype, into the logits' own storage: the
  logits are dead after this (the lm_head's backward needs its input and weight, not its output),
  so no second [tokens, V] buffer exists.

Memory: no fp32 [tokens, V] tensor in either direction, and the gradient takes the logits' place.
Traffic: 2 bytes per logit forward, 4 backward (bf16), against about 40 for the chunked torch path.
The torch path (`trainer/grpo.py: token_logprobs`) stays the reference and the CPU path.
Triton is imported by `load()`, not by importing this module (CPU runs never need it).
"""

from __future__ import annotations

from typing import Any

import torch

FWD_BLOCK = 2048  # vocabulary lanes per program iteration (forward: one program per row)
BWD_BLOCK = 4096  # vocabulary entries per program (backward)

_kernels: Any = None


def load():
    """Build the kernels (imports Triton)."""
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def forward_kernel(
        X, Tgt, LogP, Ent, LSE, stride, inv_temp, V: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        base = X + row * stride
        lanes = tl.arange(0, BLOCK)
        # per lane: running max (finite start so that empty lanes never make exp(-inf + inf)),
        # sum of exp(z - m), and sum of exp(z - m) * z
        m = tl.full((BLOCK,), -1.0e30, tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        t = tl.zeros((BLOCK,), tl.float32)
        for off in range(0, V, BLOCK):
            cols = off + lanes
            ok = cols < V
            z = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_temp
            m_new = tl.maximum(m, z)
            alpha = tl.exp(m - m_new)
            e = tl.exp(z - m_new)  # 0 on masked lanes
            s = s * alpha + e
            t = t * alpha + e * tl.where(ok, z, 0.0)  # 0 x -inf would be NaN
            m = m_new
        top = tl.max(m, 0)
        scale = tl.exp(m - top)
        total = tl.sum(s * scale, 0)
        lse = top + tl.log(total)
        mean_z = tl.sum(t * scale, 0) / total
        target = tl.load(Tgt + row)
        z_t = tl.load(base + target).to(tl.float32) * inv_temp
        tl.store(LogP + row, z_t - lse)
        tl.store(Ent + row, lse - mean_z)
        tl.store(LSE + row, lse)

    @triton.jit
    def backward_kernel(X, G, Tgt, LSE, Ent, GLogP, GEnt, stride_x, stride_g, V, inv_temp,
                        BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32) * inv_temp
        lse = tl.load(LSE + row)
        mean_z = lse - tl.load(Ent + row)
        g_logp = tl.load(GLogP + row)
        g_ent = tl.load(GEnt + row)
        p = tl.exp(z - lse)
        grad = -g_logp * p - g_ent * p * (z - mean_z)
        grad = tl.where(cols == tl.load(Tgt + row), grad + g_logp, grad) * inv_temp
        tl.store(G + row * stride_g + cols, grad.to(G.dtype.element_ty), mask=ok)

    _kernels = (forward_kernel, backward_kernel)
    return _kernels


def _forward(logits_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float):
    forward_kernel, _ = load()
    c, v = logits_CV.shape
    out = torch.empty((3, c), dtype=torch.float32, device=logits_CV.device)
    if c:
        forward_kernel[(c,)](logits_CV, targets_C, out[0], out[1], out[2], logits_CV.stride(0),
                             1.0 / temperature, V=v, BLOCK=FWD_BLOCK)  # fmt: skip
    return out[0], out[1], out[2]


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_CV, targets_C, temperature, grad_in_place):
        logp, entropy, lse = _forward(logits_CV, targets_C, temperature)
        ctx.save_for_backward(logits_CV, targets_C, lse, entropy)
        ctx.temperature, ctx.grad_in_place = temperature, grad_in_place
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        _, backward_kernel = load()
        logits, targets, lse, entropy = ctx.saved_tensors
        c, v = logits.shape
        grad = logits if ctx.grad_in_place else torch.empty_like(logits)
        if c:
            backward_kernel[(c, -(-v // BWD_BLOCK))](
                logits, grad, targets, lse, entropy, g_logp.float().contiguous(),
                g_entropy.float().contiguous(), logits.stride(0), grad.stride(0), v,
                1.0 / ctx.temperature, BLOCK=BWD_BLOCK,
            )  # fmt: skip
        return grad, None, None, None


def logprob_entropy(
    logits_CV: torch.Tensor,
    targets_C: torch.Tensor,
    temperature: float,
    grad_in_place: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy of softmax(logits / temperature), fp32, one row per token.

    logits: (C, V) with unit stride along V; targets: (C,) long. With `grad_in_place` the
    backward writes d loss / d logits over the logits' storage: the caller must not read the
    logits after backward (the trainer never does)."""
    assert logits_CV.stride(-1) == 1, "logits must be contiguous along the vocabulary"
    if logits_CV.requires_grad and torch.is_grad_enabled():
        out = _LogprobEntropy.apply(logits_CV, targets_C.contiguous(), temperature, grad_in_place)
        return out[0], out[1]
    logp, entropy, _ = _forward(logits_CV.detach(), targets_C.contiguous(), temperature)
    return logp, entropy
