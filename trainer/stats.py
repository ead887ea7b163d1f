"""What one GRPO step measures: the one place metric names are spelled.

The loop hands this object what it saw (a rollout batch, a micro-batch's loss terms, the
update's gradient norms, timings); each rank keeps sums of its share, `finish` all-reduces them
over the dp group at once (`DPSums`: sums and counts added, times and peaks maxed) and turns
them into the metrics below, the keys of `metrics.jsonl` and W&B. `METRICS` is also the source
of docs/metrics.md's table (a test keeps the two equal).
"""

from __future__ import annotations

import math

import torch

from trainer.metrics import DPSums
from trainer.perf import train_flops

METRICS = {
    "step": "GRPO step (one rollout batch, `rl.updates_per_step` optimizer steps)",
    "rollout/reward_mean": "mean reward over every response of the step",
    "rollout/reward_std": "population std of the rewards of the step",
    "rollout/response_len_mean": "response tokens per response, EOS included",
    "rollout/truncated_frac": "responses that hit `rl.max_new_tokens` without EOS",
    "train/loss": "the aggregated objective (pg + KL - entropy), mean over the step's updates",
    "train/pg_loss": "clipped policy-gradient term, token mean",
    "train/kl": "KL to the reference (`rl.kl_estimator`), token mean over all updates",
    "train/first_kl": "`train/kl` of the first update only (0 while policy == reference)",
    "train/ppo_kl": "mean of old_logp - logp (KL(old, new), k1), over all updates",
    "train/first_ppo_kl": "`train/ppo_kl` of the first update only: exactly 0 (its ratio is 1)",
    "train/clipfrac": "share of tokens where the clip bound was active, over all updates",
    "train/first_clipfrac": "`train/clipfrac` of the first update only: exactly 0",
    "train/entropy": "token entropy of softmax(logits / temperature), token mean",
    "train/grad_norm": "global norm of the sharded gradients before clipping, mean over updates",
    "train/lr": "learning rate of the last update",
    "train/skipped_updates": "updates skipped for a non-finite gradient norm",
    "train/rollout_logprob_diff": "mean abs difference of sampling and training log-probs (first update)",
    "train/micro_batches": "forward/backward passes per update on every rank: the largest count any "
    "rank needed, agreed by an all-reduce MAX (`trainer/micro_batches.py`)",
    "train/micro_batches_needed_min": "the smallest count a rank needed on its own; below "
    "`train/micro_batches` when ranks' response lengths differ",
    "train/idle_micro_batches": "empty (zero-weight, one padding row) micro-batches over all ranks, "
    "per update: ranks with fewer rows than the count",
    "train/replica_max_diff": "on steps that are multiples of `trainer.check_replicas_every` (HSDP "
    "only): the largest spread across replica groups of a parameter shard's fingerprint (float64 "
    "sum and sum of squares); 0 when replicas agree, any other value stops the run",
    "time/rollout_s": "wall seconds (max over ranks) of generation and rewards",
    "time/ref_s": "wall seconds of the micro-batch plan and the reference log-probs",
    "time/train_s": "wall seconds of the updates",
    "time/sync_s": "wall seconds of the replica check and the weight refresh of the rollout copy",
    "time/step_s": "wall seconds of the whole step",
    "perf/tokens_per_s": "prompt + response tokens of the step over `time/step_s`",
    "perf/tokens_per_s_per_gpu": "`perf/tokens_per_s` over the number of ranks",
    "perf/rollout_tokens_per_s": "generated tokens over `time/rollout_s`",
    "perf/train_tokens_per_s": "tokens through forward + backward (x updates) over `time/train_s`",
    "perf/mfu": "training FLOPs / (`time/train_s` x ranks x peak); see below; GPUs only",
    "perf/peak_mem_gb": "peak allocated GPU memory in the step (CPU: the process's peak RSS)",
}
LOSS_TERMS = ("pg_loss", "kl", "ppo_kl", "clipfrac", "entropy")  # grpo_token_loss's stats


class StepStats:
    def __init__(self, device: torch.device):
        self.sums = DPSums(device)

    def rollout(self, batch, prompt_tokens: int) -> None:
        s = self.sums
        s.add("responses", batch.size)
        s.add("reward_sum", batch.rewards_N.sum())
        s.add("reward_sq_sum", batch.rewards_N.square().sum())
        s.add("response_len_sum", batch.response_len_N.sum())
        s.add("truncated_sum", batch.truncated_N.sum())
        s.add("prompt_tokens", prompt_tokens)
        s.add("sum_sq_len", batch.attention_mask_NL.sum(-1).double().square().sum())

    def plan(self, count: int, needed: int, idle: int) -> None:
        self.sums.max("train/micro_batches", count)
        self.sums.min("train/micro_batches_needed_min", needed)
        self.sums.add("idle_micro_batches", idle)

    def micro_batch(self, loss, terms: dict[str, torch.Tensor], mask_NT, first: bool,
                    logprob_diff_NT=None) -> None:  # fmt: skip
        """One forward/backward's share: its loss and the masked sums of its per-token terms
        (every rank adds the same names, an empty micro-batch zeros, or `finish` would hang)."""
        s = self.sums
        s.add("loss", loss.detach())
        for name, per_token in terms.items():
            total = (per_token * mask_NT).sum()
            s.add(f"{name}_sum", total)
            if first:
                s.add(f"first_{name}_sum", total)
        if first:
            s.add("logprob_diff_sum", (logprob_diff_NT * mask_NT).sum())

    def update(self, grad_norms: list[float], lr: float) -> None:
        # the norm is global (the same on every rank), so the max over ranks is that value
        self.sums.max("train/grad_norm", sum(grad_norms) / len(grad_norms))
        self.sums.max("train/skipped_updates", float(sum(not math.isfinite(g) for g in grad_norms)))
        self.lr = lr

    def replicas(self, spread: float) -> None:
        self.sums.max("train/replica_max_diff", spread)

    def times(self, seconds: dict[str, float], peak_mem_gb: float) -> None:
        for name, value in seconds.items():
            self.sums.max(f"time/{name}_s", value)
        self.sums.max("perf/peak_mem_gb", peak_mem_gb)

    def finish(self, step: int, group, config, world: int, updates: int,
               peak_flops: float | None) -> dict[str, float]:  # fmt: skip
        """Collective over `group`: this step's metrics, the same numbers on every rank."""
        r = self.sums.reduce(group)
        n, tokens = r["responses"], r["response_len_sum"]
        mean = r["reward_sum"] / n
        out = {
            "step": step,
            "rollout/reward_mean": mean,
            "rollout/reward_std": math.sqrt(max(0.0, r["reward_sq_sum"] / n - mean * mean)),
            "rollout/response_len_mean": tokens / n,
            "rollout/truncated_frac": r["truncated_sum"] / n,
            "train/loss": r["loss"] / updates,
            "train/lr": self.lr,
            "train/rollout_logprob_diff": r["logprob_diff_sum"] / tokens,
            "train/idle_micro_batches": r["idle_micro_batches"],
        }
        for term in LOSS_TERMS:  # token means; kl only with a reference
            out[f"train/{term}"] = r.get(f"{term}_sum", 0.0) / (tokens * updates)
            if term != "pg_loss" and term != "entropy":
                out[f"train/first_{term}"] = r.get(f"first_{term}_sum", 0.0) / tokens
        out.update({k: v for k, v in r.items() if k.startswith(("time/", "perf/", "train/"))})
        all_tokens = r["prompt_tokens"] + tokens
        out["perf/tokens_per_s"] = all_tokens / r["time/step_s"]
        out["perf/tokens_per_s_per_gpu"] = all_tokens / r["time/step_s"] / world
        out["perf/rollout_tokens_per_s"] = tokens / r["time/rollout_s"]
        out["perf/train_tokens_per_s"] = all_tokens * updates / r["time/train_s"]
        if peak_flops is not None:
            flops = updates * train_flops(config, all_tokens, r["sum_sq_len"])
            out["perf/mfu"] = flops / (r["time/train_s"] * world * peak_flops)
        unknown = set(out) - set(METRICS)
        assert not unknown, f"metrics without a line in METRICS: {sorted(unknown)}"
        return out
