"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, reshardable, never half-marked.

The layout (names, meta.json, `latest`) and how checkpoints are found and verified live in
`launcher/run_folder.py`; this file writes and reads them. A save:

1. checks that the file system has room for every rank's shards (else stops, one line, the
   last good checkpoint untouched);
2. writes into `step_N.tmp/`; each rank fsyncs the files it wrote and reports them to rank 0;
3. rank 0 checks it sees every rank's files at their sizes (a run folder that is not shared
   by every node fails here, and `latest` keeps naming the previous checkpoint), writes
   meta.json listing them all, fsyncs it and the folder;
4. renames `step_N.tmp/` to `step_N/` (an existing `step_N/` is moved aside first and removed
   only after), then moves `latest` (written to a temporary file, fsynced, renamed).

A crash at any point leaves the previous checkpoint as latest. Nothing else is needed for an
exact resume: the prompt order and the sampling seeds are functions of (seed, step, dp rank).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from launcher.run_folder import (
    LATEST,
    META,
    candidates,
    checkpoint_dir,
    file_sizes,
    step_name,
    verify,
)
from trainer.errors import RunError

SPACE_MARGIN = 1.05  # DCP metadata and file-system slack over the tensor bytes


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def local_bytes(state) -> int:
    """Bytes of the tensors (this rank's shards of DTensors) in a nested state dict."""
    if isinstance(state, dict):
        return sum(local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(local_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        t = state.to_local() if hasattr(state, "to_local") else state
        return t.numel() * t.element_size()
    return 0


def gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"


def ensure_space(folder: Path, needed: int, what: str, keep: str, device: torch.device) -> None:
    """Collective: stop on every rank, with one line, if rank 0's file system lacks `needed` bytes."""
    t = torch.tensor([0.0, 0.0], dtype=torch.float64, device=device)
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        t[0], t[1] = needed * SPACE_MARGIN, shutil.disk_usage(folder).free
    dist.broadcast(t, src=0)
    need, free = t.tolist()
    if need > free:
        raise RunError(
            f"{what} needs {gib(need)} in {folder} but {gib(free)} are free; free space on that "
            f"disk or point hydra.run.dir at a larger one ({keep})"
        )


def save(
    model, optimizer, scheduler, step: int, run_dir: str | Path, layout: dict, keep_last: int
) -> Path:
    """Collective: every rank writes its shards; rank 0 commits. Returns the checkpoint folder."""
    root = checkpoint_dir(run_dir)
    final, tmp = root / step_name(step), root / (step_name(step) + ".tmp")
    rank, device = dist.get_rank(), next(model.parameters()).device
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    needed = torch.tensor([local_bytes(state)], dtype=torch.float64, device=device)
    dist.all_reduce(needed)
    previous = candidates(run_dir)
    keep = f"the last checkpoint, {previous[0].name}, is kept" if previous else "no checkpoint yet"
    ensure_space(root, int(needed.item()), f"checkpoint {final.name}", keep, device)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    # DCP names each rank's file __RANK_N.distcp; rank 0 also writes .metadata
    mine = {p.name: p.stat().st_size for p in tmp.glob(f"__{rank}_*.distcp")}
    if rank == 0:
        mine[".metadata"] = (tmp / ".metadata").stat().st_size
    for name in mine:
        fsync_path(tmp / name)
    reported: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(reported, mine)
    verdict: list[list[int] | None] = [None]
    if rank == 0:
        seen = file_sizes(tmp)
        verdict = [
            [
                r
                for r, files in enumerate(reported)
                if any(seen.get(n) != s for n, s in files.items())
            ]
        ]
    dist.broadcast_object_list(verdict, src=0)  # commit on every rank's word, or on none
    if missing := verdict[0]:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RunError(
            f"checkpoint {final.name} is incomplete where rank 0 writes it: the files of rank(s) "
            f"{', '.join(map(str, missing))} are not in {tmp} (the run folder is not on storage "
            f"every node shares); {keep}. Use a shared hydra.run.dir, or run without checkpoints: "
            "trainer.save_final=false trainer.save_every=0 trainer.export_hf=false"
        )
    if rank == 0:
        files = {n: s for files in reported for n, s in files.items()}
        meta = {"step": step, "scheduler": scheduler.state_dict(), "layout": layout, "files": files}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        fsync_path(tmp / META)
        fsync_path(tmp)
        aside = root / (final.name + ".replaced")
        if final.exists():  # a complete checkpoint goes only once its replacement is complete
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(tmp, final)
        fsync_path(root)
        pointer = root / (LATEST + ".tmp")
        pointer.write_text(final.name)
        fsync_path(pointer)
        os.replace(pointer, root / LATEST)
        fsync_path(root)
        shutil.rmtree(aside, ignore_errors=True)
        if keep_last > 0:
            for old in candidates(run_dir)[keep_last:]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(model, optimizer, scheduler, folder: str | Path) -> int:
    """Load a checkpoint into the (possibly differently sharded) model and optimizer; returns its step."""
    folder = Path(folder)
    meta = verify(folder)
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    scheduler.load_state_dict(meta["scheduler"])
    return int(meta["step"])


def save_hf(model, state: dict, tokenizer, out_dir: Path, dtype: torch.dtype) -> Path:
    """Rank 0 / one process: write `state` (full tensors) in `dtype` with save_pretrained, into
    OUT.tmp and then renamed, so a failed export never leaves a half-written OUT."""
    for name in list(state):  # one tensor at a time: no second full copy
        state[name] = state[name].to(dtype)
    tmp, aside = (
        out_dir.with_name(out_dir.name + ".tmp"),
        out_dir.with_name(out_dir.name + ".replaced"),
    )
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state)
    # save_pretrained records the module's dtype; the files hold `dtype`, and loading with
    # dtype="auto" should give that
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(out_dir, aside)
    os.replace(tmp, out_dir)
    shutil.rmtree(aside, ignore_errors=True)
    return out_dir


def export_bytes(model, dtype: torch.dtype) -> int:
    """Bytes of the full weights in `dtype` (a tied matrix once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * dtype.itemsize
    return total


def export_hf(model, tokenizer, out_dir: str | Path, dtype: torch.dtype) -> Path:
    """Collective: gather the full weights to rank 0 (on CPU) and save them in `dtype`."""
    out_dir = Path(out_dir)
    device = next(model.parameters()).device
    ensure_space(out_dir.parent, export_bytes(model, dtype), f"the HF export to {out_dir.name}",
                 "the checkpoints are kept; scripts/export_hf.py exports one later", device)  # fmt: skip
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        save_hf(model, state, tokenizer, out_dir, dtype)
    dist.barrier()
    return out_dir


class Checkpointer:
    """When to save, where, and the final export: the run's checkpoint policy in one place.

    Saves after step N when asked to stop, at the last step (`trainer.save_final`) and every
    `trainer.save_every` steps; every input is the same on every rank (the step, and a stop
    agreed over the group), so every rank saves together. Exports at the end (`trainer.export_hf`)."""

    def __init__(self, cfg, model, optimizer, scheduler, tokenizer, layout: dict, device_type: str):
        from trainer.model import export_dtype

        self.cfg, self.t = cfg, cfg.trainer
        self.model, self.optimizer, self.scheduler, self.tokenizer = (
            model,
            optimizer,
            scheduler,
            tokenizer,
        )
        self.layout = layout
        self.export_dtype = export_dtype(cfg.model, self.t.export_dtype, device_type)

    def resume(self) -> int:
        """Collective: load `trainer.resume` (a checkpoint the launcher chose); the step it ended."""
        if self.t.resume == "none":
            return 0
        return load(self.model, self.optimizer, self.scheduler, self.t.resume)

    def due(self, step: int, stopping: bool) -> bool:
        t = self.t
        return (
            stopping
            or (step == t.max_steps and t.save_final)
            or bool(t.save_every and step % t.save_every == 0)
        )

    def maybe_save(self, step: int, stopping: bool) -> Path | None:
        """Collective when due: the checkpoint of `step`, or None."""
        if not self.due(step, stopping):
            return None
        path = save(self.model, self.optimizer, self.scheduler, step, self.cfg.run_dir,
                    self.layout, self.t.keep_last)  # fmt: skip
        print(f"checkpoint: {path}", flush=True)
        return path

    def export(self) -> Path | None:
        """Collective: the final weights in Hugging Face format, if `trainer.export_hf`."""
        if not self.t.export_hf:
            return None
        out = export_hf(
            self.model, self.tokenizer, Path(self.cfg.run_dir) / "hf", self.export_dtype
        )
        print(f"exported Hugging Face weights: {out}", flush=True)
        return out
