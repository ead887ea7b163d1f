"""The sweep report: a markdown table and PNG plots comparing the jobs of one sweep directory.

Layouts must not change the numbers, so besides speed and memory it gives the largest
difference in loss and grad-norm between any job and the first one at equal steps.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf


@dataclass
class Job:
    name: str
    run_dir: Path
    exit_code: int | None  # None: no status.json (still running, or killed with the launcher)
    error: str | None
    rows: list[dict] = field(default_factory=list)

    def series(self, key: str) -> dict[int, float]:
        return {int(r["step"]): r[key] for r in self.rows if key in r}

    def median(self, key: str) -> float | None:
        values = [r[key] for r in self.rows[1:] or self.rows if key in r]  # step 1 includes warm-up
        return statistics.median(values) if values else None


def load_jobs(sweep_dir: Path) -> list[Job]:
    jobs = []
    for run_dir in sorted(p for p in Path(sweep_dir).iterdir() if p.is_dir()):
        status_file, config_file = run_dir / "status.json", run_dir / "config.yaml"
        if not status_file.exists() and not config_file.exists():
            continue
        status = json.loads(status_file.read_text()) if status_file.exists() else {}
        name = status.get("name")
        if not name and config_file.exists():
            name = OmegaConf.load(config_file).logger.name
        metrics = run_dir / "metrics.jsonl"
        rows = (
            [json.loads(line) for line in metrics.read_text().splitlines()]
            if metrics.exists()
            else []
        )
        jobs.append(
            Job(name or run_dir.name, run_dir, status.get("exit_code"), status.get("error"), rows)
        )
    return jobs


def max_difference(a: dict[int, float], b: dict[int, float]) -> tuple[float, int | None]:
    common = sorted(set(a) & set(b))
    if not common:
        return 0.0, None
    step = max(common, key=lambda s: abs(a[s] - b[s]))
    return abs(a[step] - b[step]), step


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def plot(jobs: list[Job], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    names = [j.name for j in jobs]
    paths = []
    for key, label, fname in (
        ("perf/tokens_per_s", "tokens/s (median step)", "throughput.png"),
        ("perf/peak_mem_gb", "peak memory, GB", "peak_memory.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(names, [j.median(key) or 0.0 for j in jobs])
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=20)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        paths.append(out_dir / fname)
    for key, label, fname in (
        ("rollout/reward_mean", "reward", "reward.png"),
        ("train/grad_norm", "grad norm", "grad_norm.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for j in jobs:
            s = j.series(key)
            ax.plot(list(s), list(s.values()), marker=".", label=j.name)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        paths.append(out_dir / fname)
    return paths


def write_report(sweep_dir: Path) -> Path:
    sweep_dir = Path(sweep_dir)
    jobs = load_jobs(sweep_dir)
    done = [j for j in jobs if j.rows]
    base = done[0] if done else None
    lines = [
        f"# Sweep report: {sweep_dir}",
        "",
        f"{len(jobs)} job(s); differences are against `{base.name}`."
        if base
        else f"{len(jobs)} job(s); none logged metrics.",
        "",
        "| job | status | steps | s/step | tokens/s | tokens/s/GPU | MFU | peak mem GB | final reward "
        "| max abs diff loss (step) | max abs diff grad norm (step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst: dict[str, tuple[float, int | None, str | None]] = {
        "train/loss": (0.0, None, None),
        "train/grad_norm": (0.0, None, None),
    }
    for j in jobs:
        status = {None: "no status", 0: "ok"}.get(j.exit_code, f"failed ({j.exit_code})")
        diffs: dict[str, str] = {}
        for key in worst:
            d, step = max_difference(j.series(key), base.series(key)) if base else (0.0, None)
            diffs[key] = f"{d:.3g} ({step})" if step is not None else "-"
            if step is not None and d >= worst[key][0]:
                worst[key] = (d, step, j.name)
        final = j.rows[-1]["rollout/reward_mean"] if j.rows else None
        lines.append(
            f"| {j.name} | {status} | {len(j.rows)} | {fmt(j.median('time/step_s'), '.3f')} "
            f"| {fmt(j.median('perf/tokens_per_s'), ',.0f')} | {fmt(j.median('perf/tokens_per_s_per_gpu'), ',.0f')} "
            f"| {fmt(j.median('perf/mfu'), '.1%')} | {fmt(max((r.get('perf/peak_mem_gb', 0) for r in j.rows), default=None), '.2f')} "
            f"| {fmt(final, '.3f')} | {diffs['train/loss']} | {diffs['train/grad_norm']} |"
        )
    lines.append("")
    for key, (d, step, name) in worst.items():
        if step is not None:
            lines.append(
                f"Largest `{key}` difference between jobs at equal steps: {d:.3g} ({name}, step {step})."
            )
    if done:
        paths = plot(done, sweep_dir / "report")
        lines += ["", *[f"![{p.stem}](report/{p.name})" for p in paths]]
    out = sweep_dir / "sweep_report.md"
    out.write_text("\n".join(lines) + "\n")
    return out
