"""Run under torchrun: a saved tiny Qwen3 loads through from_pretrained, shards, and gathers back.

    torchrun --nproc-per-node 4 tests/dist/load_pretrained.py MODEL_DIR OUT.json

Records, per layout: whether every gathered parameter equals the saved tensor (read here
straight from model.safetensors), whether the embeddings stayed tied, and whether the
rollout engine's copy (refreshed from the shards one FSDP unit at a time) equals it too.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from launcher.schema import ModelConfig
from trainer.model import build_model, hf_config, load_tokenizer
from trainer.parallel import ParallelState, exit_process, shutdown
from trainer.rollout import HFRolloutEngine


def main(model_dir: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    saved = load_file(str(Path(model_dir) / "model.safetensors"))
    m = ModelConfig(path=model_dir, init="pretrained", param_dtype="fp32")
    results = {"tokenizer_vocab": len(load_tokenizer(m))}
    for r in (1, 2):
        ps = ParallelState.build(torch.device("cpu"), r)
        model = build_model(m, ps.get_mesh("fsdp"), ps.device, seed=0)
        gathered = {n: p.full_tensor() for n, p in model.named_parameters()}
        engine = HFRolloutEngine(hf_config(m), torch.float32, ps.device)
        engine.load_weights(model)
        engine_params = dict(engine.model.named_parameters())
        results[f"r{r}"] = {
            "equal_to_saved": all(torch.equal(gathered[n], saved[n]) for n in saved),
            "saved_keys_covered": sorted(saved) == sorted(k for k in gathered if k in saved),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "engine_equal": all(torch.equal(engine_params[n], gathered[n]) for n in engine_params),
        }
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    shutdown()
    exit_process(0)  # no interpreter finalization: see trainer/parallel.py
