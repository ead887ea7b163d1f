"""Export a checkpoint to Hugging Face format (safetensors, config, tokenizer), on one CPU process.

    python scripts/export_hf.py RUN_DIR/checkpoints/step_000010 OUT_DIR
    python scripts/export_hf.py RUN_DIR OUT_DIR          # the run's latest good checkpoint

The checkpoint may have been written under any layout: DCP reassembles the full tensors. The
weights are written in the run's `trainer.export_dtype` (auto: the pretrained dtype, else the
compute dtype of the run's device).
The result loads with `AutoModelForCausalLM.from_pretrained(OUT_DIR)`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from launcher import schema  # noqa: E402
from launcher.run_folder import find_resumable, verify  # noqa: E402
from trainer.checkpoint import save_hf  # noqa: E402
from trainer.model import export_dtype, hf_config, load_tokenizer  # noqa: E402


def export(source: Path, out_dir: Path) -> Path:
    folder = source if (source / "meta.json").exists() else find_resumable(source)[0]
    if folder is None:
        raise SystemExit(f"error: {source} holds no checkpoint")
    verify(folder)
    run_dir = folder.parents[1]
    cfg = schema.load(run_dir / "config.yaml")
    model = AutoModelForCausalLM.from_config(hf_config(cfg.model), dtype=torch.float32)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    dtype = export_dtype(cfg.model, cfg.trainer.export_dtype, cfg.device)
    return save_hf(model, state["model"], load_tokenizer(cfg.model), out_dir, dtype)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python scripts/export_hf.py CHECKPOINT_OR_RUN_DIR OUT_DIR")
    print(export(Path(sys.argv[1]).resolve(), Path(sys.argv[2])))
