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
    "rollout/reward_mean": "mean task reward (`data.rewards`, before overlong shaping) over every "
    "response sampled in the step, all dynamic-sampling rounds",
    "rollout/reward_std": "population std of those rewards",
    "rollout/response_len_mean": "response tokens per sampled response, EOS included",
    "rollout/truncated_frac": "sampled responses that hit `rl.max_new_tokens` without EOS",
    "rollout/overlong_penalty_mean": "mean of DAPO's soft overlong penalty added to the rewards "
    "(`rl.overlong_buffer`; 0 when off): -penalty x max(0, len - (max_new_tokens - buffer)) / buffer",
    "rollout/zero_std_frac": "sampled groups whose (shaped) rewards are all equal (std <= "
    "`rl.zero_std_eps`), before any filtering: they carry no policy gradient",
    "rollout/sample_rounds": "sampling rounds of the step (dynamic sampling: until "
    "`rl.prompts_per_step` groups with signal, at most `rl.max_sample_rounds`; else 1)",
    "rollout/kept_groups": "groups trained on, over all ranks: `rl.prompts_per_step`, or fewer "
    "when dynamic sampling hit `rl.max_sample_rounds` (0: the update was skipped)",
    "train/loss": "the aggregated objective (pg + KL - entropy), mean over the step's updates",
    "train/pg_loss": "clipped policy-gradient term, token mean",
    "train/kl": "KL to the reference (`rl.kl_estimator`), token mean over all updates",
    "train/first_kl": "`train/kl` of the first update only (0 while policy == reference)",
    "train/ppo_kl": "mean of old_logp - logp (KL(old, new), k1), over all updates",
    "train/first_ppo_kl": "`train/ppo_kl` of the first update only: exactly 0 (its ratio is 1)",
    "train/clipfrac": "share of tokens where the clip bound was active, over all updates",
    "train/dual_clipfrac": "share of tokens where the dual-clip bound (`rl.clip_ratio_c`) was "
    "active, over all updates (0 when off)",
    "train/first_dual_clipfrac": "`train/dual_clipfrac` of the first update only: exactly 0",
    "train/first_clipfrac": "`train/clipfrac` of the first update only: exactly 0",
    "train/entropy": "token entropy of softmax(logits / temperature), token mean",
    "train/grad_norm": "global norm of the sharded gradients before clipping, mean over updates",
    "train/lr": "learning rate of the last update",
    "train/skipped_updates": "updates skipped for a non-finite gradient norm",
    "train/rollout_logprob_diff": "mean abs difference of sampling and training log-probs (first "
    "update); with `rl.top_p` < 1 or `rl.top_k` the sampler's are of the truncated distribution",
    "train/rollout_is_mean": "mean over response tokens of rho = pi_learner / pi_sampler (per token, "
    "or per response with `rl.rollout_is_level=sequence`), learner = the weights that sampled",
    "train/rollout_is_max": "largest rho of the step",
    "train/rollout_is_masked_frac": "response tokens whose weight the rollout correction changed: "
    "rejected by `mis`, truncated at `rl.rollout_is_cap` by `tis` (0 with `none`)",
    "train/micro_batches": "forward/backward passes per update on every rank: the largest count any "
    "rank needed, agreed by an all-reduce MAX (`trainer/micro_batches.py`)",
    "train/micro_batches_needed_min": "the smallest count a rank needed on its own; below "
    "`train/micro_batches` when ranks' response lengths differ",
    "train/idle_micro_batches": "empty (zero-weight, one padding row) micro-batches over all ranks, "
    "per update: ranks with fewer rows than the count",
    "train/replica_max_diff": "on steps that are multiples of `trainer.check_replicas_every` (HSDP "
    "only): the largest spread across replica groups of a parameter shard's fingerprint (float64 "
    "sum and sum of squares); 0 when replicas agree, any other value stops the run",
    "time/rollout_s": "wall seconds (max over ranks) of generation and rewards, all rounds",
    "time/ref_s": "wall seconds of the micro-batch plan, the reference log-probs and (`mis`) "
    "the learner's pre-pass",
    "time/train_s": "wall seconds of the updates",
    "time/sync_s": "wall seconds of the replica check and the weight refresh of the rollout copy",
    "time/step_s": "wall seconds of the whole step",
    "time/eval_s": "wall seconds of the evaluation (steps that evaluate)",
    "eval/pass@1": "held-out prompts whose greedy response is correct (the task's correctness "
    "reward is 1), `trainer.eval_every` steps and the last",
    "eval/pass@k": "pass@k with k = `trainer.eval_k` samples per prompt at `rl.temperature`, "
    "unbiased estimator 1 - C(n-c, k) / C(n, k) averaged over prompts",
    "eval/reward_mean": "mean task reward of the evaluation's sampled responses",
    "eval/response_len_mean": "mean length of the evaluation's sampled responses, EOS included",
    "perf/tokens_per_s": "prompt + response tokens sampled in the step (all rounds) over `time/step_s`",
    "perf/tokens_per_s_per_gpu": "`perf/tokens_per_s` over the number of ranks",
    "perf/rollout_tokens_per_s": "generated tokens over `time/rollout_s`",
    "perf/train_tokens_per_s": "tokens of the trained batch through forward + backward (x updates) "
    "over `time/train_s`",
    "perf/mfu": "training FLOPs / (`time/train_s` x ranks x peak); see below; GPUs only",
    "perf/peak_mem_gb": "peak allocated GPU memory in the step (CPU: the process's peak RSS)",
    "perf/peak_mem_rollout_gb": "GPUs: peak allocated memory while sampling (all rounds) and scoring; launcher/memory.py's `rollout` phase",
    "perf/peak_mem_update_gb": "GPUs: peak allocated memory in the reference pass and the forward/backward passes; the `update` phase",
    "perf/peak_mem_optimizer_gb": "GPUs: peak allocated memory in the optimizer steps; the `optimizer step` phase",
}
# grpo_token_loss's per-token stats; FIRST_TERMS are also logged for the first update alone
LOSS_TERMS = ("pg_loss", "kl", "ppo_kl", "clipfrac", "dual_clipfrac", "entropy")
FIRST_TERMS = ("kl", "ppo_kl", "clipfrac", "dual_clipfrac")


class StepStats:
    def __init__(self, device: torch.device):
        self.sums = DPSums(device)

    def sampled(self, rollout, rewards_N, penalty_N, zero_std_P) -> None:
        """One sampling round: every response sampled, before any filtering."""
        s = self.sums
        s.add("responses", len(rollout.response_ids))
        s.add("reward_sum", rewards_N.sum())
        s.add("reward_sq_sum", rewards_N.square().sum())
        s.add("penalty_sum", penalty_N.sum())
        s.add("response_len_sum", sum(map(len, rollout.response_ids)))
        s.add("truncated_sum", sum(rollout.truncated))
        s.add("sampled_prompt_tokens", sum(map(len, rollout.prompt_ids)))
        s.add("groups", len(zero_std_P))
        s.add("zero_std_groups", zero_std_P.sum())

    def train_batch(self, batch, prompt_tokens: int, rounds: int, kept_groups: int) -> None:
        """The batch the update trains on (this rank's share of the kept groups)."""
        s = self.sums
        s.add("train_tokens", batch.mask_NT.sum())
        s.add("prompt_tokens", prompt_tokens)
        s.add("sum_sq_len", batch.attention_mask_NL.sum(-1).double().square().sum())
        s.max("rollout/sample_rounds", rounds)  # the same on every rank
        s.max("rollout/kept_groups", kept_groups)

    def plan(self, count: int, needed: int, idle: int) -> None:
        self.sums.max("train/micro_batches", count)
        self.sums.min("train/micro_batches_needed_min", needed)
        self.sums.add("idle_micro_batches", idle)

    def micro_batch(self, loss, terms: dict[str, torch.Tensor], mask_NT, first: bool,
                    logprob_diff_NT=None, is_terms=None) -> None:  # fmt: skip
        """One forward/backward's share: its loss and the masked sums of its per-token terms
        (every rank adds the same names, an empty micro-batch zeros, or `finish` would hang)."""
        s = self.sums
        s.add("loss", loss.detach())
        for name, per_token in terms.items():
            total = (per_token * mask_NT).sum()
            s.add(f"{name}_sum", total)
            if first and name in FIRST_TERMS:
                s.add(f"first_{name}_sum", total)
        if first:
            s.add("logprob_diff_sum", (logprob_diff_NT * mask_NT).sum())
            s.add("rollout_is_sum", (is_terms["rollout_is"] * mask_NT).sum())
            s.add("rollout_is_masked_sum", (is_terms["rollout_is_masked"] * mask_NT).sum())
            s.max("train/rollout_is_max", (is_terms["rollout_is"] * mask_NT).max())

    def update(self, grad_norms: list[float], lr: float) -> None:
        # the norm is global (the same on every rank), so the max over ranks is that value; no
        # norms: the update was skipped (dynamic sampling kept no group)
        self.sums.max("train/grad_norm", sum(grad_norms) / max(len(grad_norms), 1))
        self.sums.max("train/skipped_updates", float(sum(not math.isfinite(g) for g in grad_norms)))
        self.lr = lr

    def replicas(self, spread: float) -> None:
        self.sums.max("train/replica_max_diff", spread)

    def times(self, seconds: dict[str, float], peak_mem_gb: float) -> None:
        for name, value in seconds.items():
            self.sums.max(f"time/{name}_s", value)
        self.sums.max("perf/peak_mem_gb", peak_mem_gb)

    def phase_peaks(self, peaks: dict[str, float]) -> None:
        for phase, gb in peaks.items():  # every GPU rank has every phase: the same names
            self.sums.max(f"perf/peak_mem_{phase}_gb", gb)

    def finish(self, step: int, group, config, world: int, updates: int,
               peak_flops: float | None) -> dict[str, float]:  # fmt: skip
        """Collective over `group`: this step's metrics, the same numbers on every rank."""
        r = self.sums.reduce(group)
        n, sampled_tokens = r["responses"], r["response_len_sum"]
        # train/* are token means over the trained batch; max(.., 1): an update skipped for want
        # of groups (dynamic sampling) has none and logs zeros
        tokens = max(r["train_tokens"], 1.0)
        mean = r["reward_sum"] / n
        out = {
            "step": step,
            "rollout/reward_mean": mean,
            "rollout/reward_std": math.sqrt(max(0.0, r["reward_sq_sum"] / n - mean * mean)),
            "rollout/response_len_mean": sampled_tokens / n,
            "rollout/truncated_frac": r["truncated_sum"] / n,
            "rollout/overlong_penalty_mean": r["penalty_sum"] / n,
            "rollout/zero_std_frac": r["zero_std_groups"] / r["groups"],
            "train/loss": r.get("loss", 0.0) / updates,
            "train/lr": self.lr,
            "train/rollout_logprob_diff": r.get("logprob_diff_sum", 0.0) / tokens,
            "train/rollout_is_mean": r.get("rollout_is_sum", 0.0) / tokens,
            "train/rollout_is_masked_frac": r.get("rollout_is_masked_sum", 0.0) / tokens,
            "train/idle_micro_batches": r["idle_micro_batches"],
        }
        for term in LOSS_TERMS:  # token means; kl only with a reference
            out[f"train/{term}"] = r.get(f"{term}_sum", 0.0) / (tokens * updates)
            if term in FIRST_TERMS:
                out[f"train/first_{term}"] = r.get(f"first_{term}_sum", 0.0) / tokens
        out.update(
            {k: v for k, v in r.items() if k.startswith(("time/", "perf/", "train/", "rollout/"))}
        )
        out.setdefault("train/rollout_is_max", 0.0)
        train_tokens = r["prompt_tokens"] + r["train_tokens"]
        all_tokens = r["sampled_prompt_tokens"] + sampled_tokens
        out["perf/tokens_per_s"] = all_tokens / r["time/step_s"]
        out["perf/tokens_per_s_per_gpu"] = all_tokens / r["time/step_s"] / world
        out["perf/rollout_tokens_per_s"] = sampled_tokens / r["time/rollout_s"]
        out["perf/train_tokens_per_s"] = train_tokens * updates / r["time/train_s"]
        if peak_flops is not None:
            flops = updates * train_flops(config, train_tokens, r["sum_sq_len"])
            out["perf/mfu"] = flops / (r["time/train_s"] * world * peak_flops)
        unknown = set(out) - set(METRICS)
        assert not unknown, f"metrics without a line in METRICS: {sorted(unknown)}"
        return out
