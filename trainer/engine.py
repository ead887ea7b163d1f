"""The GPU rollout engine: static KV cache, one-pass prefill, a captured decode step.

Decoding is bound by reading the weights and the KV cache once per token step. This engine
keeps that the only work, in four pieces, one job each:

- `FusedQwen3`: the Qwen3 forward over a static KV cache, written against the modules' own
  weights (the same tensors the trainer refreshes), with q/k/v and gate/up each one matmul: the
  modules' own parameters become row views of one fused weight, so the refresh (which copies
  into those parameters) fills the fused weight with no extra memory or copy. It owns the cache,
  allocated at its full size (batch x (prompt + max_new_tokens), rounded up to 64), which
  `free_cache` gives back between rollouts (the next call makes it again at the same shape).
- `sample`: temperature / top-k / top-p sampling (or greedy, per row) and the sampled token's
  log-prob under the distribution it was drawn from; without a cut, `sample_full`: one pass
  over the logits in vocabulary chunks and one uniform draw per row (inverting the CDF).
  On GPUs `sample_full` is two Triton kernels (trainer/sample_kernel.py, `sampler="triton"`),
  not compiled by torch.compile.
- `CapturedSteps`: each decode step (all layers, the lm_head, sampling), its decoder layer and
  sampler compiled by torch.compile (one compile serves all layers), captured once as a CUDA
  graph per (span, cache length), then replayed every token with no Python or launch overhead.
- `StaticCacheEngine.generate`: left-pad, prefill (the same decoder layer, compiled once with
  dynamic batch and width), replay decode steps, trim at EOS.

Decode attention is either SDPA over a span of the cache (`spans`: the first 1/n, 2/n, ... of
it, each span its own captured step) or a Triton split-K kernel (trainer/decode_attention.py)
that reads exactly the filled columns in one captured step.

Layout: prompts are left-padded to a common width W, so every sequence writes decode token
t into cache column W + t; a per-sequence key mask hides the padding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# cache lengths and spans end on a multiple of CACHE_ALIGN
from launcher.memory import CACHE_ALIGN, cache_length
from trainer import decode_attention as triton_attention
from trainer import decode_matmul as triton_matmul
from trainer import sample_kernel
from trainer.model import CausalLM
from trainer.rollout import (
    Rollout,
    SamplingParams,
    copy_sharded_weights,
    inference_copy,
    left_pad,
    trim_at_eos,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def fuse_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (sum of out, in) weight (and bias) for linears on the same input; each keeps a view."""
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias


def uncut(params: SamplingParams) -> bool:
    """No top-k or top-p cut: the whole softmax is sampled (`sample_full`)."""
    return params.top_k == 0 and params.top_p >= 1.0


def sample(
    logits_BV: torch.Tensor,
    params: SamplingParams,
    greedy_B: torch.Tensor | None = None,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw from softmax(logits / T) cut to the top-k tokens and the top-p nucleus and
    renormalised; return the token and its log-prob under that distribution, the one it was
    really drawn from. Rows where `greedy_B` is set take the argmax instead. `kernel`: without a
    cut, the Triton kernels of trainer/sample_kernel.py (`load()` first) instead of
    `sample_full`."""
    if uncut(params):
        if kernel:
            return sample_kernel.sample_full(logits_BV, params.temperature, greedy_B)
        return sample_full(logits_BV, params.temperature, greedy_B)
    z = logits_BV.float() / params.temperature
    if params.top_k > 0:
        kth = z.topk(min(params.top_k, z.shape[-1]), dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, -torch.inf)
    if params.top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)
        sorted_p = sorted_z.softmax(-1)
        drop = sorted_p.cumsum(-1) - sorted_p > params.top_p  # keep the first token always
        z = z.scatter(-1, order, sorted_z.masked_fill(drop, -torch.inf))
    logp = F.log_softmax(z, dim=-1)
    # exponential race: argmax p / E with E ~ Exp(1) is a draw from p (one pass, no multinomial)
    token = (logp.exp() / torch.empty_like(logp).exponential_()).argmax(-1)
    if greedy_B is not None:
        token = torch.where(greedy_B, z.argmax(-1), token)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def vocab_chunks(vocab: int, target: int = 1024) -> int:
    """Columns per chunk for `sample_full`: the smallest divisor of `vocab` from `target` up
    (151,936 = 128 x 1,187: chunks of 1,187), or `vocab` itself when none is at most
    8 x target (one chunk: correct, just one long reduction per row)."""
    for k in range(target, 8 * target + 1):
        if vocab % k == 0:
            return k
    return vocab


def first_past(cum_BN: torch.Tensor, u_B1: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds u; where rounding leaves u at or
    past the row's total, the last index with mass (the argmax of a non-decreasing row is the
    first place it reaches its end), never one of probability zero."""
    return torch.minimum((cum_BN <= u_B1).sum(-1, keepdim=True), cum_BN.argmax(-1, keepdim=True))


def sample_full(
    logits_BV: torch.Tensor, temperature: float, greedy_B: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` without a top-k or top-p cut, by inverting the CDF of softmax(logits / T) with
    one uniform draw per row. The vocabulary is cut into C chunks of K columns: one reduction
    pass gives each chunk's max and exp-sum (B x C rows of K: parallel work at any batch); the
    uniform picks a chunk from the C sums, then a column by a cumulative sum over
    that chunk alone. So the logits are read about once, nothing [B, V] is written (the old
    exponential race drew V random numbers per row, with an fp32 log-softmax copy, three
    passes), and the token's log-prob is z_token - logsumexp(z)."""
    b, v = logits_BV.shape
    k = vocab_chunks(v)
    z_BV = logits_BV.float() / temperature
    z_BCK = z_BV.reshape(b, v // k, k)

    def chunk(j_B1: torch.Tensor) -> torch.Tensor:  # (B, K): each row's chunk j
        return z_BCK.gather(1, j_B1[..., None].expand(b, 1, k)).squeeze(1)

    m_BC = z_BCK.amax(-1)
    mx_B1 = m_BC.amax(-1, keepdim=True)
    shift_BC = m_BC.masked_fill(m_BC == -torch.inf, 0.0)  # a chunk of -inf only: mass 0, no NaN
    w_BC = (z_BCK - shift_BC[..., None]).exp().sum(-1) * (m_BC - mx_B1).exp()  # exp-sum / e^mx
    total_B = w_BC.sum(-1)
    u_B1 = (torch.rand(b, device=logits_BV.device) * total_B)[:, None]
    cum_BC = w_BC.cumsum(-1)
    j_B1 = first_past(cum_BC, u_B1)
    # u's place inside chunk j, at least 0 (rounding must not land it on a leading token of no mass)
    r_B1 = (u_B1 - (cum_BC.gather(-1, j_B1) - w_BC.gather(-1, j_B1))).clamp(min=0.0)
    token_B = (j_B1 * k + first_past((chunk(j_B1) - mx_B1).exp().cumsum(-1), r_B1)).squeeze(-1)
    if greedy_B is not None:  # the first maximum: the first chunk holding it, its first column
        best_B1 = m_BC.argmax(-1, keepdim=True)
        at_B1 = chunk(best_B1).argmax(-1, keepdim=True)
        token_B = torch.where(greedy_B, (best_B1 * k + at_B1).squeeze(-1), token_B)
    lse_B = mx_B1.squeeze(-1) + total_B.log()
    return token_B, z_BV.gather(-1, token_B[:, None]).squeeze(-1) - lse_B


def prefill_mask(valid_BW: torch.Tensor) -> torch.Tensor:
    """(B, 1, W, W): which prompt columns each prompt position attends to: causal within the
    prompt, padded keys hidden; each position sees itself (a padded row's output is unused, and
    a row of all False would be NaN)."""
    w = valid_BW.shape[-1]
    cols = torch.arange(w, device=valid_BW.device)
    causal = cols[None, :] <= cols[:, None]
    return (valid_BW[:, None, None, :] & causal) | torch.eye(
        w, dtype=torch.bool, device=valid_BW.device
    )


def prefill_bias(valid_BW: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`prefill_mask` as the additive bias SDPA adds to the scores (0 seen, -inf hidden), built
    once per prefill and broadcast over every head of every layer. (A boolean mask inside the
    compiled layer was turned into this bias, repeated over query heads, in each of the 36
    layers: 5.95 ms per layer at 512 x 128 on the H200, 2026-12-05 profile.)"""
    mask = prefill_mask(valid_BW)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -torch.inf)


def layer_weights(layer: CausalLM) -> tuple:
    """A decoder layer's tensors in `FusedQwen3.decoder_layer`'s order, q/k/v and gate/up fused."""
    a, mlp = layer.self_attn, layer.mlp
    qkv_w, qkv_b = fuse_rows([a.q_proj, a.k_proj, a.v_proj])
    gate_up_w, _ = fuse_rows([mlp.gate_proj, mlp.up_proj])
    return (qkv_w, qkv_b, a.q_norm.weight, a.k_norm.weight, a.o_proj.weight,
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight, gate_up_w,
            mlp.down_proj.weight)  # fmt: skip


class FusedQwen3:
    """The Qwen3 forward over its own static KV cache (see the module docstring)."""

    def __init__(self, model: CausalLM, dtype: torch.dtype, device: torch.device, attention: str,
                 matmul: str = "torch"):  # fmt: skip
        self.model, self.config, self.dtype, self.device = model, model.config, dtype, device
        self.attention = attention  # decode steps: `sdpa` over a span, or the `triton` kernel
        self.matmul = matmul  # decode steps' projections: cuBLAS (`torch`) or the `triton` kernel
        if matmul == "triton":
            triton_matmul.load()
        # a Python bool, fixed here: SDPA's flag must not become symbolic in the dynamic prefill
        self.grouped = model.config.num_attention_heads != model.config.num_key_value_heads
        if attention == "triton":
            triton_attention.load()
        self.sms = triton_attention.sm_count(device)  # an int for `fuse_for` in the traced step
        self.inv_freq = model.model.rotary_emb.inv_freq.float().to(device)
        # each layer's tensors in `decoder_layer`'s order: the engine's own parameters (the weight
        # refresh writes them in place), q/k/v and gate/up fused
        self.layer_weights = [layer_weights(layer) for layer in model.model.layers]
        self.shape: tuple[int, int] | None = None  # (batch, cache length) the buffers are sized for
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []

    def allocate(self, batch: int, length: int) -> str:
        """Cache and step buffers for `batch` rows of `length` columns. Returns "kept" if the
        current ones serve (same batch, at least as long), "remade" if only a freed cache was made
        again at its old shape (compiled steps stay valid; CUDA graphs read the old addresses and
        must be recaptured), "new" if every buffer changed size."""
        if self.shape is not None and self.shape[0] == batch and self.shape[1] >= length:
            if self.k_cache:
                return "kept"
            self.make_cache(*self.shape)
            return "remade"
        dev = self.device
        self.make_cache(batch, length)
        self.key_valid = torch.zeros((batch, length), dtype=torch.bool, device=dev)
        # the decode step's inputs and outputs, static so that a captured graph can read and write them
        self.tok = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(batch, dtype=torch.long, device=dev)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)
        self.logp = torch.zeros(batch, dtype=torch.float32, device=dev)
        self.greedy = torch.zeros(batch, dtype=torch.bool, device=dev)  # rows that take the argmax
        self.shape = (batch, length)
        return "new"

    def make_cache(self, batch: int, length: int) -> None:
        cfg = self.config
        shape = (batch, cfg.num_key_value_heads, length, cfg.head_dim)
        # zeros, not empty: padded columns are masked, but 0 x NaN from stale bytes would not be
        layers = range(cfg.num_hidden_layers)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers]

    def free_cache(self) -> None:
        """Drop the K/V cache (the engine's largest buffer) until the next `allocate`."""
        self.k_cache, self.v_cache = [], []

    def rope(self, pos_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos_BT[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None], emb.sin().to(self.dtype)[:, None]  # (B, 1, T, d)

    def decoder_layer(self, x, r, cos, sin, cols_T, mask_B1TK, k_cache, v_cache, qkv_w, qkv_b,
                      q_norm, k_norm, o_w, norm1, norm2, gate_up_w, down_w) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One decoder layer on tensors alone (no layer index), so that one compiled function
        serves all L layers: a decode step compiles one layer, not L of them.

        The residual stream before the layer is `x + r`, `r` the previous layer's MLP output (zeros
        before the first layer); returns the same pair for the next. Adding `r` here, not at the
        end of the previous layer, puts the add into the kernel of this layer's input norm: a
        layer's last elementwise kernel (the residual add: 1.3 us of every layer step at batch
        64 on the H200, 2026-12-05 profile) is gone, since the compiled function ends at a
        matmul."""
        cfg, eps = self.config, self.config.rms_norm_eps
        b, t, _ = x.shape
        hd, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        # a decode step's matmuls by the skinny split-K kernel where it is chosen (the prefill's,
        # of B x T rows, by cuBLAS): its partials' sum fuses into the elementwise op that follows
        skinny = t == 1 and self.matmul == "triton" and b <= triton_matmul.MAX_ROWS
        linear = triton_matmul.linear if skinny else F.linear
        x = x + r
        h = rms_norm(x, norm1, eps)
        if (
            t == 1
            and self.attention == "triton"
            and triton_attention.fuse_for(b * nkv, self.sms, biased=qkv_b is not None)
        ):
            # a decode step of few programs per SM: the q/k norm, RoPE and the K/V cache write are
            # the attention kernel's prologue, which reads the projection's partial sums (no
            # kernels between); with many, the unfused path below is faster (`fuse_for`)
            qkv = (triton_matmul.decode_linear(h.view(b, -1), qkv_w) if skinny
                   else F.linear(h, qkv_w).view(1, b, -1))  # fmt: skip
            o = triton_attention.decode_attention_qkv(
                qkv, q_norm, k_norm, cos.view(b, hd), sin.view(b, hd), k_cache, v_cache,
                self.key_valid, cols_T, nq, eps,
            ).view(b, t, nq * hd)  # fmt: skip
            return self.mlp(x, o, o_w, norm2, gate_up_w, down_w, linear)
        q, k, v = linear(h, qkv_w, qkv_b).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q = rms_norm(q.view(b, t, nq, hd), q_norm, eps).transpose(1, 2)
        k = rms_norm(k.view(b, t, nkv, hd), k_norm, eps).transpose(1, 2)
        v = v.view(b, t, nkv, hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_cache.index_copy_(2, cols_T, k)
        v_cache.index_copy_(2, cols_T, v)
        g = nq // nkv
        if t > 1:  # the prefill (columns 0 .. T-1): the prompt attends to its own K/V
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask_B1TK, enable_gqa=self.grouped
            )
        # a decode step, grouped-query attention without repeating K/V: the G query heads that
        # share a KV head become G query rows of it, so each K/V byte is read once
        elif self.attention == "triton":  # reads columns 0 .. col, whatever the span
            o = triton_attention.decode_attention(
                q.reshape(b, nkv, g, hd), k_cache, v_cache, self.key_valid, cols_T
            ).view(b, nq, t, hd)
        else:
            span = mask_B1TK.shape[-1]  # attend over the first `span` cache columns
            o = F.scaled_dot_product_attention(
                q.reshape(b, nkv, g, hd), k_cache[:, :, :span], v_cache[:, :, :span],
                attn_mask=mask_B1TK.repeat(1, 1, g, 1) if g > 1 else mask_B1TK,
            ).view(b, nq, t, hd)  # fmt: skip
        return self.mlp(x, o.transpose(1, 2).reshape(b, t, nq * hd), o_w, norm2, gate_up_w, down_w,
                        linear)  # fmt: skip

    def mlp(self, x, o, o_w, norm2, gate_up_w, down_w, linear) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its attention: the output projection's residual added, then the MLP,
        whose output is returned beside the stream, not yet added (see `decoder_layer`)."""
        x = x + linear(o, o_w)
        gate, up = linear(rms_norm(x, norm2, self.config.rms_norm_eps), gate_up_w).chunk(2, dim=-1)
        return x, linear(F.silu(gate) * up, down_w)

    def prefill_layer(self, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """`decoder_layer` under its own name, so that the prefill's compile (dynamic over the
        batch and the prompt width: one compile for every step's prompts) keeps its cache entries
        apart from the decode step's static ones (torch.compile counts recompiles per function)."""
        return self.decoder_layer(*args)

    def forward(self, ids_BT: torch.Tensor, pos_BT: torch.Tensor, cols_T: torch.Tensor,
                mask_B1TK: torch.Tensor, layer_fn: Callable | None = None) -> torch.Tensor:  # fmt: skip
        """Logits of the last position, writing K/V of positions `cols_T` into the cache.

        `mask_B1TK`: a decode step's (T 1), which of the first K cache columns the query sees
        (only those are read); the prefill's (T > 1, writing columns 0 .. T-1), `prefill_bias`.
        `layer_fn`: `decoder_layer`, or its compiled form (the decode step's)."""
        m, layer_fn = self.model.model, layer_fn or self.decoder_layer
        cos, sin = self.rope(pos_BT)
        x = m.embed_tokens(ids_BT)
        r = torch.zeros_like(x)  # the residual stream is x + r (`decoder_layer`)
        for i in range(len(m.layers)):
            x, r = layer_fn(x, r, cos, sin, cols_T, mask_B1TK, self.k_cache[i], self.v_cache[i],
                            *self.layer_weights[i])  # fmt: skip
        last = x[:, -1] + r[:, -1]
        return self.model.lm_head(rms_norm(last, m.norm.weight, self.config.rms_norm_eps))

    def decode_step(self, span: int, params: SamplingParams, layer_fn: Callable | None = None,
                    head_fn: Callable | None = None) -> None:  # fmt: skip
        """Read self.tok at self.pos into cache column self.col; leave the next token and its
        log-prob. `layer_fn` / `head_fn`: compiled `decoder_layer` / `sample`, or None (eager)."""
        self.key_valid.index_fill_(1, self.col, True)
        mask = self.key_valid[:, None, None, :span]
        logits = self.forward(self.tok[:, None], self.pos[:, None], self.col, mask, layer_fn)
        token, logp = (head_fn or sample)(logits, params, self.greedy)
        self.tok.copy_(token)
        self.logp.copy_(logp)
        self.pos.add_(1)


class CapturedSteps:
    """Decode steps of a `FusedQwen3`, one per attention span: their layer and sampling compiled
    (`compiled`), each step captured once as a CUDA graph for the current buffers (all graphs
    share one memory pool, and run one at a time), replayed every token. `reset` forgets them
    when the buffers or the sampling change."""

    def __init__(self, net: FusedQwen3, compile: bool, cuda_graph: bool, kernel_sampler: bool):
        self.net, self.compile, self.cuda_graph = net, compile, cuda_graph
        self.kernel_sampler = kernel_sampler  # sampling without a cut by the Triton kernels
        self.reset(None)

    def reset(self, params: SamplingParams | None) -> None:
        self.params = params  # temperature and top-p are baked into the compiled steps
        self.steps: dict[int, Callable[[], None]] = {}
        self.layer_fn: Callable | None = None
        self.head_fn: Callable | None = None
        self.forget_graphs()

    def compiled(self) -> tuple[Callable | None, Callable | None]:
        """The decode step's two compiled parts: one decoder layer (called L times with each
        layer's tensors: one compile for all layers, once per span's width) and the lm_head's
        sampling (or, without a cut and with `kernel_sampler`, the Triton sampler, uncompiled).
        The CUDA graph then captures all L layers' kernels; what compiling the whole step would
        add is fusion across layer boundaries, one elementwise pass per layer, for L times the
        compile time (about a minute for Qwen3-4B)."""
        if self.compile and self.layer_fn is None:
            self.layer_fn = torch.compile(self.net.decoder_layer, fullgraph=True, dynamic=False)
        if self.head_fn is None:
            assert self.params is not None, "reset(params) first"
            if self.kernel_sampler and uncut(self.params):
                self.head_fn = functools.partial(sample, kernel=True)
            elif self.compile:
                self.head_fn = torch.compile(sample, fullgraph=True, dynamic=False)
        return self.layer_fn, self.head_fn

    def forget_graphs(self) -> None:
        """Drop the captured graphs (and their memory pool), keep the compiled steps: after the
        cache is made again at the same shape, the next replay of each span recaptures it (a
        warm-up and a capture, no compile: the steps' guards check shapes, not addresses)."""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None

    def replay(self, span: int) -> None:
        """One decode step over `span` cache columns."""
        if span not in self.steps:
            params = self.params
            assert params is not None, "reset(params) before the first replay"
            layer_fn, head_fn = self.compiled()

            def step() -> None:
                self.net.decode_step(span, params, layer_fn, head_fn)

            self.steps[span] = step
        if not self.cuda_graph:
            self.steps[span]()
            return
        if span not in self.graphs:  # warm up (compiles), then capture once for these buffers
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._snapshot_step(span)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.steps[span]()
            self.graphs[span], self.pool = graph, self.pool or graph.pool()
        self.graphs[span].replay()

    def _snapshot_step(self, span: int) -> None:
        """A warm-up step that leaves every buffer as it found it."""
        n = self.net
        buffers = (n.tok, n.pos, n.logp, n.key_valid)
        saved = [t.clone() for t in buffers]
        self.steps[span]()
        for t, s in zip(buffers, saved):
            t.copy_(s)


# The prefill layer's arguments whose sizes vary between calls, and which of their dims do: the
# batch, the prompt width and the cache length (`FusedQwen3.decoder_layer`'s first 8 arguments).
PREFILL_DYNAMIC_DIMS = (
    (0, 1),  # x: B, T, hidden
    (0, 1),  # r
    (0, 2),  # cos: B, 1, T, head_dim
    (0, 2),  # sin
    (0,),  # cols_T
    (0, 2, 3),  # mask: B, 1, T, T
    (0, 2),  # k_cache: B, kv heads, cache length, head_dim
    (0, 2),  # v_cache
)


def compile_prefill(layer_fn: Callable) -> Callable:
    """`layer_fn` compiled once for every batch, prompt width and cache length: those dims are
    marked dynamic before each call, and nothing else is. (`dynamic=True` also made every int
    of the model's config and every weight's dims symbolic: 77 shape guards where these need
    10; its trace took 1.8 s of CPU time on the tiny model against 1.0 s for this one, and its
    solver equated the batch with the KV-head count where they happened to be equal, so a
    second batch size recompiled it.)"""
    import torch._dynamo

    compiled = torch.compile(layer_fn, fullgraph=True)

    def call(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for t, dims in zip(args, PREFILL_DYNAMIC_DIMS):
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
        return compiled(*args)

    return call


class StaticCacheEngine:
    """The rollout engine on GPUs: same interface and weights as HFRolloutEngine, generation by
    the static-cache loop."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device, compile: bool = True,
                 cuda_graph: bool | None = None, spans: int = 1, attention: str = "sdpa",
                 sampler: str = "torch", matmul: str = "torch"):  # fmt: skip
        self.model = inference_copy(config, dtype, device)
        self.device, self.spans = device, spans
        self.net = FusedQwen3(self.model, dtype, device, attention, matmul)
        cuda_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
        # sampler: "triton" (trainer/sample_kernel.py, where nothing is cut) or "torch"
        self.kernel_sampler = sampler == "triton"
        if self.kernel_sampler:
            sample_kernel.load()
        self.steps = CapturedSteps(self.net, compile, cuda_graph, self.kernel_sampler)
        # the prefill's layer, compiled once for any batch and prompt width (it does not depend
        # on the sampling, so it outlives the decode steps' resets)
        self.prefill_fn = compile_prefill(self.net.prefill_layer) if compile else None
        self.span_align = CACHE_ALIGN

    @property
    def cuda_graph(self) -> bool:
        return self.steps.cuda_graph

    @cuda_graph.setter
    def cuda_graph(self, on: bool) -> None:  # the bench profiles steps run uncaptured
        self.steps.cuda_graph = on

    def load_weights(self, policy: CausalLM) -> None:
        copy_sharded_weights(policy, self.model)

    def free_cache(self) -> None:
        """`rl.free_kv_cache`: give the KV cache's memory back until the next `generate`, which
        makes it again at the same size and recaptures the steps' graphs (milliseconds)."""
        self.net.free_cache()
        self.steps.forget_graphs()

    def span(self, col: int) -> int:
        """Cache columns a step writing column `col` attends over: the first of `spans` fixed
        fractions of the cache (rounded up to `span_align` columns) that holds it. The fractions
        depend only on the cache length, so at most `spans` steps are compiled per buffer size."""
        assert self.net.shape is not None, "allocate before asking for spans"
        length, align = self.net.shape[1], self.span_align
        if self.net.attention == "triton":  # the kernel bounds its reads itself: one step for all
            return length
        for k in range(1, self.spans):
            bound = min(length, -(-k * length // self.spans // align) * align)
            if col < bound:
                return bound
        return length

    def rows_per_call(self) -> int | None:
        """The batch the buffers (and captured steps) are sized for: calls of this many rows
        reuse them, any other count reallocates and recompiles. None before the first call."""
        return None if self.net.shape is None else self.net.shape[0]

    @torch.no_grad()
    def generate(
        self, rows: list[list[int]], params: SamplingParams, greedy: list[bool] | None = None
    ) -> Rollout:
        net, new = self.net, params.max_new_tokens
        ids, valid = left_pad(rows, params.pad_token_id)
        b, width = ids.shape
        # a longer batch reallocates, and every span recompiles once for the new length
        buffers = net.allocate(b, cache_length(width, new, self.span_align))
        if buffers == "new" or self.steps.params != params:
            self.steps.reset(params)
        elif buffers == "remade":
            self.steps.forget_graphs()
        ids, valid = ids.to(self.device), valid.to(self.device)
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        net.key_valid.zero_()
        net.key_valid[:, :width] = valid
        cols = torch.arange(width, device=self.device)
        mask = prefill_bias(net.key_valid[:, :width], net.dtype)
        net.greedy.copy_(torch.tensor(greedy or [False] * b, dtype=torch.bool))
        logits = net.forward(ids, pos, cols, mask, self.prefill_fn)
        token, logp = sample(logits, params, net.greedy, kernel=self.kernel_sampler)
        tokens_BN = torch.empty((b, new), dtype=torch.long, device=self.device)
        logps_BN = torch.empty((b, new), dtype=torch.float32, device=self.device)
        tokens_BN[:, 0], logps_BN[:, 0] = token, logp
        net.tok.copy_(token)
        net.pos.copy_(pos[:, -1] + 1)
        done = token == params.eos_token_id
        steps = 1
        for t in range(1, new):
            net.col.fill_(width + t - 1)
            self.steps.replay(self.span(width + t - 1))
            tokens_BN[:, t], logps_BN[:, t] = net.tok, net.logp
            done |= net.tok == params.eos_token_id
            steps = t + 1
            # this rank's own decision: decoding runs no collective, so ranks may stop apart
            if t % 16 == 0 and bool(done.all()):  # one host sync every 16 tokens
                break
        return trim_at_eos(
            rows, tokens_BN[:, :steps].cpu(), logps_BN[:, :steps].cpu(), params.eos_token_id
        )
