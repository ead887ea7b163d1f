"""Multirun (`-m`): name each job after its swept overrides, group them, report at the end.

Each job runs in turn with its own torchrun (Hydra's basic launcher) or as its own Slurm job
(submitit). A failed job does not stop the others: its exit code goes into the job's
`status.json`, and after the last job `finish()` writes the sweep report and exits non-zero
naming the jobs that failed.
"""

from __future__ import annotations

import json
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf

from launcher.schema import Config

_sweep_dirs: list[Path] = []  # sweeps run by this process (one per `-m` invocation)


def is_multirun() -> bool:
    return HydraConfig.get().mode == RunMode.MULTIRUN


def swept_keys(sweep_dir: Path) -> set[str]:
    """Keys given several values on the command line, read from Hydra's multirun.yaml."""
    saved = OmegaConf.load(sweep_dir / "multirun.yaml")
    overrides = OverridesParser.create().parse_overrides(list(saved.hydra.overrides.task))
    return {o.key_or_group for o in overrides if o.is_sweep_override()}


def job_name() -> str:
    """This job's swept overrides (`parallel=hsdp_r2s2`), which name its W&B run and report row."""
    hc = HydraConfig.get()
    sweep_dir = Path(hc.sweep.dir).resolve()
    if sweep_dir not in _sweep_dirs:
        _sweep_dirs.append(sweep_dir)
    keys = swept_keys(sweep_dir)
    own = [o for o in hc.overrides.task if o.split("=", 1)[0].lstrip("+~") in keys]
    return ",".join(own) or f"job{hc.job.num}"


def name_job(cfg: Config) -> None:
    """W&B group = the sweep's folder, run name = the job's swept overrides (unless set)."""
    sweep_dir = Path(HydraConfig.get().sweep.dir).resolve()
    cfg.logger.group = cfg.logger.group or "sweep-" + "_".join(sweep_dir.parts[-2:])
    cfg.logger.name = cfg.logger.name or job_name()


def write_status(run_dir: Path, name: str | None, exit_code: int, error: str | None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").write_text(
        json.dumps({"name": name, "exit_code": exit_code, "error": error}) + "\n"
    )


def finish() -> int:
    """After `-m`: write each sweep's report; 1 if any job failed, else 0."""
    from launcher.report import load_jobs, write_report

    failed = []
    for sweep_dir in _sweep_dirs:
        report = write_report(sweep_dir)
        print(f"sweep report: {report}")
        failed += [
            f"{j.name} (exit {j.exit_code}: {j.error or 'see its logs'})"
            for j in load_jobs(sweep_dir)
            if j.exit_code
        ]
    if failed:
        print("failed jobs:\n  " + "\n  ".join(failed))
        return 1
    return 0
