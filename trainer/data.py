"""Prompts: the shipped synthetic task or GSM8K-style rows through `datasets`, and their order.

The synthetic task ("digit echo"): the prompt is N random digits and `=`, e.g. `7203=`, and
the answer is the same digits, `7203`. It is learnable from a random init with GRPO on a
CPU in minutes because its reward (`trainer.rewards.digit_echo`) is dense: half of it pays
for emitting digits at all, a unigram preference a two-layer model picks up in a few
updates from the variance across a group; the other half pays for the right digit in each
place, a fixed-offset copy that attention over the prompt can learn next.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.paths import is_hub_id
from launcher.schema import Config, DataConfig
from trainer.errors import RunError


@dataclass(frozen=True)
class Prompt:
    text: str  # exactly what the model is conditioned on (chat template applied if asked)
    answer: str  # what the reward functions compare against


def synthetic_prompts(d: DataConfig, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for _ in range(d.num_examples):
        digits = "".join(rng.choice("0123456789") for _ in range(d.num_digits))
        out.append(Prompt(text=f"{digits}=", answer=digits))
    return out


def load_rows(d: DataConfig):
    import datasets

    assert d.path, "data.path is required for data=gsm8k (validated)"
    if is_hub_id(d.path):
        return datasets.load_dataset(d.path, d.hub_config, split=d.split)
    path = Path(d.path).expanduser()
    kind = "parquet" if path.suffix == ".parquet" or path.is_dir() else "json"
    files = [str(p) for p in sorted(path.glob("*.parquet"))] if path.is_dir() else str(path)
    return datasets.load_dataset(kind, data_files=files, split="train")


def dataset_prompts(d: DataConfig, tokenizer) -> list[Prompt]:
    rows = load_rows(d)
    missing = {d.question_key, d.answer_key} - set(rows.column_names)
    if missing:
        raise RunError(
            f"data.path={d.path!r} has no column(s) {sorted(missing)}; it has {rows.column_names} "
            "(set data.question_key / data.answer_key)"
        )
    out = []
    for row in rows:
        question = str(row[d.question_key]) + d.prompt_suffix
        if d.chat_template:
            messages = [{"role": "system", "content": d.system_prompt}] if d.system_prompt else []
            messages.append({"role": "user", "content": question})
            question = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        out.append(Prompt(text=question, answer=str(row[d.answer_key])))
    if not out:
        raise RunError(f"data.path={d.path!r} split {d.split!r} has no rows; check data.split")
    return out


def load_prompts(d: DataConfig, tokenizer, seed: int) -> list[Prompt]:
    return synthetic_prompts(d, seed) if d.name == "synthetic" else dataset_prompts(d, tokenizer)


@dataclass
class Task:
    """The tokenizer, the prompts and their token ids (tokenized once, not every step)."""

    tokenizer: Any  # a transformers tokenizer
    prompts: list[Prompt]
    prompt_ids: list[list[int]]


def load_task(cfg: Config, local_rank: int, max_positions: int) -> Task:
    """Collective: tokenizer and prompts on every rank, checked against the model's context.

    A hub dataset is downloaded once per node: local rank 0 first, the others wait at a barrier
    and then read the cache it filled. Every rank holds every prompt (they are small); each step
    takes its own share (`PromptSampler`)."""
    import torch.distributed as dist

    from trainer.model import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    download = cfg.data.name != "synthetic" and is_hub_id(cfg.data.path)
    if download and local_rank != 0:
        dist.barrier()
    prompts = load_prompts(cfg.data, tokenizer, cfg.trainer.seed)
    if download and local_rank == 0:
        dist.barrier()
    ids = tokenizer([p.text for p in prompts], add_special_tokens=False).input_ids
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    need = len(ids[longest]) + cfg.rl.max_new_tokens
    if need > max_positions:  # the same prompts on every rank: every rank raises alike
        raise RunError(
            f"rl.max_new_tokens={cfg.rl.max_new_tokens}: the longest prompt (#{longest}, "
            f"{len(ids[longest])} tokens) plus rl.max_new_tokens is {need} positions, beyond the "
            f"model's max_position_embeddings={max_positions}; lower rl.max_new_tokens to at most "
            f"{max_positions - len(ids[longest])} or shorten the prompts"
        )
    return Task(tokenizer, prompts, ids)


def mixed_seed(seed: int, *parts: int) -> int:
    """One integer seed from the run's seed and coordinates (epoch; or step and dp rank), so that
    every stream of randomness is a function of them alone (exact resume, any layout)."""
    out = seed
    for part in parts:
        out = out * 1_000_003 + part
    return out


class PromptSampler:
    """Which prompts each data-parallel rank takes at each step.

    Epoch e is a permutation of all prompts seeded by (seed, e), cut into steps of
    `prompts_per_step` (the few left over are dropped, different ones each epoch). Step t
    takes one such slice and dp rank i the i-th contiguous part of it: every one of the R*S
    ranks gets distinct prompts, and the union over ranks is the same whatever R and S are.
    """

    def __init__(
        self, num_prompts: int, prompts_per_step: int, dp_rank: int, dp_size: int, seed: int
    ):
        if num_prompts < prompts_per_step:
            raise ValueError(
                f"{num_prompts} prompts cannot fill one step of rl.prompts_per_step={prompts_per_step}"
            )
        self.num_prompts, self.prompts_per_step = num_prompts, prompts_per_step
        self.steps_per_epoch = num_prompts // prompts_per_step
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self._perm: tuple[int, list[int]] | None = None

    def permutation(self, epoch: int) -> list[int]:
        if self._perm is None or self._perm[0] != epoch:  # steps move forward: keep one epoch
            order = list(range(self.num_prompts))
            random.Random(mixed_seed(self.seed, epoch)).shuffle(order)
            self._perm = (epoch, order)
        return self._perm[1]

    def global_indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        start = k * self.prompts_per_step
        return self.permutation(epoch)[start : start + self.prompts_per_step]

    def indices(self, step: int) -> list[int]:
        per_rank = self.prompts_per_step // self.dp_size
        return self.global_indices(step)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
