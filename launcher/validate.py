"""Everything that can be checked before a process starts.

Each rule raises `ConfigError` with one line: the key, the value, and the fix. The launcher
prints it and exits 2; no worker is started, no run folder is touched.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

from launcher.paths import dataset_cached, hub_offline, is_hub_id, local_model_dir
from launcher.schema import Config, choice_fields, rewards_of

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")


class ConfigError(Exception):
    """A config value a user can fix: the message is the whole story, in one line."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def one_of(key: str, value: object, choices: tuple[str, ...]) -> None:
    check(value in choices, f"{key}={value!r} is not one of {', '.join(choices)}")


def positive(key: str, value: float) -> None:
    check(value > 0, f"{key}={value} must be > 0")


def at_least(key: str, value: float, low: float) -> None:
    check(value >= low, f"{key}={value} must be >= {low}")


def resolve_device(device: str, visible_gpus: int) -> str:
    return ("cuda" if visible_gpus > 0 else "cpu") if device == "auto" else device


def world_size(cfg: Config) -> int:
    return cfg.parallel.nnodes * cfg.parallel.nproc_per_node


def validate_parallel(cfg: Config, visible_gpus: int, check_gpu_count: bool = True) -> None:
    p = cfg.parallel
    at_least("parallel.dp_replicate_size", p.dp_replicate_size, 1)
    at_least("parallel.dp_shard_size", p.dp_shard_size, 1)
    at_least("parallel.cp_size", p.cp_size, 1)
    at_least("parallel.nnodes", p.nnodes, 1)
    at_least("parallel.nproc_per_node", p.nproc_per_node, 1)
    world = world_size(cfg)
    check(
        world % p.cp_size == 0,
        f"parallel.cp_size={p.cp_size} does not divide the world of {world} ranks "
        f"(nnodes={p.nnodes} x nproc_per_node={p.nproc_per_node}); pick a divisor of {world}",
    )
    check(
        p.cp_size == 1,
        f"parallel.cp_size={p.cp_size}: context parallelism is not implemented yet; use 1",
    )
    dp = world // p.cp_size
    divisors = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0)
    check(
        dp % p.dp_replicate_size == 0,
        f"parallel.dp_replicate_size={p.dp_replicate_size} does not divide the {dp} data-parallel ranks "
        f"into equal replica groups; use one of {divisors}",
    )
    check(
        p.dp_replicate_size * p.dp_shard_size == dp,
        f"parallel.dp_replicate_size x parallel.dp_shard_size = {p.dp_replicate_size} x {p.dp_shard_size} "
        f"= {p.dp_replicate_size * p.dp_shard_size}, but {world} ranks will be started "
        f"(nnodes={p.nnodes} x nproc_per_node={p.nproc_per_node}); make the product {dp}",
    )
    check(
        p.nnodes == 1 or bool(p.rdzv_endpoint),
        f"parallel.nnodes={p.nnodes} needs a rendezvous: set parallel.rdzv_endpoint=HOST:PORT "
        "(the first node's address) and start the same command on every node",
    )
    if check_gpu_count and resolve_device(cfg.device, visible_gpus) == "cuda":
        check(
            p.nproc_per_node <= visible_gpus,
            f"parallel.nproc_per_node={p.nproc_per_node} but {visible_gpus} GPU(s) are visible; "
            f"use a preset with at most {visible_gpus} ranks per node or device=cpu",
        )


def validate_model(cfg: Config) -> None:
    m = cfg.model
    if m.init == "pretrained" and not cfg.dry_run:  # a plan needs the architecture, not the weights
        check(
            bool(m.path),
            "model.init=pretrained needs model.path=/path/to/model (or model.init=random)",
        )
        if local_model_dir(m.path) is None:
            check(
                is_hub_id(m.path),
                f"model.path={m.path!r} does not exist (no config.json there); "
                "point it at a folder saved with save_pretrained, or use model.init=random",
            )
            check(
                not hub_offline(),
                f"model.path={m.path!r} is not a local folder nor in the Hugging Face cache, and "
                "HF_HUB_OFFLINE is set; download it and set model.path=/local/folder",
            )
    a = m.arch
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    ):
        at_least(f"model.arch.{key}", getattr(a, key), 1)
    check(
        a.num_attention_heads % a.num_key_value_heads == 0,
        f"model.arch.num_key_value_heads={a.num_key_value_heads} must divide "
        f"model.arch.num_attention_heads={a.num_attention_heads}",
    )


def validate_data(cfg: Config) -> None:
    from trainer.rewards import REWARDS

    d = cfg.data
    check(
        d.name != "synthetic" or not d.path,
        f"data.path={d.path!r} is ignored by data=synthetic (the shipped task makes its own "
        f"prompts); for your file use data=gsm8k data.path={d.path}, or drop data.path",
    )
    check(
        d.name != "synthetic" or not d.eval_path,
        f"data.eval_path={d.eval_path!r} is ignored by data=synthetic (it holds out its own "
        "prompts for evaluation); drop data.eval_path",
    )
    if d.name == "gsm8k":
        check(
            bool(d.path),
            "data=gsm8k needs data.path (a hub id such as openai/gsm8k or a local file)",
        )
        path = d.path or ""
        local = Path(path).expanduser()
        if is_hub_id(path) and not cfg.dry_run:  # a plan needs no data
            check(
                not hub_offline() or dataset_cached(path),
                f"data.path={d.path!r} is a hub dataset that is not in the Hugging Face cache, and "
                "HF_HUB_OFFLINE is set; download it where the hub is reachable (load it once with "
                "datasets), or point data.path at a local .parquet/.jsonl file",
            )
        else:
            check(
                local.exists(),
                f"data.path={d.path!r} does not exist; give a .parquet/.jsonl file or a hub id",
            )
            check(
                local.is_dir() or local.suffix in DATA_SUFFIXES,
                f"data.path={d.path!r}: unsupported file type {local.suffix!r}; use .parquet, .jsonl or .json",
            )
        if cfg.trainer.eval_every > 0:
            validate_eval_data(cfg)
    else:
        at_least("data.num_examples", d.num_examples, 1)
        at_least("data.num_digits", d.num_digits, 1)
    for name, weight in rewards_of(d).items():
        check(
            name in REWARDS,
            f"data.rewards.{name}: unknown reward {name!r}; registered rewards are {', '.join(sorted(REWARDS))}",
        )
        check(math.isfinite(weight), f"data.rewards.{name}={weight} must be a finite number")


def validate_eval_data(cfg: Config) -> None:
    """gsm8k with trainer.eval_every: the held-out prompts exist (or are cached, offline)."""
    d = cfg.data
    path = d.eval_path or d.path or ""
    if not d.eval_path:
        check(
            is_hub_id(path),
            f"trainer.eval_every={cfg.trainer.eval_every} needs held-out prompts: data.path={d.path!r} "
            "is a local file with one split; set data.eval_path=/path/to/test.parquet",
        )
    if is_hub_id(path):
        if not cfg.dry_run:
            check(
                not hub_offline() or dataset_cached(path),
                f"data.eval_path={path!r} is a hub dataset that is not in the Hugging Face cache, "
                "and HF_HUB_OFFLINE is set; download it, or give a local .parquet/.jsonl file",
            )
        return
    local = Path(path).expanduser()
    check(
        local.exists() and (local.is_dir() or local.suffix in DATA_SUFFIXES),
        f"data.eval_path={d.eval_path!r} is not a .parquet/.jsonl/.json file or folder; give one",
    )


def validate_rl(cfg: Config) -> None:
    r, o, t = cfg.rl, cfg.optim, cfg.trainer
    dp = world_size(cfg) // cfg.parallel.cp_size
    at_least("rl.prompts_per_step", r.prompts_per_step, 1)
    at_least("rl.samples_per_prompt", r.samples_per_prompt, 2)  # a group of one has no advantage
    at_least("rl.updates_per_step", r.updates_per_step, 1)
    at_least("rl.micro_batch_responses", r.micro_batch_responses, 1)
    check(
        isinstance(r.micro_batch_tokens, int),
        f"rl.micro_batch_tokens={r.micro_batch_tokens!r} is not a token count or auto; use a "
        "number (0: rl.micro_batch_responses) or auto",
    )  # auto is resolved to a number before validation (launcher/main.py)
    at_least("rl.micro_batch_tokens", int(r.micro_batch_tokens), 0)
    at_least("rl.logprob_chunk_tokens", r.logprob_chunk_tokens, 1)
    at_least("rl.rollout_batch", r.rollout_batch, 0)
    at_least("rl.decode_spans", r.decode_spans, 1)
    check(
        r.decode_spans <= 8,
        f"rl.decode_spans={r.decode_spans} is above 8 (torch.compile's recompile limit); use 1-8",
    )
    at_least("rl.max_new_tokens", r.max_new_tokens, 1)
    check(
        r.prompts_per_step % dp == 0,
        f"rl.prompts_per_step={r.prompts_per_step} does not split over {dp} data-parallel ranks; "
        f"use a multiple of {dp}",
    )
    if cfg.data.name == "synthetic":
        check(
            cfg.data.num_examples >= r.prompts_per_step,
            f"data.num_examples={cfg.data.num_examples} cannot fill one step of "
            f"rl.prompts_per_step={r.prompts_per_step}; raise it or lower rl.prompts_per_step",
        )
    positive("rl.temperature", r.temperature)
    check(0 < r.top_p <= 1, f"rl.top_p={r.top_p} must be in (0, 1]")
    at_least("rl.top_k", r.top_k, 0)
    check(0 < r.clip_low < 1, f"rl.clip_low={r.clip_low} must be in (0, 1)")
    positive("rl.clip_high", r.clip_high)
    check(
        r.clip_ratio_c is None or r.clip_ratio_c > 1,
        f"rl.clip_ratio_c={r.clip_ratio_c} must be > 1 (the dual-clip bound sits above 1 + clip); "
        "use null to turn it off",
    )
    at_least("rl.zero_std_eps", r.zero_std_eps, 0)
    at_least("rl.max_sample_rounds", r.max_sample_rounds, 1)
    at_least("rl.overlong_buffer", r.overlong_buffer, 0)
    check(
        r.overlong_buffer < r.max_new_tokens,
        f"rl.overlong_buffer={r.overlong_buffer} must be below rl.max_new_tokens={r.max_new_tokens} "
        f"(the penalty ramps over the last overlong_buffer tokens); use at most {r.max_new_tokens - 1}",
    )
    at_least("rl.overlong_penalty", r.overlong_penalty, 0)
    check(
        r.rollout_is_cap > 1,
        f"rl.rollout_is_cap={r.rollout_is_cap} must be > 1 (weights are kept in [1/cap, cap])",
    )
    at_least("rl.kl_coef", r.kl_coef, 0)
    at_least("rl.entropy_coef", r.entropy_coef, 0)
    if r.decode_attention == "triton":
        hd = cfg.model.arch.head_dim
        check(
            hd >= 16 and hd & (hd - 1) == 0,
            f"rl.decode_attention=triton needs a power-of-two model.arch.head_dim >= 16, "
            f"not {hd}; use rl.decode_attention=sdpa",
        )
    positive("rl.adv_eps", r.adv_eps)
    positive("optim.lr", o.lr)
    at_least("optim.weight_decay", o.weight_decay, 0)
    check(
        0 <= o.beta1 < 1 and 0 <= o.beta2 < 1,
        f"optim.beta1={o.beta1}, optim.beta2={o.beta2} must be in [0, 1)",
    )
    at_least("optim.max_grad_norm", o.max_grad_norm, 0)
    at_least("optim.warmup_steps", o.warmup_steps, 0)
    check(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    at_least("trainer.max_steps", t.max_steps, 0 if cfg.parity_check else 1)  # 0: check, stop
    at_least("trainer.save_every", t.save_every, 0)
    at_least("trainer.keep_last", t.keep_last, 0)
    at_least("trainer.max_bad_updates", t.max_bad_updates, 1)
    at_least("trainer.hang_timeout_s", t.hang_timeout_s, 30)
    at_least("trainer.check_replicas_every", t.check_replicas_every, 0)
    at_least("trainer.eval_every", t.eval_every, 0)
    at_least("trainer.profile_step", t.profile_step, 0)
    at_least("trainer.eval_prompts", t.eval_prompts, 1)
    at_least("trainer.eval_k", t.eval_k, 1)


def validate(cfg: Config, visible_gpus: int, check_gpu_count: bool = True) -> None:
    for key, value, choices in choice_fields(cfg):  # the allowed values, from the schema
        one_of(key, value, choices)
    if cfg.device == "cuda" and check_gpu_count:
        check(visible_gpus > 0, "device=cuda but no GPU is visible; use device=cpu")
    validate_parallel(cfg, visible_gpus, check_gpu_count)
    gpu = resolve_device(cfg.device, visible_gpus) == "cuda"
    for key, value, other, needed in (("rl.decode_attention", cfg.rl.decode_attention, "sdpa", gpu),
                                      ("rl.logprob_kernel", cfg.rl.logprob_kernel, "torch", True),
                                      ("rl.sample_kernel", cfg.rl.sample_kernel, "torch", gpu),
                                      ("rl.decode_matmul", cfg.rl.decode_matmul, "torch", gpu)):  # fmt: skip
        check(
            value != "triton" or not needed or importlib.util.find_spec("triton") is not None,
            f"{key}=triton but Triton is not installed; pip install triton, or use {key}={other}",
        )
    if cfg.rl.logprob_kernel == "triton":
        check(
            gpu or os.environ.get("TRITON_INTERPRET") == "1",
            "rl.logprob_kernel=triton runs on GPUs; on CPU use rl.logprob_kernel=torch (or set "
            "TRITON_INTERPRET=1 to run it in Triton's interpreter, slowly)",
        )
    validate_model(cfg)
    validate_data(cfg)
    validate_rl(cfg)
