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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.paths import is_hub_id
from launcher.schema import Config, DataConfig
from trainer.errors import RunError


@dataclass(frozen=True)
class Prompt:
    text: str  # exactly what the model is conditioned on (chat template applied if asked)
    answer: str  # what the reward functions compare against


def synthetic_digits(d: DataConfig, seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("0123456789") for _ in range(d.num_digits)) for _ in range(count)]


def synthetic_prompts(d: DataConfig, seed: int) -> list[Prompt]:
    return [Prompt(f"{x}=", x) for x in synthetic_digits(d, seed, d.num_examples)]


def synthetic_eval_prompts(d: DataConfig, seed: int, count: int) -> list[Prompt]:
    """`count` distinct prompts that the training set (`synthetic_prompts`) never holds."""
    train = set(synthetic_digits(d, seed, d.num_examples))
    if 10**d.num_digits - len(train) < count:
        raise RunError(
            f"trainer.eval_prompts={count}: data=synthetic with data.num_digits={d.num_digits} has "
            f"only {10**d.num_digits - len(train)} prompts outside its {d.num_examples} training "
            "examples; raise data.num_digits or lower trainer.eval_prompts / data.num_examples"
        )
    rng, out, seen = random.Random(mixed_seed(seed, -1)), list[Prompt](), set(train)
    while len(out) < count:
        x = "".join(rng.choice("0123456789") for _ in range(d.num_digits))
        if x not in seen:
            seen.add(x)
            out.append(Prompt(f"{x}=", x))
    return out


def load_rows(path: str, hub_config: str | None, split: str):
    import datasets

    if is_hub_id(path):
        return datasets.load_dataset(path, hub_config, split=split)
    local = Path(path).expanduser()
    kind = "parquet" if local.suffix == ".parquet" or local.is_dir() else "json"
    files = [str(p) for p in sorted(local.glob("*.parquet"))] if local.is_dir() else str(local)
    return datasets.load_dataset(kind, data_files=files, split="train")


def dataset_prompts(d: DataConfig, tokenizer, evaluation: bool = False) -> list[Prompt]:
    """The prompts of data.path's data.split, or for evaluation data.eval_path's (data.path's
    when null) data.eval_split."""
    path = (d.eval_path or d.path) if evaluation else d.path
    assert path, "data.path is required for data=gsm8k (validated)"
    rows = load_rows(path, d.hub_config, d.eval_split if evaluation else d.split)
    missing = {d.question_key, d.answer_key} - set(rows.column_names)
    if missing:
        raise RunError(
            f"{'data.eval_path' if evaluation else 'data.path'}={path!r} has no column(s) "
            f"{sorted(missing)}; it has {rows.column_names} (set data.question_key / data.answer_key)"
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
        split = d.eval_split if evaluation else d.split
        raise RunError(f"{path!r} split {split!r} has no rows; check data.split / data.eval_split")
    return out


def load_prompts(d: DataConfig, tokenizer, seed: int) -> list[Prompt]:
    return synthetic_prompts(d, seed) if d.name == "synthetic" else dataset_prompts(d, tokenizer)


def load_eval_prompts(cfg: Config, tokenizer) -> list[Prompt]:
    """trainer.eval_prompts held-out prompts (the first ones of the held-out set, the same on
    every rank and at every evaluation)."""
    d, count = cfg.data, cfg.trainer.eval_prompts
    if d.name == "synthetic":
        return synthetic_eval_prompts(d, cfg.trainer.seed, count)
    return dataset_prompts(d, tokenizer, evaluation=True)[:count]


@dataclass
class Task:
    """The tokenizer, the prompts and their token ids (tokenized once, not every step);
    with trainer.eval_every, the held-out prompts too."""

    tokenizer: Any  # a transformers tokenizer
    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    eval_prompts: list[Prompt] = field(default_factory=list)
    eval_prompt_ids: list[list[int]] = field(default_factory=list)


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
    evals = load_eval_prompts(cfg, tokenizer) if cfg.trainer.eval_every > 0 else []
    if download and local_rank == 0:
        dist.barrier()
    ids = tokenizer([p.text for p in prompts + evals], add_special_tokens=False).input_ids
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    need = len(ids[longest]) + cfg.rl.max_new_tokens
    if need > max_positions:  # the same prompts on every rank: every rank raises alike
        raise RunError(
            f"rl.max_new_tokens={cfg.rl.max_new_tokens}: the longest prompt (#{longest}, "
            f"{len(ids[longest])} tokens) plus rl.max_new_tokens is {need} positions, beyond the "
            f"model's max_position_embeddings={max_positions}; lower rl.max_new_tokens to at most "
            f"{max_positions - len(ids[longest])} or shorten the prompts"
        )
    plan = cfg.data.plan_prompt_tokens
    if cfg.data.name != "synthetic" and len(ids[longest]) > plan and local_rank == 0:
        print(f"warning: the longest prompt has {len(ids[longest])} tokens, more than "
              f"data.plan_prompt_tokens={plan} that the memory plan assumed; set "
              f"data.plan_prompt_tokens={len(ids[longest])} when planning this data", flush=True)  # fmt: skip
    return Task(tokenizer, prompts, ids[: len(prompts)], evals, ids[len(prompts) :])


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

    def global_indices(self, step: int, sample_round: int = 0) -> list[int]:
        """The step's prompts; for a later round of dynamic sampling (`sample_round` > 0), more:
        a permutation seeded by (seed, step, round) without the step's earlier rounds' prompts
        (repeats only when the data has too few). Extra rounds leave the epoch's order alone, so
        the prompts of every step stay a function of (seed, step) and resume stays exact."""
        if sample_round == 0:
            epoch, k = divmod(step, self.steps_per_epoch)
            start = k * self.prompts_per_step
            return self.permutation(epoch)[start : start + self.prompts_per_step]
        used = {i for r in range(sample_round) for i in self.global_indices(step, r)}
        order = list(range(self.num_prompts))
        random.Random(mixed_seed(self.seed, step, sample_round)).shuffle(order)
        fresh = [i for i in order if i not in used] + [i for i in order if i in used]
        return fresh[: self.prompts_per_step]

    def indices(self, step: int, sample_round: int = 0) -> list[int]:
        per_rank = self.prompts_per_step // self.dp_size
        lo = self.dp_rank * per_rank
        return self.global_indices(step, sample_round)[lo : lo + per_rank]
