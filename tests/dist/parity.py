"""Run under torchrun on 4 ranks: parity_check passes on r1s4, r2s2, r4s1 and fails, naming the
parameter, when one rank's shard of one gradient is corrupted.

    torchrun --nproc-per-node 4 tests/dist/parity.py RUN_DIR OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist

from launcher import schema
from trainer import parity
from trainer.model import build_model
from trainer.parallel import ParallelState, exit_process, shutdown
from trainer.train import GRPOTrainer

CORRUPTED = "model.layers.1.mlp.down_proj.weight"


def main(run_dir: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    for r in (1, 2, 4):
        cfg = schema.load({
            "parallel": {"dp_replicate_size": r, "dp_shard_size": 4 // r, "nproc_per_node": 4},
            "data": {}, "logger": {"backend": "none"}, "run_dir": run_dir, "device": "cpu",
            "model": {}, "parity_check": True,
            "rl": {"micro_batch_tokens": 40, "kl_coef": 0.05, "rollout_correction": "tis"},
        })  # fmt: skip
        ps = ParallelState.build(torch.device("cpu"), r)
        model = build_model(cfg.model, ps.get_mesh("fsdp"), ps.device, seed=0)
        trainer = GRPOTrainer(cfg, ps, model)
        results[f"r{r}s{4 // r}"] = parity.check(trainer)

        def corrupt() -> None:
            if dist.get_rank() == 1:  # one rank's shard of one parameter's gradient
                grad = dict(model.named_parameters())[CORRUPTED].grad.to_local()
                grad.add_(0.5 * grad.abs().max() + 1e-3)

        if r == 2:
            results["r2s2 corrupted"] = parity.check(trainer, tamper=corrupt)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    shutdown()
    exit_process(0)  # no interpreter finalization: see trainer/parallel.py
