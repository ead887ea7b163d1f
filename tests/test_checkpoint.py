"""Checkpoints: exact resume, resharding on resume, export, corrupt checkpoints, NaN, signals."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, compose_config, env, launch, torchrun
from transformers import AutoModelForCausalLM

from launcher import resume
from launcher.validate import ConfigError

RUN = ["device=cpu", "parallel=hsdp_r2s2", "logger=none", "trainer.deterministic=true"]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def numbers(row):
    """Everything but wall-clock measurements."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: 6 steps in one go. B: 3 steps, then resumed to 6 (same command, trainer.resume=auto)."""
    root = tmp_path_factory.mktemp("ckpt")
    a, b = root / "a", root / "b"
    for args in (
        [f"hydra.run.dir={a}", "trainer.max_steps=6"],
        [f"hydra.run.dir={b}", "trainer.max_steps=3"],
        [f"hydra.run.dir={b}", "trainer.max_steps=6", "trainer.resume=auto"],
    ):
        out = launch(*RUN, *args, timeout=600)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "resuming" in out.stdout and "from step_000003" in out.stdout
    return a, b


def test_exact_resume_is_bit_identical(runs):
    a, b = runs
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in mb] == list(range(1, 7))
    for ra, rb in zip(ma, mb):
        assert numbers(ra) == numbers(rb), ra["step"]


@pytest.mark.parametrize("layout", ["hsdp_r1s4", "hsdp_r4s1", "hsdp_r1s2"])
def test_reshard_on_resume(runs, layout, tmp_path):
    a, b = runs
    step3 = b / "checkpoints" / "step_000003"
    out = launch(
        *RUN,
        f"parallel={layout}",
        "trainer.max_steps=4",
        f"trainer.resume={step3}",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (row,) = metrics(tmp_path / "run")
    expected = metrics(a)[3]
    assert row["step"] == 4
    if layout != "hsdp_r1s2":  # same 4 dp ranks: same prompts and seeds, so the same samples
        assert row["rollout/reward_mean"] == expected["rollout/reward_mean"]
        assert row["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-4, abs=1e-7)
        assert row["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-4)
    else:  # another world size: other prompts per rank, but a trained model, not a fresh one
        assert row["rollout/reward_mean"] > metrics(a)[0]["rollout/reward_mean"] * 0.5


def test_export_round_trip(runs, tmp_path):
    a, _ = runs
    exported = AutoModelForCausalLM.from_pretrained(a / "hf")
    out = subprocess.run(
        [sys.executable, "scripts/export_hf.py", str(a), str(tmp_path / "x")],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    from_checkpoint = AutoModelForCausalLM.from_pretrained(tmp_path / "x")
    torch.manual_seed(0)  # the run's init seed: the exported weights must have moved from it
    fresh = AutoModelForCausalLM.from_config(exported.config)
    for (name, w), w2 in zip(exported.state_dict().items(), from_checkpoint.state_dict().values()):
        assert torch.equal(w, w2), name
    assert not torch.equal(
        exported.model.layers[0].mlp.up_proj.weight, fresh.model.layers[0].mlp.up_proj.weight
    )
    assert (a / "hf" / "tokenizer.json").exists() and (a / "hf" / "config.json").exists()


def test_corrupt_checkpoint_falls_back_then_refuses(runs, tmp_path):
    _, b = runs
    run_dir = tmp_path / "b"
    shutil.copytree(b, run_dir)
    cfg = compose_config("trainer.resume=auto")
    latest = run_dir / "checkpoints" / "step_000006"
    shard = next(latest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    _, checkpoint, warnings = resume.resolve(cfg, run_dir)
    assert checkpoint.name == "step_000003"
    assert "step_000006 is corrupt" in warnings[0] and "100 bytes" in warnings[0]
    (run_dir / "checkpoints" / "step_000003" / "meta.json").unlink()  # an interrupted save
    with pytest.raises(ConfigError, match="no usable checkpoint.*incomplete"):
        resume.resolve(cfg, run_dir)
    out = launch(*RUN, "trainer.resume=auto", f"hydra.run.dir={run_dir}")
    assert (
        out.returncode == 2 and out.stderr.count("\n") == 1 and "no usable checkpoint" in out.stderr
    )


def test_a_half_written_checkpoint_is_never_latest(runs, tmp_path):
    _, b = runs
    run_dir = tmp_path / "b"
    shutil.copytree(b, run_dir)
    shutil.copytree(
        run_dir / "checkpoints" / "step_000006", run_dir / "checkpoints" / "step_000007.tmp"
    )
    _, checkpoint, warnings = resume.resolve(compose_config("trainer.resume=auto"), run_dir)
    assert checkpoint.name == "step_000006" and not warnings


def test_fresh_start_never_overwrites_checkpoints(runs):
    _, b = runs
    before = sorted(p.name for p in (b / "checkpoints").iterdir())
    out = launch(*RUN, f"hydra.run.dir={b}")
    assert out.returncode == 2 and "trainer.resume=none but" in out.stderr
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == before


def test_same_command_again_continues_the_previous_run(runs, tmp_path):
    _, b = runs
    earlier = tmp_path / "runs" / "2026-12-01" / "10-00-00"
    shutil.copytree(b, earlier)
    new = tmp_path / "runs" / "2026-12-02" / "09-00-00"
    new.mkdir(parents=True)
    cfg = compose_config(*RUN, "trainer.resume=auto")
    run_dir, checkpoint, _ = resume.resolve(cfg, new)
    assert run_dir == earlier and checkpoint.name == "step_000006"
    other = compose_config(
        *RUN, "trainer.resume=auto", "trainer.seed=1"
    )  # another job: not resumed
    assert resume.resolve(other, new) == (new, None, [])


def test_nan_gradient_skips_the_update_and_k_in_a_row_stop(tmp_path):
    out = tmp_path / "nan.json"
    torchrun("nan_guard.py", 2, str(tmp_path), str(out))
    r = json.loads(out.read_text())
    assert r["norms"] == ["nan", "nan"] and r["unchanged"] and r["bad_updates"] == 3
    assert (
        "3 updates in a row had a non-finite" in r["error"]
        and "trainer.max_bad_updates=3" in r["error"]
    )


def test_sigint_checkpoints_and_stops_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(REPO / "launch.py"), *RUN, "trainer.max_steps=100000",
                             f"hydra.run.dir={run_dir}"], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped at a checkpoint" in stdout
    last = metrics(run_dir)[-1]["step"]
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert latest == f"step_{last:06d}"
    assert not (run_dir / "STOP").exists()


def test_checkpoint_commit_is_complete_durable_and_refused_when_it_cannot_be(tmp_path):
    out = tmp_path / "commit.json"
    torchrun("ckpt_commit.py", 2, str(tmp_path), str(out))
    for r in json.loads(out.read_text()):  # every rank saw the same outcome
        assert r["first"] is None and r["again"] is None and r["verifies"]
        assert (
            r["full"].startswith("checkpoint step_000002 needs ")
            and "but 0.00 GiB are free" in r["full"]
        )
        assert "the last checkpoint, step_000001, is kept" in r["full"]
        assert r["after_full"] == ["latest", "step_000001"]
        assert (
            "the files of rank(s) 1 are not in" in r["split"]
            and "not on storage every node shares" in r["split"]
        )
        assert "latest" not in r["split_rank0_dir"] and "step_000003" not in r["split_rank0_dir"]
    assert (tmp_path / "shared" / "checkpoints" / "latest").read_text() == "step_000001"


def test_bf16_export_loads_back_in_bf16(tmp_path):
    from trainer.checkpoint import save_hf
    from trainer.model import export_dtype, hf_config, load_tokenizer

    cfg = compose_config("device=cpu")
    assert export_dtype(cfg.model, "auto", "cpu") == torch.float32  # random init: compute dtype
    assert export_dtype(cfg.model, "auto", "cuda") == torch.bfloat16
    model = AutoModelForCausalLM.from_config(hf_config(cfg.model), dtype=torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    save_hf(model, state, load_tokenizer(cfg.model), tmp_path / "hf", torch.bfloat16)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert back.dtype == torch.bfloat16 and model.dtype == torch.float32
    for name, w in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], w.to(torch.bfloat16)), name
    assert not (tmp_path / "hf.tmp").exists()


def test_pretrained_export_keeps_the_checkpoints_dtype(tiny_pretrained, tmp_path):
    from trainer.model import export_dtype

    config = json.loads((tiny_pretrained / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (tiny_pretrained / "config.json").write_text(json.dumps(config))
    try:
        cfg = compose_config("model.init=pretrained", f"model.path={tiny_pretrained}")
        assert export_dtype(cfg.model, "auto", "cpu") == torch.bfloat16
        assert export_dtype(cfg.model, "fp32", "cpu") == torch.float32
    finally:
        config["dtype"] = "float32"
        (tiny_pretrained / "config.json").write_text(json.dumps(config))
