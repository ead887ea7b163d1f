"""`dry_run=true`: the plan of a run, from the config alone (no process, no weights).

Memory per rank comes from launcher/memory.py (every phase of the step: rollout, update,
optimizer), checked against measured peaks on an H200 in docs/benchmarks.md.

Traffic per rank, counting bytes sent with ring algorithms: an all-gather or
reduce-scatter of N bytes over S ranks sends (S-1)/S * N, an all-reduce of N bytes over R
ranks sends 2 (R-1)/R * N. Each forward/backward pass all-gathers the parameters twice
(forward, then again in backward, since blocks reshard after forward) and reduce-scatters
the gradients once inside the shard group; the all-reduce across replicas runs once per
optimizer step (micro-batches before the last skip it), on the 1/S shard of the gradients.
"""

from __future__ import annotations

import json

from launcher.counting import count_params
from launcher.memory import advice, predict, shape_of
from launcher.paths import local_model_dir
from launcher.schema import ArchConfig, Config
from launcher.steptime import predict_step
from launcher.validate import world_size

GIB = 1024**3


def arch_from_model_dir(cfg: Config) -> ArchConfig:
    """The architecture: model.path's config.json when it is on this machine, else model.arch."""
    folder = local_model_dir(cfg.model.path)
    if folder is None:
        return cfg.model.arch
    hf = json.loads((folder / "config.json").read_text())
    fields = {k: hf[k] for k in ArchConfig.__dataclass_fields__ if k in hf}
    if "rope_theta" not in hf and isinstance(hf.get("rope_parameters"), dict):
        fields["rope_theta"] = hf["rope_parameters"].get("rope_theta", cfg.model.arch.rope_theta)
    if "head_dim" not in hf:
        fields["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
    return ArchConfig(**{**cfg.model.arch.__dict__, **fields})


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def fmt_gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:,.2f}"


def fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def ranks_str(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def mesh_groups(r: int, s: int) -> tuple[list[list[int]], list[list[int]]]:
    """Shard groups (rows: contiguous ranks) and replica groups (columns) of the r x s mesh."""
    shard = [[i * s + j for j in range(s)] for i in range(r)]
    replica = [[i * s + j for i in range(r)] for j in range(s)]
    return shard, replica


def plan(cfg: Config) -> str:
    p = cfg.parallel
    world, r, s = world_size(cfg), p.dp_replicate_size, p.dp_shard_size
    # A plan is usually made away from the GPUs it is for: `auto` plans for cuda.
    device = "cuda" if cfg.device == "auto" else cfg.device
    arch = arch_from_model_dir(cfg)
    counts = count_params(arch)
    compute = {"auto": 2 if device == "cuda" else 4, "bf16": 2, "fp32": 4}[cfg.model.param_dtype]
    reduce = {"fp32": 4, "bf16": 2}[cfg.model.reduce_dtype]
    n = counts.total
    node_of = lambda rank: rank // p.nproc_per_node  # noqa: E731

    out = [
        *cfg.auto_choices,
        f"hsdp-grpo plan: {cfg.presets.get('model', 'model')} ({fmt_count(n)} parameters), parallel "
        f"r{r} x s{s} on {p.nnodes} node(s) x {p.nproc_per_node} rank(s) = world {world}, device {device}",
        f"dtypes: master fp32, compute {'bf16' if compute == 2 else 'fp32'}, reduce {cfg.model.reduce_dtype}",
        "",
        "fsdp mesh (dp_replicate x dp_shard): a shard group is one row of contiguous ranks",
    ]
    shard, replica = mesh_groups(r, s)
    rows = []
    for i, ranks in enumerate(shard):
        nodes = sorted({node_of(x) for x in ranks})
        rows.append([f"replica {i}", ranks_str(ranks), ",".join(map(str, nodes))])
    out.append(table(["dp_replicate", "shard group ranks", "node(s)"], rows))
    if any(len({node_of(x) for x in g}) > 1 for g in shard):
        out.append(
            "warning: a shard group spans nodes; its all-gathers cross the slow link (make dp_shard_size divide nproc_per_node)"
        )
    if r > 1:
        out.append(
            "replica groups (all-reduce across replicas): "
            + "  ".join(f"[{ranks_str(g)}]" for g in replica)
        )

    shape = shape_of(cfg, s, world, device)
    pred = predict(arch, shape)
    capacity = p.gpu_memory_gb * 1e9 if p.gpu_memory_gb else None
    out += ["", f"memory per rank (launcher/memory.py; allocated bytes, GB = 1e9), peak in the "
            f"{pred.peak_phase} phase"]  # fmt: skip
    components: dict[str, None] = {}
    for phase in pred.phases.values():
        components.update(dict.fromkeys(phase))
    rows = [
        [name] + [fmt_gb(pred.phases[ph].get(name)) for ph in pred.phases] for name in components
    ]
    rows.append(["total"] + [fmt_gb(pred.total(ph)) for ph in pred.phases])
    out.append(table(["what", *pred.phases], rows))
    verdict = (f"; this GPU: {capacity / 1e9:.1f} GB: {'fits' if pred.needs() <= capacity else 'does NOT fit'}"
               if capacity else "")  # fmt: skip
    if capacity and pred.needs() > capacity:
        verdict += f" ({advice(cfg, arch, s, world, device, capacity)})"
    out.append(
        f"needs {pred.needs() / 1e9:.1f} GB per GPU with allocator slack and CUDA/NCCL reserve{verdict}"
    )
    if device == "cuda":
        t = predict_step(cfg, arch, shape, world)
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in t.items() if k != "step")
        out += ["", f"predicted step time on H200s (launcher/steptime.py, every response at full "
                f"length): {t['step']:.1f} s = {parts}"]  # fmt: skip
    gathers = shape.gathers
    ag = gathers * (s - 1) / s * n * compute
    rs = (s - 1) / s * n * reduce
    ar = 2 * (r - 1) / r * (n / s) * reduce if r > 1 else 0.0
    sync = (s - 1) / s * n * compute
    local_responses = (
        cfg.rl.prompts_per_step * cfg.rl.samples_per_prompt // max(world // p.cp_size, 1)
    )
    tokens = cfg.rl.micro_batch_tokens
    if isinstance(tokens, int) and tokens > 0:  # rows of full-length responses per budget
        per_micro = max(1, tokens // cfg.rl.max_new_tokens)
        what = f"<= {tokens} tokens; about, for full-length responses"
    else:
        per_micro, what = (
            cfg.rl.micro_batch_responses,
            f"<= {cfg.rl.micro_batch_responses} responses",
        )
    micro = -(-local_responses // per_micro) if local_responses else 1
    traffic = [
        [
            "all-gather params (fwd + bwd)"
            if gathers == 2
            else "all-gather params (fwd; kept for bwd)",
            f"shard group ({s})",
            fmt_bytes(ag),
            fmt_bytes(ag * micro),
        ],
        ["reduce-scatter grads", f"shard group ({s})", fmt_bytes(rs), fmt_bytes(rs * micro)],
        ["all-reduce grad shards", f"replicas ({r})", "-", fmt_bytes(ar)],
        ["gather for rollout weight sync", f"shard group ({s})", "-", fmt_bytes(sync)],
    ]
    out += [
        "",
        f"bytes sent per rank ({micro} micro-batch(es) of {what} per optimizer step)",
        table(["collective", "group", "per fwd/bwd", "per optimizer step"], traffic),
        "",
    ]
    return "\n".join(out)
