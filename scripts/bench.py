"""Benchmark the GPU hot paths of a GRPO step and compare each with its floor.

    python scripts/bench.py                     # Qwen3-4B (random init) on one GPU
    python scripts/bench.py --device cpu        # the tiny model on CPU: a smoke test of this script

(a) decode: the static-cache engine against transformers `generate` (static cache) on the
    same model and inputs, batch 64 and 256, prompt 128, 256 new tokens; the floor is every
    weight byte plus the KV cache read once per token step, at the copy bandwidth measured here.
(b) training: forward + backward + AdamW of the FSDP2-wrapped model on 8 x 1024 tokens through
    the trainer's own log-prob path; MFU = 6 N T + attention FLOPs (trainer/perf.py) over the
    bf16 matmul rate measured here.
(c) one full GRPO step through the launcher (64 prompts x 8 samples, prompt 128, 256 new tokens)
    with its breakdown, against the sum of the decode and training floors.

Writes OUT/bench.json and OUT/bench.md (OUT defaults to bench_out/).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_ENV = dict(os.environ)  # the launches' environment (grpo_step_bench)
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from launcher.counting import count_params  # noqa: E402
from launcher.run_folder import READY_LINE  # noqa: E402
from launcher.torchrun import STEP_LINE  # noqa: E402
from trainer.perf import train_flops  # noqa: E402

WHOLE_CACHE = "rl.decode_attention=sdpa rl.decode_spans=1"  # the plain captured step: the baseline


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeat: int = 3) -> float:
    """Median wall seconds of fn() (synchronized), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device) -> float:
    """Bytes per second read and written by a 2 GiB device-to-device copy, launched eagerly (a
    copy captured in a CUDA graph runs on the copy engines, about a third slower)."""
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), device, repeat=10)


def measure_ceilings(device) -> dict[str, float]:
    if device.type != "cuda":
        return {"bandwidth_Bps": float("nan"), "bf16_flops": float("nan")}
    bandwidth = copy_bandwidth(device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    tm = timed(functools.partial(torch.matmul, a, b), device, repeat=20)
    # hand the blocks back to the driver: the (c) runs are other processes on this GPU (an H100
    # showed this process holding 4.6 GB through them, 2026-12-07)
    del a, b
    torch.cuda.empty_cache()
    return {"bandwidth_Bps": bandwidth, "bf16_flops": 2 * 8192**3 / tm}


def preset(name: str, overrides: tuple[str, ...] = ()):
    """The typed config of `model=NAME model.init=random OVERRIDES`, composed as the CLI does."""
    from hydra import compose, initialize_config_dir

    from launcher.main import to_typed
    from launcher.schema import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return to_typed(
            compose(
                config_name="config", overrides=[f"model={name}", "model.init=random", *overrides]
            )
        )


def decode_floor(config, dtype, ceilings, batch: int, prompt: int, new: int) -> float:
    """Seconds to read every weight once per token step, plus the KV cache each step attends over."""
    weight_bytes = count_params(config).read_per_token(config.tie_word_embeddings) * dtype.itemsize
    kv_per_token = (
        config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize
    )
    kv_bytes = sum(batch * (prompt + t) * kv_per_token for t in range(new))
    return (new * weight_bytes + kv_bytes) / ceilings["bandwidth_Bps"]


def decode_bench(config, device, dtype, batch: int, prompt: int, new: int, ceilings,
                 variants: list[tuple[str, object]], profile: Path | None = None, hf: bool = True) -> dict:  # fmt: skip
    """The engine under each (overrides, config) variant (the first is reported), then HF
    (unless `hf` is off: its static-cache generate compiles for minutes per batch size)."""
    from transformers import GenerationConfig

    from trainer.engine import StaticCacheEngine
    from trainer.rollout import SamplingParams
    from trainer.train import engine_options

    prompts = torch.randint(0, min(config.vocab_size, 150_000), (batch, prompt)).tolist()
    params = SamplingParams(1.0, 1.0, new, eos_token_id=-1, pad_token_id=0)  # no EOS: all steps run
    floor = decode_floor(config, dtype, ceilings, batch, prompt, new)
    timings = []
    for i, (overrides, cfg) in enumerate(variants):
        torch.manual_seed(0)
        options = {**engine_options(cfg, device), "compile": device.type == "cuda"}
        rl, attention = cfg.rl, options["attention"]
        engine = StaticCacheEngine(config, dtype, device, **options)
        sync(device)
        t0 = time.perf_counter()
        engine.generate(prompts, params)  # compiles and captures each span's step
        sync(device)
        first = time.perf_counter() - t0
        t = timed(lambda: engine.generate(prompts, params), device)  # noqa: B023 (called here)
        timings.append({"overrides": overrides, "spans": rl.decode_spans, "attention": attention,
                        "sampler": options["sampler"], "matmul": options["matmul"],
                        "engine_s": t, "first_call_s": first,
                        "engine_over_floor": t / floor})  # fmt: skip
        if profile is not None:
            profile_decode(engine, prompts, params, device, profile.with_suffix(f".{i}.txt"))
        if i != len(variants) - 1:
            del engine
            torch.cuda.empty_cache() if device.type == "cuda" else None
    t_hf = float("nan")
    if hf:
        ids = torch.tensor(prompts, device=device)
        gen = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=new, min_new_tokens=new,
                               cache_implementation="static", pad_token_id=0, eos_token_id=None)  # fmt: skip
        t_hf = timed(lambda: engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                   generation_config=gen), device, repeat=1)  # fmt: skip
    t = timings[0]["engine_s"]
    return {"batch": batch, "prompt": prompt, "new_tokens": new, "engine_s": t, "hf_static_s": t_hf,
            "floor_s": floor, "engine_over_floor": t / floor, "hf_over_floor": t_hf / floor,
            "engine_tokens_per_s": batch * new / t, "variants": timings}  # fmt: skip


def profile_decode(engine, prompts, params, device, path: Path) -> None:
    """GPU kernel time per kernel over one generate, steps run uncaptured (kernels as in the graph)."""
    from torch.profiler import ProfilerActivity, profile

    engine.cuda_graph = False
    engine.generate(prompts, params)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        sync(device)
    engine.cuda_graph = device.type == "cuda"
    path.write_text(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30))


def train_bench(
    cfg, device, ceilings, micro: int, seq: int, profile_to: Path | None = None
) -> dict:
    """FSDP2 on one rank (world of 1), the trainer's log-prob path, AdamW."""
    import torch.distributed as dist

    from trainer.grpo import token_logprobs
    from trainer.model import build_model
    from trainer.parallel import ParallelState
    from trainer.perf import peak_memory_gb
    from trainer.train import use_logprob_kernel

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    ps = ParallelState.build(device, 1)
    model = build_model(cfg.model, ps.get_mesh("fsdp"), device, seed=0)
    config = model.config
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    ids = torch.randint(0, min(config.vocab_size, 150_000), (micro, seq), device=device)
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # as the trainer: no slice of the logits
    kernel = use_logprob_kernel(cfg, device)

    def step():
        # use_cache=False as the trainer: with a cache, transformers passes each layer's index
        # into the compiled layer, which then recompiles per layer and runs eager past the limit
        logits = model(input_ids=ids, use_cache=False).logits
        logp, _ = token_logprobs(logits, targets, 1.0, cfg.rl.logprob_chunk_tokens, kernel)
        (-logp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    peak_memory_gb(device)
    t = timed(step, device, repeat=5)
    if profile_to is not None:  # after timing: kernels by GPU time, and how busy the GPU was
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = time.perf_counter()
            step()
            sync(device)
            wall = time.perf_counter() - wall
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 1e6
        table = events.table(sort_by="self_device_time_total", row_limit=40)
        profile_to.write_text(f"one step: wall {wall:.3f} s, GPU kernels {busy:.3f} s\n{table}")
    flops = train_flops(config, micro * seq, micro * seq**2)
    mem = peak_memory_gb(device)
    dist.destroy_process_group()
    return {
        "tokens": micro * seq,
        "step_s": t,
        "tokens_per_s": micro * seq / t,
        "flops": flops,
        "mfu": flops / t / ceilings["bf16_flops"],
        "floor_s": flops / ceilings["bf16_flops"],
        "peak_mem_gb": mem,
    }


def grpo_step_bench(name: str, config, device, dtype, ceilings, prompts: int, samples: int, prompt: int, new: int,
                    overrides: list[str], log_to: Path | None = None, compile_cache: str = "") -> dict:  # fmt: skip
    """Two steps through the launcher; step 2's metrics (step 1 compiles and captures), and the
    wall time from starting `launch.py` to step 1's metrics line (start-up + a cold step 1).
    `compile_cache`: the run's trainer.compile_cache_dir (default: the user's)."""
    with tempfile.TemporaryDirectory() as tmp:
        cache = [f"trainer.compile_cache_dir={compile_cache}"] if compile_cache else []
        cmd = [sys.executable, str(ROOT / "launch.py"), "parallel=single", f"model={name}", "model.init=random",
               f"device={device.type}", f"data.num_digits={prompt - 1}", f"rl.prompts_per_step={prompts}",
               f"rl.samples_per_prompt={samples}", f"rl.max_new_tokens={new}", *overrides, *cache, "trainer.max_steps=2", "trainer.save_final=false", "trainer.export_hf=false", "logger=none",
               f"hydra.run.dir={tmp}/run"]  # fmt: skip
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        started, first, lines = time.perf_counter(), None, []
        launched = time.time()
        sink = open(log_to or os.devnull, "w")  # each line after the seconds since launch
        trace = Path(tmp) / "trace"  # torch.compile's structured log: what each compile cost
        # the environment the bench started with: what this process has set since (the train
        # section's rank variables; Inductor writes its default cache folder into os.environ) is
        # not the launch's; with `compile_cache`, no cache folder from the environment either
        own = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") if compile_cache else ()
        env = {k: v for k, v in START_ENV.items() if k not in own}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, cwd=ROOT, env={**env, "TORCH_TRACE": str(trace)})  # fmt: skip
        with sink, proc:
            for line in proc.stdout:  # type: ignore[union-attr]
                elapsed = time.perf_counter() - started
                if first is None and STEP_LINE.match(line):  # step 1's line: start-up is over
                    first = elapsed
                lines.append(line)
                sink.write(f"{elapsed:8.2f} s  {line}")
                sink.flush()
            # the Triton kernels' child (trainer/kernel_warmup.py): each line's time since launch
            for path in sorted((Path(tmp) / "run" / "logs").glob("kernel_warmup_rank_*.log")):
                for line in path.read_text().splitlines():
                    at, _, rest = line.partition(" ")
                    try:
                        sink.write(f"{float(at) - launched:8.2f} s  {path.stem}: {rest.strip()}\n")
                    except ValueError:  # not one of its time lines (a traceback)
                        sink.write(f"          {path.stem}: {line}\n")
        text = "".join(lines)
        if proc.returncode != 0:
            raise RuntimeError(text[-5000:])
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        compiles = compile_report(trace)
    last = rows[-1]  # step 2: compilation and capture happened in step 1
    n = prompts * samples
    length = prompt + last["rollout/response_len_mean"]
    floor = (
        decode_floor(config, dtype, ceilings, n, prompt, new)
        + train_flops(config, n * length, n * length**2) / ceilings["bf16_flops"]
    )
    out = {
        k: v
        for k, v in last.items()
        if k.startswith(("time/", "perf/", "rollout/", "train/rollout_"))
    }
    ready = [line for line in text.splitlines() if line.startswith(READY_LINE)]
    return {"overrides": " ".join(overrides), "shape": f"{prompts}x{samples}, prompt {prompt}, {new} new",
            **out, "floor_s": floor, "step_over_floor": last["time/step_s"] / floor,
            "launch_to_step1_s": first or float("nan"), "step1_s": rows[0]["time/step_s"],
            "step1_rollout_s": rows[0]["time/rollout_s"], "step1_update_s": rows[0]["time/train_s"],
            "startup": ready[0] if ready else "", "compile_s": sum(c["s"] for c in compiles),
            "compiles": compiles,
            **predicted_memory(name, device, prompts, samples, prompt, new, overrides)}  # fmt: skip


def compile_report(trace: Path) -> list[dict]:
    """Each torch.compile of rank 0 in a TORCH_TRACE folder, in order: the function, its compile id
    (frame/recompile), the seconds it took (Dynamo's trace and the backend together; a backward,
    compiled at the first backward through that graph, is its own row), and how many
    of its AOTAutograd and Inductor FX graphs came from the on-disk cache (a warm start's compiles
    should all be hits: what they still cost is tracing and loading)."""
    out: list[dict] = []
    for path in sorted(trace.glob("*rank_0*.log")):
        for line in path.read_text().splitlines():
            backward = '{"bwd_compilation_metrics"' in line  # compiled at the first backward
            if '{"compilation_metrics"' not in line and not backward:
                continue
            m = json.loads(line[line.index("{") :])[
                "bwd_compilation_metrics" if backward else "compilation_metrics"
            ]
            if backward:
                fn = next((c["fn"] for c in out if c["id"] == m["compile_id"]), "?")
                m = {**m, "co_name": f"{fn} (backward)", "entire_frame_compile_time_s": (m.get("duration_us") or 0) / 1e6,
                     "backend_compile_time_s": m.get("inductor_compile_time_s")}  # fmt: skip
            hits = {k: (m.get(f"{k}_local_cache_hit_count") or 0,
                        (m.get(f"{k}_local_cache_hit_count") or 0) + (m.get(f"{k}_local_cache_miss_count") or 0))
                    for k in ("aotautograd", "inductor_fx")}  # fmt: skip
            out.append({"fn": m["co_name"], "id": m["compile_id"], "s": m["entire_frame_compile_time_s"] or 0.0,
                        "backend_s": m["backend_compile_time_s"] or 0.0,
                        "cache_hits": {k: f"{h}/{n}" for k, (h, n) in hits.items()},
                        "recompile_reason": (m.get("recompile_reason") or "")[:300]})  # fmt: skip
    return out


def predicted_memory(name: str, device, prompts: int, samples: int, prompt: int, new: int,
                     overrides: list[str]) -> dict[str, float]:  # fmt: skip
    """launcher/memory.py's prediction for the run grpo_step_bench made, per phase (GB)."""
    from launcher.memory import predict, shape_of

    cfg = preset(name, ("parallel=single", f"data.num_digits={prompt - 1}",
                        f"rl.prompts_per_step={prompts}", f"rl.samples_per_prompt={samples}",
                        f"rl.max_new_tokens={new}", *overrides))  # fmt: skip
    pred = predict(cfg.model.arch, shape_of(cfg, 1, 1, device.type))
    out = {f"predicted/{phase}_gb": pred.total(phase) / 1e9 for phase in pred.phases}
    out["predicted/peak_gb"] = pred.peak / 1e9
    return out


def markdown(r: dict) -> str:
    lines = [f"# scripts/bench.py, {r['date']}", "", f"device: {r['device_name']}; torch {r['torch']}; model {r['model']}",
             f"measured: copy bandwidth {r['ceilings']['bandwidth_Bps'] / 1e12:.2f} TB/s, "
             f"bf16 matmul {r['ceilings']['bf16_flops'] / 1e12:.0f} TFLOP/s", "",
             "| decode | engine s | HF static s | floor s | engine / floor | HF / floor | engine tok/s |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for d in r["decode"]:
        lines.append(f"| batch {d['batch']}, prompt {d['prompt']}, {d['new_tokens']} new | {d['engine_s']:.3f} | "
                     f"{d['hf_static_s']:.3f} | {d['floor_s']:.3f} | {d['engine_over_floor']:.2f}x | "
                     f"{d['hf_over_floor']:.2f}x | {d['engine_tokens_per_s']:,.0f} |")  # fmt: skip
    for d in r["decode"]:
        lines += [f"batch {d['batch']}: " + ", ".join(
            f"{v['overrides'] or 'preset defaults'} ({v['attention']}, spans {v['spans']}): "
            f"{v['engine_s']:.3f} s ({v['engine_over_floor']:.2f}x), "
            f"first call {v['first_call_s']:.1f} s" for v in d.get("variants", []))]  # fmt: skip
    for t in r["train"]:
        what = t["overrides"] or "preset defaults"
        lines += ["", f"training ({what}): failed: {t['error']!r}" if "error" in t else
                  f"training ({what}): {t['tokens']} tokens/step, {t['step_s']:.3f} s/step, "
                  f"{t['tokens_per_s']:,.0f} tok/s, MFU {t['mfu']:.1%}, floor {t['floor_s']:.3f} s, "
                  f"peak {t['peak_mem_gb']:.1f} GB"]  # fmt: skip
    for g in r.get("grpo", []):
        lines += [
            "",
            f"GRPO step, {g['overrides'] or 'preset defaults'}"
            + (f", {g['launch']} launch on a fresh compile cache" if g.get("launch") else ""),
            "",
            "| metric | value |",
            "|---|---|",
        ]
        lines += [f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |"
                  for k, v in g.items() if k not in ("overrides", "error", "compiles")]  # fmt: skip
        lines += [
            "",
            "| compile | id | s | backend s | cache hits (AOT, FX) | why it recompiled |",
            "|---|---|---|---|---|---|",
        ]
        lines += [f"| {c['fn']} | {c['id']} | {c['s']:.2f} | {c['backend_s']:.2f} | "
                  f"{c['cache_hits']['aotautograd']}, {c['cache_hits']['inductor_fx']} | "
                  f"{c.get('recompile_reason', '').replace('|', '/').replace(chr(10), ' ')} |"
                  for c in g.get("compiles", [])]  # fmt: skip
        lines += [f"failed: {g['error'][-300:]!r}"] if "error" in g else []
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of sections to skip: decode,train,grpo; hf: transformers' generate in (a)",
    )
    ap.add_argument("--grpo", action="append", default=None, metavar="OVERRIDES",
                    help="launcher overrides for one GRPO-step run (space separated); repeat to compare "
                    "variants; default: one run with the model preset's settings")  # fmt: skip
    ap.add_argument(
        "--decode",
        action="append",
        default=None,
        metavar="OVERRIDES",
        help="rl.* overrides for one (a) engine variant (e.g. rl.decode_attention=triton); repeat "
        "to compare, the first is reported; default: the preset's settings, then SDPA over the "
        "whole cache (" + WHOLE_CACHE + ")",
    )
    ap.add_argument(
        "--train",
        action="append",
        default=None,
        metavar="OVERRIDES",
        help="config overrides for one (b) run (e.g. model.compile=false); repeat to compare; "
        "default: one run with the model preset's settings",
    )
    ap.add_argument("--profile", action="store_true", help="(a) and (b): write kernel-time tables")
    ap.add_argument("--startup", action="store_true",
                    help="(c): launch the first variant twice on a compile cache of its own (a temporary "
                    "trainer.compile_cache_dir): a first launch, nothing compiled, then a second, every "
                    "compile from that cache; both reported (launch to step 1, step 1, its compiles)")  # fmt: skip
    ap.add_argument("--grpo-shape", default="64,8,128,256", metavar="P,G,PROMPT,NEW",
                    help="(c): prompts x samples, prompt tokens, new tokens (GPU)")  # fmt: skip
    args = ap.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    name = "qwen3_4b" if gpu else "qwen3_tiny"
    dtype = torch.bfloat16 if gpu else torch.float32
    skip = set(filter(None, args.skip.split(",")))
    # on CPU nominal figures stand in for the ceilings: the CPU run is a smoke test only
    ceilings = measure_ceilings(device) if gpu else {"bandwidth_Bps": 20e9, "bf16_flops": 1e11}
    cfg = preset(name)
    from trainer.model import hf_config

    config = hf_config(cfg.model)
    r = {"date": datetime.date.today().isoformat(), "device_name": torch.cuda.get_device_name() if gpu else "cpu",
         "torch": torch.__version__, "model": name, "params_matmul": count_params(config).matmul, "ceilings": ceilings}  # fmt: skip
    shapes = [(64, 128, 256), (256, 128, 256)] if gpu else [(4, 8, 8)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(
        section: str,
    ) -> None:  # after every section, so a run cut short keeps what it measured
        print(
            section,
            json.dumps(r[section][-1] if isinstance(r[section], list) else r[section]),
            flush=True,
        )
        (out / "bench.json").write_text(json.dumps(r, indent=1))
        (out / "bench.md").write_text(markdown(r))

    r["decode"], r["train"] = [], []
    for shape in [] if "decode" in skip else shapes:
        variants = [(v, preset(name, tuple(v.split()))) for v in args.decode or ["", WHOLE_CACHE]]
        profile = out / f"profile_decode_b{shape[0]}.txt" if args.profile and gpu else None
        r["decode"].append(
            decode_bench(
                config, device, dtype, *shape, ceilings, variants, profile, "hf" not in skip
            )
        )
        save("decode")
        torch.cuda.empty_cache() if gpu else None

    for variant in [] if "train" in skip else args.train or [""]:
        variant_cfg = preset(name, tuple(variant.split()))
        try:
            t = train_bench(
                variant_cfg,
                device,
                ceilings,
                *((8, 1024) if gpu else (2, 32)),
                out / f"profile_train_{len(r['train'])}.txt" if args.profile else None,
            )
        except torch.OutOfMemoryError as e:
            if not args.train:
                raise
            t = {"error": str(e)[:300]}
        r["train"].append({"overrides": variant, **t})
        save("train")
        torch.cuda.empty_cache() if gpu else None
    if "grpo" not in skip:
        shape = tuple(map(int, args.grpo_shape.split(","))) if gpu else (4, 2, 8, 8)
        r["grpo"] = []
        runs = [(v, "") for v in args.grpo or [""]]
        if args.startup:  # the first variant launched twice on one fresh compile cache
            runs = [(runs[0][0], "first"), (runs[0][0], "second"), *runs[1:]]
        with tempfile.TemporaryDirectory() as cache:
            for i, (variant, launch) in enumerate(runs):
                try:
                    g = grpo_step_bench(name, config, device, dtype, ceilings, *shape, variant.split(),  # type: ignore[misc]
                                        out / f"grpo_{i}.log", cache if args.startup else "")  # fmt: skip
                except RuntimeError as e:
                    # one variant failing (e.g. out of memory) keeps the others
                    if not args.grpo and not launch:
                        raise
                    g = {"overrides": variant, "error": str(e)[-1500:]}
                r["grpo"].append({"launch": launch, **g} if launch else g)
                save("grpo")
    print(markdown(r))


if __name__ == "__main__":
    main()
