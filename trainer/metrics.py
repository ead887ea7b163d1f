"""The one place metrics leave the loop: reduced over dp, then written by rank 0.

Every step rank 0 appends one JSON object to `metrics.jsonl` in the run directory, logs
the same numbers to W&B (offline by default; a W&B failure never stops training) and
prints a progress line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.schema import Config


class DPSums:
    """Named sums (and maxima) over this rank's share, all-reduced over the dp group at once."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}
        self.mins: dict[str, torch.Tensor] = {}

    def _tensor(self, value: torch.Tensor | float) -> torch.Tensor:
        # kept on the device: a tensor value costs no host sync until `reduce`
        return torch.as_tensor(value, dtype=torch.float64, device=self.device).detach().double()

    def add(self, name: str, value: torch.Tensor | float) -> None:
        value = self._tensor(value)
        self.sums[name] = self.sums[name] + value if name in self.sums else value

    def max(self, name: str, value: torch.Tensor | float) -> None:
        value = self._tensor(value)
        self.maxes[name] = torch.maximum(self.maxes[name], value) if name in self.maxes else value

    def min(self, name: str, value: torch.Tensor | float) -> None:
        value = self._tensor(value)
        self.mins[name] = torch.minimum(self.mins[name], value) if name in self.mins else value

    def reduce(self, group) -> dict[str, float]:
        """Collective over `group`: every rank must have added the same names (they come from
        code paths every rank runs, empty micro-batches included)."""
        names = sorted(self.sums)
        out: dict[str, float] = {}
        if names:
            t = torch.stack([self.sums[n].reshape(()) for n in names])
            dist.all_reduce(t, group=group)
            out.update(zip(names, t.tolist()))
        for values, op in ((self.maxes, dist.ReduceOp.MAX), (self.mins, dist.ReduceOp.MIN)):
            if values:
                keys = sorted(values)
                m = torch.stack([values[k].reshape(()) for k in keys])
                dist.all_reduce(m, op=op, group=group)
                out.update(zip(keys, m.tolist()))
        return out


class MetricsLogger:
    def __init__(self, cfg: Config, is_main: bool):
        self.cfg, self.is_main = cfg, is_main
        self.path = Path(cfg.run_dir) / "metrics.jsonl"
        self.wandb = None
        self.start = time.perf_counter()
        self.first_step: int | None = None
        self.last_eval: tuple[int, float, float] | None = None  # step, pass@1, pass@k
        if is_main and cfg.logger.backend == "wandb" and cfg.logger.mode != "disabled":
            self.wandb = self._init_wandb()

    def _init_wandb(self):
        """Start the W&B run; if `online` fails (no network, no key), fall back to offline."""
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            return self._start_wandb(self.cfg.logger.mode)
        except Exception as e:  # the dashboard is optional; training is not
            if self.cfg.logger.mode == "online":
                print(
                    f"warning: W&B online failed ({type(e).__name__}: {e}); logging offline",
                    file=sys.stderr,
                )
                try:
                    return self._start_wandb("offline")
                except Exception as e2:
                    e = e2
            print(
                f"warning: W&B could not start ({type(e).__name__}: {e}); metrics.jsonl only",
                file=sys.stderr,
            )
            return None

    def _start_wandb(self, mode: str):
        import wandb

        lg = self.cfg.logger
        run = wandb.init(
            project=lg.project, entity=lg.entity, group=lg.group, name=lg.name, tags=list(lg.tags),
            config=dataclasses.asdict(self.cfg), dir=self.cfg.run_dir, mode=mode,  # type: ignore[arg-type]
            settings=wandb.Settings(console="off", init_timeout=60),
        )  # fmt: skip
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        where = (
            f"offline, `wandb sync {run.dir.removesuffix('/files')}` uploads it"
            if mode == "offline"
            else run.url
        )
        print(f"W&B run {lg.name or run.id} (group {lg.group or '-'}): {where}", flush=True)
        return run

    def truncate(self, step: int) -> None:
        """On resume: drop rows past the checkpoint's step, so the file reads as one run."""
        if self.is_main and self.path.exists():
            rows = [
                line
                for line in self.path.read_text().splitlines()
                if json.loads(line)["step"] <= step
            ]
            self.path.write_text("".join(row + "\n" for row in rows))

    def log(self, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb is not None:
            try:
                self.wandb.log(metrics)
            except Exception as e:
                print(
                    f"warning: W&B log failed ({e}); continuing with metrics.jsonl only",
                    file=sys.stderr,
                )
                self.wandb = None
        self._print(metrics)

    def _print(self, m: dict[str, float]) -> None:
        step, total = int(m["step"]), self.cfg.trainer.max_steps
        if self.first_step is None:  # a resumed run starts past step 1
            self.first_step = step
        elapsed = time.perf_counter() - self.start
        eta = elapsed / (step - self.first_step + 1) * (total - step)
        if "eval/pass@1" in m:
            self.last_eval = (step, m["eval/pass@1"], m["eval/pass@k"])
        evaluation = ""
        if self.last_eval is not None:
            at, p1, pk = self.last_eval
            evaluation = f" | pass@1 {p1:.3f} pass@{self.cfg.trainer.eval_k} {pk:.3f} (step {at})"
        print(
            f"step {step}/{total} | reward {m['rollout/reward_mean']:.3f} | len {m['rollout/response_len_mean']:.1f}"
            f" | loss {m['train/loss']:+.4f} | kl {m['train/kl']:.4f} | grad {m['train/grad_norm']:.3f}"
            f" | {m['time/step_s']:.2f}s/step | eta {eta:.0f}s{evaluation}",
            file=sys.stdout,
            flush=True,
        )

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
