"""Run under torchrun: gradient parity of the sharded tiny Qwen3 across (r, s) layouts.

    torchrun --nproc-per-node 4 tests/dist/grad_parity.py OUT.json 1 2 4 [activation_checkpointing=true]

For each replicate size R given, with every rank holding its own tokens, it records:
- err_vs_ref: the largest |full gradient - reference| where the reference is an unsharded
  copy whose gradients are all-reduced and averaged over all ranks, relative to rtol/atol;
- identical_on_ranks: the full gradients are bit-identical on every rank;
- params_roundtrip: gathering each sharded parameter gives back its initial value exactly;
and, against the first R listed, the largest gradient difference (cross_topology).
"""

import json
import sys

import torch
import torch.distributed as dist

from launcher.schema import ModelConfig
from trainer.model import build_model, full_state_dict, hf_config
from trainer.parallel import ParallelState, exit_process, shutdown
from transformers import AutoModelForCausalLM

RTOL, ATOL = 2e-5, 2e-6


def rank_tokens(rank: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1000 + rank))


def tolerance_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / (atol + rtol |b|): <= 1 means torch.testing.assert_close would pass."""
    return ((a - b).abs() / (ATOL + RTOL * b.abs())).max().item()


def main(out_path: str, replicate_sizes: list[int], options: dict) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    m = ModelConfig(param_dtype="fp32", reduce_dtype="fp32", **options)
    config = hf_config(m)
    init = full_state_dict(m, config, seed=0, device=torch.device("cpu"))
    ids = rank_tokens(rank, config.vocab_size)

    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference.load_state_dict(init)
    reference(input_ids=ids, labels=ids).loss.backward()
    ref_grads = {}
    for name, p in reference.named_parameters():
        dist.all_reduce(p.grad)
        ref_grads[name] = p.grad / world

    results, first = {}, None
    for r in replicate_sizes:
        ps = ParallelState.build(torch.device("cpu"), r)
        model = build_model(m, ps.get_mesh("fsdp"), ps.device, seed=0)
        roundtrip = all(torch.equal(p.full_tensor(), init[n]) for n, p in model.named_parameters())
        model(input_ids=ids, labels=ids).loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        flat = torch.cat([g.flatten() for g in grads.values()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        results[f"r{r}s{world // r}"] = {
            "err_vs_ref": max(tolerance_ratio(grads[n], ref_grads[n]) for n in grads),
            "identical_on_ranks": all(torch.equal(g, gathered[0]) for g in gathered),
            "params_roundtrip": roundtrip,
            "cross_topology": 0.0 if first is None else max(tolerance_ratio(grads[n], first[n]) for n in grads),
        }
        first = first or grads
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    # trailing KEY=true arguments set model options (activation_checkpointing, compile)
    sizes = [int(a) for a in sys.argv[2:] if "=" not in a]
    opts = dict(a.split("=") for a in sys.argv[2:] if "=" in a)
    main(sys.argv[1], sizes, {k: v == "true" for k, v in opts.items()})
    shutdown()
    exit_process(0)  # no interpreter finalization: see trainer/parallel.py
