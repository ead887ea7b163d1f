"""GRPO math on plain tensors: advantages, token log-probs, the clipped loss, KL, aggregation.

Shapes: N responses, T target positions; `mask_NT` is 1 where the target is a response
token. Per token, with A the response's advantage and r the importance ratio:

    r    = exp(logp - old_logp)                                       (rl.ratio_level=token)
    r    = exp(logp - sg(logp) + sg(mean_t(logp - old_logp)))         (sequence: GSPO-token)
    pg   = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))     (PPO, DAPO clip-higher)
    pg   = min(pg, -A * clip_ratio_c)            where A < 0          (dual clip, rl.clip_ratio_c)
    loss = w_is * pg + kl_coef * kl(logp, ref_logp) - entropy_coef * entropy

sg is stop-gradient. The sequence ratio has the value of GSPO's s_i = (pi / pi_old)(y_i)^(1/|y_i|)
at every token of response i and the gradient s_i * grad log pi(y_t), so with
`seq_mean_token_mean` the loss is GSPO's (Zheng et al. 2025, eq. 5 and its GSPO-token form;
clipping acts per sequence because every token of a response has the same ratio). w_is is the
rollout correction (`rollout_is_weights`): 1 unless `rl.rollout_correction` asks for TIS
(truncated) or MIS (masked) importance weights between the learner and the sampler.

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
    if not std_normalize or rewards_PG.numel() == 0:  # a rank with no group this step: 0 x G
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
    logits_NTV: torch.Tensor,
    targets_NT: torch.Tensor,
    temperature: float,
    chunk_tokens: int = 1024,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy under softmax(logits / temperature), in fp32.

    Works through `chunk_tokens` rows at a time so a full fp32 copy of the logits never
    exists; with grad enabled each chunk is recomputed in backward instead of kept. With
    `kernel` (`rl.logprob_kernel`), the Triton kernel of trainer/logprob_kernel.py does the same
    in one read of the logits, and its backward overwrites the logits with their gradient.
    """
    n, t, v = logits_NTV.shape
    flat_logits, flat_targets = logits_NTV.reshape(n * t, v), targets_NT.reshape(n * t)
    if kernel:
        from trainer.logprob_kernel import logprob_entropy

        logp, entropy = logprob_entropy(flat_logits, flat_targets, temperature)
        return logp.view(n, t), entropy.view(n, t)
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
# `rl.kl_clamp`, verl's bounds for k3 (low_var_kl): exp(-x) grows without bound where the
# reference is far likelier than the policy (x << 0), and so does its gradient; the log-ratio is
# clamped to +-20 and the estimate to [-10, 10]. k1 and k2 are linear and quadratic in x: unclamped.
KL_LOG_RATIO_BOUND, K3_BOUND = 20.0, 10.0


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, clamp: bool = False
) -> torch.Tensor:
    x = logp - ref_logp
    if clamp and estimator == "k3":
        x = x.clamp(-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
        return KL_ESTIMATORS["k3"](x).clamp(-K3_BOUND, K3_BOUND)
    return KL_ESTIMATORS[estimator](x)


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


def masked_row_mean(x_NT: torch.Tensor, mask_NT: torch.Tensor) -> torch.Tensor:
    """Mean of each row over its masked positions (0 for a row with none): N."""
    return (x_NT * mask_NT).sum(-1) / mask_NT.sum(-1).clamp(min=1)


def sequence_log_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, mask_NT: torch.Tensor
) -> torch.Tensor:
    """GSPO-token's log-ratio, N x T: at every token of a row the value mean_t(logp - old_logp)
    over that row's response, and the gradient of logp at that token (logp - sg(logp) is 0)."""
    seq_N = masked_row_mean(logp.detach() - old_logp, mask_NT)
    return logp - logp.detach() + seq_N.unsqueeze(-1)


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
    clip_ratio_c: float | None = None,
    ratio_level: str = "token",
    mask_NT: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    kl_clamp: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss and per-token diagnostics (all N x T; mask them before summing).

    `ratio_level=sequence` needs `mask_NT` (the response tokens each row's mean runs over);
    `is_weights` (N x T, no gradient; `rollout_is_weights`) multiply the policy-gradient term only."""
    adv = advantages_N.unsqueeze(-1)
    token_log_ratio = logp - old_logp
    if ratio_level == "sequence":
        assert mask_NT is not None, "the sequence-level ratio averages over the response mask"
        log_ratio = sequence_log_ratio(logp, old_logp, mask_NT)
    else:
        log_ratio = token_log_ratio
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    stats = {
        "ppo_kl": -token_log_ratio.detach(),  # k1 estimate of KL(old || new), per token
        "clipfrac": (clipped > unclipped).float().detach(),
    }
    if clip_ratio_c is not None:  # dual clip: a negative advantage's loss is bounded by -A * c
        bound = -adv * clip_ratio_c
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)
        stats["dual_clipfrac"] = dual.float().detach()
    if is_weights is not None:
        pg = pg * is_weights
    stats["pg_loss"] = pg.detach()
    loss = pg
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_estimator, kl_clamp)
        loss = loss + kl_coef * kl
        stats["kl"] = kl.detach()
    if entropy is not None:
        loss = loss - entropy_coef * entropy
        stats["entropy"] = entropy.detach()
    return loss, stats


def rollout_is_weights(
    learner_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask_NT: torch.Tensor,
    mode: str,
    cap: float,
    level: str,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Rollout correction for the gap between the learner and the sampler that drew the tokens.

    rho = pi_learner / pi_sampler per token (`level=token`), or per response the product over
    its tokens, exp(sum_t (learner - sampler)), given to each of its tokens (`level=sequence`);
    the learner's log-probs are those of the weights that sampled (the first update's, no grad).

        none  weight 1, keep 1
        tis   weight min(rho, cap), keep 1                       (truncated IS, Yao et al. 2025)
        mis   weight 1, keep [1/cap <= rho <= cap]               (masked IS: rejected tokens or
                                                                  responses leave the loss, and
                                                                  its token and response counts)

    Returns (weights_NT, keep_NT, per-token diagnostics: `rollout_is` = rho, `rollout_is_masked`
    = 1 where tis truncated or mis rejected); rho is clamped to exp(+-20) before use."""
    log_rho = (learner_logp - sampler_logp).detach() * mask_NT
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    rho = log_rho.clamp(-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND).exp()
    ones = torch.ones_like(rho)
    if mode == "tis":
        weights, keep, changed = rho.clamp(max=cap), ones, rho > cap
    elif mode == "mis":
        inside = (rho >= 1 / cap) & (rho <= cap)
        weights, keep, changed = ones, inside.float(), ~inside
    else:
        weights, keep, changed = ones, ones, torch.zeros_like(rho, dtype=torch.bool)
    return weights, keep, {"rollout_is": rho, "rollout_is_masked": changed.float()}


def overlong_penalty(
    response_len_N: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward: 0 up to
    max_new_tokens - buffer tokens, then falling linearly to -penalty at max_new_tokens
    (responses cannot be longer here: they are cut there). Lengths count EOS. buffer 0: off."""
    if buffer <= 0:
        return torch.zeros_like(response_len_N)
    expected = max_new_tokens - buffer
    return -(response_len_N - expected).clamp(min=0) / buffer * penalty


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. (2021): from n samples of which c are
    correct, 1 - C(n - c, k) / C(n, k), the chance that k drawn without replacement hold one."""
    if n - c < k:
        return 1.0
    out = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) as a stable product
        out *= 1.0 - k / i
    return 1.0 - out


def zero_std_groups(rewards_PG: torch.Tensor, eps: float) -> torch.Tensor:
    """Groups whose rewards are all equal (unbiased std <= eps): their advantages are all 0, so
    they carry no policy gradient. P booleans."""
    if rewards_PG.numel() == 0:
        return torch.zeros(rewards_PG.shape[0], dtype=torch.bool)
    return rewards_PG.std(dim=1) <= eps


def fair_shares(available: list[int], target: int) -> list[int]:
    """Dynamic sampling's cut: how many of its kept groups each dp rank trains on so that the
    ranks together train on min(target, sum(available)) groups, as evenly as their counts allow
    (one at a time, rank order, to every rank with groups left). Every rank computes it from the
    same all-reduced counts, so all agree."""
    shares, left = [0] * len(available), min(target, sum(available))
    while left:
        for r, have in enumerate(available):
            if left and shares[r] < have:
                shares[r] += 1
                left -= 1
    return shares
