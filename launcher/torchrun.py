"""Start `torch.distributed.run` for one node (or, for one rank, the worker itself), stream
rank 0, report a failing rank.

Each worker writes `logs/rank_{N}.log` in the run directory (rank 0 also prints to the
console); torchrun's own lines and rank 0's output reach this process on one pipe, which
is echoed here and kept in `logs/launcher.log`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from launcher import bytecode
from launcher.run_folder import (
    RUN_ERROR_EXIT_CODES,
    STALL_EXIT_CODE,
    describe_stall,
    heartbeat_dir,
    rank_log,
    read_heartbeats,
    stop_file,
)
from launcher.schema import Config

FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
TAIL_LINES = 20
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \| (.*)$")


def one_process(cfg: Config) -> bool:
    """A run of one rank on one node starts its worker directly: torchrun's agent would import
    torch (seconds, before the worker starts its own import) only to start one process."""
    return cfg.parallel.nnodes == 1 and cfg.parallel.nproc_per_node == 1


def worker_command(cfg: Config, config_path: Path) -> list[str]:
    if one_process(cfg):
        return [sys.executable, "-m", "trainer.main", str(config_path)]
    return torchrun_command(cfg, config_path)


def torchrun_command(cfg: Config, config_path: Path) -> list[str]:
    p = cfg.parallel
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={p.nnodes}",
        f"--nproc-per-node={p.nproc_per_node}",
        "--max-restarts=0",
    ]
    if p.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={p.rdzv_endpoint}",
            f"--rdzv-id={p.rdzv_id}",
        ]
    return [*cmd, "-m", "trainer.main", str(config_path)]


def worker_env(cfg: Config) -> dict[str, str]:
    env = dict(os.environ)
    threads = max(1, (os.cpu_count() or 1) // cfg.parallel.nproc_per_node)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Workers import this checkout even when it is not pip-installed.
    root = str(Path(__file__).resolve().parents[1])
    # the rollout's KV cache and the update's activations come and go each step in different
    # sizes: expandable segments keep that from fragmenting the cache (a user's setting wins)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    if one_process(cfg):  # what torchrun would set; no MASTER_ADDR: the worker keeps its store
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0")
        env.pop("MASTER_ADDR", None)
    if cache := compile_cache(cfg):  # warm starts: compiled kernels outlive the run
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_dir(cache, Path(root))))
        env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
        bytecode.keep_bytecode(env, bytecode_dir(cache), bytecode.package_dir())
    return env


def compile_cache(cfg: Config) -> Path | None:
    return (
        Path(cfg.trainer.compile_cache_dir).expanduser() if cfg.trainer.compile_cache_dir else None
    )


# The project's custom ops (torch.library) whose fakes give their output shapes by Python rules of
# their own (decode_matmul's split count, say): Inductor's cache key covers the traced graph, not
# those rules, so a graph cached under another version of them replays with the old shapes (and
# fails its size asserts, or worse). Their source picks the Inductor cache's folder.
CUSTOM_OPS = ("trainer/decode_attention.py", "trainer/decode_matmul.py")


def inductor_dir(cache: Path, root: Path) -> Path:
    """Inductor's cache folder in the compile cache, one per version of the custom ops' source."""
    digest = hashlib.sha256(b"".join((root / f).read_bytes() for f in CUSTOM_OPS)).hexdigest()
    return cache / "inductor" / f"ops-{digest[:12]}"


def bytecode_dir(cache: Path) -> Path:
    """The workers' bytecode folder in the compile cache (`keep_bytecode` decides if it is used)."""
    return cache / "pycache"


def describe_failure(
    output: str, run_dir: Path, code: int, hang_timeout_s: float, direct: bool = False
) -> tuple[str, int]:
    """What went wrong, first line first, and the launcher's exit code: a stall (every rank's step
    and phase), a worker's own one-line error (trainer.errors.RunError, its exit code), or the
    rank that failed first and its last lines. `direct`: the one worker ran without torchrun,
    and `code` is its own exit status (negative: the signal that ended it)."""
    beats = read_heartbeats(run_dir)
    if any(b.get("stalled") for b in beats.values()):
        return "error: " + describe_stall(beats, hang_timeout_s), STALL_EXIT_CODE
    if direct:
        rank, exitcode, code = 0, code, code if code > 0 else 1
    # torchrun lists every rank it stopped, then the one that failed first: read that one. When
    # that one ended by torchrun's own SIGTERM (it stops the survivors of a failure, and their
    # times can race the real failure's), a rank that ended any other way is the cause.
    elif match := FAILED_RANK.search(output[output.rfind("Root Cause") :]):
        rank, exitcode = int(match[1]), int(match[2])
        if exitcode == -signal.SIGTERM:
            others = [
                (int(r), int(c)) for r, c in FAILED_RANK.findall(output) if int(c) != exitcode
            ]
            rank, exitcode = others[0] if others else (rank, exitcode)
    else:
        return f"error: the workers exited with code {code}; logs are in {run_dir / 'logs'}", code
    log = rank_log(run_dir, rank)
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    if exitcode in RUN_ERROR_EXIT_CODES and (
        errors := [x for x in lines if x.startswith("error: ")]
    ):
        return errors[-1], exitcode
    cause = f"killed by signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"
    tail = "\n".join(f"  | {line}" for line in lines[-TAIL_LINES:])
    return f"error: rank {rank} failed ({cause}); last lines of {log}:\n{tail}", code


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (torchrun's workers run in sessions of their own, so a
    process group does not reach them; /proc does, on Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class StallMonitor:
    """Reads the heartbeats while the run goes on. When a rank's watchdog declares a stall, it
    gives the other ranks a few seconds to declare theirs (their stacks go to their logs), asks
    the rest for their stacks (SIGUSR1) and ends every process: torchrun alone would wait 30 s
    on a rank that is stopped."""

    poll_s, grace_s = 2.0, 5.0

    def __init__(self, proc: subprocess.Popen, run_dir: Path):
        self.proc, self.run_dir = proc, run_dir
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def watch(self) -> None:
        first_seen = None
        while not self.done.wait(self.poll_s):
            beats = read_heartbeats(self.run_dir)
            if not any(b.get("stalled") for b in beats.values()):
                continue
            first_seen = first_seen or time.time()
            if time.time() - first_seen >= self.grace_s:
                tree = process_tree(self.proc.pid)
                signal_all([b["pid"] for b in beats.values() if b["pid"] in tree], signal.SIGUSR1)
                time.sleep(1)
                signal_all(tree, signal.SIGKILL)
                return

    def close(self) -> None:
        self.done.set()


class ConsoleStream:
    """Echo the workers' output. On a terminal, rank 0's step lines drive a progress bar
    (step, reward, step time, ETA) instead of scrolling; everything else prints above it."""

    def __init__(self) -> None:
        self.progress = None
        if sys.stdout.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
            )
            self.task = self.progress.add_task("", total=None)
            self.progress.start()

    def write(self, line: str) -> None:
        match = STEP_LINE.match(line) if self.progress else None
        if match and self.progress:
            step, total, rest = int(match[1]), int(match[2]), match[3]
            self.progress.update(self.task, completed=step, total=total, description=rest)
        elif self.progress:
            self.progress.console.print(line.rstrip("\n"), markup=False, highlight=False)
        else:
            sys.stdout.write(line)

    def close(self) -> None:
        if self.progress:
            self.progress.stop()


class GracefulStop:
    """SIGINT / SIGTERM to the launcher: the first asks for a checkpoint and a clean stop, a
    second stops the workers now. torchrun runs in its own session, so a Ctrl-C in the
    terminal reaches only this process and not the workers mid-step."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path):
        self.proc, self.path = proc, stop_file(run_dir)
        self.previous = {
            sig: signal.signal(sig, self.handle) for sig in (signal.SIGINT, signal.SIGTERM)
        }

    kill_after_s = 5.0  # a rank stuck in a collective never runs its SIGTERM handler

    def handle(self, signum: int, frame) -> None:
        if self.path.exists():
            print("\nsecond signal: stopping the workers now", file=sys.stderr, flush=True)
            tree = process_tree(self.proc.pid)  # before torchrun exits and its workers lose it
            self.proc.send_signal(signal.SIGTERM)
            timer = threading.Timer(self.kill_after_s, signal_all, (tree, signal.SIGKILL))
            timer.daemon = True
            timer.start()
            return
        self.path.touch()
        print(f"\n{signal.Signals(signum).name}: checkpointing at the end of this step, then stopping "
              "(signal again to stop now)", file=sys.stderr, flush=True)  # fmt: skip

    def restore(self) -> bool:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        requested = self.path.exists()
        self.path.unlink(missing_ok=True)
        return requested


def die_with_launcher() -> None:
    """Run in the torchrun child before exec: SIGTERM it if the launcher dies (Linux), so a
    launcher killed outright never leaves a run going on in its own session."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_workers(cfg: Config, config_path: Path, run_dir: Path) -> tuple[int, str | None]:
    """Run torchrun to completion: (0, None), or its exit code and the failure, also printed."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    stop_file(run_dir).unlink(missing_ok=True)
    shutil.rmtree(heartbeat_dir(run_dir), ignore_errors=True)  # an earlier run's are not this one's
    env = worker_env(cfg)
    if (cache := compile_cache(cfg)) and bytecode.needs_fill(env, prefix := bytecode_dir(cache)):
        written, seconds = bytecode.fill(prefix, bytecode.sources())
        print(f"first launch: {written} modules compiled to bytecode in {seconds:.1f} s ({prefix})")
    proc = subprocess.Popen(
        worker_command(cfg, config_path), env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True, preexec_fn=die_with_launcher,
    )  # fmt: skip
    stop = GracefulStop(proc, run_dir)
    monitor = StallMonitor(proc, run_dir)
    kept: list[str] = []  # the failure summary is at the end
    console = ConsoleStream()
    try:
        with open(run_dir / "logs" / "launcher.log", "a") as log:
            for line in proc.stdout or ():
                console.write(line)
                log.write(line)
                kept.append(line)
    finally:
        console.close()
        code = proc.wait()
        monitor.close()
        stopped = stop.restore()
    if code == 0:
        if stopped:
            print(
                f"stopped at a checkpoint; continue with trainer.resume=auto hydra.run.dir={run_dir}"
            )
        return 0, None
    failure, code = describe_failure(
        "".join(kept[-400:]), run_dir, code, cfg.trainer.hang_timeout_s, one_process(cfg)
    )
    print(failure, file=sys.stderr)
    return code, failure.splitlines()[0].removeprefix("error: ")
