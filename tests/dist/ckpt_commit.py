"""Run under torchrun (2 ranks): when a checkpoint is committed, and when it is refused.

    torchrun --nproc-per-node 2 tests/dist/ckpt_commit.py TMP OUT.json

- a save, and the same step saved again (the complete one is replaced only once its
  replacement is complete): both verify, `latest` names the step;
- a disk too full for the next checkpoint: every rank stops with one line naming the bytes
  needed and free; the previous checkpoint stays latest and nothing of the new one is left;
- ranks whose run folders differ (node-local folders on two nodes): rank 0 does not see
  rank 1's files, every rank stops, and no `latest` names the partial checkpoint.
"""

import json
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import torch
import torch.distributed as dist

from launcher import schema
from launcher.run_folder import LATEST, checkpoint_dir, verify
from trainer import checkpoint
from trainer.errors import RunError
from trainer.model import build_model
from trainer.parallel import ParallelState, exit_process, shutdown


def main(tmp: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, tmp = dist.get_rank(), Path(tmp)
    cfg = schema.load({"parallel": {}, "data": {}, "rl": {}, "logger": {"backend": "none"},
                       "run_dir": str(tmp), "device": "cpu", "model": {}})  # fmt: skip
    ps = ParallelState.build(torch.device("cpu"), 1)
    model = build_model(cfg.model, ps.get_mesh("fsdp"), ps.device, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    out = {}

    def attempt(run_dir, step):
        try:
            checkpoint.save(model, opt, sched, step, run_dir, {"world_size": 2}, keep_last=0)
            return None
        except RunError as e:
            return str(e)

    shared = tmp / "shared"
    out["first"] = attempt(shared, 1)
    out["again"] = attempt(shared, 1)
    out["verifies"] = bool(verify(checkpoint_dir(shared) / "step_000001"))

    real = shutil.disk_usage
    shutil.disk_usage = lambda p: namedtuple("usage", "total used free")(10**6, 10**6 - 1000, 1000)
    out["full"] = attempt(shared, 2)
    shutil.disk_usage = real
    out["after_full"] = sorted(p.name for p in checkpoint_dir(shared).iterdir())

    local = tmp / f"node{rank}"  # each rank its own folder: not shared
    out["split"] = attempt(local, 3)
    out["split_rank0_dir"] = sorted(p.name for p in checkpoint_dir(tmp / "node0").iterdir())
    results = [None, None]
    dist.all_gather_object(results, out)
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
    shutdown()
    exit_process(0)  # no interpreter finalization: see trainer/parallel.py
