"""The watchdog and the launcher's account of a stall, without a distributed run."""

import subprocess
import sys

from conftest import REPO, env

from launcher.run_folder import STALL_EXIT_CODE, describe_stall, read_heartbeats


def beat(rank, step, phase, since, at, **extra):
    return {"rank": rank, "pid": 100 + rank, "host": "h", "step": step, "phase": phase,
            "since": since, "beat": at, **extra}  # fmt: skip


def test_ranks_in_different_phases_are_a_collective_mismatch():
    now = 1000.0
    beats = {
        0: beat(0, 1, "update 1/1, micro-batch 30/31", 400, 998, stalled=True),
        1: beat(1, 1, "update 1/1, optimizer step", 401, 999, stalled=True),
    }
    first, *lines = describe_stall(beats, 600, now).splitlines()
    assert "every rank is alive" in first and "2 different phases" in first
    assert (
        lines[0]
        == "  rank 0: step 1, update 1/1, micro-batch 30/31: no progress for 600 s; its Python stack is in its log"
    )
    assert lines[1].startswith(
        "  rank 1: step 1, update 1/1, optimizer step: no progress for 599 s"
    )


def test_a_silent_rank_is_the_one_named():
    beats = {0: beat(0, 3, "rollout", 100, 160, stalled=True), 1: beat(1, 3, "rollout", 95, 100)}
    first = describe_stall(beats, 60, now=161).splitlines()[0]
    assert first.startswith(
        "the run stalled: rank(s) 1 stopped responding (last seen in step 3, rollout)"
    )


def test_the_watchdog_dumps_stacks_and_exits_when_a_phase_outlasts_the_timeout(tmp_path):
    code = (
        "import time; from trainer.watchdog import Watchdog\n"
        f"w = Watchdog({str(tmp_path)!r}, 3, 0.6)\n"
        "w.phase(7, 'update 1/1, micro-batch 2/5')\n"
        "def waiting_in_a_collective(): time.sleep(30)\n"
        "waiting_in_a_collective()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(), timeout=20)
    assert out.returncode == STALL_EXIT_CODE
    log = (tmp_path / "logs" / "rank_3.log").read_text()
    assert (
        "watchdog: rank 3 made no progress" in log and "step 7, update 1/1, micro-batch 2/5" in log
    )
    assert "in waiting_in_a_collective" in log  # the main thread's stack
    (b,) = read_heartbeats(tmp_path).values()
    assert b["stalled"] and b["step"] == 7


def test_heartbeats_written_from_two_threads_at_once_never_fail(tmp_path):
    """A rank's main thread (entering a phase) and its watchdog thread (every few seconds) both
    rewrite its heartbeat: concurrent writes leave one whole file and raise nothing (with one
    temporary file per process, one thread's rename took the other's: FileNotFoundError)."""
    import json
    import threading

    from launcher.run_folder import write_json_atomic

    path, errors = tmp_path / "rank_0.json", []

    def write(who: int) -> None:
        try:
            for i in range(2000):
                write_json_atomic(path, {"who": who, "i": i})
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(path.read_text())["i"] == 1999
    assert [p.name for p in tmp_path.iterdir()] == ["rank_0.json"]  # no temporary file left
