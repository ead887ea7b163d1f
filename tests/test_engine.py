"""The static-cache engine computes the same model as the trainer (on CPU, fp32, no graphs)."""

import pytest
import torch
from conftest import compose_config
from transformers import AutoModelForCausalLM

from trainer.engine import StaticCacheEngine, sample
from trainer.model import hf_config
from trainer.rollout import SamplingParams
from trainer.train import collate, sequence_logprobs


@pytest.mark.parametrize(
    "top_p, spans, attention",
    [(1.0, 1, "sdpa"), (0.9, 1, "sdpa"), (1.0, 3, "sdpa"), (1.0, 1, "triton")],
)
def test_sampling_logprobs_match_the_training_forward(top_p, spans, attention):
    if attention == "triton":  # the GPU kernel, run by Triton's interpreter on CPU tensors
        pytest.importorskip("triton")
    config = hf_config(compose_config().model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
        temperature=0.7, top_p=top_p, max_new_tokens=6, eos_token_id=258, pad_token_id=256
    )
    torch.manual_seed(1)
    rollout = engine.generate([p for p in prompts for _ in range(2)], params)
    assert len(rollout.response_ids) == 6 and all(1 <= len(r) <= 6 for r in rollout.response_ids)
    batch = collate(rollout, torch.zeros(6), torch.zeros(6), pad_id=256, device=torch.device("cpu"))
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, batch, params.temperature)
    mask = batch.mask_NT.bool()
    assert (logp[mask] - batch.sampling_logp_NT[mask]).abs().max() < 1e-4
    # a second call reuses the buffers and still agrees
    rollout2 = engine.generate([p for p in prompts[:2] for _ in range(2)], params)
    batch2 = collate(
        rollout2, torch.zeros(4), torch.zeros(4), pad_id=256, device=torch.device("cpu")
    )
    with torch.no_grad():
        logp2, _ = sequence_logprobs(model, batch2, params.temperature)
    m2 = batch2.mask_NT.bool()
    assert (logp2[m2] - batch2.sampling_logp_NT[m2]).abs().max() < 1e-4


def test_top_p_keeps_sampling_inside_the_nucleus():
    params = SamplingParams(
        temperature=1.0, top_p=0.5, max_new_tokens=1, eos_token_id=0, pad_token_id=0
    )
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.45, 0.35]])).repeat(500, 1)
    tokens, logp = sample(logits, params)
    assert set(tokens[0::2].tolist()) == {0}  # 0.6 alone covers 0.5
    assert set(tokens[1::2].tolist()) == {1, 2}  # 0.45 does not: the next token joins
    torch.testing.assert_close(logp[0], torch.log(torch.tensor(0.6)))


def test_auto_decode_attention_picks_triton_only_where_it_runs():
    from trainer.train import decode_attention

    pytest.importorskip("triton")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert decode_attention(compose_config(), cuda) == "triton"  # head_dim 16, Triton installed
    assert decode_attention(compose_config(), cpu) == "sdpa"
    assert decode_attention(compose_config("model.arch.head_dim=24"), cuda) == "sdpa"
    assert decode_attention(compose_config("rl.decode_attention=sdpa"), cuda) == "sdpa"
