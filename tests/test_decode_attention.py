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


def unfused(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, valid, col, heads, eps):
    """The engine's layer without the fused prologue: the partials summed, q and k RMS-normed and
    rotated (trainer/engine.py's own functions), K/V written at col, SDPA over columns 0 .. col."""
    from trainer.engine import rms_norm, rotate

    b, (h, d) = qkv.shape[1], (k_cache.shape[1], k_cache.shape[3])
    x = qkv.sum(0).to(k_cache.dtype)
    q, k, v = x.split([heads * d, h * d, h * d], dim=-1)
    cos, sin = cos[:, None, None], sin[:, None, None]  # (B, 1, 1, D): over heads and the token
    q = rotate(rms_norm(q.view(b, heads, 1, d), q_norm, eps), cos, sin)
    k = rotate(rms_norm(k.view(b, h, 1, d), k_norm, eps), cos, sin)
    k_cache.index_copy_(2, col, k)
    v_cache.index_copy_(2, col, v.view(b, h, 1, d))
    seen = valid & (torch.arange(k_cache.shape[2], device=valid.device) <= col)
    g = heads // h
    return F.scaled_dot_product_attention(
        q.view(b, h, g, d).float(), k_cache.float(), v_cache.float(), attn_mask=seen[:, None, None]
    ).to(k_cache.dtype)


@pytest.mark.parametrize(
    "batch, kv_heads, group, length, col, partials, split",
    [
        (3, 2, 4, 200, 150, 1, 0),  # one program over the cache, the projection in the model dtype
        (2, 2, 3, 300, 128, 3, 128),  # three fp32 partials; col opens a split (its only column)
        (2, 1, 2, 300, 299, 2, 128),  # col is the last column, in the last (short) split
        (2, 2, 4, 64, 0, 1, 0),  # the first column: no key from the cache at all
    ],
)
@pytest.mark.parametrize("peel", [True, False])
def test_the_fused_prologue_matches_norm_rope_cache_write_and_sdpa(
    monkeypatch, batch, kv_heads, group, length, col, partials, split, peel
):
    """decode_attention_qkv = the engine's q/k norm, RoPE, K/V cache write, then attention: the
    output and both caches (the new column written, no other touched), with the first tile
    loaded before the prologue or in the loop."""
    from trainer import decode_attention as da

    monkeypatch.setattr(da, "SPLIT", split)
    monkeypatch.setattr(da, "PEEL", peel)
    da.load()
    torch.manual_seed(0)
    d, heads, eps = 16, kv_heads * group, 1e-6
    n = (heads + 2 * kv_heads) * d
    qkv = torch.randn(partials, batch, n, device=DEVICE)
    qkv = qkv if partials > 1 else qkv.to(DTYPE)  # fp32 partials, or one product in the dtype
    q_norm, k_norm = (1 + 0.3 * torch.randn(d, device=DEVICE, dtype=DTYPE) for _ in range(2))
    angle = torch.rand(batch, d // 2, device=DEVICE) * 6
    cos, sin = (f(torch.cat([angle, angle], -1)).to(DTYPE) for f in (torch.cos, torch.sin))
    k_cache, v_cache = (
        torch.randn(batch, kv_heads, length, d, device=DEVICE, dtype=DTYPE) for _ in range(2)
    )
    valid = torch.rand(batch, length, device=DEVICE) > 0.3
    valid[:, col] = True  # the engine marks the column it writes
    at = torch.tensor([col], device=DEVICE)
    args = (q_norm, k_norm, cos, sin)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = unfused(qkv, *args, k_ref, v_ref, valid, at, heads, eps)
    out = da.decode_attention_qkv(qkv, *args, k_cache, v_cache, valid, at, heads, eps)
    assert out.dtype == DTYPE and out.shape == (batch, kv_heads, group, d)
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    torch.testing.assert_close(k_cache, k_ref, rtol=TOL, atol=TOL)
    torch.testing.assert_close(v_cache, v_ref, rtol=TOL, atol=TOL)
    if col == 0:  # the op's fake and declared mutations against the kernel (traced in the engine)
        torch.library.opcheck(
            da.decode_attention_qkv, (qkv, *args, k_cache, v_cache, valid, at, heads, eps)
        )
