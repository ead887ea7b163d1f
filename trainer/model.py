"""Load Qwen3 through transformers and shard it with FSDP2 on the `fsdp` mesh.

Every rank builds the model on the meta device (no memory), applies `fully_shard` to each
decoder layer and then the root, and allocates only its shards. Rank 0 alone materialises
the full state dict (`from_pretrained`, or a seeded random init from the config) and
`set_model_state_dict(..., broadcast_from_rank0=True)` scatters it into the shards, tied
embeddings included. Master weights stay fp32; compute runs in `param_dtype`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    Qwen3Config,
)

from launcher.counting import count_params
from launcher.paths import local_model_dir
from launcher.schema import ModelConfig

SHIPPED_TOKENIZER = Path(__file__).parent / "assets" / "tokenizer"
# A transformers causal LM (or one of its modules), FSDP-wrapped or not. transformers builds its
# attributes at run time (`model.model.layers`, `config.head_dim`), which a type checker cannot
# follow through `nn.Module`; this alias says what is meant and lets it through.
CausalLM = Any
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def model_path(m: ModelConfig) -> str:
    """model.path, which validation requires whenever it is read."""
    assert m.path, "model.path is not set"
    return m.path


def hf_config(m: ModelConfig) -> PretrainedConfig:
    """model.path's config when pretrained or present on this machine, else `model.arch`."""
    if m.init == "pretrained" or local_model_dir(m.path) is not None:
        return AutoConfig.from_pretrained(model_path(m), trust_remote_code=m.trust_remote_code)
    a = m.arch
    return Qwen3Config(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads,
        head_dim=a.head_dim,
        tie_word_embeddings=a.tie_word_embeddings,
        rope_theta=a.rope_theta,  # type: ignore[call-arg]  # transformers 5 takes it in **kwargs
        max_position_embeddings=a.max_position_embeddings,
        rms_norm_eps=a.rms_norm_eps,
    )


def load_tokenizer(m: ModelConfig):
    """model.tokenizer_path, else model.path's tokenizer when it is here, else the shipped one."""
    path: str | Path | None = m.tokenizer_path
    if path is None:
        path = (
            m.path
            if local_model_dir(m.path) is not None or m.init == "pretrained"
            else SHIPPED_TOKENIZER
        )
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=m.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def compute_dtype(m: ModelConfig, device_type: str) -> torch.dtype:
    if m.param_dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return DTYPES[m.param_dtype]


def export_dtype(m: ModelConfig, export: str, device_type: str) -> torch.dtype:
    """`trainer.export_dtype`: auto is the pretrained checkpoint's own dtype (config.json), else
    the compute dtype, so a bf16 Qwen3-4B exports as 8 GB of bf16, not 16 GB of fp32 masters."""
    if export != "auto":
        return DTYPES[export]
    if m.init == "pretrained":
        saved = hf_config(m).dtype
        saved = getattr(torch, saved) if isinstance(saved, str) else saved
        if saved in (torch.bfloat16, torch.float16, torch.float32):
            return saved
    return compute_dtype(m, device_type)


def mp_policy(m: ModelConfig, device_type: str) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=compute_dtype(m, device_type), reduce_dtype=DTYPES[m.reduce_dtype]
    )


def decoder_layers(model: CausalLM) -> list[CausalLM]:
    return list(model.model.layers)


def fsdp_units(model: CausalLM) -> list[CausalLM]:
    """The FSDP units of the causal LM, innermost first: each decoder layer, then the root
    (embeddings, final norm, lm_head). `shard_model` shards exactly these; the rollout engine's
    weight refresh gathers exactly these."""
    return [*decoder_layers(model), model]


def checkpointed(layer: CausalLM) -> None:
    """Recompute `layer`'s activations in backward: only its inputs are kept.

    The checkpoint wraps the layer's `forward`, inside the module call where FSDP's hooks
    run, as torchtitan's wrapper does: FSDP's pre-backward all-gather happens before the
    recompute needs the weights. Names of parameters do not change.
    """
    forward = layer.forward

    def forward_checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = forward_checkpointed


def apply_options(model: CausalLM, m: ModelConfig) -> None:
    """`model.activation_checkpointing` and `model.compile` per decoder layer, before sharding.

    `Module.compile` compiles each layer's call in place (names unchanged; dynamo leaves
    FSDP's hooks out of the graph). Rows and widths vary per micro-batch: they are marked dynamic
    before the first call (`rows_and_width_dynamic`), so the layer compiles once for every
    shape, where dynamo alone compiles it for the first shape, again when the rows change and
    again when the width does (H100 machine, 2026-12-06, micro-batches of 21x384, 20x384, 17x300
    and 24x341 tokens: 4 compiles, their first calls 57 s together; marked, 2 compiles and 27 s,
    docs/benchmarks.md). The second graph is
    Inductor's: it guards rows x width >= 5120 (a fusion choice), so micro-batches under 5,120
    tokens get a graph of their own. Not `dynamic=True`: that also makes the config's ints
    symbolic, and its one compile took 3x longer than the two together on the H200.
    """
    for layer in decoder_layers(model):
        if m.activation_checkpointing:
            checkpointed(layer)
        if m.compile:
            layer.compile()
            # after FSDP's pre-forward hook (prepended), which hands forward views of the inputs
            layer.register_forward_pre_hook(rows_and_width_dynamic, with_kwargs=True)


@torch.compiler.disable
def rows_and_width_dynamic(module, args: tuple, kwargs: dict) -> None:
    """Mark the dims that vary between micro-batches dynamic before a compiled layer runs: the
    hidden states' rows and width, and every dim of the other tensor arguments (position ids,
    RoPE's cos and sin) of one of those sizes, on the tensors and the bases they view. The first
    micro-batch then compiles the layer once for every shape, where dynamo would compile it for
    that shape and again, dynamic, at the next one."""
    import torch._dynamo

    sizes = {n for n in args[0].shape[:2] if n > 1}
    todo = [*args, *kwargs.values()]
    while todo:
        t = todo.pop()
        if isinstance(t, (tuple, list)):
            todo += t
        elif isinstance(t, torch.Tensor):
            for d, n in enumerate(t.shape):
                if n in sizes:
                    torch._dynamo.maybe_mark_dynamic(t, d)
            if t._base is not None:  # dynamo guards a view through its base's sizes too
                todo.append(t._base)


def shard_model(
    model: CausalLM, mesh, mp: MixedPrecisionPolicy, reshard_after_forward: bool = True
) -> CausalLM:
    """`fully_shard` each unit of `fsdp_units`: decoder layers (`model.reshard_after_forward`),
    then the root, which holds embeddings, final norm and (tied) lm_head; backward needs them
    first, so keeping them gathered after forward saves one all-gather per step."""
    *layers, root = fsdp_units(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def full_state_dict(
    m: ModelConfig, config: PretrainedConfig, seed: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """The whole fp32 state dict: pretrained weights, or a seeded random init.

    Made on `device` when it is a GPU with room for two fp32 copies of the model (the init then
    takes seconds, not a minute of CPU time, and no fp32 copy passes through host memory), else
    on CPU. A random init draws from that device's generator: the same seed gives the same
    weights on every layout of one device type (not between CPU and GPU)."""
    where = torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        where = device if free > 2 * 4 * count_params(config).total else where
    if m.init == "pretrained":
        # transformers places weights at load time through `accelerate` (device_map): without it,
        # or for CPU, the plain load
        onto = where.type == "cuda" and importlib.util.find_spec("accelerate") is not None
        model = AutoModelForCausalLM.from_pretrained(
            model_path(m), dtype=torch.float32, trust_remote_code=m.trust_remote_code,
            **({"device_map": str(where)} if onto else {}),
        )  # fmt: skip
    else:
        torch.manual_seed(seed)
        with where:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.state_dict()


def reset_rotary_buffers(model: CausalLM, device: torch.device) -> None:
    """Non-persistent buffers (RoPE inverse frequencies) are not in the state dict: rebuild them."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            fresh = type(module)(config=model.config)
            for buf_name, buf in fresh.named_buffers(recurse=False):
                getattr(module, buf_name).data = buf.to(device)


def build_model(
    m: ModelConfig, mesh, device: torch.device, seed: int, requires_grad: bool = True
) -> CausalLM:
    """A Qwen3 causal LM sharded with FSDP2 on `mesh`, weights broadcast from rank 0."""
    config = hf_config(m)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=m.attn_implementation
        )
    apply_options(model, m)
    shard_model(model, mesh, mp_policy(m, device.type), m.reshard_after_forward)
    model.to_empty(device=device)
    reset_rotary_buffers(model, device)
    state: dict[str, Any] = full_state_dict(m, config, seed, device) if dist.get_rank() == 0 else {}
    set_model_state_dict(
        model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    del state
    if config.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight is model.model.embed_tokens.weight, "tied embeddings came apart"
    model.requires_grad_(requires_grad)
    return model
