"""From a composed Hydra config to running workers: type, validate, plan or launch."""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher.plan import plan
from launcher.schema import Config
from launcher.torchrun import start_workers
from launcher.validate import ConfigError, resolve_device, validate


def to_typed(cfg: DictConfig) -> Config:
    """The composed config as the schema's dataclasses (interpolations resolved)."""
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}") from None


def visible_gpus(device: str) -> int:
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


def write_config(cfg: Config, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return path


def remove_if_empty(run_dir: Path) -> None:
    """Hydra makes the run folder before the task runs; a rejected config leaves none behind."""
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


def prepare(cfg: DictConfig) -> tuple[Config, int]:
    typed = to_typed(cfg)
    gpus = visible_gpus(typed.device)
    # A plan made where no GPU is visible (a laptop, a login node) skips the GPU-count check.
    validate(typed, gpus, check_gpu_count=not (typed.dry_run and gpus == 0))
    return typed, gpus


def run(cfg: DictConfig) -> None:
    """Hydra's task function. Exits 2 on a config error, else with the workers' exit code."""
    try:
        typed, gpus = prepare(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        remove_if_empty(Path(HydraConfig.get().runtime.output_dir))
        sys.exit(2)
    if typed.dry_run:
        print(plan(typed))
        remove_if_empty(Path(HydraConfig.get().runtime.output_dir))
        return
    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    typed.run_dir = str(run_dir)
    typed.device = resolve_device(typed.device, gpus)
    config_path = write_config(typed, run_dir)
    code = start_workers(typed, config_path, run_dir)
    if code != 0:
        sys.exit(code)
    print(f"run finished: {run_dir}")
