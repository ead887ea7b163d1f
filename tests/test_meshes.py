"""Mesh sizes, dim names and group membership for every preset, for every rank.

Uses torch's in-process fake process group, so a world of 16 is checked without 16 processes.
"""

import pytest
import torch.distributed as dist
from conftest import compose_config
from test_config import PRESETS
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer.parallel import build_fsdp_meshes


@pytest.fixture
def fake_world():
    def init(rank: int, world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_meshes_on_every_rank(name, fake_world):
    p = compose_config(f"parallel={name}").parallel
    world, r, s = p.nnodes * p.nproc_per_node, p.dp_replicate_size, p.dp_shard_size
    for rank in range(world):
        fake_world(rank, world)
        meshes = build_fsdp_meshes("cpu", world, r)
        assert set(meshes) == {"dp", "cp", "dp_cp", "fsdp"}
        assert meshes["dp"].size() == world and meshes["cp"].size() == 1
        assert meshes["dp"].mesh.tolist() == list(range(world))
        assert meshes["dp_cp"].mesh.tolist() == list(range(world))
        fsdp = meshes["fsdp"]
        if r == 1:
            assert fsdp.mesh_dim_names == ("dp",) and fsdp.mesh.tolist() == list(range(world))
        else:
            assert fsdp.mesh_dim_names == ("dp_replicate", "dp_shard")
            assert tuple(fsdp.shape) == (r, s)
            shard_group = fsdp["dp_shard"].mesh.tolist()
            replica_group = fsdp["dp_replicate"].mesh.tolist()
            first = rank // s * s
            assert shard_group == list(range(first, first + s))  # contiguous: inside a node
            assert replica_group == list(range(rank % s, world, s))
            assert fsdp.get_local_rank("dp_shard") == rank % s
            assert fsdp.get_local_rank("dp_replicate") == rank // s
        dist.destroy_process_group()


def test_bad_sizes_raise(fake_world):
    fake_world(0, 4)
    with pytest.raises(ValueError, match="dp_replicate_size=3"):
        build_fsdp_meshes("cpu", 4, 3)
    with pytest.raises(ValueError, match="cp_size=3"):
        build_fsdp_meshes("cpu", 4, 1, cp_size=3)
