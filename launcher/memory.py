"""The memory a rank allocates in a GRPO step, from the config alone (no torch).

Bytes per rank, N parameters (launcher/counting.py), S the shard group, c the compute dtype's
bytes (bf16 2, fp32 4), T the tokens of one micro-batch, C `rl.logprob_chunk_tokens`, V the
vocabulary, h / I the hidden and MLP widths, Hq / Hkv the query / key-value heads of width d,
L the layers. Three phases; the step's peak is the largest:

    always      fp32 master parameters 4N/S; AdamW's two fp32 moments 8N/S (from the first
                optimizer step on); the reference model 4N/S (fp32 shards) when rl.kl_coef > 0;
                the rollout engine's full weight copy cN (GPU: the static engine; its KV cache
                stays allocated for the whole step unless rl.free_kv_cache)
    rollout     + KV cache  L x 2 x rows x Hkv x d x c x cache length (prompt + new tokens,
                rounded up to 64 columns), rows = this rank's responses per sampling call
                (`rl.rollout_batch` when set)
                + the larger of prefill (one layer's activations over rows x prompt tokens) and
                sampling (rows x V: logits in c, three fp32 copies)
    update      + fp32 gradients 4N/S
                + the root unit (embeddings, lm_head, final norm) gathered in c and its gradient
                + two decoder layers gathered in c (prefetch), one layer's gradient in c and
                  its fp32 reduce-scatter input (all L layers stay gathered when
                  model.reshard_after_forward=false)
                + activations: with checkpointing each layer's input (2h per token) kept for L
                  layers, plus one layer recomputed and its backward (2 x A per token); without,
                  A per token for every layer, where A = 22h + 20 Hq d + 20 Hkv d + 8I bytes
                  (bf16, eager: RMSNorm's fp32 copies, q/k norm and RoPE, SwiGLU's four I-wide
                  tensors); a compiled layer (model.compile) keeps COMPILED_ACTIVATIONS of that,
                  its partitioner recomputing the elementwise work in backward
                + log-probs: the model's logits T x V in c and their gradient, and the chunked
                  fp32 log-softmax working set 4 x 4 C V (z, softmax, their product, the grad);
                  with the Triton kernel (rl.logprob_kernel) the logits alone (the gradient is
                  written over them) and no fp32 working set
    optimizer   + fp32 gradients 4N/S + AdamW's foreach temporaries 4N/S

The micro-batch is `rl.micro_batch_tokens` tokens (rows x longest row, so at most that), or
`rl.micro_batch_responses` rows of prompt + max_new_tokens. This predicts
`torch.cuda.max_memory_allocated`; a GPU also holds the CUDA context, NCCL's buffers and the
caching allocator's free blocks, which `fits` adds as `RESERVE_BYTES` + `SLACK` x the
prediction. docs/benchmarks.md compares predictions with peaks measured on an H200.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launcher.counting import count_params

CACHE_ALIGN = (
    64  # the static engine's cache lengths and spans are multiples of this (it reads it here)
)


def cache_length(width: int, new: int, align: int = CACHE_ALIGN) -> int:
    """KV-cache columns for prompts `width` wide and `new` tokens, rounded up to `align` so that
    prompt widths varying by step reuse the static engine's buffers and compiled steps."""
    return -(-(width + new) // align) * align


def engine_call_rows(rows: int, rollout_batch: int) -> int:
    """Rows per engine call for a rank's `rows` responses: rl.rollout_batch (0: no cap) caps a
    call, so long responses decode in calls of fewer rows (a smaller KV cache), as many calls as
    that takes, of equal size."""
    rows = max(rows, 1)
    calls = -(-rows // (rollout_batch or rows))
    return -(-rows // calls)


# share of the eager count A that a compiled, uncheckpointed layer keeps: fitted on two H200 runs
# (0.453 at 8192 tokens, 0.473 at 2048; docs/benchmarks.md)
COMPILED_ACTIVATIONS = 0.46
RESERVE_BYTES = 2.0e9  # CUDA context, NCCL buffers, cuBLAS workspaces: outside the allocator
SLACK = 0.05  # the caching allocator's free blocks beside the allocated peak


@dataclass
class Shape:
    """What the prediction needs besides the architecture."""

    shard: int  # S
    responses: int  # this rank's responses per step (one sampling call)
    prompt_tokens: int
    new_tokens: int
    micro_batch_tokens: int  # T
    compute_bytes: int = 2
    checkpointing: bool = True
    reshard_after_forward: bool = True
    reference: bool = False
    chunk_tokens: int = 1024
    gpu: bool = True  # the static engine keeps its KV cache; CUDA context and NCCL reserve
    compiled: bool = False  # model.compile
    free_kv: bool = False  # rl.free_kv_cache: the KV cache is gone during update and optimizer
    logprob_kernel: bool = False  # rl.logprob_kernel resolved to triton
    rollout_rows: int = 0  # rl.rollout_batch (0: every response in one call)

    @property
    def call_rows(self) -> int:
        """Responses per rollout-engine call, cut as the trainer cuts them."""
        return engine_call_rows(self.responses, self.rollout_rows)

    @property
    def gathers(self) -> int:
        """All-gathers of each layer per forward/backward: again in backward unless kept."""
        return 2 if self.reshard_after_forward else 1


@dataclass
class Prediction:
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    reserve: float = RESERVE_BYTES

    def total(self, phase: str) -> float:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> float:
        return self.total(self.peak_phase)

    def needs(self) -> float:
        """Device memory a run needs: the allocated peak, allocator slack, context and NCCL."""
        return self.peak * (1 + SLACK) + self.reserve


def layer_activation_bytes(a, c: int) -> float:
    """A: bytes one decoder layer keeps for backward per token (see the module docstring)."""
    h, d, i = a.hidden_size, a.head_dim, a.intermediate_size
    return (
        (22 * h + 20 * a.num_attention_heads * d + 20 * a.num_key_value_heads * d + 8 * i) * c / 2
    )


def predict(a, s: Shape) -> Prediction:
    counts = count_params(a)
    n, c, v, h = counts.total, s.compute_bytes, a.vocab_size, a.hidden_size
    layers = a.num_hidden_layers
    always = {"master parameters (fp32, sharded)": 4 * n / s.shard,
              "AdamW moments (fp32, sharded)": 8 * n / s.shard,
              "rollout engine weights": c * n}  # fmt: skip
    if s.reference:
        always["reference model (fp32, sharded)"] = 4 * n / s.shard
    cache_len = cache_length(s.prompt_tokens, s.new_tokens)
    rows = s.call_rows
    kv = layers * 2 * rows * a.num_key_value_heads * a.head_dim * c * cache_len
    act = layer_activation_bytes(a, c)
    prefill = rows * s.prompt_tokens * act / 2  # no grad: about half is live at once
    sampling = rows * v * (c + 3 * 4)
    kept_kv = {"KV cache": kv} if s.gpu and not s.free_kv else {}  # kept through the step
    rollout = {**always, "KV cache": kv, "prefill or sampling working set": max(prefill, sampling)}
    t = s.micro_batch_tokens
    root = counts.embedding * (1 if a.tie_word_embeddings else 2)
    gathered_layers = layers if not s.reshard_after_forward else 2
    if s.checkpointing:
        activations = layers * 2 * h * t + 2 * act * t
    else:
        activations = layers * act * t * (COMPILED_ACTIVATIONS if s.compiled else 1.0)
    update = {**always, **kept_kv, "gradients (fp32, sharded)": 4 * n / s.shard,
              "root unit gathered + its gradient": 2 * c * root,
              "decoder layers gathered, one layer's gradients": (gathered_layers * c + c + 4) * counts.per_layer,
              "activations" + (" (checkpointed)" if s.checkpointing else ""): activations,
              **({"logits (their gradient in place)": c * t * v} if s.logprob_kernel else
                 {"logits and their gradient": 2 * c * t * v,
                  "log-softmax chunks (fp32)": 16 * min(s.chunk_tokens, t) * v})}  # fmt: skip
    optimizer = {**always, **kept_kv, "gradients (fp32, sharded)": 4 * n / s.shard,
                 "AdamW temporaries (fp32, sharded)": 4 * n / s.shard}  # fmt: skip
    return Prediction(
        {"rollout": rollout, "update": update, "optimizer": optimizer},
        RESERVE_BYTES if s.gpu else 0.0,
    )


def micro_batch_tokens(cfg, prompt_tokens: int) -> int:
    """The largest micro-batch one forward/backward sees, in tokens."""
    r = cfg.rl
    if isinstance(r.micro_batch_tokens, int) and r.micro_batch_tokens > 0:
        return r.micro_batch_tokens
    return r.micro_batch_responses * (prompt_tokens + r.max_new_tokens)


def prompt_tokens(cfg) -> int:
    """synthetic: the digits and '='; gsm8k: `data.plan_prompt_tokens` (the trainer warns when a
    prompt is longer)."""
    d = cfg.data
    return d.num_digits + 1 if d.name == "synthetic" else d.plan_prompt_tokens


def shape_of(cfg, shard: int, world: int, device: str, tokens: int | None = None) -> Shape:
    m, r = cfg.model, cfg.rl
    compute = {"auto": 2 if device == "cuda" else 4, "bf16": 2, "fp32": 4}[m.param_dtype]
    p = prompt_tokens(cfg)
    return Shape(shard=shard, responses=max(1, r.prompts_per_step * r.samples_per_prompt // world),
                 prompt_tokens=p, new_tokens=r.max_new_tokens,
                 micro_batch_tokens=tokens if tokens is not None else micro_batch_tokens(cfg, p),
                 compute_bytes=compute, checkpointing=m.activation_checkpointing,
                 reshard_after_forward=m.reshard_after_forward, reference=r.kl_coef > 0,
                 chunk_tokens=r.logprob_chunk_tokens, gpu=device == "cuda",
                 free_kv=r.free_kv_cache, rollout_rows=r.rollout_batch, compiled=m.compile,
                 logprob_kernel=r.logprob_kernel == "triton" or (r.logprob_kernel == "auto" and device == "cuda"))  # fmt: skip


# ---- parallel=auto and rl.micro_batch_tokens=auto ------------------------------------------

TOKEN_STEP = 256  # auto token budgets are multiples of this
MIN_ROWS = 4  # with both autos, a shard group fits when a budget of this many full rows fits


class NoFit(Exception):
    """Nothing fits; the message is the one line the launcher prints."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def largest_tokens(cfg, arch, shard: int, world: int, device: str, capacity: float) -> int:
    """The largest micro-batch token budget (a multiple of TOKEN_STEP, at most this rank's whole
    batch) whose step fits in `capacity` bytes; 0 when not even one full row fits."""
    base = shape_of(cfg, shard, world, device, tokens=0)
    row = base.prompt_tokens + base.new_tokens
    whole = -(-base.responses * row // TOKEN_STEP) * TOKEN_STEP

    def fits(tokens: int) -> bool:
        return predict(arch, shape_of(cfg, shard, world, device, tokens)).needs() <= capacity

    if not fits(row):
        return 0
    lo, hi = row, whole  # fits(lo); find the largest fitting multiple of TOKEN_STEP <= hi
    if fits(hi):
        return hi
    lo_k, hi_k = max(1, -(-lo // TOKEN_STEP)), hi // TOKEN_STEP
    if not fits(lo_k * TOKEN_STEP):
        return row
    while lo_k < hi_k:
        mid = (lo_k + hi_k + 1) // 2
        lo_k, hi_k = (mid, hi_k) if fits(mid * TOKEN_STEP) else (lo_k, mid - 1)
    return lo_k * TOKEN_STEP


def advice(cfg, arch, shard: int, world: int, device: str, capacity: float) -> str:
    """For a step that does not fit: the knob of its peak phase and a value that fits, if any."""
    from dataclasses import replace

    base = shape_of(cfg, shard, world, device)
    phase = predict(arch, base).peak_phase
    if phase == "rollout":
        # calls of equal size (the trainer splits a rank's responses evenly over its calls)
        sizes = sorted(
            {-(-base.responses // calls) for calls in range(1, base.responses + 1)}, reverse=True
        )
        fits = [
            k for k in sizes if predict(arch, replace(base, rollout_rows=k)).needs() <= capacity
        ]
        if fits:
            return (f"the rollout's KV cache for {base.call_rows} responses per call is the peak: "
                    f"rl.rollout_batch={fits[0]} fits")  # fmt: skip
    elif phase == "update":
        tokens = largest_tokens(cfg, arch, shard, world, device, capacity)
        if tokens:
            return f"the update is the peak: rl.micro_batch_tokens={tokens} fits"
    if shard < cfg.parallel.nproc_per_node:
        return "use a larger shard group (parallel.dp_shard_size, or parallel=auto)"
    return (
        f"shard over more GPUs than {shard} (parallel.dp_shard_size, with as many GPUs per "
        "node: parallel.nproc_per_node)"
    )


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def choose(cfg, arch, device: str, capacity: float) -> list[str]:
    """Resolve parallel=auto (dp_shard_size, dp_replicate_size) and rl.micro_batch_tokens=auto
    in `cfg` for `capacity` bytes per GPU; returns the lines that say what was chosen and why.
    Raises NoFit with one line naming what it needs, what there is and the knobs."""
    p, r = cfg.parallel, cfg.rl
    world = p.nnodes * p.nproc_per_node
    tokens_auto = r.micro_batch_tokens == "auto"
    lines: list[str] = []

    def need(shard: int) -> tuple[float, int | None]:
        """Bytes the step needs at this shard size, and the auto token budget (if auto)."""
        if tokens_auto:
            tokens = largest_tokens(cfg, arch, shard, world, device, capacity)
            shape = shape_of(cfg, shard, world, device)
            floor = min(MIN_ROWS, shape.responses) * (shape.prompt_tokens + shape.new_tokens)
            if tokens >= floor:
                return predict(arch, shape_of(cfg, shard, world, device, tokens)).needs(), tokens
            return predict(arch, shape_of(cfg, shard, world, device, floor)).needs(), None
        return predict(arch, shape_of(cfg, shard, world, device)).needs(), None

    shards = divisors(p.nproc_per_node) if p.auto else [p.dp_shard_size]
    tried: list[tuple[int, float]] = []
    for shard in shards:
        needed, tokens = need(shard)
        if needed <= capacity and (tokens is not None or not tokens_auto):
            if p.auto:
                p.dp_shard_size, p.dp_replicate_size = shard, world // shard
                lines.append(f"parallel=auto -> hsdp_r{world // shard}s{shard}")
                lines.append(f"  s{shard}: needs {gb(needed)} of {gb(capacity)} per GPU")
                if tried:
                    lines.append(
                        f"  s{tried[-1][0]} (the next smaller): needs {gb(tried[-1][1])}: does not fit"
                    )
                else:
                    lines.append("  (the smallest shard group: fewer all-gathers, more replicas)")
            if tokens_auto:
                assert tokens is not None
                r.micro_batch_tokens = tokens
                lines.append(f"rl.micro_batch_tokens=auto -> {tokens} (the largest multiple of "
                             f"{TOKEN_STEP} that fits beside everything else, at most this rank's batch)")  # fmt: skip
            return lines
        tried.append((shard, needed))
    shard, needed = tried[-1]
    what = (
        f"parallel=auto: even s{shard} (the whole node)"
        if p.auto
        else f"hsdp_r{p.dp_replicate_size}s{shard}"
    )
    raise NoFit(
        f"{what} needs {gb(needed)} per GPU, the GPU has {gb(capacity)}; to fit: "
        + ("lower " if tokens_auto else "lower rl.micro_batch_tokens, ")
        + "rl.max_new_tokens or rl.prompts_per_step x rl.samples_per_prompt per rank (more nodes), "
        "model.activation_checkpointing=true, or "
        + ("more GPUs per node" if p.auto else "a larger parallel.dp_shard_size")
    )
