"""Command-line overrides checked against the schema before Hydra composes anything.

Hydra rejects the same mistakes, in several lines; this gives one line with the key, the
value and the fix (a close key name, the presets of a group, the expected type), exit 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

from launcher.schema import Config
from launcher.validate import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("parallel", "model", "data", "rl", "logger")
FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                    "--config-dir", "-cd", "--experimental-rerun"}  # fmt: skip
SKIP_ALL = {
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--version",
    "--shell-completion",
    "-sc",
}


def schema_fields(cls: type = Config, prefix: str = "") -> dict[str, object]:
    """Every leaf key of the schema with its type: {"parallel.dp_replicate_size": int, ...}."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out.update(schema_fields(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = tp
    return out


def presets(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def suggestion(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"did you mean {close[0]}? " if close else ""


def type_ok(value: object, tp: object) -> str | None:
    """None if `value` (as Hydra parsed it) fits `tp`, else the expected type's name."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    optional = union and type(None) in typing.get_args(tp)
    alternatives = [a for a in typing.get_args(tp) if a is not type(None)] if union else []
    if len(alternatives) > 1:  # e.g. int | str (rl.micro_batch_tokens: a count or auto)
        misses = [type_ok(value, a) for a in alternatives]
        return (
            None if None in misses or value is None and optional else " or ".join(map(str, misses))
        )
    base = next(a for a in typing.get_args(tp) if a is not type(None)) if union else tp
    if value is None:
        return None if optional else getattr(base, "__name__", str(base))
    if base is bool:
        return None if isinstance(value, bool) else "bool (true or false)"
    if base is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "int"
    if base is float:
        return None if isinstance(value, int | float) and not isinstance(value, bool) else "float"
    return None  # strings, lists and dicts: Hydra converts or checks them


def check(argv: list[str]) -> None:
    if SKIP_ALL & set(argv):
        return
    tokens, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in FLAGS_WITH_VALUE
        else:
            tokens.append(arg)
    try:
        overrides = OverridesParser.create().parse_overrides(tokens)
    except OverrideParseException as e:
        raise ConfigError(f"cannot parse the overrides: {str(e).splitlines()[0]}") from None
    fields = schema_fields()
    for o in overrides:
        key = o.key_or_group
        if key.startswith("hydra") or o.is_add() or o.is_force_add() or o.is_delete() or "/" in key:
            continue
        values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
        if key in GROUPS:
            for v in values:
                if str(v) not in presets(key):
                    raise ConfigError(f"{key}={v} is not a preset; {suggestion(str(v), presets(key))}"
                                      f"choose one of {', '.join(presets(key))}")  # fmt: skip
            continue
        if key not in fields:
            if any(k.startswith(key + ".") for k in fields):
                continue  # a whole section, e.g. data.rewards={...}
            if any(
                key.startswith(k + ".") and typing.get_origin(fields[k]) is dict for k in fields
            ):
                continue  # an entry of a dict field, e.g. data.rewards.format: Hydra checks it
            raise ConfigError(f"{key} is not a config key; {suggestion(key, list(fields))}"
                              "every key is listed in docs/configuration.md")  # fmt: skip
        for v in values:
            expected = type_ok(v, fields[key])
            if expected:
                raise ConfigError(f"{key}={v!r} is not a valid {expected}")
