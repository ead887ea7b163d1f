"""Predicted GRPO step time from the config and measured H200 ceilings (no torch).

    rollout   per engine call (one, or one per `rl.rollout_batch` rows): a prefill of the
              prompts at the matmul peak x PREFILL_OVER_FLOOR, then max_new_tokens decode steps,
              each the sum of its kernels' floors x DECODE_OVER_FLOOR: the matmuls (the larger of
              reading the engine's weights and their FLOPs, 2 x matmul params x the call's rows)
              and the attention's read of the KV cache's filled part (on average the prompt and
              half the new tokens)
    update    hardware FLOPs (6 x matmul params x tokens + causal attention; x 4/3 with
              activation checkpointing) / (peak x TRAIN_MATH_EFFICIENCY)
              + a fixed cost per micro-batch (FSDP's casts and copies of the weights and
              gradients, the loss, launches): MICRO_BATCH_OVERHEAD_S where every micro-batch
              reduce-scatters its gradient, ONE_SHARD_MICRO_BATCH_OVERHEAD_S where a shard group
              has one rank (the gradient is reduced once, after the last micro-batch)
    shard     all-gathers (forward and backward) and the reduce-scatter per micro-batch inside
              a shard group over NVLink (NVLINK_BPS); FSDP overlaps them with compute, so only
              what exceeds the update's compute is counted
    replicas  the all-reduce of the gradient shards across replica groups, once per optimizer
              step, over NVLink on one node or `parallel.link_gbps` across nodes
    optimizer AdamW reads and writes the sharded states about 2.5 times: 40 N / S bytes / BW

The ceilings are one H200's (scripts/bench.py, 2026-12-04): copy bandwidth 4.08 TB/s, bf16
matmul 759 TFLOP/s. NVLINK_BPS is the H200 NVLink's datasheet 450 GB/s per direction derated
to 370 GB/s of all-gather bus bandwidth, not measured here (multi-GPU machines were withheld).
"""

from __future__ import annotations

from launcher.counting import count_params
from launcher.memory import Shape

BANDWIDTH_BPS = 4.08e12
BF16_FLOPS = 759e12
# Fitted on H200 runs of 2026-12-04 (docs/benchmarks.md, "Issue 18"). Decode and prefill: on
# the preset's rollout (512 rows, 256 new) with the Triton split merge and the compiled prefill
# (about 0.4 s of the rollout's 0.6 s gain, from the profiles: the prefill now runs at the
# matmul peak); before those, 1.756 and 1.585 fitted this rollout and the long-response one.
# The update's: TRAIN_MATH_EFFICIENCY and MICRO_BATCH_OVERHEAD_S on three updates that
# reduce-scattered every micro-batch; the one-shard cost on the preset's update since.
DECODE_OVER_FLOOR = 1.66
PREFILL_OVER_FLOOR = 1.0
TRAIN_MATH_EFFICIENCY = 0.98  # share of the measured peak the update's matmuls reach
MICRO_BATCH_OVERHEAD_S = 0.083  # seconds per forward/backward pass beyond its FLOPs
ONE_SHARD_MICRO_BATCH_OVERHEAD_S = 0.064  # the same, no reduce-scatter until the last
NVLINK_BPS = 370e9


def predict_step(cfg, arch, s: Shape, world: int) -> dict[str, float]:
    counts = count_params(arch)
    r, m, p = cfg.rl, cfg.model, cfg.parallel
    c = s.compute_bytes
    rows, prompt, new = s.responses, s.prompt_tokens, s.new_tokens
    # rollout: the KV cache's filled part averages prompt + new / 2 columns
    call_rows = s.call_rows
    calls = -(-rows // call_rows)
    kv_per_col = (
        arch.num_hidden_layers * 2 * call_rows * arch.num_key_value_heads * arch.head_dim * c
    )
    matmuls = max(c * counts.total / BANDWIDTH_BPS, 2 * counts.matmul * call_rows / BF16_FLOPS)
    attention = kv_per_col * (prompt + new / 2) / BANDWIDTH_BPS
    prefill = 2 * counts.matmul * call_rows * prompt / BF16_FLOPS
    rollout = calls * (
        new * (matmuls + attention) * DECODE_OVER_FLOOR + prefill * PREFILL_OVER_FLOOR
    )
    # update: every row at full length (responses that stop early make it shorter)
    length = prompt + new
    tokens = rows * length
    causal = 6 * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim
    flops = 6 * counts.matmul * tokens + causal * rows * length**2
    hardware = flops * (4 / 3 if m.activation_checkpointing else 1)
    budget = r.micro_batch_tokens if isinstance(r.micro_batch_tokens, int) else 0
    rows_per_micro = max(1, budget // length) if budget > 0 else r.micro_batch_responses
    micro = -(-rows // rows_per_micro) * r.updates_per_step
    compute = hardware * r.updates_per_step / (BF16_FLOPS * TRAIN_MATH_EFFICIENCY)
    shard = s.shard
    per_micro = ONE_SHARD_MICRO_BATCH_OVERHEAD_S if shard == 1 else MICRO_BATCH_OVERHEAD_S
    update = compute + micro * per_micro
    shard_bytes = micro * ((shard - 1) / shard) * counts.total * (s.gathers * c + 4)
    exposed_shard = max(0.0, shard_bytes / NVLINK_BPS - compute)
    replicas = world // shard
    link = p.link_gbps * 1e9 / 8 if p.nnodes > 1 else NVLINK_BPS
    allreduce = 2 * (replicas - 1) / replicas * 4 * counts.total / shard / link * r.updates_per_step
    optimizer = 40 * counts.total / shard / BANDWIDTH_BPS * r.updates_per_step
    out = {"rollout": rollout, "update": update, "shard traffic (exposed)": exposed_shard,
           "replica all-reduce": allreduce, "optimizer": optimizer}  # fmt: skip
    out["step"] = sum(out.values())
    return out
