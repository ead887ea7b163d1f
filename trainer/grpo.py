"""GRPO math on plain tensors: advantages, token log-probs, the clipped loss, KL, aggregation.

Shapes: N responses, T target positions; `mask_NT` is 1 where the target is a response
token. Per token, with ratio = exp(logp - old_logp) and A the response's advantage:

    pg   = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))   (PPO, DAPO clip-higher)
    loss = pg + kl_coef * kl(logp, ref_logp) - entropy_coef * entropy

Aggregation turns per-token losses into one number with weights computed from *global*
counts (all-reduced over dp), so the gradient is the same for any (r, s) and micro-batching:

    token_mean               w = 1 / (tokens in the whole batch)
    seq_mean_token_mean      w = 1 / (len(response) * responses in the whole batch)
    seq_mean_token_sum_norm  w = 1 / (max_new_tokens * responses in the whole batch)   (Dr. GRPO)
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def group_advantages(rewards_PG: torch.Tensor, std_normalize: bool, eps: float) -> torch.Tensor:
    """(r - mean) / (std + eps) within each group of G samples of one prompt; std is unbiased
    (torch.std). Without std_normalize (Dr. GRPO): r - mean."""
    centered = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if not std_normalize:
        return centered
    return centered / (rewards_PG.std(dim=1, keepdim=True) + eps)


def _logprob_entropy(logits_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float):
    # log p = z - logsumexp(z); entropy = logsumexp(z) - sum softmax(z) z: two fp32 C x V temps
    z = logits_CV.float() / temperature
    lse_C = torch.logsumexp(z, dim=-1)
    logp_C = z.gather(-1, targets_C.unsqueeze(-1)).squeeze(-1) - lse_C
    entropy_C = lse_C - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp_C, entropy_C


def token_logprobs(
    logits_NTV: torch.Tensor, targets_NT: torch.Tensor, temperature: float, chunk_tokens: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy under softmax(logits / temperature), in fp32.

    Works through `chunk_tokens` rows at a time so a full fp32 copy of the logits never
    exists; with grad enabled each chunk is recomputed in backward instead of kept.
    """
    n, t, v = logits_NTV.shape
    flat_logits, flat_targets = logits_NTV.reshape(n * t, v), targets_NT.reshape(n * t)
    logps, ents = [], []
    for start in range(0, n * t, chunk_tokens):
        args = (
            flat_logits[start : start + chunk_tokens],
            flat_targets[start : start + chunk_tokens],
            temperature,
        )
        if torch.is_grad_enabled() and flat_logits.requires_grad:
            lp, en = checkpoint(_logprob_entropy, *args, use_reentrant=False)
        else:
            lp, en = _logprob_entropy(*args)
        logps.append(lp)
        ents.append(en)
    return torch.cat(logps).view(n, t), torch.cat(ents).view(n, t)


# Per-token estimates of KL(policy || reference) from samples of the policy (Schulman's k1/k2/k3),
# as functions of x = logp - ref_logp; keys are `rl.kl_estimator`'s choices (launcher/schema.py).
KL_ESTIMATORS = {
    "k1": lambda x: x,
    "k2": lambda x: 0.5 * x.square(),
    "k3": lambda x: torch.exp(-x) - 1 + x,  # low-variance, always >= 0
}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    return KL_ESTIMATORS[estimator](logp - ref_logp)


# Per-token weights whose masked sum over the whole (global) batch is the aggregated loss; keys
# are `rl.loss_agg`'s choices. Arguments: mask_NT (float), global tokens, global responses,
# max_new_tokens.
AGGREGATIONS = {
    "token_mean": lambda mask, tokens, responses, budget: mask / tokens,
    "seq_mean_token_mean": lambda mask, tokens, responses, budget: (
        mask / (mask.sum(-1, keepdim=True).clamp(min=1) * responses)
    ),
    "seq_mean_token_sum_norm": lambda mask, tokens, responses, budget: mask / (budget * responses),
}


def loss_weights(
    mask_NT: torch.Tensor,
    agg: str,
    global_tokens: float,
    global_responses: float,
    max_new_tokens: int,
) -> torch.Tensor:
    """Per-token weights whose masked sum over the whole (global) batch is the aggregated loss."""
    return AGGREGATIONS[agg](mask_NT.float(), global_tokens, global_responses, max_new_tokens)


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages_N: torch.Tensor,
    clip_low: float,
    clip_high: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss and per-token diagnostics (all N x T; mask them before summing)."""
    adv = advantages_N.unsqueeze(-1)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    loss = pg
    stats = {
        "pg_loss": pg.detach(),
        "ppo_kl": -log_ratio.detach(),  # k1 estimate of KL(old || new)
        "clipfrac": (clipped > unclipped).float().detach(),
    }
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        loss = loss + kl_coef * kl
        stats["kl"] = kl.detach()
    if entropy is not None:
        loss = loss - entropy_coef * entropy
        stats["entropy"] = entropy.detach()
    return loss, stats
