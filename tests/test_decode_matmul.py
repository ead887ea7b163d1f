"""The decode step's skinny split-K matmul (trainer/decode_matmul.py) against x @ W^T, in Triton's
interpreter on CPU (the source the GPU compiles). `TRITON_INTERPRET=0 pytest
tests/test_decode_matmul.py` on a GPU machine runs the compiled kernel in bf16."""

import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("triton")  # a test dependency; conftest sets TRITON_INTERPRET=1
GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE, DTYPE, TOL = ("cuda", torch.bfloat16, 2e-2) if GPU else ("cpu", torch.float32, 1e-5)


@pytest.mark.parametrize(
    "m, n, k, bn, bk, splits",
    [
        (5, 48, 64, 16, 32, 1),  # rows fewer than a tile (masked), the output in x's dtype
        (64, 100, 256, 32, 64, 2),  # weight rows not a multiple of the tile
        (17, 64, 200, 32, 32, 3),  # K not a multiple of BK x splits: the last split runs short
        (3, 32, 96, 16, 32, 4),  # the last split has no columns at all: its partial is zero
    ],
)
def test_partial_products_sum_to_the_matmul(m, n, k, bn, bk, splits):
    from trainer.decode_matmul import Config, launch

    torch.manual_seed(0)
    x = torch.randn(m, k, device=DEVICE).to(DTYPE)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(DTYPE)
    y = launch(x, w, Config(bn=bn, bk=bk, splits=splits))
    assert y.shape == (splits, m, n)
    assert y.dtype == (DTYPE if splits == 1 else torch.float32)
    expected = x.float() @ w.float().T
    torch.testing.assert_close(y.float().sum(0), expected, atol=TOL, rtol=TOL)


def test_an_input_strided_along_k_is_taken():
    """torch.compile may hand the op a transposed layout; the product is the same."""
    from trainer.decode_matmul import Config, launch

    x = torch.randn(64, 5, device=DEVICE).to(DTYPE).T  # (5, 64), stride 1 along the rows
    w = (torch.randn(32, 64, device=DEVICE) / 8).to(DTYPE)
    y = launch(x, w, Config(bn=16, bk=32, splits=2)).float().sum(0)
    torch.testing.assert_close(y, x.float() @ w.float().T, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("sms, splits", [(1, 1), (132, 2)])
def test_the_op_and_its_fake_agree(monkeypatch, sms, splits):
    """torch.compile traces the op by its fake: shapes, dtypes and strides must be the real ones
    (opcheck also runs it under the fake and the dispatcher's other checks), for one split (x's
    dtype) and for fp32 partials (3 weight tiles on 132 SMs split K = 1024 in two)."""
    from trainer import decode_matmul

    monkeypatch.setattr(decode_matmul, "sm_count", lambda device: sms)
    x = torch.randn(6, 1024, device=DEVICE).to(DTYPE)
    w = (torch.randn(192, 1024, device=DEVICE) / 32).to(DTYPE)
    op = decode_matmul.decode_linear
    torch.library.opcheck(op, (x, w), test_utils=("test_schema", "test_faketensor"))
    y = op(x, w)
    assert y.shape == (splits, 6, 192)
    assert y.dtype == (DTYPE if splits == 1 else torch.float32)
    # the fake in bf16 (the engine's dtype; on CPU the op runs in fp32, where the partials'
    # dtype and x's are the same): partials in fp32, one split in x's dtype
    x16, w16 = x.to(torch.bfloat16), w.to(torch.bfloat16)
    with FakeTensorMode() as mode:
        fake = op(mode.from_tensor(x16), mode.from_tensor(w16))
    assert (fake.shape, fake.stride()) == (y.shape, y.stride())
    assert fake.dtype == (torch.bfloat16 if splits == 1 else torch.float32)
    torch.testing.assert_close(y.float().sum(0), x.float() @ w.float().T, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("m", [64, 256])
def test_every_sm_gets_a_program_at_qwen3_4b_shapes(m):
    """On 132 SMs (an H100 or H200), each of Qwen3-4B's projections launches at least one program
    per SM, where cuBLAS left a quarter of them idle on three of the four (docs/benchmarks.md)."""
    from trainer.decode_matmul import config_for

    for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)):
        cfg = config_for(m, n, k, 132)
        assert -(-n // cfg.bn) * cfg.splits >= 132, (n, k, cfg)
        assert k // cfg.splits >= cfg.bk, (n, k, cfg)


@pytest.mark.parametrize("splits", [1, 3])
def test_engine_decodes_with_the_kernel_as_with_cublas(monkeypatch, splits):
    """The engine built with `matmul="triton"` (and the Triton attention) records the log-probs
    of what it drew as the training forward computes them: with the output written whole, and
    with three splits of K (the tiny model's K of 64 and 128 would not be split by `config_for`),
    whose fp32 partials the decode layer sums."""
    from conftest import compose_config
    from test_engine import reference_logprobs
    from transformers import AutoModelForCausalLM

    from trainer import decode_matmul
    from trainer.engine import StaticCacheEngine

    setting = decode_matmul.Config(bn=16, bk=16, splits=splits)
    monkeypatch.setattr(decode_matmul, "config_for", lambda m, n, k, sms: setting)
    from trainer.model import hf_config
    from trainer.rollout import SamplingParams

    config = hf_config(compose_config().model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    engine = StaticCacheEngine(config, torch.float32, torch.device(DEVICE), compile=False,
                               attention="triton", matmul="triton")  # fmt: skip
    engine.model.load_state_dict(model.state_dict())
    rows = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=5, eos_token_id=258,
                            pad_token_id=256)  # fmt: skip
    torch.manual_seed(1)
    rollout = engine.generate(rows, params)
    expected = reference_logprobs(model, rollout, params.temperature, 1.0)
    torch.testing.assert_close(
        torch.cat(rollout.sampling_logprobs).cpu(), expected, atol=1e-4, rtol=0
    )
