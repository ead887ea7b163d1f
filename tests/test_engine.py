"""The static-cache engine computes the same model as the trainer (on CPU, fp32, no graphs)."""

import os

import pytest
import torch
from conftest import compose_config
from transformers import AutoModelForCausalLM

from trainer.engine import StaticCacheEngine, first_past, sample, sample_full, vocab_chunks
from trainer.model import hf_config
from trainer.rollout import SamplingParams
from trainer.train import collate, sequence_logprobs


def triton_on_cpu_tensors() -> None:
    """Skip unless the Triton kernels can run on this file's CPU tensors: Triton installed and
    its interpreter on (conftest sets TRITON_INTERPRET=1; a GPU run with TRITON_INTERPRET=0
    tests the compiled kernels in test_decode_attention.py and its siblings instead)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1")


def reference_logprobs(model, rollout, temperature: float, top_p: float, top_k: int = 0):
    """Log p(response token) under softmax(logits / T) cut to the top-k tokens, then to the
    smallest nucleus of those whose mass reaches top_p, renormalised: one unpadded forward per row, written
    independently of the engine's sampler."""
    out = []
    for prompt, response in zip(rollout.prompt_ids, rollout.response_ids, strict=True):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            z = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        for t in range(len(response)):
            p = z[t].softmax(-1)
            keep = torch.ones_like(p, dtype=torch.bool)
            if top_k:
                keep &= p >= p.topk(top_k).values[-1]
            if top_p < 1.0:  # the nucleus of the top-k distribution, as HF and vLLM cut it
                sorted_p, order = torch.where(keep, p, 0.0).sort(descending=True)
                sorted_p = sorted_p / sorted_p.sum()
                n = int((sorted_p.cumsum(0) < top_p).sum()) + 1  # smallest set reaching top_p
                nucleus = torch.zeros_like(keep)
                nucleus[order[:n]] = True
                keep &= nucleus
            q = torch.where(keep, p, 0.0)
            assert keep[response[t]], "the sampler drew a token outside the cut"
            out.append(torch.log(q[response[t]] / q.sum()))
    return torch.stack(out)


@pytest.mark.parametrize(
    "top_p, top_k, spans, attention, bias",
    [(1.0, 0, 1, "sdpa", False), (0.9, 0, 1, "sdpa", False), (0.8, 20, 1, "sdpa", False),
     (1.0, 0, 3, "sdpa", False), (1.0, 0, 1, "triton", False), (1.0, 0, 1, "triton", True)],
)  # fmt: skip
def test_sampling_logprobs_match_the_training_forward(
    top_p, top_k, spans, attention, bias, monkeypatch
):
    """The engine records log p of each token under the distribution it really sampled from:
    the full softmax, or the top-k / top-p cut renormalised. The Triton attention's two paths
    both run: the interpreter counts as one SM, so the first call's 6 rows x 2 KV heads (12
    programs) take the unfused path and the second call's 4 rows (8) the fused prologue, unless
    the q/k/v projection has a bias (`attention_bias`), which the fused prologue does not add:
    then both calls go unfused."""
    launched: list[tuple[bool, int]] = []
    if attention == "triton":  # the GPU kernel, run by Triton's interpreter on CPU tensors
        triton_on_cpu_tensors()
        from trainer import decode_attention as da

        def spy(launch, fused: bool):
            def recorded(*args, **kwargs):
                out = launch(*args, **kwargs)
                launched.append((fused, out.shape[0] * out.shape[1]))  # fused?, B x Hkv
                return out

            return recorded

        monkeypatch.setattr(da, "launch", spy(da.launch, False))
        monkeypatch.setattr(da, "launch_qkv", spy(da.launch_qkv, True))
    config = hf_config(compose_config().model)
    config.attention_bias = bias
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if bias:  # initialised to zero: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    engine = StaticCacheEngine(
        config, torch.float32, torch.device("cpu"), compile=False, spans=spans, attention=attention
    )
    engine.span_align = 1  # spans of 4, 8, 12 columns on this 12-column cache (6 + 6)
    engine.model.load_state_dict(model.state_dict())  # fills the fused q/k/v, gate/up weights
    prompts = [
        [5, 6, 7],
        [8, 9, 10, 11, 12, 13],
        [14],
    ]  # different lengths: left padding is exercised
    params = SamplingParams(
        temperature=0.7, top_p=top_p, top_k=top_k, max_new_tokens=6, eos_token_id=258,
        pad_token_id=256,
    )  # fmt: skip
    torch.manual_seed(1)
    for rows in (
        [p for p in prompts for _ in range(2)],
        [p for p in prompts[:2] for _ in range(2)],
    ):
        # the second call reuses the buffers and still agrees
        rollout = engine.generate(rows, params)
        assert all(1 <= len(r) <= 6 for r in rollout.response_ids)
        expected = reference_logprobs(model, rollout, params.temperature, top_p, top_k)
        torch.testing.assert_close(
            torch.cat(rollout.sampling_logprobs), expected, atol=1e-4, rtol=0
        )
    if top_p == 1.0 and top_k == 0:  # the training forward reads the same numbers
        batch = collate(
            rollout, torch.zeros(4), torch.zeros(4), pad_id=256, device=torch.device("cpu")
        )
        with torch.no_grad():
            logp, _ = sequence_logprobs(model, batch, params.temperature)
        mask = batch.mask_NT.bool()
        assert (logp[mask] - batch.sampling_logp_NT[mask]).abs().max() < 1e-4
    if attention == "triton":  # `fuse_for`: fused up to 8 programs per SM, unfused past it
        expected_launches = {(False, 12), (not bias, 8)}  # never fused with a q/k/v bias
        assert set(launched) == expected_launches, set(launched)


def test_top_p_keeps_sampling_inside_the_nucleus():
    params = SamplingParams(
        temperature=1.0, top_p=0.5, max_new_tokens=1, eos_token_id=0, pad_token_id=0
    )
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.45, 0.35]])).repeat(500, 1)
    tokens, logp = sample(logits, params)
    assert set(tokens[0::2].tolist()) == {0}  # 0.6 alone covers 0.5
    assert set(tokens[1::2].tolist()) == {1, 2}  # 0.45 does not: the next token joins
    # log-probs under the renormalised nucleus, the distribution each token was drawn from
    torch.testing.assert_close(logp[0::2], torch.zeros(500))  # {0}: 0.6 / 0.6
    expected = torch.log(torch.tensor([0.0, 0.45 / 0.8, 0.35 / 0.8]))[tokens[1::2]]
    torch.testing.assert_close(logp[1::2], expected)


def test_top_k_and_greedy_rows():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.3, 0.6]])).repeat(500, 1)
    params = SamplingParams(
        temperature=1.0, top_p=1.0, top_k=2, max_new_tokens=1, eos_token_id=0, pad_token_id=0
    )
    tokens, logp = sample(logits, params)
    assert set(tokens[0::2].tolist()) == {0, 1} and set(tokens[1::2].tolist()) == {1, 2}
    expected = torch.log(
        torch.tensor([[0.5, 0.3, 0.0], [0.0, 0.3, 0.6]]) / torch.tensor([[0.8], [0.9]])
    )
    torch.testing.assert_close(logp, expected.repeat(500, 1).gather(1, tokens[:, None]).squeeze(1))
    greedy = torch.zeros(1000, dtype=torch.bool)
    greedy[:4] = True
    tokens, _ = sample(logits, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=1,
                                              eos_token_id=0, pad_token_id=0), greedy)  # fmt: skip
    assert tokens[:4].tolist() == [0, 2, 0, 2]


def test_full_softmax_sampler_draws_from_softmax_over_chunks():
    """The one-pass sampler (no top-k / top-p): token frequencies follow softmax(z / T) across
    its chunks (4 chunks of 1,024 here), the log-prob is log softmax at the drawn token, tokens
    of probability zero are never drawn, greedy rows take the first maximum."""
    assert vocab_chunks(151_936) == 1_187 and vocab_chunks(4_096) == 1_024
    assert vocab_chunks(259) == 259  # no divisor in range: one chunk
    torch.manual_seed(0)
    z = torch.randn(4_096) * 2.5
    z[1_000:3_000] = -torch.inf  # two whole chunks and part of a third with no mass
    p = (z / 0.7).softmax(-1)
    n = 20_000
    tokens, logp = sample_full(z.repeat(n, 1), 0.7)
    assert not torch.isinf(z[tokens]).any()
    counts = torch.bincount(tokens, minlength=z.numel()).float()
    expected = p * n
    big = expected > 20  # Pearson's chi-square over the tokens with enough expected draws
    chi2 = ((counts - expected)[big] ** 2 / expected[big]).sum().item()
    dof = int(big.sum()) - 1
    assert dof > 20 and chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)
    rare = counts[~big].sum() / n  # the tail's mass, together
    assert abs(rare - p[~big].sum()) < 0.01
    torch.testing.assert_close(logp, p.log()[tokens])
    # the same distribution through `sample`, which takes this path when nothing is cut
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=1, eos_token_id=0,
                            pad_token_id=0)  # fmt: skip
    tokens, logp = sample(z.repeat(1_000, 1), params)
    torch.testing.assert_close(logp, p.log()[tokens])
    # greedy: a maximum tied across chunks 1 and 3 goes to the first
    tied = torch.randn(3, 4_096)
    tied[:, [1_500, 3_500]] = 50.0
    greedy = torch.tensor([True, False, True])
    tokens, logp = sample_full(tied, 1.0, greedy)
    assert tokens[[0, 2]].tolist() == [1_500, 1_500] and tokens[1].item() in (1_500, 3_500)
    torch.testing.assert_close(logp, tied.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))


def test_first_past_never_lands_on_zero_mass():
    cum = torch.tensor([[0.0, 0.2, 0.2, 0.7, 0.7, 0.7], [0.5, 0.5, 1.0, 1.0, 1.0, 1.0]])
    u = torch.tensor([[0.1], [0.5]])  # row 0: inside column 1's mass; row 1: on a boundary
    assert first_past(cum, u).squeeze(1).tolist() == [1, 2]
    u = torch.tensor([[0.7], [1.3]])  # at or past the total (rounding): the last column with mass
    assert first_past(cum, u).squeeze(1).tolist() == [3, 2]


def test_auto_decode_attention_picks_triton_only_where_it_runs():
    from trainer.train import decode_attention

    pytest.importorskip("triton")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert decode_attention(compose_config(), cuda) == "triton"  # head_dim 16, Triton installed
    assert decode_attention(compose_config(), cpu) == "sdpa"
    assert decode_attention(compose_config("model.arch.head_dim=24"), cuda) == "sdpa"
    assert decode_attention(compose_config("rl.decode_attention=sdpa"), cuda) == "sdpa"


def test_freed_cache_is_made_again_with_the_same_compiled_step():
    """rl.free_kv_cache: after free_cache the next generate remakes the cache at its old shape
    and draws exactly what it would have drawn; the compiled step is reused, not recompiled
    (its guards see the new cache tensors as the same shapes); nor is the prefill's layer when
    the prompts' width changes."""
    import torch._dynamo

    config = hf_config(compose_config().model)
    torch.manual_seed(0)
    engine = StaticCacheEngine(config, torch.float32, torch.device("cpu"), compile=True)
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=4, eos_token_id=258,
                            pad_token_id=256)  # fmt: skip
    rows = [[5, 6, 7], [8, 9]]
    torch._dynamo.reset()
    torch.manual_seed(1)
    first = engine.generate(rows, params)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.manual_seed(2)
    kept = engine.generate(rows, params)
    engine.free_cache()
    assert engine.net.k_cache == [] and engine.net.shape is not None
    torch.manual_seed(2)
    remade = engine.generate(rows, params)
    assert len(engine.net.k_cache) == config.num_hidden_layers
    assert remade.response_ids == kept.response_ids
    torch.testing.assert_close(
        torch.cat(remade.sampling_logprobs), torch.cat(kept.sampling_logprobs)
    )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled, "recompiled"
    assert first.response_ids  # the compiled step ran
    # prompts of other widths (the same cache length): the prefill's layer was compiled once,
    # dynamic over the width, and the decode steps stay as they were
    engine.generate([[5, 6, 7, 8, 9, 10], [11]], params)
    engine.generate([[5], [6, 7, 8, 9]], params)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled, "recompiled"
    # another row count: new buffers, so the decode step's layer and sampler compile again for
    # it (static), but not the prefill's layer (the tiny model has 2 KV heads: a prefill
    # compiled with dynamic=True equated its batch of 2 with them and compiled again here)
    engine.generate([[5, 6], [7], [8, 9, 10]], params)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled + 2


def test_engine_calls_are_cut_evenly_and_padded_to_the_engine_batch():
    """rl.rollout_batch / evaluation: rows go to the engine in calls of `size`; where the engine
    has fixed buffers a short last call is padded (and the padding dropped from the result)."""
    from types import SimpleNamespace

    from trainer.rollout import Rollout
    from trainer.train import GRPOTrainer

    calls = []

    class Engine:
        def __init__(self, fixed):
            self.fixed = fixed

        def rows_per_call(self):
            return self.fixed

        def generate(self, rows, params, greedy=None):
            calls.append((len(rows), list(greedy or [])))
            return Rollout(rows, [[r[0] + 100] for r in rows], [torch.zeros(1)] * len(rows),
                           [False] * len(rows))  # fmt: skip

    rows = [[i] for i in range(7)]
    me = SimpleNamespace(engine=Engine(None), sampling=None)
    out = GRPOTrainer.generate_in_engine_batches(me, rows, size=4)  # type: ignore[arg-type]
    assert [c[0] for c in calls] == [4, 3] and out.response_ids == [[i + 100] for i in range(7)]
    calls.clear()
    me.engine = Engine(4)  # the static engine, buffers sized for 4 rows: pad, then drop
    out = GRPOTrainer.generate_in_engine_batches(me, rows, [True] * 7)  # type: ignore[arg-type]
    assert [c[0] for c in calls] == [4, 4] and calls[1][1] == [True] * 3 + [False]
    assert out.response_ids == [[i + 100] for i in range(7)] and len(out.truncated) == 7


def test_compiled_decode_layer_ends_at_its_last_matmul(monkeypatch):
    """A decode step's layer under torch.compile (Inductor, here its CPU code) is three
    elementwise kernels beside its matmuls and the attention: the input norm with the previous
    layer's residual add, the output projection's add with the second norm, SiLU·up. The MLP's
    residual add waits for the next layer's norm (`decoder_layer`), so no kernel follows the
    down projection."""
    import re

    from torch._inductor.utils import run_and_get_code

    from trainer import decode_attention

    triton_on_cpu_tensors()
    monkeypatch.setattr(decode_attention, "FUSE", True)  # the prologue in the attention kernel
    config = hf_config(compose_config().model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    engine = StaticCacheEngine(config, torch.float32, torch.device("cpu"), compile=False,
                               attention="triton")  # fmt: skip
    engine.model.load_state_dict(model.state_dict())
    net, b = engine.net, 3
    net.allocate(b, 8)
    x, r = torch.randn(b, 1, config.hidden_size), torch.randn(b, 1, config.hidden_size)
    cos, sin = net.rope(torch.full((b, 1), 5))
    net.col.fill_(5)
    net.key_valid[:, :6] = True
    mask = net.key_valid[:, None, None, :8]
    layer = torch.compile(net.decoder_layer, fullgraph=True, dynamic=False)
    caches = [c.clone() for c in (net.k_cache[0], net.v_cache[0])]
    (x_out, r_out), codes = run_and_get_code(layer, x, r, cos, sin, net.col, mask, *caches,
                                             *net.layer_weights[0])  # fmt: skip
    kernels = set(re.findall(r"\b(cpp_fused_\w+)\(", codes[0]))
    assert len(kernels) == 3, sorted(kernels)
    body = codes[0].split("def call(")[1].split("return (")[0]
    last_kernel = max(body.rfind(k + "(") for k in kernels)
    assert body.rfind("extern_kernels.mm(") > last_kernel, "an elementwise kernel after down_proj"
    # and the compiled layer computes what the eager one does (whose log-probs the tests above
    # check against the training forward)
    k_cache, v_cache = net.k_cache[0].clone(), net.v_cache[0].clone()
    x_eager, r_eager = net.decoder_layer(x, r, cos, sin, net.col, mask, k_cache, v_cache,
                                         *net.layer_weights[0])  # fmt: skip
    torch.testing.assert_close((x_out, r_out), (x_eager, r_eager), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches, [k_cache, v_cache])
