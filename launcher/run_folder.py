"""The run folder's layout, shared by the launcher and the workers (no torch here).

RUN_DIR/config.yaml                 the resolved config the workers read
RUN_DIR/STOP                        written by a launcher: checkpoint and stop at the step's end
RUN_DIR/logs/rank_N.log             each rank's output (rank 0 also on the console)
RUN_DIR/logs/launcher.log           torchrun's lines and rank 0's, as the launcher saw them
RUN_DIR/logs/heartbeats/rank_N.json where rank N is (step, phase, since when), rewritten
                                    every few seconds by its watchdog (trainer/watchdog.py)
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

# How a worker ends, and what the launcher makes of it: after printing one `error: ...` line,
# 2 (bad input found inside the workers) or 3 (the run went wrong: replicas drifted apart);
# 124 when its watchdog found no progress for trainer.hang_timeout_s.
BAD_INPUT_EXIT_CODE, RUN_FAULT_EXIT_CODE = 2, 3
RUN_ERROR_EXIT_CODES = (BAD_INPUT_EXIT_CODE, RUN_FAULT_EXIT_CODE)
STALL_EXIT_CODE = 124
# Rank 0's line when its start-up is done (imports, process group, model, engine); bench.py
# reads the start-up's split from it.
READY_LINE = "ready after "


def stop_file(run_dir: str | Path) -> Path:
    """Its existence asks the workers to checkpoint and stop at the next step boundary."""
    return Path(run_dir) / "STOP"


def rank_log(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"rank_{rank}.log"


def heartbeat_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "logs" / "heartbeats"


def heartbeat_interval(hang_timeout_s: float) -> float:
    """Seconds between heartbeats: a few per timeout, at most 5."""
    return min(5.0, hang_timeout_s / 6)


def write_json_atomic(path: Path, data: dict) -> None:
    """Readers see the old file or the new one. The temporary file is this thread's own: a
    rank's main thread and its watchdog both write its heartbeat, and with one name per process
    one thread's rename took the file the other had just written (FileNotFoundError)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_heartbeats(run_dir: str | Path) -> dict[int, dict]:
    """Every heartbeat this node can see, by rank (the whole job's on a shared run folder)."""
    out = {}
    folder = heartbeat_dir(run_dir)
    for path in folder.glob("rank_*.json") if folder.is_dir() else []:
        try:
            beat = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # being replaced right now: the next read gets it
        out[int(beat["rank"])] = beat
    return dict(sorted(out.items()))


def describe_stall(beats: dict[int, dict], hang_timeout_s: float, now: float | None = None) -> str:
    """One summary line naming the stalled rank(s), then one line per rank: step, phase, how long.

    A rank whose heartbeat stopped (stopped, frozen or gone) is the one holding the others up;
    if every rank still beats, they wait on each other: in different phases, a collective not
    every rank reached."""
    now = time.time() if now is None else now
    stale_after = 3 * heartbeat_interval(hang_timeout_s) + 2
    silent = [r for r, b in beats.items() if not b.get("done") and now - b["beat"] > stale_after]

    def where(b: dict) -> str:
        return f"step {b['step']}, {b['phase']}"

    lines = []
    for r, b in beats.items():
        if r in silent:
            state = f"no heartbeat for {now - b['beat']:.0f} s (stopped, frozen or killed)"
        elif b.get("stalled"):
            state = f"no progress for {now - b['since']:.0f} s; its Python stack is in its log"
        else:
            state = f"in this phase for {now - b['since']:.0f} s"
        lines.append(f"  rank {r}: {where(b)}: {state}")
    phases = {where(b) for b in beats.values()}
    if silent:
        head = (
            f"the run stalled: rank(s) {', '.join(map(str, silent))} stopped responding "
            f"(last seen in {where(beats[silent[0]])}); the other ranks waited for them"
        )
    elif len(phases) > 1:
        head = (
            f"the run stalled: no progress for {hang_timeout_s:g} s; every rank is alive, in "
            f"{len(phases)} different phases (a collective that not every rank reached)"
        )
    elif phases:
        head = f"the run stalled: no progress for {hang_timeout_s:g} s; every rank waits in {phases.pop()}"
    else:
        head = "the run stalled and no rank wrote a heartbeat"
    tail = f"  (trainer.hang_timeout_s={hang_timeout_s:g}; raise it if a phase legitimately takes longer)"
    return "\n".join([head, *lines, tail])


# -- checkpoints -------------------------------------------------------------------------------

META = "meta.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_\d{6}$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which and why."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def file_sizes(folder: Path) -> dict[str, int]:
    return {
        p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != META
    }


def verify(folder: Path) -> dict:
    """The checkpoint's meta.json if every file it lists is there at its recorded size."""
    meta_path = folder / META
    if not meta_path.is_file():
        raise CheckpointError(f"{folder} is incomplete: no {META} (the save did not finish)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{folder}/{META} is corrupt: {e}") from None
    actual = file_sizes(folder)
    for name, size in meta["files"].items():
        if name not in actual:
            raise CheckpointError(f"{folder} is incomplete: {name} is missing")
        if actual[name] != size:
            raise CheckpointError(
                f"{folder} is corrupt: {name} has {actual[name]} bytes, {size} were written"
            )
    return meta


def candidates(run_dir: str | Path) -> list[Path]:
    """Committed checkpoints of a run, newest first (`latest` first when it names one)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = sorted(
        (p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), reverse=True
    )
    latest = root / LATEST
    if latest.is_file() and (root / latest.read_text().strip()).is_dir():
        first = root / latest.read_text().strip()
        found = [first, *(p for p in found if p != first)]
    return found


def find_resumable(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and a warning for each newer one that did not.

    Raises if checkpoints exist but none is usable: a run never silently starts over."""
    warnings: list[str] = []
    found = candidates(run_dir)
    for folder in found:
        try:
            verify(folder)
            return folder, warnings
        except CheckpointError as e:
            warnings.append(f"{e}; trying an older checkpoint")
    if found:
        raise CheckpointError(
            f"no usable checkpoint in {checkpoint_dir(run_dir)} ({'; '.join(warnings)}); "
            "fix or remove them, or start a new run with trainer.resume=none"
        )
    return None, warnings
