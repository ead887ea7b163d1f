"""GRPO math against values worked out by hand on small tensors."""

import math

import pytest
import torch

from trainer.grpo import (
    fair_shares,
    group_advantages,
    grpo_token_loss,
    kl_penalty,
    loss_weights,
    overlong_penalty,
    pass_at_k,
    rollout_is_weights,
    sequence_log_ratio,
    token_logprobs,
    zero_std_groups,
)


def test_group_advantages_std_and_dr_grpo():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735; group 1: no spread, no signal
    adv = group_advantages(rewards, std_normalize=True, eps=0.0 + 1e-6)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(adv[0], torch.tensor([expected, -expected, -expected, expected]))
    assert torch.equal(adv[1], torch.zeros(4))
    dr = group_advantages(rewards, std_normalize=False, eps=1e-6)
    torch.testing.assert_close(dr[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def loss_at(ratio: float, adv: float, clip_low=0.2, clip_high=0.2):
    logp = torch.tensor([[math.log(ratio)]])
    loss, stats = grpo_token_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), clip_low, clip_high)
    return loss.item(), stats["clipfrac"].item()


@pytest.mark.parametrize(
    "ratio,adv,clip_high,expected_loss,clipped",
    [
        (1.25, +1.0, 0.20, -1.20, 1.0),  # good token pushed past 1 + 0.2: clipped, no gradient
        (1.25, +1.0, 0.28, -1.25, 0.0),  # clip-higher (DAPO) leaves it room
        (0.75, -1.0, 0.20, +0.80, 1.0),  # bad token pushed below 1 - 0.2: clipped
        (1.25, -1.0, 0.20, +1.25, 0.0),  # bad token made likelier: pessimistic bound, unclipped
        (0.75, +1.0, 0.20, -0.75, 0.0),  # good token made less likely: unclipped
        (1.00, +1.0, 0.20, -1.00, 0.0),  # on-policy
    ],
)
def test_clipped_ratio_loss(ratio, adv, clip_high, expected_loss, clipped):
    loss, frac = loss_at(ratio, adv, clip_high=clip_high)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    assert frac == clipped


def test_clip_high_asymmetry_only_moves_the_upper_bound():
    assert loss_at(0.7, -1.0, clip_low=0.2, clip_high=0.28) == pytest.approx((0.8, 1.0))
    assert loss_at(1.3, +1.0, clip_low=0.2, clip_high=0.28) == pytest.approx((-1.28, 1.0))


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -2.0])  # x = logp - ref = 1, 0
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([math.exp(-1.0), 0.0]))
    assert (kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0).all()


def test_kl_and_entropy_terms_enter_the_loss():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    entropy = torch.tensor([[0.5]])
    loss, stats = grpo_token_loss(
        logp,
        logp,
        torch.tensor([2.0]),
        0.2,
        0.2,
        ref_logp=ref,
        kl_coef=0.1,
        kl_estimator="k1",
        entropy=entropy,
        entropy_coef=0.01,
    )
    assert loss.item() == pytest.approx(-2.0 + 0.1 * 1.0 - 0.01 * 0.5)
    assert stats["kl"].item() == pytest.approx(1.0) and stats["ppo_kl"].item() == 0.0


def test_aggregations_and_masking():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    tok = loss_weights(mask, "token_mean", global_tokens=3, global_responses=2, max_new_tokens=4)
    seq = loss_weights(
        mask, "seq_mean_token_mean", global_tokens=3, global_responses=2, max_new_tokens=4
    )
    drg = loss_weights(
        mask, "seq_mean_token_sum_norm", global_tokens=3, global_responses=2, max_new_tokens=4
    )
    torch.testing.assert_close(tok, torch.tensor([[1 / 3, 1 / 3, 0], [1 / 3, 0, 0]]))
    torch.testing.assert_close(seq, torch.tensor([[0.25, 0.25, 0], [0.5, 0, 0]]))
    torch.testing.assert_close(drg, torch.tensor([[0.125, 0.125, 0], [0.125, 0, 0]]))
    per_token = torch.tensor([[1.0, 2.0, 1e6], [4.0, 1e6, 1e6]])  # padding holds garbage
    assert (per_token * tok).sum().item() == pytest.approx(7 / 3)
    assert (per_token * seq).sum().item() == pytest.approx((1.5 + 4.0) / 2)
    assert (per_token * drg).sum().item() == pytest.approx((3.0 + 4.0) / 8)


def test_global_weights_split_over_ranks_sum_to_the_whole():
    """Two 'ranks' holding halves of a batch, weighted by global counts, add up to the whole."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    values = torch.arange(12.0).view(4, 3)
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        whole = (values * loss_weights(mask, agg, 7, 4, 3)).sum()
        halves = sum(
            (values[i] * loss_weights(mask[i], agg, 7, 4, 3)).sum()
            for i in (slice(0, 2), slice(2, 4))
        )
        torch.testing.assert_close(halves, whole)


def test_token_logprobs_by_hand_with_temperature():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    logp, ent = token_logprobs(logits, torch.tensor([[1]]), temperature=1.0)
    assert logp.item() == pytest.approx(math.log(0.75))
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    logp2, _ = token_logprobs(logits, torch.tensor([[1]]), temperature=2.0)
    p = math.sqrt(3) / (1 + math.sqrt(3))  # softmax([0, ln 3] / 2)
    assert logp2.item() == pytest.approx(math.log(p))


def test_token_logprobs_chunking_changes_nothing():
    logits = torch.randn(3, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    a, ea = token_logprobs(logits, targets, 0.7, chunk_tokens=4)
    (ga,) = torch.autograd.grad(a.sum() + ea.sum(), logits)
    b, eb = token_logprobs(logits, targets, 0.7, chunk_tokens=10_000)
    (gb,) = torch.autograd.grad(b.sum() + eb.sum(), logits)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ea, eb)
    torch.testing.assert_close(ga, gb)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(a, ref)


def test_the_trainers_registries_are_the_schemas_choices():
    from launcher.schema import RLConfig, choices_of
    from trainer.grpo import AGGREGATIONS, KL_ESTIMATORS

    assert tuple(AGGREGATIONS) == choices_of(RLConfig, "loss_agg")
    assert tuple(KL_ESTIMATORS) == choices_of(RLConfig, "kl_estimator")


def test_gspo_sequence_ratio_value_and_gradient_match_the_paper():
    """GSPO (Zheng et al. 2025): s = exp(mean_t(logp - old)), loss -A * clip(s); its gradient per
    token is -A * s / |y| (unclipped), which token-mean weights 1/|y| give here."""
    old = torch.tensor([[-1.2, -1.4]])
    mask = torch.ones(1, 2)
    s = math.exp(0.3)  # mean of the log-ratios 0.2 and 0.4
    for adv, clipped in ((+1.0, True), (-1.0, False)):
        logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
        loss, stats = grpo_token_loss(logp, old, torch.tensor([adv]), 3e-4, 4e-4,
                                      ratio_level="sequence", mask_NT=mask)  # fmt: skip
        (loss * mask / 2).sum().backward()
        if clipped:  # A > 0 and s > 1 + 4e-4: the clipped bound -A * 1.0004 wins, no gradient
            assert loss[0, 0].item() == pytest.approx(-1.0004)
            assert stats["clipfrac"].tolist() == [[1.0, 1.0]]
            torch.testing.assert_close(logp.grad, torch.zeros(1, 2))
        else:  # A < 0: the pessimistic max keeps the unclipped A * s
            assert loss[0, 0].item() == pytest.approx(s, rel=1e-6)
            torch.testing.assert_close(logp.grad, torch.full((1, 2), s / 2))
            # the same as differentiating the sequence objective -A * exp(mean(logp - old))
            x = torch.tensor([-1.0, -1.0], requires_grad=True)
            (-adv * torch.exp((x - old[0]).mean())).backward()
            torch.testing.assert_close(logp.grad[0], x.grad)


def test_gspo_ratio_ignores_padding():
    logp = torch.tensor([[-1.0, -1.0, 5.0]])
    old = torch.tensor([[-1.2, -1.4, -9.0]])  # garbage in the padded third column
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    log_ratio = sequence_log_ratio(logp, old, mask)
    torch.testing.assert_close(log_ratio, torch.full((1, 3), 0.3))


@pytest.mark.parametrize(
    "ratio, adv, expected, dual",
    [
        (4.0, -1.0, 3.0, 1.0),  # A < 0 and ratio 4: the PPO loss 4 is bounded at -A * c = 3
        (2.0, -1.0, 2.0, 0.0),  # below the bound: untouched
        (4.0, +1.0, -1.2, 0.0),  # A > 0: dual clip never applies
    ],
)
def test_dual_clip_by_hand(ratio, adv, expected, dual):
    logp = torch.tensor([[math.log(ratio)]])
    loss, stats = grpo_token_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), 0.2, 0.2,
                                  clip_ratio_c=3.0)  # fmt: skip
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["dual_clipfrac"].item() == dual


def test_k3_clamp_bounds_value_and_gradient():
    logp = torch.tensor([-31.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -2.0])  # x = -30 (policy far below the reference) and x = 1
    kl = kl_penalty(logp, ref, "k3", clamp=True)
    torch.testing.assert_close(kl, torch.tensor([10.0, math.exp(-1.0)]))  # e^30 - 31 clamped to 10
    kl.sum().backward()
    assert logp.grad[0].item() == 0.0 and logp.grad[1].item() == pytest.approx(1 - math.exp(-1.0))
    assert kl_penalty(logp, ref, "k3")[0].item() == pytest.approx(math.exp(30.0) - 31.0, rel=1e-5)


def test_rollout_importance_weights_by_hand():
    learner = torch.tensor([[-1.0, -2.0, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0, 7.0]])  # rho = e^0.5, e^-1; the third column is padding
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    r1, r2 = math.exp(0.5), math.exp(-1.0)
    w, keep, st = rollout_is_weights(learner, sampler, mask, "tis", 2.0, "token")
    torch.testing.assert_close(w, torch.tensor([[r1, r2, 1.0]]))
    torch.testing.assert_close(keep, torch.ones(1, 3))
    w, _, st = rollout_is_weights(learner, sampler, mask, "tis", 1.5, "token")
    torch.testing.assert_close(w, torch.tensor([[1.5, r2, 1.0]]))  # truncated at the cap
    assert st["rollout_is_masked"].tolist() == [[1.0, 0.0, 0.0]]
    w, keep, st = rollout_is_weights(learner, sampler, mask, "mis", 2.0, "token")
    torch.testing.assert_close(w, torch.ones(1, 3))
    assert keep[0, :2].tolist() == [1.0, 0.0]  # e^-1 < 1/2: rejected
    # sequence level: rho = e^(0.5 - 1) = 0.6065 for the whole response
    w, keep, st = rollout_is_weights(learner, sampler, mask, "tis", 2.0, "sequence")
    torch.testing.assert_close(w[0, :2], torch.full((2,), math.exp(-0.5)))
    _, keep, _ = rollout_is_weights(learner, sampler, mask, "mis", 2.0, "sequence")
    assert keep[0, :2].tolist() == [1.0, 1.0]  # 0.6065 inside [0.5, 2]
    _, keep, st = rollout_is_weights(learner, sampler, mask, "mis", 1.5, "sequence")
    assert keep[0, :2].tolist() == [0.0, 0.0]  # outside [0.667, 1.5]: the whole response goes
    w, keep, _ = rollout_is_weights(learner, sampler, mask, "none", 2.0, "token")
    assert torch.equal(w, torch.ones(1, 3)) and torch.equal(keep, torch.ones(1, 3))


def test_is_weights_scale_only_the_policy_gradient():
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    loss, _ = grpo_token_loss(logp, logp, torch.tensor([2.0]), 0.2, 0.2, ref_logp=ref,
                              kl_coef=0.1, kl_estimator="k1", is_weights=torch.tensor([[0.5]]))  # fmt: skip
    assert loss.item() == pytest.approx(0.5 * -2.0 + 0.1 * 1.0)


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([5.0, 6.0, 7.0, 8.0, 10.0])
    out = overlong_penalty(lengths, max_new_tokens=10, buffer=4, penalty=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    assert overlong_penalty(lengths, 10, 0, 1.0).abs().sum() == 0  # buffer 0: off


@pytest.mark.parametrize(
    "n, c, k, expected",
    [(4, 1, 2, 1 - 3 / 6), (5, 2, 3, 1 - 1 / 10), (4, 0, 2, 0.0), (4, 3, 2, 1.0), (8, 3, 1, 3 / 8)],
)
def test_unbiased_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_zero_std_groups_and_fair_shares():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5]])
    assert zero_std_groups(rewards, 1e-6).tolist() == [True, False, True]
    assert fair_shares([5, 0, 2, 1], 6) == [3, 0, 2, 1]  # one at a time, rank order
    assert fair_shares([5, 0, 2, 1], 10) == [5, 0, 2, 1]  # too few: train on all
    assert fair_shares([3, 3], 3) == [2, 1]
    assert fair_shares([0, 0], 4) == [0, 0]
