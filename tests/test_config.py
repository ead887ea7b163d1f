"""Every preset composes to the layout its name promises; the CLI shows it; docs are current."""

import subprocess
import sys

import pytest
from conftest import CONF, REPO, compose_config, env, launch

PRESETS = {
    "single": (1, 1, 1, 1),
    "fsdp": (1, 8, 1, 8),
    "hsdp_r1s2": (1, 2, 1, 2),
    "hsdp_r2s1": (2, 1, 1, 2),
    "hsdp_r1s4": (1, 4, 1, 4),
    "hsdp_r2s2": (2, 2, 1, 4),
    "hsdp_r4s1": (4, 1, 1, 4),
    "hsdp_r1s8": (1, 8, 1, 8),
    "hsdp_r2s4": (2, 4, 1, 8),
    "hsdp_r4s2": (4, 2, 1, 8),
    "hsdp_r8s1": (8, 1, 1, 8),
    "hsdp_r2s8_2nodes": (2, 8, 2, 8),
}


def test_every_parallel_file_is_listed():
    # auto: the layout is chosen by the launcher (tests/test_plan.py)
    assert {p.stem for p in (CONF / "parallel").glob("*.yaml")} == set(PRESETS) | {"auto"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_composes_to_its_layout(name):
    p = compose_config(f"parallel={name}").parallel
    r, s, nnodes, nproc = PRESETS[name]
    assert (p.dp_replicate_size, p.dp_shard_size, p.nnodes, p.nproc_per_node, p.cp_size) == (
        r,
        s,
        nnodes,
        nproc,
        1,
    )
    assert p.dp_replicate_size * p.dp_shard_size == p.nnodes * p.nproc_per_node


def test_fsdp_shards_over_every_rank_it_is_given():
    p = compose_config("parallel=fsdp", "parallel.nproc_per_node=4").parallel
    assert (p.dp_replicate_size, p.dp_shard_size) == (1, 4)


@pytest.mark.parametrize("group", ["model", "data", "rl", "logger"])
def test_every_group_option_composes(group):
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        cfg = compose_config(f"{group}={option}")
        assert getattr(cfg, group) is not None


def test_qwen3_4b_is_the_public_architecture():
    a = compose_config("model=qwen3_4b").model.arch
    assert (a.num_hidden_layers, a.hidden_size, a.intermediate_size) == (36, 2560, 9728)
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.vocab_size) == (
        32,
        8,
        128,
        151936,
    )
    assert a.tie_word_embeddings and a.rope_theta == 1e6


def test_rl_presets():
    grpo, dr, dapo = (compose_config(f"rl={n}").rl for n in ("grpo", "dr_grpo", "dapo"))
    assert (grpo.std_normalize, grpo.loss_agg, grpo.clip_low, grpo.clip_high) == (
        True,
        "token_mean",
        0.2,
        0.2,
    )
    assert (dr.std_normalize, dr.loss_agg) == (False, "seq_mean_token_sum_norm")
    assert (dapo.clip_low, dapo.clip_high, dapo.loss_agg, dapo.kl_coef) == (
        0.2,
        0.28,
        "token_mean",
        0.0,
    )


def test_cfg_job_shows_the_layout():
    out = launch("parallel=hsdp_r2s2", "--cfg", "job")
    assert out.returncode == 0, out.stderr
    assert "dp_replicate_size: 2" in out.stdout and "dp_shard_size: 2" in out.stdout


def test_unknown_key_is_rejected():
    out = launch("parallel.dp_replicat_size=2", "--cfg", "job")
    assert out.returncode != 0
    assert "dp_replicat_size" in out.stderr


def test_help_lists_groups_and_presets():
    out = launch("--help")
    assert out.returncode == 0
    for line in (
        "parallel: auto, fsdp, hsdp_r1s2",
        "model: qwen3_0_6b, qwen3_4b, qwen3_tiny",
        "rl: dapo, dr_grpo, grpo",
    ):
        assert line in out.stdout


def test_configuration_docs_are_current():
    out = subprocess.run(
        [sys.executable, "scripts/gen_config_docs.py", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["parallel.dp_replicate_size=3", "device=cpu"],
        ["dry_run=true", "model=qwen3_4b"],
    ],
    ids=["help", "validation error", "dry run"],
)
def test_the_launcher_never_imports_torch(argv):
    """Everything before a worker starts stays light: torch is imported by the workers only."""
    code = (
        "import atexit, runpy, sys\n"
        "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
        f"sys.argv = ['launch.py', *{argv!r}]\n"
        "runpy.run_path('launch.py', run_name='__main__')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env(), capture_output=True, text=True
    )
    assert "torch imported: False" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_dapo_and_gspo_presets_are_the_papers():
    dapo = compose_config("rl=dapo", "rl.max_new_tokens=100").rl
    assert (dapo.clip_low, dapo.clip_high, dapo.kl_coef, dapo.loss_agg) == (
        0.2,
        0.28,
        0.0,
        "token_mean",
    )
    assert dapo.dynamic_sampling and dapo.overlong_buffer == 20  # a fifth of the new tokens, as set
    gspo = compose_config("rl=gspo").rl
    assert (gspo.ratio_level, gspo.clip_low, gspo.clip_high) == ("sequence", 3e-4, 4e-4)
    assert gspo.loss_agg == "seq_mean_token_mean"


def test_compiled_kernels_are_cached_where_the_config_says(monkeypatch, tmp_path):
    """trainer.compile_cache_dir reaches the workers as Inductor's and Triton's cache folders;
    a user's own environment wins; "" leaves torch's default."""
    from launcher.torchrun import worker_env

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    env = worker_env(compose_config())
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / ".cache/hsdp-grpo/compile/inductor")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / ".cache/hsdp-grpo/compile/triton")
    env = worker_env(compose_config(f"trainer.compile_cache_dir={tmp_path}/cc"))
    assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{tmp_path}/cc/inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    assert worker_env(compose_config())["TORCHINDUCTOR_CACHE_DIR"] == "/mine"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert "TORCHINDUCTOR_CACHE_DIR" not in worker_env(compose_config("trainer.compile_cache_dir="))


def test_workers_keep_bytecode_under_the_compile_cache_where_the_packages_have_none(
    monkeypatch, tmp_path
):
    """An image built with PYTHONDONTWRITEBYTECODE=1 and no .pyc beside torch compiles every
    module from source at each worker start: the workers then get PYTHONPYCACHEPREFIX under
    trainer.compile_cache_dir. A first launch's workers only read it while a process beside them
    writes it; a later launch's read it (and may add to it). The packages stay untouched.
    Bytecode beside the packages, or a user's prefix, is left alone."""
    import subprocess
    import sys

    from launcher import torchrun
    from launcher.torchrun import keep_bytecode, worker_env, write_bytecode

    pkg = tmp_path / "site" / "bare"  # a package installed without bytecode
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 7\n")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setattr(torchrun, "torch_package_dir", lambda: pkg)
    prefix = tmp_path / "cc" / "pycache"
    cfg = compose_config(f"trainer.compile_cache_dir={tmp_path}/cc")

    def run_worker(env: dict[str, str]) -> None:
        out = subprocess.run([sys.executable, "-c", "import bare; print(bare.VALUE)"],
                             env={**env, "PYTHONPATH": str(tmp_path / "site")},
                             capture_output=True, text=True, check=True)  # fmt: skip
        assert out.stdout == "7\n"

    first = worker_env(cfg)  # a first launch: read only, nothing there yet
    assert first["PYTHONPYCACHEPREFIX"] == str(prefix)
    assert first["PYTHONDONTWRITEBYTECODE"] == "1"
    run_worker(first)
    assert not prefix.exists()
    writer = write_bytecode({**first, "PYTHONPATH": str(tmp_path / "site")}, prefix, ("bare",))
    assert writer is not None and writer.wait(timeout=60) == 0
    (pyc,) = prefix.rglob("bare/__init__*.pyc")
    written = pyc.stat().st_mtime_ns

    later = worker_env(cfg)  # the prefix exists: read it, write what is missing
    assert later["PYTHONPYCACHEPREFIX"] == str(prefix)
    assert "PYTHONDONTWRITEBYTECODE" not in later
    assert write_bytecode(later, prefix) is None  # no second writer
    run_worker(later)
    assert pyc.stat().st_mtime_ns == written  # read, not rewritten
    assert not (pkg / "__pycache__").exists()

    base = {"PYTHONDONTWRITEBYTECODE": "1"}
    (pkg / "__pycache__").mkdir()  # bytecode beside the packages: nothing to do
    keep_bytecode(env := dict(base), tmp_path / "p", pkg)
    assert env == base
    (pkg / "__pycache__").rmdir()
    keep_bytecode(env := {**base, "PYTHONPYCACHEPREFIX": "/mine"}, tmp_path / "p", pkg)
    assert env["PYTHONPYCACHEPREFIX"] == "/mine"
    assert write_bytecode(env, tmp_path / "p") is None  # the user's prefix is not written
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    assert "PYTHONPYCACHEPREFIX" not in worker_env(compose_config("trainer.compile_cache_dir="))


def test_a_first_launch_writes_bytecode_once_rank_0_is_ready(monkeypatch, tmp_path):
    """The bytecode writer starts when rank 0 prints its `ready after` line (the workers'
    imports are done: the writer beside them had slowed them), while they still run; once only;
    and where no such line comes (another node's launcher), when the workers end."""
    from launcher import torchrun

    calls = []
    monkeypatch.setattr(
        torchrun, "write_bytecode", lambda env, prefix: calls.append((prefix, done.exists()))
    )
    done = tmp_path / "done"
    cfg = compose_config(f"trainer.compile_cache_dir={tmp_path}/cc")
    for ready in (True, False):
        done.unlink(missing_ok=True)
        calls.clear()
        lines = ["ready after 1.0 s in this process", "step 1/1 | loss 0"] if ready else []
        worker = (f"import pathlib, time\nfor line in {lines!r}: print(line, flush=True)\n"
                  f"time.sleep(1)\npathlib.Path({str(done)!r}).touch()")  # fmt: skip
        command = [sys.executable, "-c", worker]
        monkeypatch.setattr(torchrun, "worker_command", lambda c, p, command=command: command)
        assert torchrun.start_workers(cfg, tmp_path / "config.yaml", tmp_path / "run") == (0, None)
        assert calls == [(tmp_path / "cc" / "pycache", not ready)]
