"""What each torchrun worker runs: `python -m trainer.main RUN_DIR/config.yaml`.

Process group, meshes, sharded Qwen3, then the GRPO loop (or, with trainer.smoke_test,
one forward and backward pass that checks the sharded model).
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

IMPORTED_FROM = time.perf_counter()  # before torch and transformers: start-up's first lap

from trainer.lean_imports import skip_sklearn  # noqa: E402

skip_sklearn()  # before trainer.model imports transformers' models (see trainer/lean_imports.py)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from launcher import schema  # noqa: E402
from launcher.run_folder import READY_LINE  # noqa: E402
from trainer.data import load_task  # noqa: E402
from trainer.errors import RunError  # noqa: E402
from trainer.model import CausalLM, build_model, hf_config  # noqa: E402
from trainer.parallel import ParallelState, exit_process, shutdown  # noqa: E402
from trainer.watchdog import Watchdog  # noqa: E402


def redirect_output(log_path: Path, tee: bool) -> None:
    """Send this process's stdout and stderr (C level too) to `log_path`; tee keeps the console."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab", buffering=0)
    sys.stdout.flush()
    sys.stderr.flush()
    if not tee:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        return
    read_end, write_end = os.pipe()
    console = os.dup(1)

    def pump() -> None:
        while chunk := os.read(read_end, 1 << 16):
            os.write(console, chunk)
            log.write(chunk)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)

    def drain() -> None:  # close our ends so the pump reads EOF, then let it finish
        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        thread.join(timeout=5)

    atexit.register(drain)


def init_distributed(device_type: str, hang_timeout_s: float) -> torch.device:
    # the watchdog names a stall after hang_timeout_s; the process group's own timeout is the
    # backstop, a minute later
    timeout = datetime.timedelta(seconds=hang_timeout_s + 60)
    # one rank started without torchrun (launcher/torchrun.py, one_process): an in-process
    # store, no port to find
    alone = "MASTER_ADDR" not in os.environ
    store = dist.HashStore() if alone else None
    rank, world = (0, 1) if alone else (-1, -1)  # -1: from the environment
    if device_type == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group(
            "nccl", device_id=device, timeout=timeout, store=store, rank=rank, world_size=world
        )
        return device
    dist.init_process_group("gloo", timeout=timeout, store=store, rank=rank, world_size=world)
    return torch.device("cpu")


def smoke_test(model: CausalLM, ps: ParallelState, vocab_size: int) -> float:
    """One forward and backward on rank-specific tokens; returns the loss."""
    gen = torch.Generator().manual_seed(ps.rank)
    ids = torch.randint(0, vocab_size, (2, 16), generator=gen).to(ps.device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    if missing or not torch.isfinite(loss):
        raise RuntimeError(
            f"smoke test failed: loss={loss.item()}, parameters without grad: {missing}"
        )
    return loss.item()


def check_shared_run_dir(cfg: schema.Config, ps: ParallelState) -> None:
    """Collective, on several nodes: does every rank see rank 0's run folder? Checkpoints need
    it (every rank writes its shards there, and resuming reads them back); without them a
    node-local folder works, with metrics and the export on rank 0's node."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", ps.world_size)) == ps.world_size:
        return  # one node: one file system
    token = [uuid.uuid4().hex if ps.rank == 0 else ""]
    dist.broadcast_object_list(token, src=0)
    marker = Path(cfg.run_dir) / ".shared_marker"
    if ps.rank == 0:
        marker.write_text(token[0])
    dist.barrier()
    try:
        sees = marker.read_text() == token[0]
    except OSError:
        sees = False
    seen: list[tuple[bool, str]] = [(False, "")] * ps.world_size
    dist.all_gather_object(seen, (sees, socket.gethostname()))
    blind = [r for r, (ok, _) in enumerate(seen) if not ok]
    if not blind:
        return
    where = (
        f"rank(s) {', '.join(map(str, blind))} on {', '.join(sorted({seen[r][1] for r in blind}))}"
    )
    t = cfg.trainer
    if t.save_final or t.save_every > 0 or t.resume != "none":  # the same verdict on every rank
        raise RunError(
            f"the run folder {cfg.run_dir} is not on storage every node shares ({where} do not "
            "see what rank 0 wrote there); checkpoints need one: set hydra.run.dir to a shared "
            "path, or run without checkpoints: trainer.save_final=false trainer.save_every=0"
        )
    if ps.rank == 0:
        print(f"warning: the run folder is not shared with {where}: metrics and the export are "
              "written on this node, each node keeps its own ranks' logs", flush=True)  # fmt: skip


@record
def main(config_path: str) -> None:
    cfg = schema.load(config_path)
    rank = int(os.environ["RANK"])
    redirect_output(Path(cfg.run_dir) / "logs" / f"rank_{rank}.log", tee=rank == 0)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    watchdog = Watchdog(cfg.run_dir, rank, cfg.trainer.hang_timeout_s)
    exit_code = 0
    try:
        run(cfg, rank, watchdog)
    except RunError as e:  # raised alike on every rank: one line and its exit code
        print(f"error: {e}", flush=True)
        exit_code = e.exit_code
    if dist.is_initialized():
        try:
            shutdown()
        except Exception:
            if not exit_code:
                raise
    watchdog.close()
    exit_process(exit_code)


def run(cfg: schema.Config, rank: int, watchdog: Watchdog) -> None:
    # where start-up time goes, printed before step 1 (the imports: torch, transformers, trainer)
    laps = [("start", IMPORTED_FROM), ("imports", time.perf_counter())]
    torch.manual_seed(cfg.trainer.seed)
    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True)
    watchdog.phase(0, "process group")
    device = init_distributed(cfg.device, cfg.trainer.hang_timeout_s)
    ps = ParallelState.build(device, cfg.parallel.dp_replicate_size, cfg.parallel.cp_size)
    if ps.dp_shard_size != cfg.parallel.dp_shard_size:  # the launcher checked R x S = ranks
        raise RunError(
            f"parallel.dp_shard_size={cfg.parallel.dp_shard_size}, but {ps.world_size} ranks "
            f"started, which with parallel.dp_replicate_size={ps.dp_replicate_size} makes shard "
            f"groups of {ps.dp_shard_size}; start as many ranks as R x S"
        )
    print(f"{ps.describe()}, pid {os.getpid()}", flush=True)
    check_shared_run_dir(cfg, ps)
    laps.append(("process group", time.perf_counter()))
    task = None
    if not cfg.trainer.smoke_test:  # data first: a prompt too long for the model stops us here
        watchdog.phase(0, "load data")
        config = hf_config(cfg.model)
        task = load_task(cfg, ps.local_rank, config.max_position_embeddings)
        if device.type == "cuda" and cfg.trainer.max_steps > 0:
            from trainer import kernel_warmup

            # the Triton kernels compile in a child process while this one builds the model; it
            # only saves time, so nothing about it may stop the run
            try:
                kernel_warmup.start(
                    kernel_warmup.spec_for(cfg, config, device, ps.dp_size, task.prompt_ids),
                    Path(cfg.run_dir) / "logs" / f"kernel_warmup_rank_{rank}.log",
                )
            except Exception as e:
                print(f"warning: the Triton kernels' warm-up did not start: {e!r}", flush=True)
    laps.append(("data", time.perf_counter()))
    watchdog.phase(0, "build model")
    model = build_model(cfg.model, ps.get_mesh("fsdp"), device, seed=cfg.trainer.seed)
    laps.append(("model", time.perf_counter()))
    if cfg.trainer.smoke_test:
        loss = smoke_test(model, ps, model.config.vocab_size)
        print(f"rank {rank}: sharded forward/backward ok, loss {loss:.4f}", flush=True)
    else:
        from trainer.train import GRPOTrainer

        trainer = GRPOTrainer(cfg, ps, model, watchdog, task)
        laps.append(("engine and optimizer", time.perf_counter()))
        if ps.rank == 0:
            parts = ", ".join(
                f"{name} {t - laps[i][1]:.1f} s" for i, (name, t) in enumerate(laps[1:])
            )
            print(
                f"{READY_LINE}{laps[-1][1] - laps[0][1]:.1f} s in this process: {parts}", flush=True
            )
        if cfg.parity_check:
            from trainer import parity

            ok, line = parity.check(trainer)
            if not ok:  # the same verdict on every rank (broadcast)
                raise RunError(line, exit_code=1)
            if ps.rank == 0:
                print(line, flush=True)
        if cfg.trainer.max_steps > 0:
            trainer.train()


if __name__ == "__main__":
    main(sys.argv[1])
