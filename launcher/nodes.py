"""Several nodes, one job: the launchers agree on one run folder before any worker starts.

Each node runs the same command; each launcher composes its config and would name its run
folder by its own clock (`runs/DATE/TIME`) and pick a checkpoint to resume from what its own
disk shows. With `parallel.nnodes > 1` they agree first, over the rendezvous endpoint, before
torchrun uses it: the launcher that can listen on `parallel.rdzv_endpoint` (the host it names)
hosts the agreement; the others connect, send their config, and get back the host's run
folder and checkpoint, or one line saying which key differs between the nodes. The host
stops listening before it answers, so the port is free for torchrun's own rendezvous store,
which the other nodes' torchrun agents wait for.

The run folder travels relative to the working directory when it is inside it (so each
node finds it in its own checkout, on shared storage the same folder), else as an absolute
path. Whether every node really sees the same folder is checked by the workers
(trainer/main.py, a marker written by rank 0), since only they run on every node at once.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

from launcher.schema import Config
from launcher.validate import ConfigError

JOIN_TIMEOUT_S = 600.0  # as torchrun's own rendezvous join timeout
PER_NODE_KEYS = ("run_dir", "trainer.resume")  # what a node may see differently before agreeing


def flat(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def relative(path: Path | None, base: Path) -> str | None:
    if path is None:
        return None
    path = path.resolve()
    return str(path.relative_to(base)) if path.is_relative_to(base) else str(path)


def first_difference(mine: dict, theirs: dict) -> str | None:
    for key in sorted(set(mine) | set(theirs)):
        if key not in PER_NODE_KEYS and mine.get(key) != theirs.get(key):
            return f"{key} is {theirs.get(key)!r} there and {mine.get(key)!r} on the hosting node"
    return None


def send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def receive(conn: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("closed before a whole message")
        data += chunk
    return json.loads(data)


def endpoint(cfg: Config) -> tuple[str, int]:
    host, _, port = (cfg.parallel.rdzv_endpoint or "").rpartition(":")
    return host, int(port)


def host_agreement(server: socket.socket, cfg: Config, proposal: dict, nnodes: int) -> dict:
    """Accept the other nnodes - 1 launchers, close the port, answer every one the same."""
    conns: list[socket.socket] = []
    peers: list[dict] = []
    server.settimeout(JOIN_TIMEOUT_S)
    try:
        while len(conns) < nnodes - 1:
            conn, _ = server.accept()
            conn.settimeout(60)
            conns.append(conn)
            peers.append(receive(conn))
    except TimeoutError:
        raise ConfigError(
            f"parallel.nnodes={nnodes}: {nnodes - 1 - len(conns)} node(s) did not join at "
            f"{cfg.parallel.rdzv_endpoint} within {JOIN_TIMEOUT_S:.0f} s; start the same command on every node"
        ) from None
    finally:
        server.close()  # torchrun's rendezvous store takes this port next
    errors = [d for p in peers if (d := first_difference(proposal["config"], p["config"]))]
    answer = {**proposal, "error": None}
    if errors:
        answer["error"] = (
            f"parallel.nnodes={nnodes}: the nodes were started with different configs ({errors[0]}); "
            "start the same command on every node"
        )
    for conn in conns:
        send(conn, answer)
        conn.settimeout(10)
        try:
            conn.recv(1)  # the peer closes first: the TIME_WAIT stays on its side, not this port
        except OSError:
            pass
        conn.close()
    return answer


def join_agreement(cfg: Config, proposal: dict) -> dict:
    host, port = endpoint(cfg)
    deadline, said = time.time() + JOIN_TIMEOUT_S, False
    while True:
        try:
            with socket.create_connection((host, port), timeout=10) as conn:
                send(conn, proposal)
                return receive(conn)
        except (ConnectionError, OSError):
            if time.time() > deadline:
                raise ConfigError(
                    f"parallel.rdzv_endpoint={cfg.parallel.rdzv_endpoint}: no launcher hosted the "
                    f"agreement there within {JOIN_TIMEOUT_S:.0f} s; start the same command on the "
                    "node that address names"
                ) from None
            if not said:
                print(f"waiting for the node at {cfg.parallel.rdzv_endpoint}", file=sys.stderr)
                said = True
            time.sleep(0.5)


def agree(cfg: Config, run_dir: Path, checkpoint: Path | None) -> tuple[Path, Path | None]:
    """(run folder, checkpoint) for this job on every node: the hosting launcher's."""
    cwd = Path.cwd().resolve()
    proposal = {
        "run_dir": relative(run_dir, cwd),
        "checkpoint": relative(checkpoint, run_dir.resolve()),
        "config": flat(asdict(cfg)),
    }
    host, port = endpoint(cfg)
    try:
        server = socket.create_server((socket.gethostbyname(host), port))
    except OSError:  # not the named host, or another launcher here already hosts
        answer = join_agreement(cfg, proposal)
    else:
        answer = host_agreement(server, cfg, proposal, cfg.parallel.nnodes)
    if answer["error"]:
        raise ConfigError(answer["error"])
    agreed = cwd / answer["run_dir"]
    ckpt = answer["checkpoint"]
    return agreed, None if ckpt is None else agreed / ckpt
