"""Compile this project's Triton kernels in a process beside the worker, before it needs them.

A worker's first sampling, first decode step and first update launch the Triton kernels of
trainer/sample_kernel.py, decode_attention.py, decode_matmul.py and logprob_kernel.py. On a
fresh Triton cache each first launch compiles its kernel (and the C launcher Triton builds for
its signature) in the worker, while everything waits: 10.7 s on an H100 machine (2026-12-06:
the sampler 2.0 s, decode attention 7.1 s, the log-prob kernels 1.5 s, docs/benchmarks.md).
`start` runs this module as a child process as soon as the worker knows its shapes (before it
builds the model); the child launches each kernel once on tensors whose arguments specialise as
the real calls' do (dtypes, constexprs, 16-byte-aligned pointers, ints of the same divisibility
by 16), which writes them to TRITON_CACHE_DIR; the worker's own first launches then load them
from there.

Nothing waits on the child: a kernel it has not finished when the worker reaches it is compiled
by both (Triton's cache writes are atomic), and its failure costs only the time it would have
saved. It holds a CUDA context on the worker's GPU (about 0.5 GB) for the seconds it runs.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before torch: the child's log counts its imports too

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402


@dataclass
class Spec:
    """What to compile: the shapes the worker's kernels will see."""

    device: int  # the worker's CUDA device index
    vocab: int
    sampler: bool  # rl.sample_kernel resolved to triton
    # rl.decode_attention resolved to triton: the split its launches use (decode_attention.settings:
    # 0, one program per row and KV head; else splits of that many columns and their merge); None:
    # not the Triton attention
    attention: int | None
    kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    cache_length: int  # the expected KV-cache length (its `span` is what is compiled)
    logprob: bool  # rl.logprob_kernel resolved to triton
    # rl.decode_matmul resolved to triton: [rows, N, K] of each of a decode step's projections
    # (decode_matmul.projections at the rows of an engine call); empty: cuBLAS
    matmul: list[list[int]] = field(default_factory=list)
    eps: float = 1e-6  # the q/k norms' (a constexpr of the attention's prologue)
    # the fused attention's first tile loaded before its prologue (decode_attention.settings)
    attention_peel: bool = False
    # the engine launches the attention with its prologue fused (`decode_attention_qkv`, from the
    # q/k/v projection: decode_attention.fuse_for), else `decode_attention`
    attention_fused: bool = True


def spec_for(cfg, config, device: torch.device, dp_size: int, prompt_ids: list[list[int]]) -> Spec:
    """The kernels a GRPO run of `cfg` launches on `device` (a GPU) and their shapes: the static
    engine's sampler and decode attention (the one-program kernel where a rank's rollout rows
    fill the GPU, else the split kernel and its merge; with its prologue fused and its first
    tile peeled where its programs are few per SM: `decode_attention.settings` and `fuse_for`
    for the rows of each engine call), at the cache length of the longest prompt plus
    rl.max_new_tokens; the decode matmuls at those rows; the update's log-prob kernel."""
    from launcher.memory import cache_length, engine_call_rows
    from trainer import decode_attention as da
    from trainer import decode_matmul as dm
    from trainer.train import engine_kind, engine_options, use_logprob_kernel

    rl = cfg.rl
    static = engine_kind(cfg, device) == "static"
    options = engine_options(cfg, device)
    # the rows of each of the rank's engine calls, as its rollout will cut them
    rows = engine_call_rows(
        rl.prompts_per_step // dp_size * rl.samples_per_prompt, rl.rollout_batch
    )
    kv = config.num_key_value_heads
    split, peel = da.settings(rows * kv, device)  # as the engine's launches take them
    biased = bool(getattr(config, "attention_bias", False))
    fused = da.fuse_for(rows * kv, da.sm_count(device), biased)  # as the engine decides it
    longest = max(map(len, prompt_ids), default=1)
    return Spec(
        device=device.index or 0,
        vocab=config.vocab_size,
        sampler=static and options["sampler"] == "triton",
        attention=split if static and options["attention"] == "triton" else None,
        kv_heads=kv,
        group=config.num_attention_heads // kv,
        head_dim=config.head_dim,  # as the engine reads it
        cache_length=cache_length(longest, rl.max_new_tokens),
        logprob=use_logprob_kernel(cfg, device),
        matmul=[[rows, n, k] for n, k in dm.projections(config)]
        if static and options["matmul"] == "triton" and rows <= dm.MAX_ROWS
        else [],
        eps=config.rms_norm_eps,
        attention_peel=peel,
        attention_fused=fused,
    )


def start(spec: Spec, log: Path) -> subprocess.Popen | None:
    """The child process, started in the background, its output in `log` (None where there is
    nothing to compile)."""
    if not (spec.sampler or spec.attention is not None or spec.logprob or spec.matmul):
        return None
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "trainer.kernel_warmup", json.dumps(asdict(spec))],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=os.environ.copy(),
        )


def warm(spec: Spec, device: torch.device, dtype: torch.dtype = torch.bfloat16,
         report: Callable[[str], None] = print) -> list[str]:  # fmt: skip
    """Launch each kernel of `spec` once on `device` (the child's work; on CPU under Triton's
    interpreter, the tests'), calling `report` after each. Returns what was launched, in order:
    the sampler first (the prefill needs it first), then decode attention and the decode
    matmuls, then the update's log-prob kernels."""
    done: list[str] = []

    def finished(name: str) -> None:
        done.append(name)
        report(name)

    v = spec.vocab
    if spec.sampler:
        from trainer import sample_kernel

        sample_kernel.load()
        logits = torch.zeros((1, v), dtype=dtype, device=device)
        # the engine always passes its per-row greedy flags
        sample_kernel.sample_full(logits, 1.0, torch.zeros(1, dtype=torch.bool, device=device))
        finished("sampler")
    if spec.attention is not None:
        from trainer import decode_attention as da

        da.load()
        length, hd, kv, heads = (
            spec.cache_length,
            spec.head_dim,
            spec.kv_heads,
            spec.kv_heads * spec.group,
        )
        col = torch.zeros(1, dtype=torch.long, device=device)
        # one program per row and KV head over the whole cache (batches that fill the GPU), or
        # splits of spec.attention columns and their merge (whose split count follows the length)
        if not spec.attention_fused:
            q = torch.zeros((1, kv, spec.group, hd), dtype=dtype, device=device)
            k = torch.zeros((1, kv, length, hd), dtype=dtype, device=device)
            da.launch(q, k, k, torch.ones((1, length), dtype=torch.bool, device=device), col,
                      spec.attention)  # fmt: skip
        else:  # the engine's: from the q/k/v projection, as the decode matmul leaves it
            n = (heads + 2 * kv) * hd
            if spec.matmul:  # its partial sums at the real rows (their count is a constexpr)
                from trainer import decode_matmul as dm

                dm.load()
                rows, _, width = spec.matmul[0]
                qkv = dm.decode_linear(
                    torch.zeros((rows, width), dtype=dtype, device=device),
                    torch.zeros((n, width), dtype=dtype, device=device),
                )
            else:  # cuBLAS's product, one partial in the model's dtype
                qkv = torch.zeros((1, 1, n), dtype=dtype, device=device)
            b = qkv.shape[1]
            k = torch.zeros((b, kv, length, hd), dtype=dtype, device=device)
            norm, rope = (
                torch.ones(hd, dtype=dtype, device=device),
                torch.zeros((b, hd), dtype=dtype, device=device),
            )
            valid = torch.ones((b, length), dtype=torch.bool, device=device)
            da.launch_qkv(
                qkv, norm, norm, rope, rope, k, k, valid, col, heads, spec.eps, spec.attention,
                spec.attention_peel,
            )  # fmt: skip
        finished("decode attention")
    if spec.matmul:
        from trainer import decode_matmul as dm

        dm.load()
        # the real shapes: the launch's ints (rows, N, K and the strides) specialise on their
        # divisibility by 16 and the setting on all three (a few hundred MB, freed at once)
        for rows, n, width in spec.matmul:
            x = torch.zeros((rows, width), dtype=dtype, device=device)
            dm.decode_linear(x, torch.zeros((n, width), dtype=dtype, device=device))
        finished("decode matmul")
    if spec.logprob:
        from trainer.logprob_kernel import load, logprob_entropy

        load()
        # rows x width tokens: each pointer into the (3, tokens) output is 16-byte aligned or not
        # by the token count mod 4, so the three alignments are three compiles
        for tokens in (4, 6, 5):
            logits = torch.zeros((tokens, v), dtype=dtype, device=device, requires_grad=True)
            targets = torch.zeros(tokens, dtype=torch.long, device=device)
            logp, entropy = logprob_entropy(logits * 1, targets, 1.0)
            (logp.sum() + entropy.sum()).backward()
        finished("log-prob")
    return done


def main(spec_json: str) -> None:
    os.nice(5)  # behind the worker, which compiles its own graphs meanwhile
    spec = Spec(**json.loads(spec_json))
    device = torch.device("cuda", spec.device)
    torch.cuda.set_device(device)

    def report(name: str) -> None:
        now = time.time()  # Unix seconds (bench.py aligns them to the launch), and since start
        print(f"{now:.2f} {now - STARTED:6.2f} s  {name}", flush=True)

    report("imported")
    warm(spec, device, report=report)


if __name__ == "__main__":
    main(sys.argv[1])
