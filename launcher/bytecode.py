"""The workers' bytecode where the installed packages keep none.

An image built with PYTHONDONTWRITEBYTECODE=1 or `pip install --no-compile` (often read-only)
ships torch, transformers and the rest without `__pycache__`: every worker then compiles some
2,800 modules from source at each start (on the H200 machine its imports took 13-16 s, against
7 s from bytecode). `keep_bytecode` points the workers' `PYTHONPYCACHEPREFIX` into the compile
cache; on a first launch `fill` compiles what they will import there, on every core, before
they start (one worker importing from source compiles one module at a time, and each rank of a
node would do it again). Workers then read it, and write what is missing.
"""

from __future__ import annotations

import importlib.util
import os
import py_compile
import sys
import sysconfig
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# The top-level packages a worker imports (start-up, model, Dynamo/Inductor/Triton's code
# generation, logging), whole (not scikit-learn, which transformers up to 5.17 would import:
# trainer/lean_imports.py keeps workers from it). tests/test_config.py checks that these cover
# what `trainer.main` and a compile import.
PACKAGES = (
    "torch", "torchgen", "functorch", "triton", "sympy", "mpmath", "networkx", "numpy",
    "jinja2", "markupsafe", "filelock", "fsspec", "transformers", "huggingface_hub",
    "safetensors", "tokenizers", "tqdm", "regex", "yaml", "packaging", "typing_extensions",
    "hydra", "omegaconf", "antlr4", "PIL", "dill", "kernels", "httpx", "httpcore", "httpx2",
    "httpcore2", "h11", "anyio", "sniffio", "idna", "certifi", "truststore", "wandb",
)  # fmt: skip
# Never imported by a run: test suites, GUI and packaging parts of the standard library.
SKIP_DIRS = frozenset(
    {"__pycache__", "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
     "site-packages", "dist-packages", "pydoc_data"}
)  # fmt: skip
# Of transformers' 400 model folders, the ones a worker imports.
KEEP_MODELS = frozenset({"auto", "qwen3", "encoder_decoder"})


def package_dir() -> Path | None:
    """Where `import torch` reads its modules from, found without importing it (the launcher
    starts before torch is needed)."""
    spec = importlib.util.find_spec("torch")
    return Path(spec.origin).parent if spec and spec.origin else None


def keep_bytecode(env: dict[str, str], prefix: Path, torch_dir: Path | None) -> None:
    """Give the workers `prefix` (PYTHONPYCACHEPREFIX) where torch has no `__pycache__` beside it:
    their bytecode is then kept under the compile cache, not in the installed packages, and
    they write what is missing (PYTHONDONTWRITEBYTECODE dropped: the prefix keeps the packages as
    they were). Left alone where bytecode exists or the user chose a prefix."""
    if env.get("PYTHONPYCACHEPREFIX") or torch_dir is None or (torch_dir / "__pycache__").is_dir():
        return
    env["PYTHONPYCACHEPREFIX"] = str(prefix)
    env.pop("PYTHONDONTWRITEBYTECODE", None)


def sources(packages: tuple[str, ...] = PACKAGES, stdlib: Path | None = None) -> list[Path]:
    """The source files a worker's imports may read: the standard library's and `packages`'
    (those installed; found without importing them), less SKIP_DIRS and transformers' other
    models."""
    roots = [stdlib or Path(sysconfig.get_paths()["stdlib"])]
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin in (None, "built-in", "frozen"):
            continue
        if spec.submodule_search_locations:
            roots += [Path(p) for p in spec.submodule_search_locations]
        elif spec.origin.endswith(".py"):
            roots.append(Path(spec.origin))
    return [f for root in roots for f in _walk(root)]


def _walk(root: Path) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for folder, dirs, names in os.walk(root):
        models = Path(folder).name == "models" and Path(folder).parent.name == "transformers"
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and (not models or d in KEEP_MODELS)]
        yield from (Path(folder, n) for n in names if n.endswith(".py"))


def needs_fill(env: dict[str, str], prefix: Path) -> bool:
    """A first launch: the workers were given `prefix` (`keep_bytecode`) and it is not there."""
    return env.get("PYTHONPYCACHEPREFIX") == str(prefix) and not prefix.exists()


def fill(prefix: Path, files: list[Path], jobs: int | None = None) -> tuple[int, float]:
    """Compile `files` to bytecode under `prefix`, where a worker with that PYTHONPYCACHEPREFIX
    looks for it, in `jobs` processes (default: every core: the workers have not started).
    Files that do not compile (templates, other Pythons' syntax) are left to the importer.
    Returns (files written, seconds)."""
    started = time.perf_counter()
    prefix.mkdir(parents=True, exist_ok=True)
    jobs = jobs or cores()
    chunk = max(1, len(files) // (jobs * 8))
    if jobs == 1:
        previous, sys.pycache_prefix = sys.pycache_prefix, str(prefix)
        try:
            written = sum(map(_compile, files))
        finally:
            sys.pycache_prefix = previous
    else:
        with ProcessPoolExecutor(jobs, initializer=_set_prefix, initargs=(str(prefix),)) as pool:
            written = sum(pool.map(_compile, files, chunksize=chunk))
    return written, time.perf_counter() - started


def cores() -> int:
    """The cores this process may run on (its CPU set, not the host's count), at most 32."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return max(1, min(32, len(usable) if usable else os.cpu_count() or 1))


def _set_prefix(prefix: str) -> None:
    sys.pycache_prefix = prefix  # what PYTHONPYCACHEPREFIX sets in the workers


def _compile(path: Path) -> int:
    """One file's bytecode where the importer will look (`cache_from_source` under the prefix),
    stamped with the source's time and size, as an import would write it."""
    try:
        py_compile.compile(
            str(path), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP
        )
    except (py_compile.PyCompileError, OSError, ValueError):
        return 0
    return 1
