"""Run under torchrun (4 ranks, r2s2): replicas agree after real GRPO steps, and a shard changed
on one replica is caught, on every rank, naming the parameter.

    torchrun --nproc-per-node 4 tests/dist/replicas.py RUN_DIR OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist

from launcher import schema
from trainer.errors import RunError
from trainer.model import build_model
from trainer.parallel import ParallelState, exit_process, shutdown
from trainer.replicas import check_replicas
from trainer.train import GRPOTrainer

CORRUPTED = "model.layers.1.mlp.up_proj.weight"


def main(run_dir: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    cfg = schema.load({
        "parallel": {"dp_replicate_size": 2, "dp_shard_size": 2, "nproc_per_node": 4}, "data": {},
        "rl": {"prompts_per_step": 4, "max_new_tokens": 6}, "logger": {"backend": "none"},
        "run_dir": run_dir, "device": "cpu", "model": {}, "trainer": {"check_replicas_every": 1},
        "optim": {"lr": 1e-2},
    })  # fmt: skip
    ps = ParallelState.build(torch.device("cpu"), 2)
    model = build_model(cfg.model, ps.get_mesh("fsdp"), ps.device, seed=0)
    trainer = GRPOTrainer(cfg, ps, model)
    group = ps.get_mesh("fsdp").get_group("dp_replicate")
    rows = [trainer.step(s) for s in (1, 2)]  # each checks replicas after its update
    if dist.get_rank() == 2:  # replica 1, shard 0: one element of one shard
        with torch.no_grad():
            dict(model.named_parameters())[CORRUPTED].to_local()[0, 0] += 1e-3
    error = None
    try:
        check_replicas(model, group, ps.device, step=3)
    except RunError as e:
        error = (str(e), e.exit_code)
    errors = [None] * 4
    dist.all_gather_object(errors, error)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"diffs": [r["train/replica_max_diff"] for r in rows],
                       "grad_norms": [r["train/grad_norm"] for r in rows], "errors": errors}, f)  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
    shutdown()
    exit_process(0)  # no interpreter finalization: see trainer/parallel.py
