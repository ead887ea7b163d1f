"""Replica consistency: under HSDP every replica group holds the same shards, bit for bit.

Each replica applies the same all-reduced gradient with the same optimizer state, so any
difference between replicas is a fault (a bug, a bad GPU or link) that would otherwise train
diverged copies silently. Every `trainer.check_replicas_every` steps each rank fingerprints
each of its parameter shards (float64 sum and sum of squares: cheap, one pass, and equal for
equal shards), takes the spread of each fingerprint over its replica group (max - min, two
all-reduces), and the largest spread of each parameter over every rank (one more), so every
rank sees the same verdict and names the same first differing parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from launcher.run_folder import RUN_FAULT_EXIT_CODE
from trainer.errors import RunError
from trainer.model import CausalLM


@torch.no_grad()
def fingerprints(model: CausalLM) -> tuple[list[str], torch.Tensor]:
    """Parameter names and a (P, 2) float64 fingerprint of this rank's shard of each."""
    names, rows = [], []
    for name, p in model.named_parameters():
        local = (p.to_local() if hasattr(p, "to_local") else p).detach().double()
        names.append(name)
        rows.append(torch.stack([local.sum(), local.square().sum()]))
    return names, torch.stack(rows)


@torch.no_grad()
def replica_spread(
    model: CausalLM, replicate_group, device: torch.device
) -> tuple[list[str], torch.Tensor]:
    """Collective over every rank: per parameter, the largest fingerprint spread across replicas."""
    names, fp = fingerprints(model)
    fp = fp.to(device)
    hi, neg_lo = fp.clone(), -fp
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=replicate_group)
    dist.all_reduce(neg_lo, op=dist.ReduceOp.MAX, group=replicate_group)
    spread = (hi + neg_lo).amax(dim=1)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)  # the same verdict on every rank
    return names, spread


def check_replicas(model: CausalLM, replicate_group, device: torch.device, step: int) -> float:
    """Collective: the largest spread (0.0 when replicas agree); raises on every rank if not."""
    names, spread = replica_spread(model, replicate_group, device)
    worst = spread.max().item()
    if worst > 0:
        bad = (spread > 0).nonzero().flatten().tolist()
        raise RunError(
            f"replicas drifted apart at step {step}: parameter {names[bad[0]]} differs between "
            f"replica groups (fingerprint spread {spread[bad[0]].item():.3g}; {len(bad)} of "
            f"{len(names)} parameters differ); stopping rather than train diverged copies. A bug or "
            "a faulty GPU or link: resume from the last checkpoint (trainer.resume=auto) and report it",
            exit_code=RUN_FAULT_EXIT_CODE,
        )
    return worst
