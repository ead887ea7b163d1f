"""Before workers start: which checkpoint a run resumes from, and in which run directory.

`trainer.resume`:
- `none` (default): start fresh; refused if the run directory already holds checkpoints, so
  a fresh start never overwrites them.
- `auto`: the newest checkpoint that verifies in the run directory; if the run directory is
  new (Hydra's default makes one per invocation), the newest earlier run of the same job
  (same model, data, rl, optim and seed) under the same `runs/` tree, which the run then
  continues in. Nothing to resume: start fresh.
- a path: a checkpoint folder (`.../checkpoints/step_000010`) or a run directory.

A newer checkpoint that is incomplete or corrupt is skipped with a warning; if checkpoints
exist and none verifies, the run stops with an error instead of starting over.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from omegaconf import OmegaConf

from launcher.run_folder import CheckpointError, candidates, find_resumable, verify
from launcher.schema import Config
from launcher.validate import ConfigError

SAME_JOB_KEYS = ("model", "data", "rl", "optim")


def same_job(cfg: Config, saved_config: Path) -> bool:
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_config))
    except Exception:
        return False
    if not isinstance(saved, dict):
        return False
    mine = asdict(cfg)
    return (
        all(saved.get(k) == mine[k] for k in SAME_JOB_KEYS)
        and saved["trainer"]["seed"] == cfg.trainer.seed
    )


def earlier_runs(run_dir: Path) -> list[Path]:
    """Run directories beside this one (runs/DATE/TIME and runs/NAME), newest first."""
    found = {p.parent for p in run_dir.parent.parent.glob("*/*/config.yaml")}
    found |= {p.parent for p in run_dir.parent.glob("*/config.yaml")}
    found.discard(run_dir)
    return sorted(found, key=lambda p: (p / "config.yaml").stat().st_mtime, reverse=True)


def usable(run_dir: Path) -> tuple[Path | None, list[str]]:
    try:
        return find_resumable(run_dir)
    except CheckpointError as e:
        raise ConfigError(f"trainer.resume: {e}") from None


def resolve(cfg: Config, run_dir: Path) -> tuple[Path, Path | None, list[str]]:
    """(run directory to write, checkpoint to load or None, warnings to print)."""
    resume = cfg.trainer.resume
    if resume == "none":
        if candidates(run_dir):
            raise ConfigError(
                f"trainer.resume=none but {run_dir} already holds checkpoints; continue it with "
                "trainer.resume=auto or start elsewhere (hydra.run.dir=NEW_DIR)"
            )
        return run_dir, None, []
    if resume == "auto":
        checkpoint, warnings = usable(run_dir)
        if checkpoint is not None or (run_dir / "config.yaml").exists():
            return run_dir, checkpoint, warnings
        for earlier in earlier_runs(run_dir):
            if same_job(cfg, earlier / "config.yaml") and candidates(earlier):
                checkpoint, warnings = usable(earlier)
                return earlier, checkpoint, warnings
        return run_dir, None, []
    path = Path(resume).expanduser().resolve()
    if not path.exists():
        raise ConfigError(
            f"trainer.resume={resume!r} does not exist; give a checkpoint folder, a run directory, auto or none"
        )
    if (path / "checkpoints").is_dir():
        checkpoint, warnings = usable(path)
        if checkpoint is None:
            raise ConfigError(f"trainer.resume={resume!r} holds no checkpoint")
        return run_dir, checkpoint, warnings
    try:
        verify(path)
    except CheckpointError as e:
        raise ConfigError(f"trainer.resume={resume!r}: {e}") from None
    return run_dir, path, []
