"""The GRPO loop on one rank: rollout -> rewards -> advantages -> (ref log-probs) -> updates
-> weight sync -> metrics.

Departures from the papers, stated: advantages are per group of `samples_per_prompt`
responses with the unbiased std; `updates_per_step` reuses the whole rollout batch that many
times (TRL's `num_iterations`), and the old log-probs are those of the first update's
forward pass, which ran with the weights that sampled (so its ratio is exactly 1, and no
extra forward pass is spent on them).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from launcher.memory import engine_call_rows
from launcher.run_folder import stop_file
from launcher.schema import TASK_CORRECTNESS, Config, OptimConfig, rewards_of
from trainer import checkpoint, micro_batches
from trainer.data import PromptSampler, Task, load_task, mixed_seed
from trainer.engine import StaticCacheEngine
from trainer.grpo import (
    fair_shares,
    group_advantages,
    grpo_token_loss,
    loss_weights,
    overlong_penalty,
    pass_at_k,
    rollout_is_weights,
    token_logprobs,
    zero_std_groups,
)
from trainer.metrics import DPSums, MetricsLogger
from trainer.micro_batches import MicroBatch
from trainer.model import CausalLM, build_model, compute_dtype
from trainer.parallel import ParallelState, any_rank
from trainer.perf import PhasePeaks, peak_flops, peak_memory_gb
from trainer.replicas import check_replicas
from trainer.rewards import REWARDS, score
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
    is_keep_NT: torch.Tensor | None = None  # rl.rollout_correction=mis: 1 where rho is kept
    loss_mask_NT: torch.Tensor | None = None  # response tokens that count in the loss
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
                rows = mb.rows.to(t.device)  # a no-op: the plan's indices live on the device
                out[name] = t[rows, : widths[suffix]] if suffix in widths else t[rows]
        return Batch(**out)


def collate(
    rollout: Rollout,
    rewards_N: torch.Tensor,
    advantages_N: torch.Tensor,
    pad_id: int,
    device: torch.device,
) -> Batch:
    n = len(rollout.response_ids)  # 0 on a rank that dynamic sampling left without groups
    width = max(
        (len(p) + len(r) for p, r in zip(rollout.prompt_ids, rollout.response_ids)), default=2
    )
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


def sequence_logprobs(
    model: CausalLM,
    batch: Batch,
    temperature: float,
    chunk_tokens: int = 1024,
    kernel: bool = False,
):
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
    logp, entropy = token_logprobs(logits, targets, temperature, chunk_tokens, kernel)
    return logp[:, :-1], entropy[:, :-1]


class StepProfile:
    """`trainer.profile_step`: that step under torch.profiler, one table per phase (rollout,
    reference and plan, update, refresh) so that a kernel's time is where it was spent; each rank
    writes RUN_DIR/profile/step_N_rank_R.txt. Other steps: every call is a no-op."""

    def __init__(self, cfg: Config, ps: ParallelState, step: int):
        self.on, self.ps = cfg.trainer.profile_step == step, ps
        self.path = Path(cfg.run_dir) / "profile" / f"step_{step}_rank_{ps.rank}.txt"
        self.prof: Any = None
        self.name, self.started, self.sections = "", 0.0, [f"step {step}, rank {ps.rank}"]

    def phase(self, name: str) -> None:
        """End the running phase's profile (if any) and start `name`'s."""
        if not self.on:
            return
        self.end()
        from torch.profiler import ProfilerActivity, profile

        cuda = self.ps.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.prof, self.name = profile(activities=activities), name
        self.prof.__enter__()
        self.started = time.perf_counter()

    def end(self) -> None:
        """End the running phase's profile; its table joins the file."""
        if self.prof is None:
            return
        cuda = self.ps.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        self.prof.__exit__(None, None, None)
        events = self.prof.key_averages()
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        busy = sum(getattr(e, key) for e in events) / 1e6
        self.sections.append(f"## {self.name}: wall {wall:.3f} s, {'GPU kernels' if cuda else 'CPU ops'} "
                             f"{busy:.3f} s (summed; streams overlap)\n" + events.table(sort_by=key, row_limit=40))  # fmt: skip
        self.prof = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(self.sections))


def triton_chosen(choice: str, device: torch.device) -> bool:
    """A kernel choice of `auto`, `triton` or `torch`: auto is Triton on a GPU where Triton is
    installed."""
    if choice != "auto":
        return choice == "triton"
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def use_logprob_kernel(cfg: Config, device: torch.device) -> bool:
    """`rl.logprob_kernel`: the Triton kernel (auto: on a GPU where Triton is installed)."""
    return triton_chosen(cfg.rl.logprob_kernel, device)


def decode_attention(cfg: Config, device: torch.device) -> str:
    """`rl.decode_attention=auto`: the Triton kernel where it can run (a GPU, Triton, a
    power-of-two head_dim >= 16), else SDPA."""
    if cfg.rl.decode_attention != "auto":
        return cfg.rl.decode_attention
    from trainer.decode_attention import supports

    fits = device.type == "cuda" and supports(cfg.model.arch.head_dim)
    return "triton" if fits and importlib.util.find_spec("triton") is not None else "sdpa"


def engine_options(cfg: Config, device: torch.device) -> dict[str, Any]:
    """The static engine's settings from `rl` (its compile, spans, attention and sampler)."""
    rl = cfg.rl
    sampler = "triton" if triton_chosen(rl.sample_kernel, device) else "torch"
    matmul = "triton" if triton_chosen(rl.decode_matmul, device) else "torch"
    return {"compile": rl.compile_decode, "spans": rl.decode_spans,
            "attention": decode_attention(cfg, device), "sampler": sampler,
            "matmul": matmul}  # fmt: skip


def engine_kind(cfg: Config, device: torch.device) -> str:
    """`rl.engine`: the static-cache engine on GPUs (auto), transformers generate on CPU."""
    if cfg.rl.engine != "auto":
        return cfg.rl.engine
    return "static" if device.type == "cuda" else "hf"


def make_engine(cfg: Config, config, device: torch.device) -> RolloutEngine:
    """The rollout engine `engine_kind` names, with `engine_options`."""
    dtype = compute_dtype(cfg.model, device.type)
    if engine_kind(cfg, device) == "static":
        return StaticCacheEngine(config, dtype, device, **engine_options(cfg, device))
    return HFRolloutEngine(config, dtype, device, cfg.model.attn_implementation)


class SigtermFlag:
    """Set by SIGTERM. The handler holds this flag, never the trainer: the interpreter keeps a
    handler until exit, and a trainer kept there would keep the model and its process groups
    alive into interpreter shutdown, where gloo aborts (see `parallel.shutdown`)."""

    def __init__(self) -> None:
        self.seen = False
        signal.signal(signal.SIGTERM, self.set)

    def set(self, signum, frame) -> None:
        self.seen = True


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
        self.eval_prompts, self.eval_prompt_ids = task.eval_prompts, task.eval_prompt_ids
        self.sampling = SamplingParams(
            self.rl.temperature,
            self.rl.top_p,
            self.rl.max_new_tokens,
            self.tokenizer.eos_token_id,
            self.tokenizer.pad_token_id,
            self.rl.top_k,
        )
        self.engine = make_engine(cfg, model.config, device)
        self.logprob_kernel = use_logprob_kernel(cfg, device)
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
        self.peaks = PhasePeaks(device)
        self.sigterm = SigtermFlag()  # checkpoint and stop at the end of the step it comes in

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
            metrics = self.step(step)
            if self.eval_due(step):
                metrics.update(self.evaluate(step))
            self.metrics.log(metrics)
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
        profile = StepProfile(self.cfg, self.ps, step)
        profile.phase("rollout")
        clock = [time.perf_counter()]

        def lap(next_phase: str = "") -> None:
            self.sync()
            clock.append(time.perf_counter())
            if next_phase:
                profile.phase(next_phase)
            else:
                profile.end()

        self.phase("rollout")
        self.peaks = PhasePeaks(self.ps.device)
        batch, kept_groups = self.rollout(step, stats)
        self.peaks.mark("rollout")
        if self.rl.free_kv_cache:  # the update and the optimizer step get its memory
            self.engine.free_cache()
        lap("reference and plan")
        plan = self.micro_batches(batch, stats)
        if self.reference is not None:
            batch.ref_logp_NT = self.logprobs(self.reference, batch, plan, "reference")
        if self.rl.rollout_correction == "mis":  # which tokens the learner keeps, before the loss
            batch.is_keep_NT = self.mis_keep(batch, plan)
        lap("update")
        if kept_groups > 0:  # the global count: every rank updates, or none does
            self.update(batch, plan, stats)
        else:
            stats.update([], float(self.scheduler.get_last_lr()[0]))
            if self.ps.rank == 0:
                print(f"step {step}: no group with reward spread after {self.rl.max_sample_rounds} "
                      "sampling rounds; update skipped", flush=True)  # fmt: skip
        lap("replica check and weight refresh")
        self.check_replicas(step, stats)
        self.phase("weight refresh")
        self.engine.load_weights(self.model)
        lap()
        t = clock
        rest = peak_memory_gb(self.ps.device)  # since the last phase mark: replica check, refresh
        step_peak = max(rest, self.peaks.step_peak() or 0.0)
        stats.times({"rollout": t[1] - t[0], "ref": t[2] - t[1], "train": t[3] - t[2],
                     "sync": t[4] - t[3], "step": t[4] - t[0]}, step_peak)  # fmt: skip
        stats.phase_peaks(self.peaks.peaks)
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
        asked = self.sigterm.seen or (
            self.ps.local_rank == 0 and stop_file(self.cfg.run_dir).exists()
        )
        return any_rank(asked, self.ps.device)  # stop (and save) together or not at all

    def layout(self) -> dict[str, int]:
        return {"world_size": self.ps.world_size, "dp_replicate_size": self.ps.dp_replicate_size,
                "dp_shard_size": self.ps.dp_shard_size}  # fmt: skip

    def rollout(self, step: int, stats: StepStats) -> tuple[Batch, int]:
        """Sample, score and shape this rank's groups; with rl.dynamic_sampling, in rounds until
        the ranks together hold rl.prompts_per_step groups with reward spread. Returns the batch
        and the number of groups all ranks together train on."""
        rl, g = self.rl, self.rl.samples_per_prompt
        kept: list[
            tuple[Rollout, torch.Tensor, torch.Tensor]
        ] = []  # (rollout, task rewards, shaped)
        rounds = rl.max_sample_rounds if rl.dynamic_sampling else 1
        for sample_round in range(rounds):
            self.phase(f"rollout, round {sample_round + 1}" if rl.dynamic_sampling else "rollout")
            rollout, rewards_N, shaped_N = self.sample_groups(step, sample_round)
            no_signal_P = zero_std_groups(shaped_N.view(-1, g), rl.zero_std_eps)
            stats.sampled(rollout, rewards_N, shaped_N - rewards_N, no_signal_P)
            keep_P = ~no_signal_P if rl.dynamic_sampling else torch.ones_like(no_signal_P)
            rows = [i for i in range(len(rewards_N)) if keep_P[i // g]]
            kept.append((rollout.select(rows), rewards_N[rows], shaped_N[rows]))
            if not rl.dynamic_sampling:
                break
            # Collective: the groups kept so far, summed over dp; every rank leaves together.
            if (
                self.dp_sum(sum(len(r.response_ids) for r, _, _ in kept) // g)
                >= rl.prompts_per_step
            ):
                break
        rollout = sum((r for r, _, _ in kept[1:]), kept[0][0])
        rewards_N, shaped_N = torch.cat([r for _, r, _ in kept]), torch.cat([s for _, _, s in kept])
        total = rl.prompts_per_step  # without dynamic sampling every group trains
        if rl.dynamic_sampling:
            # Collective: every rank's kept count (a one-hot all-reduce) -> the same fair cut on all
            counts = torch.zeros(self.ps.dp_size, dtype=torch.long, device=self.ps.device)
            counts[self.ps.dp_rank] = len(rewards_N) // g
            dist.all_reduce(counts, group=self.dp_group)
            shares = fair_shares(counts.tolist(), rl.prompts_per_step)
            rows = list(range(shares[self.ps.dp_rank] * g))
            rollout, rewards_N, shaped_N = rollout.select(rows), rewards_N[rows], shaped_N[rows]
            total = sum(shares)
        advantages_N = group_advantages(shaped_N.view(-1, g), rl.std_normalize, rl.adv_eps).view(-1)
        batch = collate(
            rollout, rewards_N, advantages_N, self.tokenizer.pad_token_id, self.ps.device
        )
        stats.train_batch(batch, sum(map(len, rollout.prompt_ids)), sample_round + 1, total)
        return batch, total

    def sample_groups(self, step: int, sample_round: int):
        """One round: this rank's share of the round's prompts, `samples_per_prompt` responses
        each; their task rewards, and the rewards with DAPO's overlong shaping added."""
        rl, g = self.rl, self.rl.samples_per_prompt
        indices = self.sampler.indices(step - 1, sample_round)
        # Sampling randomness is a function of (seed, step, dp rank[, round]) alone.
        extra = (sample_round,) if sample_round else ()
        torch.manual_seed(mixed_seed(self.cfg.trainer.seed, step, self.ps.dp_rank, *extra))
        rows = [self.prompt_ids[i] for i in indices for _ in range(g)]
        size = engine_call_rows(len(rows), rl.rollout_batch)
        rollout = self.generate_in_engine_batches(rows, size=size)
        texts = self.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        answers = [self.prompts[i].answer for i in indices for _ in range(g)]
        rewards_N = torch.tensor([score(t, a, self.rewards) for t, a in zip(texts, answers)])
        lengths_N = torch.tensor([len(r) for r in rollout.response_ids], dtype=torch.float)
        penalty_N = overlong_penalty(lengths_N, rl.max_new_tokens, rl.overlong_buffer,
                                     rl.overlong_penalty)  # fmt: skip
        return rollout, rewards_N, rewards_N + penalty_N

    def eval_due(self, step: int) -> bool:
        """Every trainer.eval_every steps and at the last step: a config fact, the same on every rank."""
        every = self.cfg.trainer.eval_every
        return every > 0 and (step % every == 0 or step == self.cfg.trainer.max_steps)

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """Collective (one all-reduce at the end): the held-out prompts, split over the dp ranks
        (rank i takes prompts i, i + dp, ...; a rank may get none). Each prompt gets one greedy
        response (pass@1) and trainer.eval_k samples at the training temperature (pass@k by the
        unbiased estimator, and the mean reward and length of the samples). A response is
        correct when the task's correctness reward (TASK_CORRECTNESS) is 1."""
        self.phase("evaluation")
        started, k = time.perf_counter(), self.cfg.trainer.eval_k
        mine = range(self.ps.dp_rank, len(self.eval_prompts), self.ps.dp_size)
        rows = [self.eval_prompt_ids[i] for i in mine for _ in range(1 + k)]
        greedy = [j == 0 for _ in mine for j in range(1 + k)]
        torch.manual_seed(mixed_seed(self.cfg.trainer.seed, step, self.ps.dp_rank, -1))
        responses = self.generate_in_engine_batches(rows, greedy).response_ids
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        correct = REWARDS[TASK_CORRECTNESS[self.cfg.data.name]]
        sums = DPSums(self.ps.device)
        for n, i in enumerate(mine):
            answer = self.eval_prompts[i].answer
            group = range(n * (1 + k), (n + 1) * (1 + k))
            right = [correct(texts[j], answer) >= 1.0 for j in group]
            samples = group[1:]
            sums.add("prompts", 1)
            sums.add("greedy_correct", float(right[0]))
            sums.add("pass_at_k", pass_at_k(k, sum(right[1:]), k))
            sums.add("reward", sum(score(texts[j], answer, self.rewards) for j in samples))
            sums.add("length", sum(len(responses[j]) for j in samples))
        for name in ("prompts", "greedy_correct", "pass_at_k", "reward", "length"):
            sums.add(name, 0.0)  # every rank adds every name, one with no prompts too
        sums.max("time/eval_s", time.perf_counter() - started)
        r = sums.reduce(self.dp_group)
        num = max(r["prompts"], 1.0)
        return {"eval/pass@1": r["greedy_correct"] / num, "eval/pass@k": r["pass_at_k"] / num,
                "eval/reward_mean": r["reward"] / (num * k), "eval/response_len_mean": r["length"] / (num * k),
                "time/eval_s": r["time/eval_s"]}  # fmt: skip

    def generate_in_engine_batches(
        self, rows: list[list[int]], greedy: list[bool] | None = None, size: int | None = None
    ) -> Rollout:
        """Responses for `rows` in calls of `size` rows (default: the batch the engine's buffers
        and captured steps already have, else all at once). Where the engine has fixed buffers
        (the static engine recompiles for another row count), a short last call is padded."""
        flags = greedy or [False] * len(rows)
        size = size or self.engine.rows_per_call() or max(len(rows), 1)
        parts: list[Rollout] = []
        for start in range(0, len(rows), size):
            chunk, chunk_flags = rows[start : start + size], flags[start : start + size]
            pad = size - len(chunk) if self.engine.rows_per_call() else 0
            result = self.engine.generate(
                chunk + [chunk[0]] * pad, self.sampling, chunk_flags + [False] * pad
            )
            parts.append(result.select(list(range(len(chunk)))) if pad else result)
        return sum(parts, Rollout([], [], [], []))  # empty for a rank with no rows

    def dp_sum(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.ps.device)
        dist.all_reduce(t, group=self.dp_group)
        return int(t.item())

    def micro_batches(self, batch: Batch, stats: StepStats | None = None) -> list[MicroBatch]:
        """Collective: this rank's micro-batches for the step, as many as every other rank runs
        (the count is all-reduced over dp; see trainer/micro_batches.py). One plan serves the
        reference pass and every update of the step: the rows do not change in between."""
        lengths = batch.attention_mask_NL.sum(-1).tolist()
        rl = self.rl
        tokens = rl.micro_batch_tokens
        assert isinstance(tokens, int), "rl.micro_batch_tokens=auto is resolved by the launcher"
        needed = micro_batches.local_count(lengths, rl.micro_batch_responses, tokens)
        count = micro_batches.agreed_count(needed, self.dp_group, self.ps.device)
        plan = micro_batches.split(lengths, count, tokens)
        # row indices on the device, copied once here: a host index into device tensors would
        # copy it, and wait for the GPU to drain, at every micro-batch
        plan = [dataclasses.replace(mb, rows=mb.rows.to(self.ps.device)) for mb in plan]
        if stats is not None:
            stats.plan(count, needed, sum(mb.empty for mb in plan))
        return plan

    @torch.no_grad()
    def logprobs(
        self, model: CausalLM, batch: Batch, plan: list[MicroBatch], name: str
    ) -> torch.Tensor:
        """Log-probs of the batch's targets under `model` (no grad), N x T."""
        out = torch.zeros_like(batch.sampling_logp_NT)
        for k, mb in enumerate(plan):  # the agreed count: every rank runs as many forwards
            self.phase(f"{name}, micro-batch {k + 1}/{len(plan)}")
            logp = sequence_logprobs(model, batch.rows(mb), self.rl.temperature,
                                     self.rl.logprob_chunk_tokens, self.logprob_kernel)[0]  # fmt: skip
            if not mb.empty:
                out[mb.rows, : mb.width - 1] = logp
        return out

    def mis_keep(self, batch: Batch, plan: list[MicroBatch]) -> torch.Tensor:
        """rl.rollout_correction=mis: the tokens (or responses) whose learner/sampler ratio lies in
        [1/cap, cap], from a forward pass of the policy that sampled; the others leave the loss
        and its counts, so they must be known before the loss weights (one extra forward)."""
        learner = self.logprobs(self.model, batch, plan, "learner log-probs")
        rl = self.rl
        _, keep, _ = rollout_is_weights(learner, batch.sampling_logp_NT, batch.mask_NT, "mis",
                                        rl.rollout_is_cap, rl.rollout_is_level)  # fmt: skip
        return keep * batch.mask_NT

    def update(self, batch: Batch, plan: list[MicroBatch], stats: StepStats) -> None:
        """`rl.updates_per_step` optimizer steps on this rollout batch."""
        self.prepare_update(batch)
        grad_norms = []
        for u in range(self.rl.updates_per_step):  # a config value: the same on every rank
            self.update_name = f"update {u + 1}/{self.rl.updates_per_step}"
            self.backward(batch, plan, first=u == 0, stats=stats)
            self.peaks.mark("update")  # with the reference / MIS passes before it
            self.phase(f"{self.update_name}, optimizer step")
            grad_norms.append(self.optimizer_step())
            self.peaks.mark("optimizer")
        stats.update(grad_norms, float(self.last_lr))

    def prepare_update(self, batch: Batch) -> None:
        """Collective: the loss mask, the loss weights (from global counts) and room for the old
        log-probs."""
        mask = batch.mask_NT
        if self.rl.mask_truncated:  # DAPO's overlong filtering
            mask = mask * (1 - batch.truncated_N).unsqueeze(-1)
        if batch.is_keep_NT is not None:
            mask = mask * batch.is_keep_NT
        batch.loss_mask_NT = mask
        batch.weights_NT = self.loss_weights(mask)
        batch.old_logp_NT = torch.zeros_like(batch.sampling_logp_NT)

    def loss_weights(self, loss_mask_NT: torch.Tensor) -> torch.Tensor:
        """Per-token weights from the counts of the whole batch over all dp ranks: loss tokens,
        and responses with at least one (every response, unless masked out)."""
        t = torch.tensor(
            [loss_mask_NT.sum().item(), (loss_mask_NT.sum(-1) > 0).sum().item()],
            dtype=torch.float64,
            device=self.ps.device,
        )
        dist.all_reduce(t, group=self.dp_group)
        global_tokens, global_responses = (max(x, 1.0) for x in t.tolist())
        return loss_weights(
            loss_mask_NT, self.rl.loss_agg, global_tokens, global_responses, self.rl.max_new_tokens
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
        keep_gathered = not self.cfg.model.reshard_after_forward
        for k, mb in enumerate(plan):
            self.phase(f"{self.update_name}, micro-batch {k + 1}/{len(plan)}")
            last = k == len(plan) - 1  # the agreed count: the same micro-batch is last everywhere
            if self.ps.dp_shard_size == 1:
                # a reduce-scatter over one rank is a chain of copies (cast in, copy, add into
                # the sharded gradient): with one shard rank the unsharded gradient IS the
                # sharded one, so accumulate it unsharded (same fp32 sums, same order, same
                # memory) and reduce once, after the last micro-batch (replicas included)
                self.model.set_requires_gradient_sync(last)
            elif self.ps.dp_replicate_size > 1:  # all-reduce across replicas once, after the last
                self.model.set_requires_all_reduce(last)
            if keep_gathered:  # gathered from forward to backward already: keep them gathered
                # to the next micro-batch too (no weight changes before the optimizer step), so
                # each layer is all-gathered once per update, not once per micro-batch
                self.model.set_reshard_after_backward(last)
            mbb = batch.rows(mb)
            assert mbb.old_logp_NT is not None and mbb.weights_NT is not None
            assert mbb.loss_mask_NT is not None
            logp, entropy = sequence_logprobs(
                self.model, mbb, rl.temperature, rl.logprob_chunk_tokens, self.logprob_kernel
            )
            if first:
                mbb.old_logp_NT = logp.detach()
                if not mb.empty:
                    batch.old_logp_NT[mb.rows, : mb.width - 1] = mbb.old_logp_NT
            # rho from the learner's log-probs under the weights that sampled (the old ones)
            is_weights, _, is_terms = rollout_is_weights(
                mbb.old_logp_NT, mbb.sampling_logp_NT, mbb.mask_NT,
                "tis" if rl.rollout_correction == "tis" else "none", rl.rollout_is_cap, rl.rollout_is_level,
            )  # fmt: skip
            if mbb.is_keep_NT is not None:  # mis: what the pre-pass rejected
                is_terms["rollout_is_masked"] = mbb.mask_NT - mbb.is_keep_NT
            token_loss, terms = grpo_token_loss(
                logp, mbb.old_logp_NT, mbb.advantages_N, rl.clip_low, rl.clip_high,
                ref_logp=mbb.ref_logp_NT, kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator,
                entropy=entropy if rl.entropy_coef > 0 else entropy.detach(), entropy_coef=rl.entropy_coef,
                clip_ratio_c=rl.clip_ratio_c, ratio_level=rl.ratio_level, mask_NT=mbb.loss_mask_NT,
                is_weights=is_weights if rl.rollout_correction == "tis" else None, kl_clamp=rl.kl_clamp,
            )  # fmt: skip
            loss = (token_loss * mbb.weights_NT).sum()
            # FSDP averages gradients over the dp ranks; the weights already divide by global
            # counts, so scaling by dp makes the result the gradient of the global loss.
            (loss * self.ps.dp_size).backward()
            diff = (logp.detach() - mbb.sampling_logp_NT).abs() if first else None
            stats.micro_batch(loss, terms, mbb.mask_NT, first, diff, is_terms if first else None)

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
