"""A stall is named, not silent: each rank says where it is, and a thread watches.

The main thread marks every phase it enters (`phase(step, "update 1/1, micro-batch 3/8")`:
rollout, reference, each update micro-batch, optimizer, refresh, checkpoint, export). A daemon
thread rewrites `RUN_DIR/logs/heartbeats/rank_N.json` every few seconds with that phase, when it
began and a fresh timestamp. If the phase has not changed for `trainer.hang_timeout_s` (the
rank is stuck in a collective, or in anything else), the thread marks the heartbeat stalled,
dumps every thread's Python stack into the rank's log (faulthandler) and ends the process with
`STALL_EXIT_CODE`; torchrun then stops the other ranks. A rank that is stopped (SIGSTOP) or
frozen writes no heartbeat at all, so the launcher, reading the heartbeats, names it as the
rank the others waited for (`launcher.run_folder.describe_stall`).

The thread runs while the main thread waits inside a gloo or NCCL call (both release the
GIL). As a backstop the process-group timeout is set a minute beyond hang_timeout_s.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from launcher.run_folder import (
    STALL_EXIT_CODE,
    heartbeat_dir,
    heartbeat_interval,
    rank_log,
    write_json_atomic,
)


class Watchdog:
    def __init__(self, run_dir: str | Path, rank: int, hang_timeout_s: float):
        self.rank, self.timeout = rank, hang_timeout_s
        self.path = heartbeat_dir(run_dir) / f"rank_{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(rank_log(run_dir, rank), "a")  # stacks go here, past any console pipe
        faulthandler.register(signal.SIGUSR1, file=self.log, all_threads=True)  # stacks on demand
        self.step, self.name, self.since = 0, "startup", time.time()
        self.done = threading.Event()
        self.beat()
        self.thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self.thread.start()

    def phase(self, step: int, name: str) -> None:
        """The main thread enters `name` of `step`: progress, as far as the watchdog knows."""
        new_step = step != self.step
        self.step, self.name, self.since = step, name, time.time()
        if new_step:  # once a step from here too, so a rank stopped early in one is seen in it
            self.beat()

    def beat(self, **extra) -> None:
        write_json_atomic(self.path, {
            "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "step": self.step,
            "phase": self.name, "since": self.since, "beat": time.time(), **extra,
        })  # fmt: skip

    def _watch(self) -> None:
        interval = heartbeat_interval(self.timeout)
        while not self.done.wait(interval):
            stuck_for = time.time() - self.since
            if stuck_for < self.timeout:
                self.beat()
                continue
            self.beat(stalled=True)
            print(f"watchdog: rank {self.rank} made no progress for {stuck_for:.0f} s in step "
                  f"{self.step}, {self.name} (trainer.hang_timeout_s={self.timeout:g}); "
                  "Python stacks follow, then this rank exits", file=self.log, flush=True)  # fmt: skip
            faulthandler.dump_traceback(file=self.log, all_threads=True)
            self.log.flush()
            sys.stdout.flush()
            os._exit(STALL_EXIT_CODE)

    def close(self) -> None:
        """The run ended on this rank: the heartbeat says so, and the thread stops."""
        self.done.set()
        self.thread.join(timeout=10)
        self.beat(done=True)


class NoWatchdog:
    """For code that drives the trainer's pieces directly (tests, benchmarks): phases go nowhere."""

    def phase(self, step: int, name: str) -> None:
        pass

    def close(self) -> None:
        pass
