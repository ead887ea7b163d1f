"""The Triton log-prob/entropy kernel against the chunked torch path (trainer/grpo.py), values
and gradients, in Triton's interpreter on CPU in fp32 (the same kernel source a GPU compiles).
On a GPU machine, `TRITON_INTERPRET=0 pytest tests/test_logprob_kernel.py` runs it compiled, in
bf16 against the torch path over the same bf16 logits."""

import os

import pytest
import torch

from trainer.grpo import token_logprobs

pytest.importorskip("triton")  # a test dependency; conftest sets TRITON_INTERPRET=1
GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE, DTYPE = ("cuda", torch.bfloat16) if GPU else ("cpu", torch.float32)
# values are fp32 either way; bf16 gradients are rounded to bf16 by both paths
TOL = dict(rtol=2e-2, atol=2e-2) if GPU else dict(rtol=1e-4, atol=1e-4)  # summation order


def lm_head_case(rows: int, hidden: int, vocab: int, seed: int):
    """Logits as the model makes them (hidden @ lm_head^T), with leaves to take gradients of."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, hidden, generator=g) * 2).to(DEVICE, DTYPE).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g).to(DEVICE, DTYPE).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    a = torch.randn(rows, generator=g).to(DEVICE)  # upstream gradients of log p and entropy
    b = torch.randn(rows, generator=g).to(DEVICE)
    return h, w, targets, a, b


@pytest.mark.parametrize(
    "rows, vocab, temperature",
    [
        (6, 1000, 1.0),  # less than one forward block
        (5, 5003, 0.7),  # several blocks, a ragged last one, a temperature
        (3, 4096, 1.3),  # exactly the backward block
    ],
)
def test_values_and_gradients_match_the_torch_path(rows, vocab, temperature):
    grads, values = [], []
    for kernel in (False, True):
        h, w, targets, a, b = lm_head_case(rows, 16, vocab, seed=rows)
        logits = h @ w.T  # the kernel writes its gradient over these, as in the trainer
        logp, ent = token_logprobs(logits[None], targets[None], temperature, 2, kernel=kernel)
        assert logp.dtype == ent.dtype == torch.float32 and logp.shape == (1, rows)
        ((a * logp[0]).sum() + (b * ent[0]).sum()).backward()
        values.append((logp.detach(), ent.detach()))
        grads.append((h.grad, w.grad))
    for ref, got in zip(values[0], values[1]):
        torch.testing.assert_close(got, ref, rtol=1e-5 if not GPU else 2e-3, atol=1e-4)
    for ref, got in zip(grads[0], grads[1]):
        torch.testing.assert_close(got.float(), ref.float(), **TOL)


def test_by_hand_and_without_grad():
    """log p and entropy of a 3-way softmax by hand; a no-grad call returns the same values."""
    logits = torch.tensor([[1.0, 2.0, 3.0]], device=DEVICE, dtype=DTYPE)
    p = torch.tensor([1.0, 2.0, 3.0]).exp()
    p = p / p.sum()
    with torch.no_grad():
        logp, ent = token_logprobs(
            logits[None], torch.tensor([[1]], device=DEVICE), 1.0, kernel=True
        )
    assert logp.item() == pytest.approx(p[1].log().item(), abs=1e-5)
    assert ent.item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)


def test_extreme_logits_stay_finite():
    """A row dominated by one logit far above the rest (entropy ~ 0, p ~ one-hot) and a flat row."""
    logits = torch.zeros(2, 3000, device=DEVICE, dtype=DTYPE)
    logits[0, 7] = 80.0
    logits = logits.requires_grad_()
    targets = torch.tensor([7, 2999], device=DEVICE)
    logp, ent = token_logprobs(logits.clone()[None], targets[None], 1.0, kernel=True)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert logp[0, 0].item() == pytest.approx(0.0, abs=1e-4) and ent[0, 0].item() < 1e-4
    assert logp[0, 1].item() == pytest.approx(-torch.tensor(3000.0).log().item(), abs=1e-3)
    (logp.sum() + ent.sum()).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
