"""Multirun: one W&B group, runs named by their overrides, a report; Slurm parameters."""

import json
import sys

import submitit.slurm.slurm
from conftest import CONF, REPO, launch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launcher.report import write_report

sys.path.insert(0, str(REPO / "tests"))
from wandb_reader import summary  # noqa: E402


def test_two_job_cpu_sweep_gives_two_runs_one_group_and_a_report(tmp_path):
    sweep = tmp_path / "sweep"
    out = launch(
        "-m",
        "parallel=hsdp_r1s2,hsdp_r2s1",
        "model=qwen3_tiny",
        "data=synthetic",
        "device=cpu",
        "trainer.max_steps=3",
        f"hydra.sweep.dir={sweep}",
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if (p / "config.yaml").exists())
    assert len(jobs) == 2
    groups, names = set(), []
    for job in jobs:
        assert json.loads((job / "status.json").read_text())["exit_code"] == 0
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        (run_file,) = job.glob("wandb/offline-run-*/run-*.wandb")
        run = summary(run_file)
        groups.add(run["run"].run_group)
        names.append(run["run"].display_name)
        config = {u.key: json.loads(u.value_json) for u in run["run"].config.update}
        assert config["parallel"]["dp_replicate_size"] * config["parallel"]["dp_shard_size"] == 2
        assert config["trainer"]["max_steps"] == 3
        # W&B holds the same numbers as metrics.jsonl, step for step
        logged = [h for h in run["history"] if "rollout/reward_mean" in h]
        assert [h["step"] for h in logged] == [1, 2, 3]
        assert [h["train/loss"] for h in logged] == [r["train/loss"] for r in rows]
        assert {"perf/tokens_per_s", "perf/peak_mem_gb", "perf/train_tokens_per_s"} <= set(
            logged[0]
        )
    assert len(groups) == 1 and groups.pop().startswith("sweep-")
    assert names == ["parallel=hsdp_r1s2", "parallel=hsdp_r2s1"]
    report = (sweep / "sweep_report.md").read_text()
    assert (
        "| parallel=hsdp_r1s2 | ok | 3 |" in report and "| parallel=hsdp_r2s1 | ok | 3 |" in report
    )
    assert "Largest `train/loss` difference" in report
    for png in ("throughput", "peak_memory", "reward", "grad_norm"):
        assert (sweep / "report" / f"{png}.png").stat().st_size > 1000


def test_failed_job_does_not_stop_the_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    # rl.prompts_per_step=3 does not split over 2 ranks (job 0 fails validation); 4 does
    out = launch(
        "-m",
        "parallel=hsdp_r1s2",
        "rl.prompts_per_step=3,4",
        "device=cpu",
        "trainer.max_steps=1",
        "logger=none",
        f"hydra.sweep.dir={sweep}",
        timeout=600,
    )
    assert out.returncode == 1
    assert "failed jobs:" in out.stdout and "rl.prompts_per_step=3" in out.stdout
    report = (sweep / "sweep_report.md").read_text()
    assert "| rl.prompts_per_step=3 | failed (2) | 0 |" in report
    assert "| rl.prompts_per_step=4 | ok | 1 |" in report


def test_report_from_the_command_line(tmp_path):
    job = tmp_path / "0_a"
    job.mkdir()
    (job / "status.json").write_text(json.dumps({"name": "a", "exit_code": 0, "error": None}))
    (job / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "step": s,
                    "rollout/reward_mean": 0.1 * s,
                    "train/loss": 1.0,
                    "train/grad_norm": 2.0,
                    "time/step_s": 1.0,
                    "perf/tokens_per_s": 100.0,
                    "perf/peak_mem_gb": 1.5,
                }
            )
            + "\n"
            for s in (1, 2)
        )
    )
    path = write_report(tmp_path)
    assert "| a | ok | 2 | 1.000 | 100 |" in path.read_text()


def test_slurm_launcher_parameters_for_two_nodes():
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=["hydra/launcher=slurm_2x8", "parallel=hsdp_r2s8_2nodes"],
            return_hydra_config=True,
        )
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (2, 1, 8)
    assert cfg.parallel.nnodes * cfg.parallel.nproc_per_node == 16
    # the sbatch file submitit would write for these parameters (nothing is submitted)
    text = submitit.slurm.slurm._make_sbatch_string(
        command="python launch.py",
        folder="/tmp/submitit-test",
        nodes=launcher["nodes"],
        ntasks_per_node=launcher["tasks_per_node"],
        gpus_per_node=launcher["gpus_per_node"],
        cpus_per_task=launcher["cpus_per_task"],
        time=launcher["timeout_min"],
        mem=f"{launcher['mem_gb']}GB",
    )
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8"):
        assert line in text, text


def test_slurm_rendezvous_is_the_first_node(monkeypatch, tmp_path):
    from conftest import compose_config

    from launcher.main import slurm_rendezvous

    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho gpu-node-07\necho gpu-node-08\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-node-[07-08]")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    cfg = compose_config("parallel=hsdp_r2s8_2nodes")
    slurm_rendezvous(cfg)
    assert (cfg.parallel.rdzv_endpoint, cfg.parallel.rdzv_id) == ("gpu-node-07:29500", "4242")
