"""The GRPO loop on one rank: rollout -> rewards -> advantages -> (ref log-probs) -> updates
-> weight sync -> metrics.

Departures from the papers, stated: advantages are per group of `samples_per_prompt`
responses with the unbiased std; `updates_per_step` reuses the whole rollout batch that many
times (TRL's `num_iterations`), and the old log-probs are those of the first update's
forward pass, which ran with the weights that sampled (so its ratio is exactly 1, and no
extra forward pass is spent on them).
"""

from __future__ import annotations

import importlib.util
import math
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from launcher.run_folder import stop_file
from launcher.schema import Config, OptimConfig, rewards_of
from trainer import checkpoint, micro_batches
from trainer.data import PromptSampler, Task, load_task, mixed_seed
from trainer.engine import StaticCacheEngine
from trainer.grpo import group_advantages, grpo_token_loss, loss_weights, token_logprobs
from trainer.metrics import MetricsLogger
from trainer.micro_batches import MicroBatch
from trainer.model import CausalLM, build_model, compute_dtype
from trainer.parallel import ParallelState, any_rank
from trainer.perf import peak_flops, peak_memory_gb
from trainer.replicas import check_replicas
from trainer.rewards import score
from trainer.rollout import HFRolloutEngine, Rollout, RolloutEngine, SamplingParams
from trainer.stats import StepStats
from trainer.watchdog import NoWatchdog


@dataclass
class Batch:
    """One rank's rollout as right-padded tensors; T = longest prompt + response - 1 targets.

    Names say their shape: N responses, L tokens per row, T = L - 1 target positions."""

    input_ids_NL: torch.Tensor
    attention_mask_NL: torch.Tensor
    mask_NT: torch.Tensor  # 1 where the target token is a response token
    sampling_logp_NT: torch.Tensor
    advantages_N: torch.Tensor
    rewards_N: torch.Tensor
    response_len_N: torch.Tensor
    truncated_N: torch.Tensor
    ref_logp_NT: torch.Tensor | None = None
    old_logp_NT: torch.Tensor | None = None  # filled by the first update of a step
    weights_NT: torch.Tensor | None = None  # per-token loss weights from the global counts

    @property
    def size(self) -> int:
        return self.input_ids_NL.shape[0]

    def rows(self, mb: MicroBatch) -> Batch:
        """The micro-batch's rows cut to its width; an empty micro-batch is one padding row
        of width 2 whose masks and weights are zero (it runs the collectives, adds nothing)."""
        widths = {"_NL": mb.width, "_NT": mb.width - 1}
        padding = {"_NL": (1, 2), "_NT": (1, 1)}
        out: dict[str, Any] = {}
        for name, t in vars(self).items():
            suffix = name[-3:]
            if t is None:
                out[name] = None
            elif mb.empty:
                out[name] = t.new_zeros(padding.get(suffix, (1,)))
            else:
                out[name] = t[mb.rows, : widths[suffix]] if suffix in widths else t[mb.rows]
        return Batch(**out)


def collate(
    rollout: Rollout,
    rewards_N: torch.Tensor,
    advantages_N: torch.Tensor,
    pad_id: int,
    device: torch.device,
) -> Batch:
    n = len(rollout.response_ids)
    width = max(len(p) + len(r) for p, r in zip(rollout.prompt_ids, rollout.response_ids))
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width - 1))
    sampling = torch.zeros((n, width - 1))
    for i, (p, r) in enumerate(zip(rollout.prompt_ids, rollout.response_ids)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        # target j is token j + 1: response tokens are targets len(p) - 1 ... len(p) + len(r) - 2
        mask[i, len(p) - 1 : len(p) + len(r) - 1] = 1
        sampling[i, len(p) - 1 : len(p) + len(r) - 1] = rollout.sampling_logprobs[i]
    lengths = torch.tensor([len(r) for r in rollout.response_ids], dtype=torch.float)
    return Batch(
        ids.to(device),
        attn.to(device),
        mask.to(device),
        sampling.to(device),
        advantages_N.to(device),
        rewards_N.to(device),
        lengths.to(device),
        torch.tensor(rollout.truncated, dtype=torch.float).to(device),
    )


def lr_factor(o: OptimConfig, total_steps: int):
    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def sequence_logprobs(model: CausalLM, batch: Batch, temperature: float, chunk_tokens: int = 1024):
    """Log-probs and entropies of targets 0 .. L-2 of every row of `batch` (N x T each).

    Rows are right-padded, so under the causal mask no real token attends to padding: the
    forward needs no attention mask (and SDPA takes its causal fast path). Padding positions
    get values that the loss masks out.
    """
    ids = batch.input_ids_NL
    logits = model(input_ids=ids, use_cache=False).logits
    # the target of the last column does not exist: score a dummy one and drop it, so the logits
    # are never copied (a slice [:, :-1] would be, by the reshape inside token_logprobs)
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    logp, entropy = token_logprobs(logits, targets, temperature, chunk_tokens)
    return logp[:, :-1], entropy[:, :-1]


def decode_attention(cfg: Config, device: torch.device) -> str:
    """`rl.decode_attention=auto`: the Triton kernel where it can run (a GPU, Triton, a
    power-of-two head_dim >= 16), else SDPA."""
    if cfg.rl.decode_attention != "auto":
        return cfg.rl.decode_attention
    from trainer.decode_attention import supports

    fits = device.type == "cuda" and supports(cfg.model.arch.head_dim)
    return "triton" if fits and importlib.util.find_spec("triton") is not None else "sdpa"


def make_engine(cfg: Config, config, device: torch.device) -> RolloutEngine:
    """`rl.engine`: the static-cache engine on GPUs (auto), transformers generate on CPU."""
    kind = (
        cfg.rl.engine if cfg.rl.engine != "auto" else ("static" if device.type == "cuda" else "hf")
    )
    dtype = compute_dtype(cfg.model, device.type)
    if kind == "static":
        return StaticCacheEngine(config, dtype, device, compile=cfg.rl.compile_decode,
                                 spans=cfg.rl.decode_spans, attention=decode_attention(cfg, device))  # fmt: skip
    return HFRolloutEngine(config, dtype, device, cfg.model.attn_implementation)


class GRPOTrainer:
    def __init__(self, cfg: Config, ps: ParallelState, model: CausalLM, watchdog=None,
                 task: Task | None = None):  # fmt: skip
        self.cfg, self.ps, self.model = cfg, ps, model
        self.watchdog = watchdog or NoWatchdog()
        self.current_step, self.update_name = 0, "update 1/1"
        self.rl, device = cfg.rl, ps.device
        self.rewards = rewards_of(cfg.data)
        task = task or load_task(cfg, ps.local_rank, model.config.max_position_embeddings)
        self.tokenizer, self.prompts, self.prompt_ids = (
            task.tokenizer,
            task.prompts,
            task.prompt_ids,
        )
        self.sampler = PromptSampler(
            len(self.prompts), self.rl.prompts_per_step, ps.dp_rank, ps.dp_size, cfg.trainer.seed
        )
        self.sampling = SamplingParams(
            self.rl.temperature,
            self.rl.top_p,
            self.rl.max_new_tokens,
            self.tokenizer.eos_token_id,
            self.tokenizer.pad_token_id,
        )
        self.engine = make_engine(cfg, model.config, device)
        self.engine.load_weights(model)
        self.reference = None
        if self.rl.kl_coef > 0:
            self.reference = build_model(
                cfg.model, ps.get_mesh("fsdp"), device, cfg.trainer.seed, requires_grad=False
            )
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            foreach=True,
        )
        total_updates = cfg.trainer.max_steps * self.rl.updates_per_step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_factor(o, total_updates)
        )
        self.checkpointer = checkpoint.Checkpointer(cfg, model, self.optimizer, self.scheduler,
                                                    self.tokenizer, self.layout(), device.type)  # fmt: skip
        self.metrics = MetricsLogger(cfg, is_main=ps.rank == 0)
        self.dp_group = ps.get_mesh("dp").get_group()
        self.peak_flops = peak_flops(device, cfg.trainer.peak_tflops)
        self.bad_updates = 0
        self.sigterm = False
        signal.signal(signal.SIGTERM, self.on_sigterm)

    def on_sigterm(self, signum, frame) -> None:
        self.sigterm = True  # checkpoint and stop at the end of this step

    def phase(self, name: str) -> None:
        self.watchdog.phase(self.current_step, name)

    def sync(self) -> None:
        if self.ps.device.type == "cuda":
            torch.cuda.synchronize()

    def train(self) -> None:
        """Steps until trainer.max_steps or a stop agreed by every rank; saves as the
        checkpointer's policy says; exports at the end of a run that was not stopped."""
        step, stopping = self.resume(), False
        while step < self.cfg.trainer.max_steps and not stopping:
            step += 1
            self.metrics.log(self.step(step))
            self.phase("stop decision")
            stopping = self.stop_requested()
            self.phase("checkpoint")
            self.checkpointer.maybe_save(step, stopping)
        if stopping:
            print(f"stopped by request after step {step}", flush=True)
        else:
            self.phase("export")
            self.checkpointer.export()
        self.metrics.close()

    def step(self, step: int) -> dict[str, float]:
        """One GRPO step; returns its metrics, reduced over the dp ranks."""
        stats, self.current_step = StepStats(self.ps.device), step
        clock = [time.perf_counter()]

        def lap() -> None:
            self.sync()
            clock.append(time.perf_counter())

        self.phase("rollout")
        batch = self.rollout(step, stats)
        lap()
        plan = self.micro_batches(batch, stats)
        if self.reference is not None:
            batch.ref_logp_NT = self.reference_logprobs(batch, plan)
        lap()
        self.update(batch, plan, stats)
        lap()
        self.check_replicas(step, stats)
        self.phase("weight refresh")
        self.engine.load_weights(self.model)
        lap()
        t = clock
        stats.times({"rollout": t[1] - t[0], "ref": t[2] - t[1], "train": t[3] - t[2],
                     "sync": t[4] - t[3], "step": t[4] - t[0]}, peak_memory_gb(self.ps.device))  # fmt: skip
        self.phase("metrics")
        return stats.finish(step, self.dp_group, self.model.config, self.ps.world_size,
                            self.rl.updates_per_step, self.peak_flops)  # fmt: skip

    def check_replicas(self, step: int, stats: StepStats) -> None:
        """Every trainer.check_replicas_every steps (the same steps on every rank), under HSDP."""
        every = self.cfg.trainer.check_replicas_every
        if every and self.ps.dp_replicate_size > 1 and step % every == 0:
            self.phase("replica check")
            group = self.ps.get_mesh("fsdp").get_group("dp_replicate")
            stats.replicas(check_replicas(self.model, group, self.ps.device, step))

    def resume(self) -> int:
        """Load `trainer.resume` (resolved to a checkpoint folder by the launcher); the step it ends."""
        if self.cfg.trainer.resume == "none":
            return 0
        self.phase("resume")
        step = self.checkpointer.resume()
        self.engine.load_weights(self.model)
        self.metrics.truncate(step)
        if self.ps.rank == 0:
            print(f"resumed from {self.cfg.trainer.resume} at step {step}", flush=True)
        return step

    def stop_requested(self) -> bool:
        """A stop asked of the launcher (its STOP file) or of any worker (SIGTERM), agreed by all ranks."""
        asked = self.sigterm or (self.ps.local_rank == 0 and stop_file(self.cfg.run_dir).exists())
        return any_rank(asked, self.ps.device)  # stop (and save) together or not at all

    def layout(self) -> dict[str, int]:
        return {"world_size": self.ps.world_size, "dp_replicate_size": self.ps.dp_replicate_size,
                "dp_shard_size": self.ps.dp_shard_size}  # fmt: skip

    def rollout(self, step: int, stats: StepStats) -> Batch:
        g = self.rl.samples_per_prompt
        indices = self.sampler.indices(step - 1)
        prompts = [self.prompts[i] for i in indices]
        prompt_ids = [self.prompt_ids[i] for i in indices]
        # Sampling randomness is a function of (seed, step, dp rank) alone.
        torch.manual_seed(mixed_seed(self.cfg.trainer.seed, step, self.ps.dp_rank))
        rollout = self.engine.generate(prompt_ids, g, self.sampling)
        texts = self.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        rewards_N = torch.tensor(
            [score(t, prompts[i // g].answer, self.rewards) for i, t in enumerate(texts)]
        )
        advantages_N = group_advantages(
            rewards_N.view(-1, g), self.rl.std_normalize, self.rl.adv_eps
        ).view(-1)
        batch = collate(
            rollout, rewards_N, advantages_N, self.tokenizer.pad_token_id, self.ps.device
        )
        stats.rollout(batch, sum(len(p) for p in rollout.prompt_ids))
        return batch

    def micro_batches(self, batch: Batch, stats: StepStats | None = None) -> list[MicroBatch]:
        """Collective: this rank's micro-batches for the step, as many as every other rank runs
        (the count is all-reduced over dp; see trainer/micro_batches.py). One plan serves the
        reference pass and every update of the step: the rows do not change in between."""
        lengths = batch.attention_mask_NL.sum(-1).tolist()
        rl = self.rl
        needed = micro_batches.local_count(lengths, rl.micro_batch_responses, rl.micro_batch_tokens)
        count = micro_batches.agreed_count(needed, self.dp_group, self.ps.device)
        plan = micro_batches.split(lengths, count, rl.micro_batch_tokens)
        if stats is not None:
            stats.plan(count, needed, sum(mb.empty for mb in plan))
        return plan

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch, plan: list[MicroBatch]) -> torch.Tensor:
        out = torch.zeros_like(batch.sampling_logp_NT)
        for k, mb in enumerate(plan):  # the agreed count: every rank runs as many forwards
            self.phase(f"reference, micro-batch {k + 1}/{len(plan)}")
            logp = sequence_logprobs(self.reference, batch.rows(mb), self.rl.temperature,
                                     self.rl.logprob_chunk_tokens)[0]  # fmt: skip
            if not mb.empty:
                out[mb.rows, : mb.width - 1] = logp
        return out

    def update(self, batch: Batch, plan: list[MicroBatch], stats: StepStats) -> None:
        """`rl.updates_per_step` optimizer steps on this rollout batch."""
        self.prepare_update(batch)
        grad_norms = []
        for u in range(self.rl.updates_per_step):  # a config value: the same on every rank
            self.update_name = f"update {u + 1}/{self.rl.updates_per_step}"
            self.backward(batch, plan, first=u == 0, stats=stats)
            self.phase(f"{self.update_name}, optimizer step")
            grad_norms.append(self.optimizer_step())
        stats.update(grad_norms, float(self.last_lr))

    def prepare_update(self, batch: Batch) -> None:
        """Collective: the loss weights (from global counts) and room for the old log-probs."""
        batch.weights_NT = self.loss_weights(batch)
        batch.old_logp_NT = torch.zeros_like(batch.sampling_logp_NT)

    def loss_weights(self, batch: Batch) -> torch.Tensor:
        """Per-token weights from the counts of the whole batch over all dp ranks."""
        t = torch.tensor(
            [batch.mask_NT.sum().item(), batch.size], dtype=torch.float64, device=self.ps.device
        )
        dist.all_reduce(t, group=self.dp_group)
        global_tokens, global_responses = t.tolist()
        return loss_weights(
            batch.mask_NT, self.rl.loss_agg, global_tokens, global_responses, self.rl.max_new_tokens
        )

    def backward(self, batch: Batch, plan: list[MicroBatch], first: bool, stats: StepStats) -> None:
        """Accumulate the gradient of the global loss over this rank's micro-batches.

        `plan` has the agreed count (`micro_batches`), so every rank runs the same number of
        forward/backward passes; an empty micro-batch is a zero-weight padding row. On the
        first update the current log-probs are the old ones (same weights that sampled): they
        are stored into `batch.old_logp_NT`, and the ratio is exactly 1.
        """
        rl = self.rl
        assert batch.old_logp_NT is not None, "prepare_update(batch) first"
        for k, mb in enumerate(plan):
            self.phase(f"{self.update_name}, micro-batch {k + 1}/{len(plan)}")
            if self.ps.dp_replicate_size > 1:  # all-reduce across replicas once, after the last
                self.model.set_requires_all_reduce(k == len(plan) - 1)
            mbb = batch.rows(mb)
            assert mbb.old_logp_NT is not None and mbb.weights_NT is not None
            logp, entropy = sequence_logprobs(
                self.model, mbb, rl.temperature, rl.logprob_chunk_tokens
            )
            if first:
                mbb.old_logp_NT = logp.detach()
                if not mb.empty:
                    batch.old_logp_NT[mb.rows, : mb.width - 1] = mbb.old_logp_NT
            token_loss, terms = grpo_token_loss(
                logp, mbb.old_logp_NT, mbb.advantages_N, rl.clip_low, rl.clip_high,
                ref_logp=mbb.ref_logp_NT, kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator,
                entropy=entropy if rl.entropy_coef > 0 else entropy.detach(), entropy_coef=rl.entropy_coef,
            )  # fmt: skip
            loss = (token_loss * mbb.weights_NT).sum()
            # FSDP averages gradients over the dp ranks; the weights already divide by global
            # counts, so scaling by dp makes the result the gradient of the global loss.
            (loss * self.ps.dp_size).backward()
            diff = (logp.detach() - mbb.sampling_logp_NT).abs() if first else None
            stats.micro_batch(loss, terms, mbb.mask_NT, first, diff)

    def optimizer_step(self) -> float:
        """Clip on the global norm of the sharded gradients and step; skip a non-finite update."""
        lr = self.scheduler.get_last_lr()[0]
        max_norm = self.cfg.optim.max_grad_norm or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # Skip or step, decided over all ranks: the norm is already global, but replicas that
        # drifted apart could disagree on it, and one rank stepping alone would desynchronise.
        if not any_rank(not torch.isfinite(grad_norm), self.ps.device):
            self.optimizer.step()
            self.bad_updates = 0
        else:
            self.bad_updates += 1
            if self.bad_updates >= self.cfg.trainer.max_bad_updates:
                raise FloatingPointError(
                    f"{self.bad_updates} updates in a row had a non-finite loss or gradient norm ({grad_norm.item()}), "
                    f"each skipped; stopping (trainer.max_bad_updates={self.cfg.trainer.max_bad_updates}). "
                    "Lower optim.lr or look at the rewards and data."
                )
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_lr = lr
        return grad_norm.item()
