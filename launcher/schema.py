"""The typed config: the one source of truth for every key.

YAML files under `conf/` choose values for these fields; they cannot add keys (Hydra merges
them into these dataclasses in struct mode). Each field's comment is its documentation:
`docs/configuration.md` is generated from this file (`python scripts/gen_config_docs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Union

from hydra.core.config_store import ConfigStore


def choice(default: str, *choices: str):
    """A string key with a fixed set of values: the one place they are written. Validation, the
    generated docs and the trainer's registries read them from here (`choices_of`)."""
    assert default in choices
    return field(default=default, metadata={"choices": choices})


def choices_of(cls: type, name: str) -> tuple[str, ...]:
    return next(f.metadata["choices"] for f in fields(cls) if f.name == name)


def choice_fields(node, prefix: str = ""):
    """(dotted key, value, allowed values) of every choice field in a config, nested ones too."""
    for f in fields(node):
        value = getattr(node, f.name)
        if "choices" in f.metadata:
            yield f"{prefix}{f.name}", value, f.metadata["choices"]
        elif is_dataclass(value):
            yield from choice_fields(value, f"{prefix}{f.name}.")


@dataclass
class ParallelConfig:
    """How the ranks are laid out: R replica groups of S-way shards (`hsdp_r{R}s{S}`)."""

    # Replica groups R: the gradient all-reduce crosses them, parameters are not sharded over them.
    dp_replicate_size: int = 1
    # Shard group size S: ranks one parameter is sharded over (all-gather / reduce-scatter stay inside).
    dp_shard_size: int = 1
    # parallel=auto: the launcher picks dp_shard_size, the smallest divisor of nproc_per_node
    # whose predicted step fits (launcher/memory.py), and dp_replicate_size = world / that.
    auto: bool = False
    # Memory per GPU the plan may use (GB, 1e9 bytes); null: read from the first visible GPU.
    # Needed by parallel=auto and rl.micro_batch_tokens=auto where no GPU is visible. A GPU
    # launch whose predicted step needs more than this stops before start, naming a knob that fits.
    gpu_memory_gb: float | None = None
    # Inter-node bandwidth per GPU in Gb/s, for the plan's predicted step time (400: NDR
    # InfiniBand, one NIC per GPU).
    link_gbps: float = 400.0
    # Context-parallel size; only 1 is implemented, the mesh view exists for later.
    cp_size: int = 1
    # Nodes in the job; each runs one launcher and one torchrun agent.
    nnodes: int = 1
    # Worker processes (GPUs) per node.
    nproc_per_node: int = 1
    # host:port of the c10d rendezvous; required when nnodes > 1 (inside a Slurm job the launcher
    # fills it with the job's first node and parallel.rdzv_port).
    rdzv_endpoint: str | None = None
    # The port of the rendezvous the launcher fills in itself (Slurm).
    rdzv_port: int = 29500
    # Rendezvous id shared by the nodes of one job.
    rdzv_id: str = "hsdp-grpo"


@dataclass
class ArchConfig:
    """The Qwen3 architecture (transformers' Qwen3Config names), used for `model.init=random`
    and by the dry-run plan when no config.json is at `model.path`."""

    # Decoder layers.
    num_hidden_layers: int = 2
    # Model width.
    hidden_size: int = 64
    # MLP width.
    intermediate_size: int = 128
    # Query heads.
    num_attention_heads: int = 4
    # Key/value heads (grouped-query attention).
    num_key_value_heads: int = 2
    # Width of one attention head.
    head_dim: int = 16
    # Embedding rows; must cover the tokenizer's ids (the shipped one has 259).
    vocab_size: int = 259
    # lm_head shares the embedding matrix.
    tie_word_embeddings: bool = True
    # RoPE base.
    rope_theta: float = 1_000_000.0
    # Longest position RoPE is set up for.
    max_position_embeddings: int = 2048
    # RMSNorm epsilon.
    rms_norm_eps: float = 1e-6


@dataclass
class ModelConfig:
    """Which Qwen3 to train and how its weights are held."""

    # Local folder or hub id for `from_pretrained`; null builds `model.arch` with the shipped tokenizer.
    path: str | None = None
    # pretrained: weights from model.path; random: the architecture only, seeded init.
    init: str = choice("random", "pretrained", "random")
    # Tokenizer folder or hub id; null: model.path's, else the shipped byte-level one.
    tokenizer_path: str | None = None
    arch: ArchConfig = field(default_factory=ArchConfig)
    # Dtype of parameters in forward/backward; auto: bf16 on cuda, fp32 on cpu.
    param_dtype: str = choice("auto", "auto", "bf16", "fp32")
    # Dtype of the gradient reduce-scatter / all-reduce.
    reduce_dtype: str = choice("fp32", "fp32", "bf16")
    # Attention kernel passed to transformers.
    attn_implementation: str = choice("sdpa", "sdpa", "eager", "flash_attention_2")
    # Recompute each decoder layer's activations in backward instead of keeping them (about
    # a third more compute; activation memory drops to the layer inputs).
    activation_checkpointing: bool = False
    # torch.compile each decoder layer (before sharding), fusing norms, RoPE and the MLP gate.
    compile: bool = False
    # Free each decoder layer's gathered weights after its forward and gather them again in
    # backward (less memory, one more all-gather per layer). The root (embeddings, final norm,
    # lm_head) always stays gathered: backward needs it first.
    reshard_after_forward: bool = True
    # Run code shipped with a hub model. Off unless you trust the repository.
    trust_remote_code: bool = False


TASK_REWARDS = {"synthetic": {"digit_echo": 1.0}, "gsm8k": {"math_answer": 1.0, "format": 0.1}}
# The reward whose value 1 means a response is correct (evaluation's pass@k), per task.
TASK_CORRECTNESS = {"synthetic": "digit_echo", "gsm8k": "math_answer"}


def rewards_of(data: DataConfig) -> dict[str, float]:
    """The rewards a run scores with: `data.rewards`, or its task's own when that is empty."""
    return dict(data.rewards) or TASK_REWARDS[data.name]


@dataclass
class DataConfig:
    """Prompts and the rewards that score their responses."""

    # Which loader: synthetic (the shipped digit-echo task) or gsm8k (GSM8K-style rows through
    # datasets: a hub id or a local parquet/jsonl file).
    name: str = choice("synthetic", "synthetic", "gsm8k")
    # gsm8k: hub id or local .parquet / .jsonl / .json file; ignored by synthetic.
    path: str | None = None
    # gsm8k: dataset config name on the hub (`main` for openai/gsm8k).
    hub_config: str | None = None
    # gsm8k: dataset split.
    split: str = "train"
    # gsm8k, evaluation (trainer.eval_every): the split of data.eval_path (or of data.path when
    # it is null; a local file has one split, so a local data.path needs data.eval_path).
    eval_split: str = "test"
    eval_path: str | None = None
    # gsm8k: column holding the question.
    question_key: str = "question"
    # gsm8k: column holding the reference answer (GSM8K's ends in `#### 42`).
    answer_key: str = "answer"
    # Wrap each prompt with the tokenizer's chat template.
    chat_template: bool = False
    # Optional system message (only with chat_template).
    system_prompt: str | None = None
    # Text appended to every question (e.g. an instruction about the answer format).
    prompt_suffix: str = ""
    # Reward functions by registered name and their weights; the reward is the weighted sum.
    # Empty: the task's own (TASK_REWARDS: synthetic digit_echo; gsm8k math_answer + 0.1 format).
    rewards: dict[str, float] = field(default_factory=dict)
    # gsm8k: the longest prompt in tokens that the memory plan (dry_run, parallel=auto,
    # rl.micro_batch_tokens=auto) assumes; the trainer warns when a prompt is longer.
    plan_prompt_tokens: int = 256
    # synthetic: number of prompts generated, and digits per prompt.
    num_examples: int = 4096
    num_digits: int = 4


@dataclass
class RLConfig:
    """GRPO: batch sizes (named by what they count), sampling, advantages and the loss."""

    # Prompts per step over the whole data-parallel domain (split over all R*S ranks).
    prompts_per_step: int = 16
    # Responses sampled per prompt: one GRPO group.
    samples_per_prompt: int = 8
    # Optimizer steps per rollout batch; 1 is on-policy.
    updates_per_step: int = 1
    # Responses per forward/backward on one rank (memory knob; does not change the gradient).
    micro_batch_responses: int = 16
    # Token budget per forward/backward on one rank (rows x longest row); 0: use
    # micro_batch_responses. Rows are sorted by length and packed, so padding stays small.
    # auto: the largest budget (a multiple of 256) whose predicted step fits the GPU
    # (launcher/memory.py; needs a visible GPU or parallel.gpu_memory_gb).
    micro_batch_tokens: Union[int, str] = 0  # noqa: UP007 (OmegaConf 2.3 reads typing.Union only)
    # Longest response; longer ones are cut (counted in rollout/truncated_frac).
    max_new_tokens: int = 256
    # Sampling temperature; logits are divided by it in rollout and training alike.
    temperature: float = 1.0
    # Nucleus sampling mass (1 = off). The sampler records the log-prob of the truncated,
    # renormalised distribution it drew from; the learner's is of the full one (docs/algorithms.md).
    top_p: float = 1.0
    # Sample only among the k likeliest tokens (0 = off); recorded like top_p.
    top_k: int = 0
    # Divide advantages by the group std (off = Dr. GRPO).
    std_normalize: bool = True
    # Added to the group std before dividing.
    adv_eps: float = 1e-6
    # Ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO clip-higher when clip_high > clip_low).
    clip_low: float = 0.2
    clip_high: float = 0.2
    # The importance ratio per token (PPO/GRPO), or per response: GSPO's exp(mean over the
    # response of the token log-ratios), clipped per response (use with rl=gspo's tiny ranges).
    ratio_level: str = choice("token", "token", "sequence")
    # Dual clip (Ye et al. 2020): for a negative advantage the loss is at most -A * clip_ratio_c,
    # so one token with a huge ratio cannot dominate; verl's default 3. null: off. Must be > 1.
    clip_ratio_c: float | None = 3.0
    # KL penalty to a frozen reference; the reference is built only when > 0.
    kl_coef: float = 0.0
    # KL estimator (Schulman's k1, k2, k3; k3 is the low-variance one).
    kl_estimator: str = choice("k3", "k1", "k2", "k3")
    # k3 only, verl's bounds: the log-ratio clamped to +-20 and k3 to [-10, 10], so a token the
    # reference finds far likelier than the policy cannot blow up the term and its gradient.
    kl_clamp: bool = True
    # Entropy bonus: loss -= entropy_coef * entropy, aggregated like the policy-gradient term
    # (rl.loss_agg): a token mean under token_mean, a mean of response means under
    # seq_mean_token_mean, and each response's entropy sum over max_new_tokens, averaged over
    # responses, under seq_mean_token_sum_norm.
    entropy_coef: float = 0.0
    # DAPO dynamic sampling: drop groups whose rewards are all equal (std <= zero_std_eps: no
    # gradient) and sample more prompts, in rounds, until prompts_per_step groups with signal are
    # collected over all ranks or max_sample_rounds is reached (then train on what was kept).
    dynamic_sampling: bool = False
    zero_std_eps: float = 1e-6
    max_sample_rounds: int = 3
    # Take responses cut at max_new_tokens (no EOS) out of the loss (DAPO's overlong filtering).
    mask_truncated: bool = False
    # DAPO's soft overlong punishment: over the last overlong_buffer tokens before max_new_tokens
    # the reward falls linearly, to -overlong_penalty at max_new_tokens. 0: off.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # Rollout correction for the sampler/learner mismatch, from the sampler's recorded log-probs:
    # none; tis (truncated importance sampling: weight min(rho, rollout_is_cap)); mis (masked:
    # tokens, or whole responses with rollout_is_level=sequence, whose rho is outside
    # [1/cap, cap] leave the loss). rho = pi_learner / pi_sampler (docs/algorithms.md).
    rollout_correction: str = choice("none", "none", "tis", "mis")
    rollout_is_cap: float = 2.0
    # rho per token, or per response (the product of its tokens' ratios).
    rollout_is_level: str = choice("token", "token", "sequence")
    # How per-token losses become one number (trainer/grpo.py): token_mean, seq_mean_token_mean,
    # seq_mean_token_sum_norm (sum / max_new_tokens, Dr. GRPO).
    loss_agg: str = choice(
        "token_mean", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"
    )
    # Log-probs and entropies are computed this many tokens at a time (fp32 over the vocabulary:
    # 1024 x 151,936 x 4 B = 0.6 GB per chunk for Qwen3), recomputed in backward.
    logprob_chunk_tokens: int = 1024
    # Log-probs and entropies in the update: auto (triton on a GPU with Triton installed, else
    # torch), triton (trainer/logprob_kernel.py: one read of the bf16 logits, no fp32 copy, the
    # gradient written over the logits; logprob_chunk_tokens unused), torch (the chunked path).
    logprob_kernel: str = choice("auto", "auto", "triton", "torch")
    # Free the static engine's KV cache after each rollout and make it again (same size, same
    # compiled steps, the CUDA graphs recaptured) at the next: the update and the optimizer step
    # get its memory (29 GB for the qwen3_4b preset). false keeps it for the whole step.
    free_kv_cache: bool = True
    # Responses per rollout-engine call (0: all of a rank's responses in one call). A long-response
    # run whose KV cache does not fit for every response at once decodes them in calls of this many.
    rollout_batch: int = 0
    # Rollout engine: auto (static on GPUs, hf on CPU), static (static KV cache + CUDA graph),
    # hf (transformers generate).
    engine: str = choice("auto", "auto", "static", "hf")
    # static engine: compile the decode step with torch.compile before capturing it, and the
    # prefill's decoder layer (once, for any batch and prompt width).
    compile_decode: bool = True
    # static engine: decode steps attend over the first 1/n, 2/n, ... n/n of the KV cache (the
    # part that holds the tokens so far) instead of all of it every step; each of the n spans is
    # its own compiled, captured step (about a minute of compile each for Qwen3-4B). 1: whole cache.
    decode_spans: int = 3
    # static engine, decode attention: auto (triton on a GPU with Triton installed and head_dim a
    # power of two >= 16, else sdpa), sdpa (PyTorch SDPA over the span), triton (a kernel that
    # reads only the filled columns, split over the cache where the batch is too small to fill the
    # GPU; one compiled step; needs a GPU and Triton; it also norms and rotates the step's q and k
    # and writes its K/V into the cache).
    decode_attention: str = choice("auto", "auto", "sdpa", "triton")
    # static engine, sampling without a top-k or top-p cut: auto (triton on a GPU with Triton
    # installed, else torch), triton (trainer/sample_kernel.py: two kernels, one read of the bf16
    # logits, no torch.compile), torch (the chunked sampler in trainer/engine.py, compiled).
    sample_kernel: str = choice("auto", "auto", "triton", "torch")
    # static engine, the decode steps' projections (q/k/v, o, gate/up, down; engine calls of at
    # most 256 rows): auto (triton on a GPU with Triton installed, else torch), triton
    # (trainer/decode_matmul.py: a skinny matmul split over K, its partial sums fused into the
    # next elementwise kernel), torch (cuBLAS; the default: the kernel measured 4% / 19% slower
    # than cuBLAS at batch 64 / 256 on an H100, 2026-12-07).
    decode_matmul: str = choice("torch", "auto", "triton", "torch")


@dataclass
class OptimConfig:
    """AdamW on the sharded fp32 master weights."""

    # Peak learning rate.
    lr: float = 1e-6
    # Decoupled weight decay.
    weight_decay: float = 0.0
    # AdamW betas and epsilon.
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    # Clip the global norm of the sharded gradients; 0 disables clipping (norm still logged).
    max_grad_norm: float = 1.0
    # Learning-rate schedule after the linear warmup: constant, or cosine to min_lr_ratio * lr.
    schedule: str = choice("constant", "constant", "cosine")
    # Linear warmup from 0 over this many optimizer steps.
    warmup_steps: int = 0
    # cosine: the final learning rate as a fraction of optim.lr.
    min_lr_ratio: float = 0.1


@dataclass
class TrainerConfig:
    """The loop around the updates."""

    # GRPO steps (rollout + updates) to run.
    max_steps: int = 50
    # Seeds model init, data order and sampling.
    seed: int = 0
    # Use deterministic algorithms (bit-for-bit reproducible runs; slower on GPU).
    deterministic: bool = False
    # Checkpoint every N steps (0: only at the end); a checkpoint is always written at the end.
    save_every: int = 0
    # Checkpoints kept in the run directory (0 keeps all).
    keep_last: int = 2
    # `none` (start fresh) | `auto` (latest good checkpoint of this run, or of the newest earlier
    # run of the same job) | a checkpoint folder or run directory.
    resume: str = "none"
    # Write a checkpoint at the end of the run (besides every save_every steps).
    save_final: bool = True
    # Write the final weights in Hugging Face format (safetensors, config, tokenizer) to RUN_DIR/hf.
    export_hf: bool = True
    # Dtype of the exported weights; auto: the pretrained checkpoint's own dtype, else the compute
    # dtype (bf16 on GPUs, fp32 on CPU).
    export_dtype: str = choice("auto", "auto", "bf16", "fp32")
    # Stop after this many updates in a row with a non-finite loss or gradient norm (each is skipped).
    max_bad_updates: int = 3
    # Peak TFLOP/s per GPU for perf/mfu; 0: the dense bf16 datasheet value of known GPUs.
    peak_tflops: float = 0.0
    # End each worker after one forward/backward check of the sharded model (no GRPO).
    smoke_test: bool = False
    # Seconds a rank may spend in one phase (rollout, a micro-batch, a checkpoint, ...) before the
    # run is stopped as stalled, naming each rank's step and phase, stacks in the rank logs
    # (trainer/watchdog.py). The first step's compiles and a large checkpoint count; >= 30. The
    # process-group timeout is this plus 60 s.
    hang_timeout_s: float = 600.0
    # Where compiled kernels (TorchInductor's FX graph and autotune caches, Triton's binaries) are
    # kept between runs, shared by every run of this user: a second launch loads the decode steps'
    # and layers' kernels instead of compiling them. "": torch's default (a per-user /tmp folder).
    # TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR in the environment win. Where torch's own modules
    # have no bytecode beside them (an image built with PYTHONDONTWRITEBYTECODE=1 or pip
    # --no-compile), the workers' bytecode is kept here too (PYTHONPYCACHEPREFIX; a user's wins).
    compile_cache_dir: str = "~/.cache/hsdp-grpo/compile"
    # Every N steps, check that the replica groups of an HSDP layout hold identical parameter
    # shards (a fingerprint per shard, compared across replicas); a difference stops the run
    # naming the first differing parameter. 0: never. Logged as train/replica_max_diff.
    check_replicas_every: int = 50
    # Profile this step (0: none) with torch.profiler: each rank writes
    # RUN_DIR/profile/step_N_rank_R.txt, one table per phase (rollout, reference and plan, update,
    # refresh) of its kernels and ops by GPU (or CPU) time, and how much of each phase's wall time
    # the GPU was busy.
    profile_step: int = 0
    # Evaluate on held-out prompts every N steps and after the last one (0: never): greedy
    # pass@1 and pass@k from eval_k samples at rl.temperature (the unbiased estimator), split over
    # all dp ranks. Held out: data.eval_split / data.eval_path for gsm8k; for synthetic, prompts
    # never drawn for training.
    eval_every: int = 0
    # Held-out prompts per evaluation, and samples per prompt for pass@k.
    eval_prompts: int = 64
    eval_k: int = 4


@dataclass
class LoggerConfig:
    """Where metrics go besides `metrics.jsonl` in the run directory."""

    # Where metrics go besides metrics.jsonl (always written).
    backend: str = choice("wandb", "wandb", "none")
    # W&B mode: offline (a run folder for `wandb sync`), online, disabled.
    mode: str = choice("offline", "offline", "online", "disabled")
    # W&B project, entity (team or user), group, run name and tags; a sweep fills group and name.
    project: str = "hsdp-grpo"
    entity: str | None = None
    group: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class Config:
    """The whole run."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # auto: cuda if a GPU is visible, else cpu.
    device: str = choice("auto", "auto", "cuda", "cpu")
    # Print the plan (mesh, memory, traffic) and exit without starting a process.
    dry_run: bool = False
    # Before training: one GRPO update's gradient on this layout against one process over the
    # same global batch (trainer/parity.py); exits 1 on FAIL. With trainer.max_steps=0 it checks
    # and stops: the first command to run on a new cluster.
    parity_check: bool = False
    # Filled in by the launcher: where this run writes config, logs and metrics.
    run_dir: str = ""
    # Filled in by the launcher: the preset chosen in each group (Hydra's choices), e.g.
    # {model: qwen3_4b, parallel: hsdp_r2s2}; names runs and plans.
    presets: dict[str, str] = field(default_factory=dict)
    # Filled in by the launcher: what parallel=auto / rl.micro_batch_tokens=auto chose and why.
    auto_choices: list[str] = field(default_factory=list)


def load(source) -> Config:
    """A typed Config from a saved config.yaml (path) or a dict of values; unset keys take defaults."""
    from pathlib import Path

    from omegaconf import OmegaConf

    values = OmegaConf.load(source) if isinstance(source, (str, Path)) else OmegaConf.create(source)
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), values))
    assert isinstance(config, Config)
    return config


def register() -> None:
    """Register the schema: `conf/config.yaml` starts from it, so every group file merged
    into it is checked against these dataclasses (unknown keys and wrong types fail)."""
    ConfigStore.instance().store(name="config_schema", node=Config)
    # `${floordiv:a,b}` for presets whose value follows another key (rl=dapo's overlong buffer
    # is a fifth of rl.max_new_tokens, whatever the data preset or the command line sets)
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("floordiv", lambda a, b: int(a) // int(b), replace=True)
