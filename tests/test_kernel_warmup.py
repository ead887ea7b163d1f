"""The child process that compiles the Triton kernels ahead of a worker's first calls
(trainer/kernel_warmup.py): what it compiles for a run, and that its launches match the kernels'
current signatures (in Triton's interpreter on CPU; whether they hit the worker's cache entries
is measured on the GPU: docs/benchmarks.md)."""

import pytest
import torch
from conftest import compose_config

from trainer import kernel_warmup
from trainer.model import hf_config

pytest.importorskip("triton")  # conftest sets TRITON_INTERPRET=1


def test_it_launches_each_kernel_the_spec_names():
    spec = kernel_warmup.Spec(device=0, vocab=300, sampler=True, attention=True, kv_heads=2,
                              group=4, head_dim=16, cache_length=64, logprob=True)  # fmt: skip
    reported: list[str] = []
    done = kernel_warmup.warm(spec, torch.device("cpu"), torch.float32, reported.append)
    assert done == reported == ["sampler", "decode attention", "log-prob"]
    spec.sampler = spec.logprob = False
    assert kernel_warmup.warm(spec, torch.device("cpu"), torch.float32) == ["decode attention"]


def test_the_spec_follows_the_run(monkeypatch):
    """The qwen3_4b preset on a GPU: every kernel, the one-program attention where a rank's 512
    rollout rows fill the GPU, the cache length of the longest prompt plus the new tokens; the
    choices that turn a kernel off turn its compile off."""
    from trainer import decode_attention

    sms = 132
    monkeypatch.setattr(decode_attention, "split_for", lambda n, d: 0 if n >= sms else 128)
    gpu = torch.device("cuda", 3)
    prompts = [[1] * 100, [1] * 130]

    def spec(*overrides: str, dp: int = 1) -> kernel_warmup.Spec:
        cfg = compose_config("model=qwen3_4b", "model.init=random", "rl.prompts_per_step=64",
                             "rl.max_new_tokens=256", *overrides)  # fmt: skip
        return kernel_warmup.spec_for(cfg, hf_config(cfg.model), gpu, dp, prompts)

    s = spec()
    assert (s.device, s.vocab, s.kv_heads, s.group, s.head_dim) == (3, 151_936, 8, 4, 128)
    assert s.sampler and s.attention and s.logprob
    assert s.cache_length == 448  # 130 + 256, rounded up to 64
    assert not spec("rl.sample_kernel=torch").sampler
    assert not spec("rl.logprob_kernel=torch").logprob
    assert not spec("rl.decode_attention=sdpa").attention
    hf = spec("rl.engine=hf")
    assert not (hf.sampler or hf.attention) and hf.logprob
    # 64 x 8 rows over 32 ranks: 16 each, 128 programs: the split kernel, left to the worker
    assert not spec(dp=32).attention
