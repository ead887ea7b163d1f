"""Run under torchrun: model.compile over micro-batches of different shapes on each rank.

    torchrun --nproc-per-node 2 tests/dist/compile_shapes.py OUT.json

Every rank runs forward/backward on two micro-batches whose rows and widths differ from each
other and from the other rank's, once through the compiled model and once through an eager
twin built the same way. Rank 0 writes, per rank: how many graphs dynamo compiled (one: the
decoder layer, dynamic over rows and width from its first call) and the largest gradient
difference relative to rtol/atol (the compiled sums may round differently).
"""

import json
import sys

import torch
import torch._dynamo
import torch.distributed as dist

from launcher.schema import ModelConfig
from trainer.model import build_model
from trainer.parallel import ParallelState, exit_process, shutdown

RTOL, ATOL = 1e-4, 1e-5
SHAPES = {0: [(4, 20), (3, 27)], 1: [(2, 31), (5, 9)]}  # (rows, width) per micro-batch


def grads(compile: bool, ps: ParallelState) -> dict[str, torch.Tensor]:
    m = ModelConfig(param_dtype="fp32", reduce_dtype="fp32", compile=compile)
    model = build_model(m, ps.get_mesh("fsdp"), ps.device, seed=0)
    gen = torch.Generator().manual_seed(1000 + ps.rank)
    for rows, width in SHAPES[ps.rank]:
        ids = torch.randint(0, model.config.vocab_size, (rows, width), generator=gen)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # as the trainer calls it
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    ps = ParallelState.build(torch.device("cpu"), 1)
    eager = grads(False, ps)
    torch._dynamo.reset()
    compiled = grads(True, ps)
    mine = {
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "err": max(((compiled[n] - g).abs() / (ATOL + RTOL * g.abs())).max().item() for n, g in eager.items()),
    }
    everyone = [None] * ps.world_size
    dist.all_gather_object(everyone, mine)
    if ps.rank == 0:
        with open(out_path, "w") as f:
            json.dump(everyone, f)


if __name__ == "__main__":
    main(sys.argv[1])
    shutdown()
    exit_process(0)  # no interpreter finalization: see trainer/parallel.py
