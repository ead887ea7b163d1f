"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, reshardable, never half-marked.

    RUN_DIR/checkpoints/step_000010/   DCP files of {"model", "optim"} (each rank writes its shards)
                                       meta.json: step, LR schedule, the layout it was saved
                                       under, and the size of every file (written last)
    RUN_DIR/checkpoints/latest         the name of the newest complete checkpoint

A checkpoint is written into `step_N.tmp/`, completed with meta.json once every rank has
finished, renamed to `step_N/`, and only then named in `latest`: a crash at any point
leaves the previous checkpoint as latest. Nothing else is needed for an exact resume: the
prompt order and the sampling seeds are functions of (seed, step, dp rank) alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

META = "meta.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which and why."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def file_sizes(folder: Path) -> dict[str, int]:
    return {
        p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != META
    }


def verify(folder: Path) -> dict:
    """The checkpoint's meta.json if every file it lists is there at its recorded size."""
    meta_path = folder / META
    if not meta_path.is_file():
        raise CheckpointError(f"{folder} is incomplete: no {META} (the save did not finish)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{folder}/{META} is corrupt: {e}") from None
    actual = file_sizes(folder)
    for name, size in meta["files"].items():
        if name not in actual:
            raise CheckpointError(f"{folder} is incomplete: {name} is missing")
        if actual[name] != size:
            raise CheckpointError(
                f"{folder} is corrupt: {name} has {actual[name]} bytes, {size} were written"
            )
    return meta


def candidates(run_dir: str | Path) -> list[Path]:
    """Committed checkpoints of a run, newest first (`latest` first when it names one)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = sorted(
        (p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".tmp")), reverse=True
    )
    latest = root / LATEST
    if latest.is_file() and (root / latest.read_text().strip()).is_dir():
        first = root / latest.read_text().strip()
        found = [first, *(p for p in found if p != first)]
    return found


def find_resumable(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and a warning for each newer one that did not.

    Raises if checkpoints exist but none is usable: a run never silently starts over."""
    warnings, found = [], candidates(run_dir)
    for folder in found:
        try:
            verify(folder)
            return folder, warnings
        except CheckpointError as e:
            warnings.append(f"{e}; trying an older checkpoint")
    if found:
        raise CheckpointError(
            f"no usable checkpoint in {checkpoint_dir(run_dir)} ({'; '.join(warnings)}); "
            "fix or remove them, or start a new run with trainer.resume=none"
        )
    return None, warnings


def save(
    model, optimizer, scheduler, step: int, run_dir: str | Path, layout: dict, keep_last: int
) -> Path:
    """Collective: every rank writes its shards; rank 0 commits. Returns the checkpoint folder."""
    root = checkpoint_dir(run_dir)
    final, tmp = root / step_name(step), root / (step_name(step) + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        meta = {
            "step": step,
            "scheduler": scheduler.state_dict(),
            "layout": layout,
            "files": file_sizes(tmp),
        }
        (tmp / META).write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / (LATEST + ".tmp")
        pointer.write_text(final.name)
        os.replace(pointer, root / LATEST)
        if keep_last > 0:
            for old in candidates(run_dir)[keep_last:]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(model, optimizer, scheduler, folder: str | Path) -> int:
    """Load a checkpoint into the (possibly differently sharded) model and optimizer; returns its step."""
    folder = Path(folder)
    meta = verify(folder)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    scheduler.load_state_dict(meta["scheduler"])
    return int(meta["step"])


def export_hf(model, tokenizer, out_dir: str | Path) -> Path:
    """Collective: gather the full weights to rank 0 (on CPU) and save them with save_pretrained."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    out_dir = Path(out_dir)
    if dist.get_rank() == 0:
        model.save_pretrained(out_dir, state_dict=state)
        tokenizer.save_pretrained(out_dir)
    dist.barrier()
    return out_dir
