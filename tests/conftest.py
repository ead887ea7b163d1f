"""Shared helpers: compose configs as the CLI does, run the CLI, run scripts under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from launcher.main import to_typed
from launcher.schema import Config, register

# Triton kernels run in Triton's interpreter on CPU tensors; it must be chosen before triton loads
os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
register()


def compose_config(*overrides: str) -> Config:
    """The typed config `python launch.py OVERRIDES` would get."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return to_typed(compose(config_name="config", overrides=list(overrides)))


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    e.setdefault("OMP_NUM_THREADS", "1")
    # inductor compiles in this process, not a worker pool: on 2 cores the pool only adds
    # processes, and once it aborted a rank at exit ("terminate called without an active exception")
    e.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    e["WANDB_SILENT"] = "true"
    return e


def launch(
    *overrides: str, timeout: float = 300, extra_env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """`python launch.py OVERRIDES` as a user types it."""
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *overrides],
        cwd=cwd,
        env={**env(), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun(
    script: str, nproc: int, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(REPO / "tests" / "dist" / script),
            *args,
        ],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="session")
def tiny_pretrained(tmp_path_factory) -> Path:
    """A tiny Qwen3 with non-default weights and the shipped tokenizer, saved as a user would."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.model import hf_config, load_tokenizer

    cfg = compose_config()
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(hf_config(cfg.model), dtype=torch.float32)
    model.save_pretrained(folder)
    load_tokenizer(cfg.model).save_pretrained(folder)
    return folder
