"""Run under torchrun on 4 ranks: dynamic sampling and evaluation where ranks differ on purpose.

    torchrun --nproc-per-node 4 tests/dist/variants.py RUN_DIR OUT.json

Dynamic sampling: the rewards of each (rank, round) are scripted so that one rank never finds a
group with signal, one always does, one only in its second round; the rounds, the fair cut and
the update must be decided over all ranks alike (a rank with nothing to train on still takes
part). Evaluation: a scripted engine answers the held-out prompts right or wrong by a rule the
test recomputes by hand; 3 prompts over 4 ranks leave one rank with none.
"""

import json
import sys

import torch
import torch.distributed as dist

from launcher import schema
from trainer.grpo import pass_at_k
from trainer.model import build_model
from trainer.parallel import ParallelState, exit_process, shutdown
from trainer.rewards import digit_echo
from trainer.rollout import Rollout
from trainer.train import GRPOTrainer

G = 2  # samples per prompt

# (rank, round) -> does the rank's one group this round have reward spread?
SPREAD = {
    "two_rounds": {0: [False, False, False], 1: [True, True, True], 2: [False, True, False],
                   3: [True, True, True]},
    "cap_hit": {0: [False] * 3, 1: [False, True, False], 2: [False] * 3, 3: [False] * 3},
    "none": {r: [False] * 3 for r in range(4)},
}  # fmt: skip


def scripted_sample_groups(trainer: GRPOTrainer, script: dict[int, list[bool]]):
    rank = dist.get_rank()

    def sample_groups(step: int, sample_round: int):
        (i,) = trainer.sampler.indices(step - 1, sample_round)  # one prompt per rank
        length = 2 + 3 * rank + sample_round  # uneven lengths across ranks and rounds
        # two different responses: equal ones with advantages +a and -a would cancel exactly
        responses = [[7 + (t + j) % 5 for t in range(length)] for j in range(G)]
        rollout = Rollout([trainer.prompt_ids[i]] * G, responses,
                          [torch.full((length,), -1.0)] * G, [False] * G)  # fmt: skip
        rewards = torch.tensor([1.0, 0.0] if script[rank][sample_round] else [0.5, 0.5])
        return rollout, rewards, rewards.clone()

    return sample_groups


class ScriptedEngine:
    """Right or wrong by rule: for the eval prompt with answer x, the greedy response is right
    when int(x) is even, and the first int(x) % (k + 1) of its samples are right."""

    def __init__(self, tokenizer, k: int, rows_per_call: int):
        self.tokenizer, self.k, self.size, self.seen = tokenizer, k, rows_per_call, {}
        self.calls: list[int] = []

    def rows_per_call(self) -> int:
        return self.size

    def load_weights(self, model) -> None:
        pass

    def generate(self, rows, params, greedy=None):
        assert greedy is not None and len(rows) == self.size  # whole engine batches, padded
        self.calls.append(len(rows))
        out = []
        for row, g in zip(rows, greedy):
            answer = self.tokenizer.decode(row).rstrip("=")
            if g:
                right = int(answer) % 2 == 0
            else:
                self.seen[answer] = self.seen.get(answer, 0) + 1
                right = self.seen[answer] <= int(answer) % (self.k + 1)
            text = answer if right else "no"
            out.append(self.tokenizer(text, add_special_tokens=False).input_ids)
        return Rollout([list(r) for r in rows], out, [torch.zeros(len(o)) for o in out],
                       [False] * len(rows))  # fmt: skip


def expected_eval(trainer: GRPOTrainer, k: int) -> dict[str, float]:
    tok = trainer.tokenizer
    p1 = pk = reward = length = 0.0
    for prompt in trainer.eval_prompts:
        x = int(prompt.answer)
        c = x % (k + 1)
        p1 += float(x % 2 == 0)
        pk += pass_at_k(k, c, k)
        reward += c * 1.0 + (k - c) * digit_echo("no", prompt.answer)
        right_len = len(tok(prompt.answer, add_special_tokens=False).input_ids)
        length += c * right_len + (k - c) * len(tok("no", add_special_tokens=False).input_ids)
    n = len(trainer.eval_prompts)
    return {"eval/pass@1": p1 / n, "eval/pass@k": pk / n, "eval/reward_mean": reward / (n * k),
            "eval/response_len_mean": length / (n * k)}  # fmt: skip


def main(run_dir: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    k = 3
    cfg = schema.load({
        "parallel": {}, "data": {}, "logger": {"backend": "none"}, "run_dir": run_dir,
        "device": "cpu", "model": {},
        "rl": {"prompts_per_step": 4, "samples_per_prompt": G, "dynamic_sampling": True,
               "max_sample_rounds": 3, "micro_batch_responses": 1},
        "trainer": {"eval_every": 1, "eval_prompts": 3, "eval_k": k, "max_steps": 1},
    })  # fmt: skip
    ps = ParallelState.build(torch.device("cpu"), 2)  # r2s2: dp over all 4 ranks
    model = build_model(cfg.model, ps.get_mesh("fsdp"), ps.device, seed=0)
    trainer = GRPOTrainer(cfg, ps, model)
    result: dict = {"rank": dist.get_rank()}
    for name, script in SPREAD.items():
        trainer.sample_groups = scripted_sample_groups(trainer, script)
        before = [p.to_local().clone() for p in model.parameters()]
        metrics = trainer.step(1)
        changed = any(not torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
        result[name] = {"metrics": {k: v for k, v in metrics.items() if not k.startswith("time/")},
                        "changed": changed}  # fmt: skip
    engine = ScriptedEngine(trainer.tokenizer, k, rows_per_call=5)
    trainer.engine = engine
    result["eval"] = trainer.evaluate(1)
    result["eval_expected"] = expected_eval(trainer, k)
    result["eval_calls"] = engine.calls
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(everyone, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    shutdown()
    exit_process(0)  # no interpreter finalization: see trainer/parallel.py
