"""The Triton sampler (trainer/sample_kernel.py) against the CDF of softmax(logits / T) computed
in float64, in Triton's interpreter on CPU (the same kernel source the GPU compiles). On a GPU
machine, `TRITON_INTERPRET=0 pytest tests/test_sample_kernel.py` runs the compiled kernels."""

import os

import pytest
import torch

pytest.importorskip("triton")  # a test dependency; conftest sets TRITON_INTERPRET=1
GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


@pytest.fixture
def kernel(monkeypatch):
    from trainer import sample_kernel

    sample_kernel.load()
    monkeypatch.setattr(sample_kernel, "CHUNK", 16)  # 7 chunks of a 100-token vocabulary
    return sample_kernel


def logits(seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    z = torch.randn(100) * 2.0
    z[16:32] = -torch.inf  # a whole chunk without mass
    z[40:45] = -torch.inf  # and part of another
    z[96:] = -torch.inf  # the last (partial) chunk's tail: the last token with mass is 95
    return z


def test_each_uniform_lands_on_the_token_the_float64_cdf_gives(kernel):
    """u in [0, 1) maps to the first token whose cumulative mass passes u x total, across chunk
    boundaries and past chunks of no mass; the log-prob is log softmax(z / T) at that token."""
    z, t = logits(), 0.7
    p = torch.softmax(z.double() / t, -1)
    cdf = p.cumsum(0)
    u = torch.cat([torch.linspace(0, 1, 48)[:-1], torch.rand(16)])
    expected = torch.searchsorted(cdf, u.double(), right=True)
    # uniforms within rounding of a boundary may go either way: not asserted
    clear = ((cdf[None, :] - u.double()[:, None]).abs() > 1e-5).all(-1)
    assert clear.sum() > 50
    tokens, logp = kernel.sample_full(z.repeat(len(u), 1).to(DEVICE), t, u_B=u.to(DEVICE))
    tokens, logp = tokens.cpu(), logp.cpu()
    assert tokens[clear].tolist() == expected[clear].tolist()
    assert not torch.isinf(z[tokens]).any()  # no token of zero mass, boundaries included
    torch.testing.assert_close(logp, torch.log_softmax(z / t, -1)[tokens], rtol=0, atol=2e-6)


def test_uniforms_at_the_ends_never_draw_zero_mass(kernel):
    """u = 0 draws the first token with mass, u just under 1 the last (95), never a -inf token
    on either side of them."""
    z = logits(1)
    z[:3] = -torch.inf
    u = torch.tensor([0.0, 1 - 2**-24, 0.9999999])
    tokens, _ = kernel.sample_full(z.repeat(3, 1).to(DEVICE), 1.3, u_B=u.to(DEVICE))
    assert tokens.tolist() == [3, 95, 95]


def test_greedy_rows_take_the_first_maximum_across_chunks(kernel):
    z = torch.randn(4, 100)
    z[:, [37, 70, 71]] = 9.0  # tied in chunks 2 and 4, and twice in chunk 4
    greedy = torch.tensor([True, False, True, False])
    u = torch.tensor([0.3, 0.0, 0.9, 0.999])
    tokens, logp = kernel.sample_full(z.to(DEVICE), 0.5, greedy.to(DEVICE), u_B=u.to(DEVICE))
    tokens, logp = tokens.cpu(), logp.cpu()
    assert tokens[[0, 2]].tolist() == [37, 37]
    cdf = torch.softmax(z[[1, 3]].double() / 0.5, -1).cumsum(-1)
    drawn = [int(torch.searchsorted(c, x, right=True)) for c, x in zip(cdf, u[[1, 3]].double())]
    assert tokens[[1, 3]].tolist() == drawn  # the sampled rows of the same call
    torch.testing.assert_close(
        logp, torch.log_softmax(z / 0.5, -1).gather(1, tokens[:, None])[:, 0]
    )


def test_its_own_uniforms_are_the_generators_draws(kernel):
    """Without `u_B` (the engine's use) each row inverts one uniform of the device's generator,
    torch.rand(B) at that point: the same tokens as those uniforms passed in."""
    z = logits(2).repeat(64, 1).to(DEVICE)
    torch.manual_seed(3)
    tokens, logp = kernel.sample_full(z, 0.9)
    torch.manual_seed(3)
    u = torch.rand(64, device=DEVICE)
    assert len(set(tokens.tolist())) > 5
    again, logp_again = kernel.sample_full(z, 0.9, u_B=u)
    assert tokens.tolist() == again.tolist() and torch.equal(logp, logp_again)


def test_engine_samples_with_the_kernel_as_it_does_without():
    """The engine built with `sampler="triton"` (no cut) records the log-probs of what it drew
    under the full softmax, as the training forward computes them; a top-p cut still takes the
    torch sampler."""
    from conftest import compose_config
    from test_engine import reference_logprobs
    from transformers import AutoModelForCausalLM

    from trainer.engine import StaticCacheEngine
    from trainer.model import hf_config
    from trainer.rollout import SamplingParams

    config = hf_config(compose_config().model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    engine = StaticCacheEngine(config, torch.float32, torch.device(DEVICE), compile=False,
                               sampler="triton")  # fmt: skip
    engine.model.load_state_dict(model.state_dict())
    rows = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [5, 6, 7]]
    for top_p in (1.0, 0.9):
        params = SamplingParams(temperature=0.7, top_p=top_p, max_new_tokens=5, eos_token_id=258,
                                pad_token_id=256)  # fmt: skip
        torch.manual_seed(1)
        rollout = engine.generate(rows, params)
        expected = reference_logprobs(model, rollout, params.temperature, top_p)
        torch.testing.assert_close(
            torch.cat(rollout.sampling_logprobs).cpu(), expected, atol=1e-4, rtol=0
        )
