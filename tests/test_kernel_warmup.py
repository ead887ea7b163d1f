"""The child process that compiles the Triton kernels ahead of a worker's first calls
(trainer/kernel_warmup.py): what it compiles for a run, and that its launches match the kernels'
current signatures (in Triton's interpreter on CPU; on a GPU machine,
`TRITON_INTERPRET=0 pytest tests/test_kernel_warmup.py` runs them compiled on the GPU)."""

import os

import pytest
import torch
from conftest import compose_config

from trainer import kernel_warmup
from trainer.model import hf_config

pytest.importorskip("triton")  # conftest sets TRITON_INTERPRET=1
GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")


def test_it_launches_each_kernel_the_spec_names():
    spec = kernel_warmup.Spec(device=0, vocab=300, sampler=True, attention=0, kv_heads=2,
                              group=4, head_dim=16, cache_length=64, logprob=True)  # fmt: skip
    reported: list[str] = []
    done = kernel_warmup.warm(spec, DEVICE, torch.float32, reported.append)
    assert done == reported == ["sampler", "decode attention", "log-prob"]
    spec.matmul = [[3, 48, 64]]
    assert kernel_warmup.warm(spec, DEVICE, torch.float32)[1:3] == [
        "decode attention",
        "decode matmul",
    ]
    spec.sampler = spec.logprob = False
    spec.matmul = []
    assert kernel_warmup.warm(spec, DEVICE, torch.float32) == ["decode attention"]
    spec.attention = None
    assert kernel_warmup.warm(spec, DEVICE, torch.float32) == []


def test_the_spec_follows_the_run(monkeypatch):
    """The qwen3_4b preset on a GPU: every kernel, the one-program attention where a rank's 512
    rollout rows fill the GPU (the split one where a rank's share does not), the cache length of the longest prompt plus the new tokens; the
    choices that turn a kernel off turn its compile off."""
    from trainer import decode_attention

    sms = 132
    monkeypatch.setattr(decode_attention, "split_for", lambda n, d: 0 if n >= sms else 128)
    monkeypatch.setattr(decode_attention, "sm_count", lambda device: sms)
    gpu = torch.device("cuda", 3)
    prompts = [[1] * 100, [1] * 130]

    def spec(*overrides: str, dp: int = 1) -> kernel_warmup.Spec:
        cfg = compose_config("model=qwen3_4b", "model.init=random", "rl.prompts_per_step=64",
                             "rl.max_new_tokens=256", *overrides)  # fmt: skip
        return kernel_warmup.spec_for(cfg, hf_config(cfg.model), gpu, dp, prompts)

    s = spec()
    assert (s.device, s.vocab, s.kv_heads, s.group, s.head_dim) == (3, 151_936, 8, 4, 128)
    assert s.sampler and s.attention == 0 and s.logprob
    assert s.cache_length == 448  # 130 + 256, rounded up to 64
    assert not spec("rl.sample_kernel=torch").sampler
    assert not spec("rl.logprob_kernel=torch").logprob
    assert spec("rl.decode_attention=sdpa").attention is None
    hf = spec("rl.engine=hf")
    assert not hf.sampler and hf.attention is None and hf.logprob
    # 64 x 8 rows over 32 ranks: 16 each, 128 programs: splits of 128 columns and their merge
    assert spec(dp=32).attention == 128
    # the attention's prologue fused, its first tile peeled, where its programs are few per SM:
    # 4096 programs (31 per SM) no; a quarter of the rows, 1024 (7.8 per SM), and 128 yes
    assert not s.attention_peel and not s.attention_fused
    assert spec(dp=4).attention_peel and spec(dp=32).attention_peel
    assert spec(dp=4).attention_fused and spec(dp=32).attention_fused
    monkeypatch.setattr(decode_attention, "PEEL", False)  # a forced setting, as the engine takes it
    monkeypatch.setattr(decode_attention, "FUSE", False)
    assert not spec(dp=32).attention_peel and not spec(dp=32).attention_fused
    monkeypatch.setattr(decode_attention, "PEEL", None)
    monkeypatch.setattr(decode_attention, "FUSE", True)
    assert spec().attention_fused
    # a biased q/k/v projection takes the unfused path whatever FUSE says (the prologue adds none)
    cfg = compose_config("model=qwen3_4b", "model.init=random")
    biased = hf_config(cfg.model)
    biased.attention_bias = True
    assert not kernel_warmup.spec_for(cfg, biased, gpu, 4, prompts).attention_fused
    monkeypatch.setattr(decode_attention, "FUSE", None)
    # the decode matmuls: cuBLAS past 256 rows a call (the preset's 512), else each projection
    assert s.matmul == []
    q_kv, mlp = [[128, 6144, 2560], [128, 2560, 4096]], [[128, 19456, 2560], [128, 2560, 9728]]
    assert spec("rl.decode_matmul=auto", dp=4).matmul == q_kv + mlp
    assert spec("rl.decode_matmul=torch", dp=4).matmul == []
    # rl.rollout_batch caps a call; the calls are of equal size: 128 rows in 8 calls of 16
    # (128 programs), not the cap's 17 (136)
    assert spec("rl.rollout_batch=17", dp=4).attention == 128
    assert spec("rl.rollout_batch=19", dp=4).attention == 0  # 7 calls of 19 rows, 152 programs


def signature(args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a launch for: each tensor's dtype and 16-byte alignment, each int's
    being 1 or a multiple of 16, floats as floats, and the constexprs and launch options as they
    are. Two launches of one signature share one compiled kernel."""

    def one(a):
        if isinstance(a, torch.Tensor):
            return (str(a.dtype), a.data_ptr() % 16 == 0)
        if isinstance(a, int) and not isinstance(a, bool):
            return ("int", a == 1, a % 16 == 0)
        return "float" if isinstance(a, float) else a

    return tuple(map(one, args)), tuple(sorted(kwargs.items()))


def record_launches(monkeypatch) -> dict[str, set]:
    """Every launch of the project's Triton kernels from now on, by kernel, as signatures."""
    from trainer import decode_attention, decode_matmul, logprob_kernel, sample_kernel

    seen: dict[str, set] = {}

    class Recorded:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.setdefault(self.name, set()).add(signature(args, kwargs))
                return self.kernel[grid](*args, **kwargs)

            return launch

    for module, names in ((sample_kernel, ("chunk", "pick")),
                          (decode_attention, ("attention", "merge")),
                          (decode_matmul, ("matmul",)),
                          (logprob_kernel, ("logprob forward", "logprob backward"))):  # fmt: skip
        kernels = module.load()
        monkeypatch.setattr(module, "_kernels", tuple(map(Recorded, names, kernels)))
    return seen


@pytest.mark.parametrize("split, fused", [(0, False), (32, True)])
def test_its_launches_compile_what_the_engine_and_the_update_launch(monkeypatch, split, fused):
    """The point of the child: its launches have the signatures of the worker's own, so the
    kernels it compiles are the ones the worker loads. The engine (Triton sampler and attention:
    one program per row and KV head, unfused, as on a GPU that many rows fill, or splits of 32
    columns of the 64-column cache and their merge, the prologue fused, as where few rows do not)
    and the update's log-probs on a tiny Qwen3, then `warm` for the same shapes: every signature
    the worker launched, the child launched too."""
    from transformers import AutoModelForCausalLM

    from launcher.memory import cache_length
    from trainer import decode_attention, decode_matmul
    from trainer.engine import StaticCacheEngine
    from trainer.rollout import SamplingParams
    from trainer.train import sequence_logprobs

    config = hf_config(compose_config().model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(DEVICE)
    engine = StaticCacheEngine(config, torch.float32, DEVICE, compile=False,
                               attention="triton", sampler="triton", matmul="triton")  # fmt: skip
    engine.model.load_state_dict(model.state_dict())
    monkeypatch.setattr(decode_attention, "split_for", lambda programs, device: split)
    monkeypatch.setattr(decode_attention, "FUSE", fused)
    worker = record_launches(monkeypatch)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=3, eos_token_id=258,
                            pad_token_id=256)  # fmt: skip
    engine.generate(prompts, params)
    ids = torch.randint(
        0, 256, (2, 8), device=DEVICE
    )  # 16 tokens: the (3, tokens) output's rows all aligned
    batch = type("Batch", (), {"input_ids_NL": ids})()
    logp, entropy = sequence_logprobs(model, batch, 0.7, kernel=True)
    (logp.sum() + entropy.sum()).backward()
    kernels = {"chunk", "pick", "attention", "matmul", "logprob forward", "logprob backward"}
    assert set(worker) == kernels | ({"merge"} if split else set())

    child = record_launches(monkeypatch)
    spec = kernel_warmup.Spec(
        device=0, vocab=config.vocab_size, sampler=True, attention=split,
        kv_heads=config.num_key_value_heads,
        group=config.num_attention_heads // config.num_key_value_heads, head_dim=config.head_dim,
        cache_length=cache_length(max(map(len, prompts)), params.max_new_tokens), logprob=True,
        matmul=[[len(prompts), n, k] for n, k in decode_matmul.projections(config)],
        eps=config.rms_norm_eps,
        attention_peel=decode_attention.settings(len(prompts) * config.num_key_value_heads, DEVICE)[1],
        attention_fused=fused,
    )  # fmt: skip
    kernel_warmup.warm(spec, DEVICE, torch.float32, report=lambda name: None)
    for kernel, launched in worker.items():
        assert launched <= child.get(kernel, set()), kernel
