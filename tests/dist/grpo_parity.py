"""Run under torchrun: the GRPO loss gradient for one fixed batch across (r, s) layouts, with
ranks that see deliberately different shapes.

    torchrun --nproc-per-node 4 tests/dist/grpo_parity.py RUN_DIR OUT.json 1 2 4

One global batch of responses (random prompts, responses, advantages, sampling and reference
log-probs) is split over the dp ranks unevenly: rank 0 holds only short rows, rank 1 only long
ones, rank 2 a mix, rank 3 nothing at all, and ranks 4-7 (on 8 ranks) one to five mixed rows.
So every rank plans a different number of micro-batches on its own, and the agreed count makes
them run the same. Each rank runs the trainer's own reference pass and `backward`, with
micro-batches of 2 responses and packed by a token budget of 24. For every replicate size
given, aggregation and micro-batching it records the largest difference, in units of
assert_close's tolerance, between the full gradient (and the reference log-probs) and one
single-process computation of the same loss over the whole batch (no FSDP, no split), and
the micro-batch count each rank would have needed alone.

Besides the three aggregations, two variants whose masks and weights depend on the data:
masked importance sampling with truncated responses taken out of the loss (the loss counts,
all-reduced, shrink by what each rank rejects), and GSPO's sequence ratio with sequence-level
truncated importance weights. Their sampling log-probs are the model's own plus noise, so rho
spreads around 1 and some tokens and responses fall outside [1/2, 2].
"""

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from launcher import schema
from trainer.grpo import grpo_token_loss, loss_weights, token_logprobs
from trainer.micro_batches import local_count
from trainer.model import build_model, full_state_dict, hf_config
from trainer.parallel import ParallelState, exit_process, shutdown
from trainer.rollout import Rollout
from trainer.stats import StepStats
from trainer.train import GRPOTrainer, collate

RTOL, ATOL = 2e-5, 2e-6
MAX_NEW = 16
VARIANTS = {  # name -> rl overrides (and model overrides under "model")
    "token_mean": {"loss_agg": "token_mean"},
    "seq_mean_token_mean": {"loss_agg": "seq_mean_token_mean"},
    "seq_mean_token_sum_norm": {"loss_agg": "seq_mean_token_sum_norm"},
    "mis_token+mask_truncated": {"loss_agg": "token_mean", "rollout_correction": "mis",
                                 "rollout_is_level": "token", "mask_truncated": True},
    # the Triton log-prob/entropy kernel (Triton's interpreter on CPU), its gradient written over
    # the logits, against the reference's torch path (a large entropy_coef: both gradients count)
    "token_mean+logprob_kernel": {"loss_agg": "token_mean", "logprob_kernel": "triton", "entropy_coef": 0.5},
    # layers kept gathered from forward to backward and across micro-batches (the qwen3_4b preset)
    "gspo+tis_sequence": {"loss_agg": "seq_mean_token_mean", "ratio_level": "sequence",
                          "clip_low": 3e-4, "clip_high": 4e-4, "rollout_correction": "tis",
                          "rollout_is_level": "sequence", "model": {"reshard_after_forward": False}},
}  # fmt: skip


def rows_per_rank(world: int, g: torch.Generator) -> list[list[tuple[int, int]]]:
    """(prompt length, response length) of each rank's rows."""
    rint = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    shapes = [
        [(rint(3, 4), rint(1, 2)) for _ in range(4)],  # all short
        [(rint(5, 6), rint(12, MAX_NEW)) for _ in range(4)],  # all long
        [(rint(3, 6), n) for n in (1, 16, 5, 9)],  # mixed
        [],  # nothing to do
    ]
    shapes += [[(rint(3, 6), rint(1, MAX_NEW)) for _ in range(rint(1, 5))] for _ in range(world - 4)]
    return shapes


def global_batch(vocab: int, world: int):
    g = torch.Generator().manual_seed(7)
    shapes = rows_per_rank(world, g)
    flat = [s for rank in shapes for s in rank]
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p, _ in flat]
    responses = [torch.randint(0, vocab, (r,), generator=g).tolist() for _, r in flat]
    logps = [-torch.rand(len(r), generator=g) * 3 for r in responses]
    truncated = [len(r) == MAX_NEW for r in responses]  # cut at the budget, as a sampler would
    rollout = Rollout(prompts, responses, logps, truncated)
    rewards = torch.rand(len(flat), generator=g)
    advantages = torch.randn(len(flat), generator=g)
    batch = collate(rollout, rewards, advantages, pad_id=0, device=torch.device("cpu"))
    batch.ref_logp_NT = -torch.rand(batch.sampling_logp_NT.shape, generator=g) * 3
    offsets = [0]
    for rank in shapes:
        offsets.append(offsets[-1] + len(rank))
    return batch, offsets


def rows_of(batch, rows: slice):
    sliced = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()}
    return type(batch)(**sliced)


def plain_logprobs(cfg: schema.Config, batch, init):
    model = AutoModelForCausalLM.from_config(hf_config(cfg.model), dtype=torch.float32)
    model.load_state_dict(init)
    # the plain way: the whole padded batch with its attention mask, logits sliced to targets
    logits = model(input_ids=batch.input_ids_NL, attention_mask=batch.attention_mask_NL).logits
    logp, entropy = token_logprobs(logits[:, :-1], batch.input_ids_NL[:, 1:], cfg.rl.temperature)
    return model, logp, entropy


def reference_grads(cfg: schema.Config, batch, init):
    """The same loss, one process, whole batch, first update (old = current, detached), with
    the rollout correction written out here: rho per token or per response, mis's mask, tis's
    truncated weight, and the truncated rows masked."""
    rl = cfg.rl
    model, logp, entropy = plain_logprobs(cfg, batch, init)
    mask = batch.mask_NT * (1 - batch.truncated_N[:, None]) if rl.mask_truncated else batch.mask_NT
    log_rho = (logp.detach() - batch.sampling_logp_NT) * batch.mask_NT
    if rl.rollout_is_level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    rho = log_rho.exp()
    if rl.rollout_correction == "mis":
        mask = mask * ((rho >= 1 / rl.rollout_is_cap) & (rho <= rl.rollout_is_cap)).float()
    is_w = rho.clamp(max=rl.rollout_is_cap) if rl.rollout_correction == "tis" else None
    token_loss, _ = grpo_token_loss(logp, logp.detach(), batch.advantages_N, rl.clip_low, rl.clip_high,
                                    ref_logp=batch.ref_logp_NT, kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator,
                                    entropy=entropy, entropy_coef=rl.entropy_coef, ratio_level=rl.ratio_level,
                                    mask_NT=mask, is_weights=is_w, clip_ratio_c=rl.clip_ratio_c, kl_clamp=rl.kl_clamp)  # fmt: skip
    responses = (mask.sum(-1) > 0).sum().item()
    w = loss_weights(mask, rl.loss_agg, mask.sum().item(), responses, rl.max_new_tokens)
    (token_loss * w).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}, (logp.detach() * batch.mask_NT)


def ratio(a, b) -> float:
    return ((a - b).abs() / (ATOL + RTOL * b.abs())).max().item() if a.numel() else 0.0


def config(run_dir: str, variant: str, world: int, micro_tokens: int = 0) -> schema.Config:
    return schema.load({
        "parallel": {}, "data": {}, "logger": {"backend": "none"}, "run_dir": run_dir, "device": "cpu",
        "model": {"param_dtype": "fp32", **VARIANTS[variant].get("model", {})},
        "rl": {"kl_coef": 0.05, "entropy_coef": 0.01, "micro_batch_responses": 2,
               "micro_batch_tokens": micro_tokens, "max_new_tokens": MAX_NEW, "prompts_per_step": world,
               "samples_per_prompt": 2, **{k: v for k, v in VARIANTS[variant].items() if k != "model"}},
    })  # fmt: skip


def main(run_dir: str, out_path: str, *args: str) -> None:
    """args: replicate sizes, and optionally `variants=a,b` (default: all of VARIANTS)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    chosen = [a.split("=", 1)[1].split(",") for a in args if a.startswith("variants=")]
    replicates = [a for a in args if not a.startswith("variants=")]
    results, needs = {}, {}
    for variant in chosen[0] if chosen else VARIANTS:
        cfg = config(run_dir, variant, world)
        init = full_state_dict(cfg.model, hf_config(cfg.model), seed=0, device=torch.device("cpu"))
        batch, offsets = global_batch(hf_config(cfg.model).vocab_size, world)
        if cfg.rl.rollout_correction != "none":  # a sampler that is close to the learner, not equal
            noise = torch.empty_like(batch.sampling_logp_NT).uniform_(-1.2, 1.2, generator=torch.Generator().manual_seed(3))
            with torch.no_grad():
                batch.sampling_logp_NT = (plain_logprobs(cfg, batch, init)[1] + noise) * batch.mask_NT
        ref, ref_logp = reference_grads(cfg, batch, init)
        rows = slice(offsets[rank], offsets[rank + 1])
        local = rows_of(batch, rows)
        for r in map(int, replicates):
            for micro_tokens in (0, 24):
                run_cfg = config(run_dir, variant, world, micro_tokens)
                ps = ParallelState.build(torch.device("cpu"), r)
                model = build_model(run_cfg.model, ps.get_mesh("fsdp"), ps.device, seed=0)
                trainer = GRPOTrainer(run_cfg, ps, model)
                stats = StepStats(ps.device)
                plan = trainer.micro_batches(local, stats)
                local.ref_logp_NT = rows_of(batch, rows).ref_logp_NT
                own_ref = trainer.logprobs(trainer.reference, local, plan, "reference")  # seed-0 init
                if run_cfg.rl.rollout_correction == "mis":
                    local.is_keep_NT = trainer.mis_keep(local, plan)
                trainer.prepare_update(local)
                trainer.backward(local, plan, first=True, stats=stats)
                grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
                key = f"{variant}/r{r}s{world // r}/" + (f"tokens{micro_tokens}" if micro_tokens else "responses2")
                err_ref = torch.tensor(ratio(own_ref * local.mask_NT, ref_logp[rows]))
                dist.all_reduce(err_ref, op=dist.ReduceOp.MAX)
                results[key] = {"grad": max(ratio(grads[n], ref[n]) for n in grads),
                                "ref_logp": err_ref.item(), "agreed": len(plan)}  # fmt: skip
                mine = local_count(local.attention_mask_NL.sum(-1).tolist(), 2, micro_tokens)
                counts = [None] * world
                dist.all_gather_object(counts, mine)
                needs[key] = counts
                stats.sums.reduce(trainer.dp_group)  # the same names on every rank, or this hangs
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"results": results, "needs": needs}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
    shutdown()
    exit_process(0)  # no interpreter finalization: see trainer/parallel.py
