"""`parity_check=true`: one GRPO update's gradient on this run's layout against one process.

The first command to run on a new cluster. Every rank samples its share of step 1 with the
user's model, data and dtypes, and computes the gradient of the GRPO loss exactly as training
does (agreed micro-batches, FSDP2 on the chosen mesh, the replica all-reduce). Rank 0 then
gathers the whole global batch and the full weights and computes the same loss over that batch
in one plain (unsharded) fp32 model on the CPU (so a model that only fits sharded still can be
checked), with the same global counts, masks and corrections, written out here independently of
the sharded path's micro-batching. The report:

    parity: max |g - g_ref| / max |g_ref| = X (tolerance T for <compute dtype>): ok
    parity: ... : FAIL, worst parameter NAME (max |g - g_ref| / max |g_ref| of its own = Y)

T is 1e-4 when the run computes in fp32 and 5e-2 in bf16 (the reference is fp32: bf16 rounding
of activations and all-gathered weights is what the tolerance allows, a wrong shard or a
missing reduction is orders of magnitude above it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM

from trainer.grpo import grpo_token_loss, loss_weights, rollout_is_weights
from trainer.model import compute_dtype, hf_config
from trainer.stats import StepStats

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
ROW_FIELDS = ("input_ids_NL", "attention_mask_NL", "mask_NT", "sampling_logp_NT", "advantages_N",
              "truncated_N", "ref_logp_NT")  # fmt: skip


def rows_of(batch) -> list[dict[str, torch.Tensor]]:
    """This rank's rows, each unpadded (its real length), on the CPU."""
    out = []
    lengths = batch.attention_mask_NL.sum(-1).tolist()
    for i, length in enumerate(lengths):
        row = {}
        for f in ROW_FIELDS:
            t = getattr(batch, f)
            if t is None:
                continue
            t = t[i].detach().cpu()
            row[f] = (
                t[:length] if f.endswith("_NL") else t[: length - 1] if f.endswith("_NT") else t
            )
        out.append(row)
    return out


def padded(rows: list[dict[str, torch.Tensor]], field: str) -> torch.Tensor:
    if field.endswith("_N"):
        return torch.stack([r[field] for r in rows])
    width = max(len(r[field]) for r in rows)
    out = torch.zeros((len(rows), width), dtype=rows[0][field].dtype)
    for i, r in enumerate(rows):
        out[i, : len(r[field])] = r[field]
    return out


def reference_gradients(cfg, state: dict[str, torch.Tensor], rows) -> dict[str, torch.Tensor]:
    """The GRPO loss over the whole global batch in one fp32 CPU model, first update."""
    from trainer.train import Batch, sequence_logprobs

    rl = cfg.rl
    model = AutoModelForCausalLM.from_config(hf_config(cfg.model), dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in state.items()})  # names as in HF: see model.py
    fields = {f: padded(rows, f) for f in ROW_FIELDS if f in rows[0]}
    batch = Batch(fields["input_ids_NL"], fields["attention_mask_NL"], fields["mask_NT"],
                  fields["sampling_logp_NT"], fields["advantages_N"], torch.zeros(len(rows)),
                  fields["attention_mask_NL"].sum(-1), fields["truncated_N"],
                  ref_logp_NT=fields.get("ref_logp_NT"))  # fmt: skip
    logp, entropy = sequence_logprobs(model, batch, rl.temperature, rl.logprob_chunk_tokens)
    mask = batch.mask_NT.float()
    if rl.mask_truncated:
        mask = mask * (1 - batch.truncated_N.float())[:, None]
    is_w = None
    if rl.rollout_correction != "none":
        weights, keep, _ = rollout_is_weights(logp.detach(), batch.sampling_logp_NT, batch.mask_NT,
                                              rl.rollout_correction, rl.rollout_is_cap,
                                              rl.rollout_is_level)  # fmt: skip
        mask = mask * keep
        is_w = weights if rl.rollout_correction == "tis" else None
    token_loss, _ = grpo_token_loss(
        logp, logp.detach(), batch.advantages_N, rl.clip_low, rl.clip_high,
        ref_logp=batch.ref_logp_NT if rl.kl_coef > 0 else None, kl_coef=rl.kl_coef,
        kl_estimator=rl.kl_estimator, entropy=entropy if rl.entropy_coef > 0 else entropy.detach(),
        entropy_coef=rl.entropy_coef, clip_ratio_c=rl.clip_ratio_c, ratio_level=rl.ratio_level,
        mask_NT=mask, is_weights=is_w, kl_clamp=rl.kl_clamp,
    )  # fmt: skip
    tokens, responses = mask.sum().item(), (mask.sum(-1) > 0).sum().item()
    w = loss_weights(mask, rl.loss_agg, max(tokens, 1.0), max(responses, 1), rl.max_new_tokens)
    (token_loss * w).sum().backward()
    return {n: p.grad if p.grad is not None else torch.zeros_like(p)
            for n, p in model.named_parameters()}  # fmt: skip


def check(trainer, tamper: Callable[[], None] | None = None) -> tuple[bool, str]:
    """Collective: the report line (on every rank) and whether it passed. `tamper` runs after the
    sharded backward, before the comparison (tests corrupt a shard's gradient with it)."""
    cfg, ps = trainer.cfg, trainer.ps
    trainer.phase("parity check")
    stats = StepStats(ps.device)
    batch, _ = trainer.rollout(1, stats)  # step 1's prompts and seeds, as training will draw them
    plan = trainer.micro_batches(batch, stats)
    if trainer.reference is not None:
        batch.ref_logp_NT = trainer.logprobs(trainer.reference, batch, plan, "reference")
    if cfg.rl.rollout_correction == "mis":
        batch.is_keep_NT = trainer.mis_keep(batch, plan)
    trainer.prepare_update(batch)
    trainer.backward(batch, plan, first=True, stats=stats)
    if tamper is not None:
        tamper()
    grads = {}
    for name, p in trainer.model.named_parameters():  # collective: every rank gathers each one
        # p.grad is None alike on every rank (FSDP gives every shard a gradient or none)
        g = p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape, device=ps.device)
        if ps.rank == 0:
            grads[name] = g.float().cpu()
    trainer.optimizer.zero_grad(set_to_none=True)  # training starts from no gradient
    state: dict = get_model_state_dict(trainer.model,
                                 options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # fmt: skip
    everyone: list = [None] * ps.world_size
    dist.all_gather_object(everyone, rows_of(batch))  # cp_size is 1: every rank is a dp rank
    line = ""
    if ps.rank == 0:
        rows = [r for rank_rows in everyone for r in rank_rows]
        ref = reference_gradients(cfg, state, rows)
        scale = max(g.abs().max().item() for g in ref.values())
        diffs = {n: (grads[n] - ref[n]).abs().max().item() for n in ref}
        worst = max(diffs, key=lambda n: diffs[n])
        err = diffs[worst] / max(scale, 1e-30)
        bf16 = compute_dtype(cfg.model, ps.device.type) == torch.bfloat16
        tol = TOLERANCE[torch.bfloat16 if bf16 else torch.float32]
        ok = err <= tol
        line = (f"parity: max |g - g_ref| / max |g_ref| = {err:.2e} (tolerance {tol:g} for "
                f"{'bf16' if bf16 else 'fp32'}; {len(rows)} responses, layout "
                f"r{ps.dp_replicate_size}s{ps.dp_shard_size}): ")  # fmt: skip
        if ok:
            line += "ok"
        else:
            own = diffs[worst] / max(ref[worst].abs().max().item(), 1e-30)
            line += (
                f"FAIL, worst parameter {worst} (its own max |g - g_ref| / max |g_ref| = {own:.2e})"
            )
    verdict = [line]
    dist.broadcast_object_list(verdict, src=0)  # every rank exits alike
    return verdict[0].endswith(": ok"), verdict[0]
