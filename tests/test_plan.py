"""dry_run=true: the plan, from the config alone, within seconds, starting nothing."""

import time

import torch
from conftest import compose_config, launch
from transformers import AutoModelForCausalLM

from launcher.counting import count_params
from launcher.plan import mesh_groups, plan
from trainer.model import hf_config


def test_param_count_matches_the_transformers_model():
    for preset in ("qwen3_tiny", "qwen3_0_6b", "qwen3_4b"):
        cfg = compose_config(f"model={preset}", "model.init=random")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config(cfg.model))
        counts = count_params(cfg.model.arch)
        assert counts.total == sum(p.numel() for p in model.parameters()), preset
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        assert counts.matmul == linear, preset  # what MFU counts: every matmul, lm_head included
        assert count_params(model.config) == counts  # the same from transformers' own config


def test_mesh_groups_are_contiguous_shards_and_strided_replicas():
    shard, replica = mesh_groups(2, 4)
    assert shard == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_plan_numbers_for_qwen3_4b_r2s4():
    cfg = compose_config("parallel=hsdp_r2s4", "model=qwen3_4b")
    text = plan(cfg)
    n = count_params(cfg.model.arch).total
    gib = lambda b: f"{b / 1024**3:,.2f} GiB"  # noqa: E731
    assert "world 8" in text and "device cuda" in text and "compute bf16" in text
    assert "replica 0     0-3" in text and "replica 1     4-7" in text
    assert "[0,4]  [1,5]  [2,6]  [3,7]" in text
    assert gib(4 * n / 4) in text  # fp32 master shard
    assert gib(8 * n / 4) in text  # AdamW moments
    assert gib(2 * 3 / 4 * n * 2) in text  # bf16 all-gather fwd + bwd inside a shard group of 4
    assert gib(2 * 1 / 2 * n / 4 * 4) in text  # fp32 all-reduce of the 1/4 shard across 2 replicas


def test_cli_dry_run_is_fast_and_starts_nothing(tmp_path):
    start = time.perf_counter()
    out = launch(
        "parallel=hsdp_r2s4", "model=qwen3_4b", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert out.returncode == 0, out.stderr
    assert time.perf_counter() - start < 30
    assert "4.02B parameters" in out.stdout and "all-reduce grad shards" in out.stdout
    assert not (tmp_path / "run" / "logs").exists()


def test_plan_warns_when_a_shard_group_spans_nodes():
    cfg = compose_config(
        "parallel=hsdp_r2s8_2nodes",
        "parallel.dp_replicate_size=1",
        "parallel.dp_shard_size=16",
        "parallel.rdzv_endpoint=h:1",
    )
    assert "spans nodes" in plan(cfg)
