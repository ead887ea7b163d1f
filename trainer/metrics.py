"""The one place metrics leave the loop: reduced over dp, then written by rank 0.

Every step rank 0 appends one JSON object to `metrics.jsonl` in the run directory, logs
the same numbers to W&B (offline by default; a W&B failure never stops training) and
prints a progress line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.schema import Config


class DPSums:
    """Named sums (and maxima) over this rank's share, all-reduced over the dp group at once."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, float] = {}

    def add(self, name: str, value: torch.Tensor | float) -> None:
        value = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach().double()
        self.sums[name] = self.sums[name] + value if name in self.sums else value

    def max(self, name: str, value: float) -> None:
        self.maxes[name] = max(self.maxes.get(name, -math.inf), value)

    def reduce(self, group) -> dict[str, float]:
        names = sorted(self.sums)
        out: dict[str, float] = {}
        if names:
            t = torch.stack([self.sums[n].reshape(()) for n in names])
            dist.all_reduce(t, group=group)
            out.update(zip(names, t.tolist()))
        if self.maxes:
            keys = sorted(self.maxes)
            m = torch.tensor([self.maxes[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            out.update(zip(keys, m.tolist()))
        return out


class MetricsLogger:
    def __init__(self, cfg: Config, is_main: bool):
        self.cfg, self.is_main = cfg, is_main
        self.path = Path(cfg.run_dir) / "metrics.jsonl"
        self.wandb = None
        self.start = time.perf_counter()
        if is_main and cfg.logger.backend == "wandb" and cfg.logger.mode != "disabled":
            self.wandb = self._init_wandb()

    def _init_wandb(self):
        lg = self.cfg.logger
        try:
            import wandb

            run = wandb.init(
                project=lg.project,
                entity=lg.entity,
                group=lg.group,
                name=lg.name,
                tags=list(lg.tags),
                config=dataclasses.asdict(self.cfg),
                dir=self.cfg.run_dir,
                mode=lg.mode,
                settings=wandb.Settings(console="off", quiet=True),
            )
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
            return run
        except Exception as e:  # the dashboard is optional; training is not
            warnings.warn(
                f"W&B could not start ({type(e).__name__}: {e}); logging to metrics.jsonl only",
                stacklevel=1,
            )
            return None

    def log(self, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb is not None:
            try:
                self.wandb.log(metrics)
            except Exception as e:
                warnings.warn(f"W&B log failed ({e}); continuing with metrics.jsonl", stacklevel=1)
                self.wandb = None
        self._print(metrics)

    def _print(self, m: dict[str, float]) -> None:
        step, total = int(m["step"]), self.cfg.trainer.max_steps
        elapsed = time.perf_counter() - self.start
        eta = elapsed / step * (total - step)
        print(
            f"step {step}/{total} | reward {m['rollout/reward_mean']:.3f} | len {m['rollout/response_len_mean']:.1f}"
            f" | loss {m['train/loss']:+.4f} | kl {m['train/kl']:.4f} | grad {m['train/grad_norm']:.3f}"
            f" | {m['time/step_s']:.2f}s/step | eta {eta:.0f}s",
            file=sys.stdout,
            flush=True,
        )

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
