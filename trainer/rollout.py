"""Rollout engines: sample responses for this rank's prompts from an inference copy of the policy.

An engine holds its own unsharded weights in the compute dtype (bf16 on GPUs) and is
refreshed from the FSDP shards after every update, one FSDP unit (decoder layer, then the
root) at a time: the unit is all-gathered in its compute dtype, copied, and resharded, so
no full fp32 copy of the model ever exists. `RolloutEngine` is the interface the trainer
uses; `HFRolloutEngine` is the simple colocated one (transformers `generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, GenerationConfig

from trainer.model import CausalLM, fsdp_units


@dataclass
class SamplingParams:
    temperature: float
    top_p: float
    max_new_tokens: int
    eos_token_id: int
    pad_token_id: int
    top_k: int = 0  # 0: off


@dataclass
class Rollout:
    """Responses for a list of prompts, one row per response (prompt i's samples adjacent)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]  # sampled tokens, ending with EOS unless truncated
    # log p(token) under the distribution it was drawn from: softmax(logits / temperature), cut
    # to rl.top_k / rl.top_p and renormalised (the full one when neither is set)
    sampling_logprobs: list[torch.Tensor]
    truncated: list[bool]

    def __add__(self, other: Rollout) -> Rollout:
        return Rollout(self.prompt_ids + other.prompt_ids, self.response_ids + other.response_ids,
                       self.sampling_logprobs + other.sampling_logprobs,
                       self.truncated + other.truncated)  # fmt: skip

    def select(self, rows: list[int]) -> Rollout:
        return Rollout([self.prompt_ids[i] for i in rows], [self.response_ids[i] for i in rows],
                       [self.sampling_logprobs[i] for i in rows], [self.truncated[i] for i in rows])  # fmt: skip


def trim_at_eos(
    rows: list[list[int]], tokens_NT: torch.Tensor, logp_NT: torch.Tensor, eos: int
) -> Rollout:
    """Cut each sampled row after its first EOS (kept); rows without one are truncated."""
    responses, logprobs, truncated = [], [], []
    for i, tokens in enumerate(tokens_NT.tolist()):
        end = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        responses.append(tokens[:end])
        logprobs.append(logp_NT[i, :end])
        truncated.append(eos not in tokens[:end])
    return Rollout(rows, responses, logprobs, truncated)


class RolloutEngine(Protocol):
    def load_weights(self, policy: CausalLM) -> None: ...

    def rows_per_call(self) -> int | None: ...

    def free_cache(self) -> None:
        """Give back memory the engine keeps between calls (the next `generate` takes it again)."""
        ...

    def generate(
        self, rows: list[list[int]], params: SamplingParams, greedy: list[bool] | None = None
    ) -> Rollout:
        """One response per row (a prompt's token ids); rows marked in `greedy` take the argmax."""
        ...


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to a common width W, so every row's next token is column W:
    (ids_BW, valid_BW), valid marking the real tokens."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, p in enumerate(rows):
        ids[i, width - len(p) :] = torch.tensor(p)
        valid[i, width - len(p) :] = True
    return ids, valid


def inference_copy(
    config, dtype: torch.dtype, device: torch.device, attn: str = "sdpa"
) -> CausalLM:
    """An unsharded Qwen3 in the compute dtype, for sampling only (no grads)."""
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def copy_sharded_weights(policy: CausalLM, target: CausalLM) -> None:
    """Copy the sharded policy's weights into the unsharded `target`, one FSDP unit at a time
    (`trainer.model.fsdp_units`: the units `shard_model` made); every target parameter must be
    written, or the engine would sample from stale weights."""
    target_params = dict(target.named_parameters())
    prefix = {id(unit): name for name, unit in policy.named_modules()}
    written = set()
    for unit in fsdp_units(policy):
        unit.unshard()
        base = prefix[id(unit)]
        for name, param in unit.named_parameters():
            if isinstance(param, DTensor):  # belongs to an inner unit, still sharded
                continue
            full_name = f"{base}.{name}" if base else name
            target_params[full_name].copy_(param)
            written.add(full_name)
        unit.reshard()
    missing = sorted(set(target_params) - written)
    assert not missing, f"the weight refresh did not write {missing}"


class HFRolloutEngine:
    """A plain transformers copy of the policy, sampled with `generate` (left-padded batch)."""

    def __init__(
        self, config, dtype: torch.dtype, device: torch.device, attn_implementation: str = "sdpa"
    ):
        self.model = inference_copy(config, dtype, device, attn_implementation)
        self.device = device

    def load_weights(self, policy: CausalLM) -> None:
        copy_sharded_weights(policy, self.model)

    def rows_per_call(self) -> int | None:
        return None  # any batch: generate keeps no buffers

    def free_cache(self) -> None:
        pass  # generate's cache lives only inside the call

    @torch.no_grad()
    def generate(
        self, rows: list[list[int]], params: SamplingParams, greedy: list[bool] | None = None
    ) -> Rollout:
        flags = greedy or [False] * len(rows)
        out = Rollout([], [], [], [])
        order: list[int] = []  # the row each of out's rows answers
        for g in (False, True):  # `generate` samples or decodes greedily for a whole batch
            idx = [i for i, f in enumerate(flags) if f == g]
            if idx:
                out = out + self._generate([rows[i] for i in idx], params, greedy=g)
                order += idx
        position = {row: k for k, row in enumerate(order)}
        return out.select([position[i] for i in range(len(rows))])

    def _generate(self, rows: list[list[int]], params: SamplingParams, greedy: bool) -> Rollout:
        input_ids, valid = left_pad(rows, params.pad_token_id)
        width = input_ids.shape[1]
        sampling = {"do_sample": False} if greedy else {
            "do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k}  # fmt: skip
        generation = GenerationConfig(
            **sampling,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=params.eos_token_id,
            pad_token_id=params.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=valid.long().to(self.device),
            generation_config=generation,
        )
        new_NT = out.sequences[:, width:]
        # out.scores: one (N, V) tensor per step, the logits after the processors generate applied
        # (/ temperature, -inf outside top-k and top-p): their log-softmax is the distribution
        # the token was drawn from. One step at a time, so no (N, T, V) fp32 tensor is made.
        logp_NT = torch.stack(
            [
                F.log_softmax(step_NV.float(), dim=-1).gather(-1, new_NT[:, t, None]).squeeze(-1)
                for t, step_NV in enumerate(out.scores)
            ],
            dim=1,
        ).cpu()
        return trim_at_eos(rows, new_NT.cpu(), logp_NT, params.eos_token_id)
