"""From a composed Hydra config to running workers: type, validate, plan or launch."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher import memory, nodes, resume, sweep
from launcher.plan import arch_from_model_dir as plan_arch
from launcher.plan import plan
from launcher.schema import Config
from launcher.torchrun import start_workers
from launcher.validate import ConfigError, resolve_device, validate

CONFIG_GROUPS = ("parallel", "model", "data", "rl", "logger")


def to_typed(cfg: DictConfig) -> Config:
    """The composed config as the schema's dataclasses (interpolations resolved)."""
    try:
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}") from None
    assert isinstance(typed, Config)
    return typed


def cuda_driver():
    """The initialised CUDA driver library, or None (no NVIDIA driver, or it fails to start)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return cuda if cuda.cuInit(0) == 0 else None


def visible_gpus(device: str) -> int:
    """GPUs this process may use (CUDA_VISIBLE_DEVICES applies), asked of the CUDA driver
    itself: the launcher never imports torch (it takes seconds and a GPU context)."""
    cuda = None if device == "cpu" else cuda_driver()
    count = ctypes.c_int(0)
    if cuda is None or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def gpu_memory_bytes() -> float | None:
    """Total memory of the first visible GPU, from the CUDA driver (no torch); None without one."""
    cuda = cuda_driver()
    device, total = ctypes.c_int(0), ctypes.c_size_t(0)
    if cuda is None or cuda.cuDeviceGet(ctypes.byref(device), 0) != 0:
        return None
    if cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device) != 0:
        return None
    return float(total.value)


def gpu_capacity(cfg: Config, gpus: int) -> float | None:
    """Bytes per GPU that the memory checks plan for: parallel.gpu_memory_gb, else the first
    visible GPU's where the run is on GPUs; None where neither is known."""
    if cfg.parallel.gpu_memory_gb:
        return cfg.parallel.gpu_memory_gb * 1e9
    if gpus > 0 and resolve_device(cfg.device, gpus) == "cuda":
        return gpu_memory_bytes()
    return None


def resolve_autos(cfg: Config, gpus: int) -> list[str]:
    """parallel=auto and rl.micro_batch_tokens=auto become numbers here, before validation, from
    the memory model (launcher/memory.py); returns the lines that say what was chosen."""
    p = cfg.parallel
    tokens_auto = cfg.rl.micro_batch_tokens == "auto"
    if not (p.auto or tokens_auto):
        return []
    what = "parallel=auto" if p.auto else "rl.micro_batch_tokens=auto"
    if p.nproc_per_node < 1 or p.nnodes < 1:
        return []  # validation names the bad count
    device = "cpu" if cfg.device == "cpu" else "cuda"
    capacity = gpu_capacity(cfg, gpus)
    if capacity is None:
        raise ConfigError(f"{what} needs the memory of a GPU and none is visible; set "
                          "parallel.gpu_memory_gb (e.g. 141 for an H200, 80 for an H100)")  # fmt: skip
    try:
        return memory.choose(cfg, plan_arch(cfg), device, capacity)
    except memory.NoFit as e:
        raise ConfigError(str(e)) from None


def check_fits(cfg: Config, gpus: int) -> None:
    """A GPU run whose step needs more memory than its GPU has stops here, with one line naming
    the knob and a value that fits, not with an out-of-memory error in step 1 after the model is
    built (the qwen3_4b preset on an 80 GB H100: 2026-12-07, docs/benchmarks.md). The need is the
    memory model's (launcher/memory.py: within 10% of the peaks measured on an H200, 0.5% for the
    preset's GRPO step), as the dry run's plan states it, with its allocator slack and reserve.
    Autos were chosen to fit (`resolve_autos`); a plan only reports."""
    p = cfg.parallel
    if cfg.dry_run or p.auto or cfg.rl.micro_batch_tokens == "auto":
        return
    if resolve_device(cfg.device, gpus) != "cuda":
        return
    capacity = gpu_capacity(cfg, gpus)
    if capacity is None:
        return
    arch, world, shard = plan_arch(cfg), p.nnodes * p.nproc_per_node, p.dp_shard_size
    needed = memory.predict(arch, memory.shape_of(cfg, shard, world, "cuda")).needs()
    if needed > capacity:
        raise ConfigError(
            f"hsdp_r{p.dp_replicate_size}s{shard} needs {memory.gb(needed)} per GPU (predicted "
            f"by launcher/memory.py), the GPU has {memory.gb(capacity)}: "
            + memory.advice(cfg, arch, shard, world, "cuda", capacity)
        )


def write_config(cfg: Config, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return path


def remove_if_empty(run_dir: Path) -> None:
    """Hydra makes the run folder before the task runs; a rejected config leaves none behind."""
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


def slurm_rendezvous(cfg: Config) -> None:
    """Inside a Slurm job of several nodes, rendezvous at its first node unless told otherwise."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if cfg.parallel.nnodes == 1 or cfg.parallel.rdzv_endpoint or not nodelist:
        return
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True
    ).stdout.split()
    if hosts:
        cfg.parallel.rdzv_endpoint = f"{hosts[0]}:{cfg.parallel.rdzv_port}"
        cfg.parallel.rdzv_id = os.environ.get("SLURM_JOB_ID", cfg.parallel.rdzv_id)


def prepare(cfg: DictConfig) -> tuple[Config, int]:
    typed = to_typed(cfg)
    choices = HydraConfig.get().runtime.choices
    typed.presets = {g: choices[g] for g in CONFIG_GROUPS if choices.get(g)}
    slurm_rendezvous(typed)
    gpus = visible_gpus(typed.device)
    typed.auto_choices = resolve_autos(typed, gpus)
    # A plan made where no GPU is visible (a laptop, a login node) skips the GPU-count check.
    validate(typed, gpus, check_gpu_count=not (typed.dry_run and gpus == 0))
    check_fits(typed, gpus)
    return typed, gpus


def run(cfg: DictConfig) -> int:
    """Hydra's task function.

    A single run exits 2 on a config error, else with the workers' exit code. A job of a
    multirun returns its code instead, so the sweep goes on; `launcher.sweep.finish` reports.
    """
    multirun = sweep.is_multirun()
    hydra_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    try:
        typed, gpus = prepare(cfg)
        run_dir, checkpoint, warnings = (
            (hydra_dir, None, []) if typed.dry_run else resume.resolve(typed, hydra_dir)
        )
        if typed.parallel.nnodes > 1 and not typed.dry_run:  # one folder for the whole job
            run_dir, checkpoint = nodes.agree(typed, run_dir, checkpoint)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        if not multirun:
            remove_if_empty(hydra_dir)
            sys.exit(2)
        sweep.write_status(hydra_dir, sweep.job_name(), 2, str(e))
        return 2
    if typed.dry_run:
        print(plan(typed))
        remove_if_empty(hydra_dir)
        return 0
    for line in typed.auto_choices:
        print(line)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if run_dir != hydra_dir:
        remove_if_empty(hydra_dir)
    if checkpoint is not None:
        print(f"resuming {run_dir} from {checkpoint.name}")
    if multirun:
        sweep.name_job(typed)
    typed.run_dir = str(run_dir)
    typed.trainer.resume = str(checkpoint) if checkpoint else "none"
    typed.device = resolve_device(typed.device, gpus)
    config_path = write_config(typed, run_dir)
    code, failure = start_workers(typed, config_path, run_dir)
    sweep.write_status(run_dir, typed.logger.name, code, failure)
    if code != 0 and not multirun:
        sys.exit(code)
    print(f"{'job' if multirun else 'run'} {'finished' if code == 0 else 'failed'}: {run_dir}")
    return code
