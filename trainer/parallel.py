"""Every device mesh of a run is built here; everything else asks `ParallelState.get_mesh(name)`.

Views (world = nnodes * nproc_per_node, dp = world / cp):
- `dp`:    1-D, all data-parallel ranks: prompts are split and metrics reduced over it;
- `cp`:    1-D, context parallel (size 1 for now);
- `dp_cp`: 1-D, dp and cp flattened (what a loss is normalised over once cp exists);
- `fsdp`:  what `fully_shard` gets: the `dp` mesh itself when dp_replicate_size == 1, else
           `dp` unflattened into (`dp_replicate`, `dp_shard`), so rank = r * S + s and each
           shard group is S contiguous ranks (inside one node when S divides nproc_per_node).
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MIN_TORCH_FOR_UNFLATTEN = (2, 10)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def build_fsdp_meshes(
    device_type: str, world_size: int, dp_replicate_size: int, cp_size: int = 1
) -> dict[str, DeviceMesh]:
    """Build the named mesh views over `world_size` ranks (see the module docstring)."""
    if world_size % cp_size:
        raise ValueError(f"cp_size={cp_size} does not divide world_size={world_size}")
    dp = world_size // cp_size
    if dp % dp_replicate_size:
        raise ValueError(f"dp_replicate_size={dp_replicate_size} does not divide dp={dp}")
    world = init_device_mesh(device_type, (dp, cp_size), mesh_dim_names=("dp", "cp"))
    meshes = {"dp": world["dp"], "cp": world["cp"], "dp_cp": world._flatten("dp_cp")}
    if dp_replicate_size == 1:
        meshes["fsdp"] = meshes["dp"]
        return meshes
    if torch_version() < MIN_TORCH_FOR_UNFLATTEN:
        raise RuntimeError(
            f"hybrid sharding (dp_replicate_size={dp_replicate_size}) needs torch >= 2.10 for "
            f"DeviceMesh._unflatten; this is torch {torch.__version__}"
        )
    # The one use of the private `_unflatten`: split `dp` into replicas x shards in place,
    # so the 2-D mesh shares ranks (and the dp process group) with the 1-D view.
    meshes["fsdp"] = meshes["dp"]._unflatten(
        0, (dp_replicate_size, dp // dp_replicate_size), ("dp_replicate", "dp_shard")
    )
    return meshes


def any_rank(flag: bool, device: torch.device, group=None) -> bool:
    """True on every rank of `group` (default: all) if it is true on any: the one way a branch
    that runs collectives is decided, so that no rank takes it alone (an all-reduce MAX)."""
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def shutdown() -> None:
    """Leave the process group together: nobody tears down while a peer still talks."""
    dist.barrier()
    dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this rank after its exit handlers ran, without interpreter finalization.

    torch keeps every device mesh, and through it the gloo groups, in module-level caches
    (DTensor's redistribute planner), so `destroy_process_group` does not free the groups: their
    worker threads live until the process ends. A worker that drops a finished work holding
    tensors with Python references after the interpreter began finalizing takes the GIL from a
    dying interpreter and aborts: SIGABRT, "terminate called without an active exception", on a
    rank whose run succeeded (3 of 30 four-rank runs on 2 busy cores; gdb: `~AsyncBarrierWork`
    in `ProcessGroupGloo::runLoop`). So: the exit handlers first (logs drained, W&B finished),
    while Python is whole, then `os._exit`: no finalization, no window.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)


@dataclass
class ParallelState:
    rank: int
    local_rank: int
    world_size: int
    dp_replicate_size: int
    dp_shard_size: int
    cp_size: int
    device: torch.device
    meshes: dict[str, DeviceMesh]

    @classmethod
    def build(cls, device: torch.device, dp_replicate_size: int, cp_size: int = 1) -> ParallelState:
        world_size = dist.get_world_size()
        meshes = build_fsdp_meshes(device.type, world_size, dp_replicate_size, cp_size)
        dp = world_size // cp_size
        return cls(
            rank=dist.get_rank(),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=world_size,
            dp_replicate_size=dp_replicate_size,
            dp_shard_size=dp // dp_replicate_size,
            cp_size=cp_size,
            device=device,
            meshes=meshes,
        )

    def get_mesh(self, name: str) -> DeviceMesh:
        if name not in self.meshes:
            raise KeyError(f"no mesh named {name!r}; have {sorted(self.meshes)}")
        return self.meshes[name]

    @property
    def dp_size(self) -> int:
        return self.get_mesh("dp").size()

    @property
    def dp_rank(self) -> int:
        return self.get_mesh("dp").get_local_rank()

    def describe(self) -> str:
        """One line with this rank's coordinates in every mesh view."""
        fsdp = self.get_mesh("fsdp")
        coords = ", ".join(
            f"{n}={fsdp.get_local_rank(n)}/{fsdp.size(i)}"
            for i, n in enumerate(fsdp.mesh_dim_names or ())
        )
        return (
            f"rank {self.rank}/{self.world_size} on {self.device}: dp={self.dp_rank}/{self.dp_size}, "
            f"cp={self.get_mesh('cp').get_local_rank()}/{self.cp_size}, fsdp[{coords}]"
        )
