"""Run under torchrun: a non-finite gradient skips the update; K in a row stop the run.

    torchrun --nproc-per-node 2 tests/dist/nan_guard.py RUN_DIR OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist

from launcher import schema
from trainer.model import build_model
from trainer.parallel import ParallelState, exit_process, shutdown
from trainer.train import GRPOTrainer


def main(run_dir: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    cfg = schema.load({
        "parallel": {}, "data": {}, "rl": {"prompts_per_step": 2}, "logger": {"backend": "none"},
        "run_dir": run_dir, "device": "cpu", "model": {}, "trainer": {"max_bad_updates": 3},
    })  # fmt: skip
    ps = ParallelState.build(torch.device("cpu"), 1)
    model = build_model(cfg.model, ps.get_mesh("fsdp"), ps.device, seed=0)
    trainer = GRPOTrainer(cfg, ps, model)
    before = [p.full_tensor().clone() for p in model.parameters()]

    def poisoned_step() -> float:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        if dist.get_rank() == 1:  # one rank's shard is enough: the norm is global
            next(model.parameters()).grad.to_local().fill_(float("nan"))
        return trainer.optimizer_step()

    norms, error = [poisoned_step(), poisoned_step()], None
    unchanged = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
    try:
        poisoned_step()
    except FloatingPointError as e:
        error = str(e)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"norms": [str(n) for n in norms], "unchanged": unchanged, "bad_updates": trainer.bad_updates,
                       "error": error}, f)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    shutdown()
    exit_process(0)  # no interpreter finalization: see trainer/parallel.py
