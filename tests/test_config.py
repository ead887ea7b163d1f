"""Every preset composes to the layout its name promises; the CLI shows it; docs are current."""

import json
import subprocess
import sys
from pathlib import Path

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
    inductor = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    assert inductor.parent == tmp_path / ".cache/hsdp-grpo/compile/inductor"
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / ".cache/hsdp-grpo/compile/triton")
    env = worker_env(compose_config(f"trainer.compile_cache_dir={tmp_path}/cc"))
    assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{tmp_path}/cc/inductor/{inductor.name}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    assert worker_env(compose_config())["TORCHINDUCTOR_CACHE_DIR"] == "/mine"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert "TORCHINDUCTOR_CACHE_DIR" not in worker_env(compose_config("trainer.compile_cache_dir="))


def test_a_new_version_of_the_custom_ops_gets_a_new_inductor_cache(tmp_path):
    """Inductor's cache key does not cover a custom op's fake (its output shapes by the op's own
    rules): a graph cached under other rules would replay with their shapes. Any change to the
    ops' source moves Inductor's folder; the same source finds the same folder."""
    from launcher.torchrun import CUSTOM_OPS, inductor_dir

    for f in CUSTOM_OPS:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_bytes((REPO / f).read_bytes())
    first = inductor_dir(tmp_path / "cc", tmp_path)
    assert inductor_dir(tmp_path / "cc", tmp_path) == first
    assert first == inductor_dir(tmp_path / "cc", REPO)
    with open(tmp_path / CUSTOM_OPS[-1], "a") as f:
        f.write("\nSHARED_BYTES = 100 * 1024\n")
    assert inductor_dir(tmp_path / "cc", tmp_path) != first


def test_a_first_launch_compiles_the_workers_bytecode_before_they_start(monkeypatch, tmp_path):
    """An image built with PYTHONDONTWRITEBYTECODE=1 and no .pyc beside torch compiles every
    module from source at each worker start: the workers then get PYTHONPYCACHEPREFIX under
    trainer.compile_cache_dir. A first launch fills it (every core) before any worker starts;
    the workers read it and write only what it lacks; a later launch does not fill it again. The
    packages stay untouched. Bytecode beside the packages, or a user's prefix, is left alone."""
    from launcher import bytecode, torchrun
    from launcher.bytecode import keep_bytecode, needs_fill, sources

    site = tmp_path / "site"
    pkg = site / "bare"  # a package installed without bytecode
    (pkg / "tests").mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 7\n")
    (pkg / "tests" / "test_bare.py").write_text("X = 1\n")  # never imported: not compiled
    (pkg / "broken.py").write_text("def (:\n")  # does not compile: left to the importer
    (site / "extra.py").write_text("VALUE = 8\n")  # not in the list: the worker writes it
    std = tmp_path / "std"  # a standard library of one module
    std.mkdir()
    (std / "stdmod.py").write_text("Y = 2\n")
    monkeypatch.syspath_prepend(str(site))
    files = sources(("bare", "not_installed"), std)
    assert sorted(f.relative_to(tmp_path).as_posix() for f in files) == [
        "site/bare/__init__.py", "site/bare/broken.py", "std/stdmod.py"]  # fmt: skip
    monkeypatch.setattr(bytecode, "sources", lambda: files)
    monkeypatch.setattr(bytecode, "package_dir", lambda: pkg)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    prefix = tmp_path / "cc" / "pycache"
    cfg = compose_config(f"trainer.compile_cache_dir={tmp_path}/cc")
    env = torchrun.worker_env(cfg)
    assert env["PYTHONPYCACHEPREFIX"] == str(prefix) and "PYTHONDONTWRITEBYTECODE" not in env
    assert needs_fill(env, prefix)

    seen = tmp_path / "seen.json"  # what the worker found when it started
    worker = f"""import importlib.util, json, os, sys
cached = lambda name: importlib.util.cache_from_source(importlib.util.find_spec(name).origin)
found = {{n: os.path.exists(cached(n)) for n in ("bare", "extra")}}
import bare, extra
json.dump({{"found": found, "prefix": sys.pycache_prefix}}, open({str(seen)!r}, "w"))"""
    monkeypatch.setattr(torchrun, "worker_command", lambda c, p: [sys.executable, "-c", worker])

    def cached(src: Path) -> Path:  # where a worker with the prefix reads and writes its bytecode
        return (
            prefix
            / src.parent.relative_to(src.anchor)
            / f"{src.stem}.{sys.implementation.cache_tag}.pyc"
        )

    written: dict[str, int] = {}
    for nth in ("first", "second"):
        assert torchrun.start_workers(cfg, tmp_path / "config.yaml", tmp_path / "run") == (0, None)
        result = json.loads(seen.read_text())
        assert result["prefix"] == str(prefix)
        assert result["found"] == {"bare": True, "extra": nth == "second"}  # filled first
        assert not cached(pkg / "broken.py").exists()
        assert not cached(pkg / "tests" / "test_bare.py").exists()
        now = {n: cached(f).stat().st_mtime_ns for n, f in
               (("bare", pkg / "__init__.py"), ("extra", site / "extra.py"), ("std", std / "stdmod.py"))}  # fmt: skip
        assert all(now[k] == written[k] for k in written)  # read, not rewritten, by the next launch
        written = now
    assert not any(site.rglob("__pycache__")) and not any(std.rglob("__pycache__"))

    base = {"PYTHONDONTWRITEBYTECODE": "1"}
    (pkg / "__pycache__").mkdir()  # bytecode beside the packages: nothing to do
    keep_bytecode(env := dict(base), tmp_path / "p", pkg)
    assert env == base and not needs_fill(env, tmp_path / "p")
    (pkg / "__pycache__").rmdir()
    keep_bytecode(env := {**base, "PYTHONPYCACHEPREFIX": "/mine"}, tmp_path / "p", pkg)
    assert env["PYTHONPYCACHEPREFIX"] == "/mine"
    assert not needs_fill(env, tmp_path / "p")  # the user's prefix is not filled
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    assert "PYTHONPYCACHEPREFIX" not in torchrun.worker_env(
        compose_config("trainer.compile_cache_dir=")
    )


def test_the_bytecode_fill_covers_what_a_worker_imports():
    """`launcher.bytecode.PACKAGES` (with the standard library) is the list a first launch
    compiles: it must hold what a worker imports at start-up and at its first compile, or those
    modules are compiled from source in every worker. This project's own modules (the workers
    write those) and the environment's import hooks are not in it."""
    from launcher.bytecode import sources

    code = """import json, sys
import trainer.main, trainer.train, transformers.models.qwen3.modeling_qwen3
import torch._inductor.compile_fx, torch._inductor.codegen.triton
print(json.dumps([m.__file__ for m in list(sys.modules.values())
                  if str(getattr(m, "__file__", "")).endswith(".py")]))"""
    out = subprocess.run([sys.executable, "-c", code], env=env(), cwd=REPO, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    own = tuple(f"{REPO / d}/" for d in ("trainer", "launcher"))
    imported = [f for f in json.loads(out.splitlines()[-1]) if not f.startswith(own)]
    compiled = {str(f) for f in sources()}
    missing = [f for f in imported if f not in compiled]
    assert len(imported) > 1000
    assert len(missing) <= 0.01 * len(imported), missing


def test_a_worker_leaves_scikit_learn_unimported(tmp_path):
    """transformers (up to 5.17) imports sklearn.metrics with its generation package wherever
    scikit-learn is installed, seconds of every worker's start for a feature the trainer never
    uses (trainer/lean_imports.py). Here a stand-in scikit-learn is installed that fails on
    import: the worker's modules, a model's included, load without it, and transformers' own
    check says it is absent."""
    fake = tmp_path / "site" / "sklearn"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('a worker imported scikit-learn')\n")
    code = """import sys
import trainer.main, transformers.models.qwen3.modeling_qwen3
from transformers.generation import candidate_generator
print(candidate_generator.is_sklearn_available(), "sklearn" in sys.modules)"""
    e = env()
    e["PYTHONPATH"] = f"{tmp_path / 'site'}:{e['PYTHONPATH']}"
    out = subprocess.run([sys.executable, "-c", code], env=e, cwd=REPO, capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]
