"""Run under torchrun: the GRPO loss gradient for one fixed batch across (r, s) layouts.

    torchrun --nproc-per-node 4 tests/dist/grpo_parity.py RUN_DIR OUT.json

One global batch of responses (random prompts, responses, advantages, sampling and reference
log-probs) is split over the dp ranks; each rank runs the trainer's own `backward` with
micro-batches of 2 responses, and (r2s2) with micro-batches packed by a token budget of 20. For every layout and loss aggregation it records the largest
difference, in units of assert_close's tolerance, between the full gradient and one
single-process computation of the same loss over the whole batch (no FSDP, no split).
"""

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from launcher import schema
from trainer.grpo import grpo_token_loss, loss_weights
from trainer.metrics import DPSums
from trainer.model import build_model, full_state_dict, hf_config
from trainer.parallel import ParallelState
from trainer.rollout import Rollout
from trainer.grpo import token_logprobs
from trainer.train import GRPOTrainer, collate

RTOL, ATOL = 2e-5, 2e-6
NUM_RESPONSES = 16


def global_batch(vocab: int):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(NUM_RESPONSES)]
    responses = [torch.randint(0, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(NUM_RESPONSES)]
    logps = [-torch.rand(len(r), generator=g) * 3 for r in responses]
    rollout = Rollout(prompts, responses, logps, [False] * NUM_RESPONSES)
    rewards = torch.rand(NUM_RESPONSES, generator=g)
    advantages = torch.randn(NUM_RESPONSES, generator=g)
    batch = collate(rollout, rewards, advantages, pad_id=0, device=torch.device("cpu"))
    batch.ref_logp_NT = -torch.rand(batch.sampling_logp_NT.shape, generator=g) * 3
    return batch


def rows_of(batch, rows: slice):
    sliced = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()}
    return type(batch)(**sliced)


def reference_grads(cfg: schema.Config, batch, init) -> dict[str, torch.Tensor]:
    """The same loss, one process, whole batch, first update (old = current, detached)."""
    rl = cfg.rl
    model = AutoModelForCausalLM.from_config(hf_config(cfg.model), dtype=torch.float32)
    model.load_state_dict(init)
    # the plain way: the whole padded batch with its attention mask, logits sliced to targets
    logits = model(input_ids=batch.input_ids_NL, attention_mask=batch.attention_mask_NL).logits
    logp, entropy = token_logprobs(logits[:, :-1], batch.input_ids_NL[:, 1:], rl.temperature)
    token_loss, _ = grpo_token_loss(logp, logp.detach(), batch.advantages_N, rl.clip_low, rl.clip_high,
                                    ref_logp=batch.ref_logp_NT, kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator,
                                    entropy=entropy, entropy_coef=rl.entropy_coef)
    w = loss_weights(batch.mask_NT, rl.loss_agg, batch.mask_NT.sum().item(), batch.size, rl.max_new_tokens)
    (token_loss * w).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def ratio(a, b) -> float:
    return ((a - b).abs() / (ATOL + RTOL * b.abs())).max().item()


def config(run_dir: str, agg: str, world: int, micro_tokens: int = 0) -> schema.Config:
    return schema.load({
        "parallel": {}, "data": {}, "logger": {"backend": "none"}, "run_dir": run_dir, "device": "cpu",
        "model": {"param_dtype": "fp32"},
        "rl": {"loss_agg": agg, "kl_coef": 0.05, "entropy_coef": 0.01, "micro_batch_responses": 2,
               "micro_batch_tokens": micro_tokens, "max_new_tokens": 8, "prompts_per_step": world,
               "samples_per_prompt": 2},
    })  # fmt: skip


def main(run_dir: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        cfg = config(run_dir, agg, world)
        init = full_state_dict(cfg.model, hf_config(cfg.model), seed=0)
        batch = global_batch(hf_config(cfg.model).vocab_size)
        ref = reference_grads(cfg, batch, init)
        per_rank = NUM_RESPONSES // world
        local = rows_of(batch, slice(rank * per_rank, (rank + 1) * per_rank))
        for r, micro_tokens in ((1, 0), (2, 0), (4, 0), (2, 20)):
            run_cfg = config(run_dir, agg, world, micro_tokens)
            ps = ParallelState.build(torch.device("cpu"), r)
            model = build_model(run_cfg.model, ps.get_mesh("fsdp"), ps.device, seed=0)
            trainer = GRPOTrainer(run_cfg, ps, model)
            old = torch.zeros_like(local.sampling_logp_NT)
            trainer.backward(local, trainer.loss_weights(local), old, first=True, sums=DPSums(ps.device))
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            key = f"{agg}/r{r}s{world // r}" + (f"/tokens{micro_tokens}" if micro_tokens else "")
            results[key] = max(ratio(grads[n], ref[n]) for n in grads)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
