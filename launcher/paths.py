"""Where models and data come from, for both sides of torchrun (no torch here): a hub id or a
local folder or file, and whether the Hugging Face cache already holds it."""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: str | None) -> bool:
    if not path:
        return False
    return (
        not Path(path).exists()
        and bool(HUB_ID.match(path))
        and not path.startswith((".", "/", "~"))
    )


def local_model_dir(path: str | None) -> Path | None:
    """The folder holding `path`'s config.json, if it is on this machine (local or HF cache)."""
    if not path:
        return None
    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        return p
    if is_hub_id(path):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
        if isinstance(cached, str):
            return Path(cached).parent
    return None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or datasets' own HF_DATASETS_OFFLINE) is set: nothing may be downloaded."""
    return any(
        os.environ.get(k, "0").lower() not in ("0", "", "false", "no", "off")
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def dataset_cached(hub_id: str) -> bool:
    """A hub dataset is on this machine: in the hub's file cache or datasets' Arrow cache."""
    from huggingface_hub import constants

    org, name = hub_id.split("/")
    hub = Path(constants.HF_HUB_CACHE) / f"datasets--{org}--{name}" / "snapshots"
    arrow = Path(os.environ.get("HF_DATASETS_CACHE", Path(constants.HF_HOME) / "datasets"))
    return (hub.is_dir() and any(hub.iterdir())) or (arrow / f"{org}___{name}").is_dir()
