"""The split-K decode-attention kernel against SDPA with the engine's mask, in Triton's
interpreter on CPU (the same kernel source the GPU compiles). On a GPU machine,
`TRITON_INTERPRET=0 pytest tests/test_decode_attention.py` runs the compiled kernel in bf16."""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # a test dependency; conftest sets TRITON_INTERPRET=1
GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE, DTYPE, TOL = ("cuda", torch.bfloat16, 2e-2) if GPU else ("cpu", torch.float32, 1e-5)


@pytest.mark.parametrize(
    "batch, kv_heads, group, head_dim, length, col",
    [
        (3, 2, 4, 16, 200, 150),  # the filled length crosses a split (128 columns) mid-block
        (2, 1, 1, 32, 64, 10),  # one query head per KV head, one partial block
        (2, 2, 8, 16, 300, 299),  # the last column of a cache that is not a multiple of a split
        # 9 splits merged (not a power of two), 3 query heads per KV head
        (2, 1, 3, 16, 1100, 1050),
    ],
)
def test_matches_sdpa_over_the_filled_columns(batch, kv_heads, group, head_dim, length, col):
    from trainer.decode_attention import decode_attention, load

    load()
    torch.manual_seed(0)
    q = torch.randn(batch, kv_heads, group, head_dim, device=DEVICE)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, device=DEVICE) for _ in range(2))
    valid = torch.rand(batch, length, device=DEVICE) > 0.3  # padding and holes, as prompts leave
    valid[:, col] = True  # the engine marks the column it writes
    valid[0, col + 1 :] = True  # stale keys past col must not be read
    q, k, v = (x.to(DTYPE) for x in (q, k, v))
    out = decode_attention(q, k, v, valid, torch.tensor([col], device=DEVICE))
    assert out.dtype == DTYPE
    seen = valid & (torch.arange(length, device=DEVICE) <= col)
    q, k, v = (x.float() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None, None, :])
    torch.testing.assert_close(out.float(), ref, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    "setting",
    [
        {"SPLIT": 128, "BLOCK": 128, "V_FIRST": False},  # the split path: up to 9 splits merged
        {"SPLIT": 256, "BLOCK": 64, "STAGES": 1, "WARPS": 8},
        {"SPLIT": 0, "V_FIRST": False},
    ],
)
def test_every_setting_the_sweep_tries_is_exact(monkeypatch, setting):
    """scripts/bench_decode_attention.py sweeps the module's launch settings: the ones the kernel
    source branches on (V_FIRST; the split path with its merge against SPLIT 0, one program over
    the whole cache writing the output, which the default picks on CPU) give the same attention."""
    from trainer import decode_attention as da

    for knob, value in setting.items():
        monkeypatch.setattr(da, knob, value)
    test_matches_sdpa_over_the_filled_columns(3, 2, 4, 16, 200, 150)
    test_matches_sdpa_over_the_filled_columns(2, 1, 3, 16, 1100, 1050)


@pytest.mark.parametrize("split", [128, 0])
def test_a_sequence_with_one_valid_key_attends_to_it_alone(monkeypatch, split):
    from trainer import decode_attention as da
    from trainer.decode_attention import decode_attention, load

    monkeypatch.setattr(da, "SPLIT", split)
    load()
    q, k, v = (torch.randn(1, 1, n, 16, device=DEVICE, dtype=DTYPE) for n in (2, 256, 256))
    valid = torch.zeros(1, 256, dtype=torch.bool, device=DEVICE)
    valid[0, 140] = True  # in the second split (SPLIT 128); the first has no valid key at all
    out = decode_attention(q, k, v, valid, torch.tensor([140], device=DEVICE))
    torch.testing.assert_close(out, v[:, :, 140:141].expand(1, 1, 2, 16))


def test_the_op_traces_under_torch_compile():
    """The engine calls it inside a fullgraph-compiled step: its fake and real outputs agree."""
    from trainer.decode_attention import decode_attention, load

    load()
    q = torch.randn(2, 2, 4, 16, device=DEVICE, dtype=DTYPE)
    k, v = (torch.randn(2, 2, 64, 16, device=DEVICE, dtype=DTYPE) for _ in range(2))
    valid, col = (
        torch.ones(2, 64, dtype=torch.bool, device=DEVICE),
        torch.tensor([9], device=DEVICE),
    )
    torch.library.opcheck(decode_attention, (q, k, v, valid, col))
    step = torch.compile(lambda: decode_attention(q, k, v, valid, col) * 2, fullgraph=True)
    torch.testing.assert_close(step(), 2 * decode_attention(q, k, v, valid, col))
