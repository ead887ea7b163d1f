"""Write docs/configuration.md from the schema (launcher/schema.py) and the presets in conf/,
and the table of docs/metrics.md from the metric names (trainer/stats.py, METRICS).

python scripts/gen_config_docs.py          # rewrite both
python scripts/gen_config_docs.py --check  # exit 1 if either is stale (run by the tests)
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

from launcher import schema

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "configuration.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"
TABLE_START = "<!-- metrics table: generated from trainer/stats.py (METRICS) by scripts/gen_config_docs.py -->"
TABLE_END = "<!-- end metrics table -->"


def field_comments(cls: type) -> dict[str, str]:
    """The `#` comment lines directly above each field of `cls` in schema.py."""
    lines = Path(schema.__file__).read_text().splitlines()
    node = next(
        n
        for n in ast.parse("\n".join(lines)).body
        if isinstance(n, ast.ClassDef) and n.name == cls.__name__
    )
    out = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign):
            i, comment = stmt.lineno - 2, []
            while i >= 0 and lines[i].strip().startswith("#"):
                comment.insert(0, lines[i].strip().lstrip("# "))
                i -= 1
            out[stmt.target.id] = " ".join(comment).replace("|", "\\|")
    return out


def type_name(tp: object) -> str:
    """The annotation as written in the schema (`str | None`), with table pipes escaped."""
    return str(tp).replace("typing.", "").replace("|", "\\|")


def default_of(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "(group)" if f.default == "???" else f"`{f.default!r}`".replace("None", "null")
    value = f.default_factory()
    return "(section)" if dataclasses.is_dataclass(value) else f"`{value!r}`"


def section(prefix: str, cls: type) -> list[str]:
    comments = field_comments(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        sub = f.type if isinstance(f.type, type) else getattr(schema, str(f.type), None)
        if sub is not None and dataclasses.is_dataclass(sub):
            nested.append((key + ".", sub, " ".join((sub.__doc__ or "").split())))
            continue
        kind = type_name(f.type)
        if "choices" in f.metadata:
            kind = "one of " + ", ".join(f"`{c}`" for c in f.metadata["choices"])
        rows.append(f"| `{key}` | {kind} | {default_of(f)} | {comments.get(f.name, '')} |")
    out = []
    if rows:
        out += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    for key, sub, comment in nested:
        presets = sorted(p.stem for p in (ROOT / "conf" / key.rstrip(".")).glob("*.yaml"))
        out += [f"## `{key.rstrip('.')}`", ""]
        if comment:
            out += [comment, ""]
        if presets:
            out += ["Presets: " + ", ".join(f"`{key.rstrip('.')}={p}`" for p in presets), ""]
        out += section(key, sub)
    return out


def flatten(node: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in node.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def cross_group_settings() -> list[str]:
    """Keys a preset sets outside its own group (files marked `# @package _global_`)."""
    from omegaconf import OmegaConf

    rows = []
    for path in sorted((ROOT / "conf").glob("*/*.yaml")):
        group = path.parent.name
        if not path.read_text().startswith("# @package _global_"):
            continue
        for key, value in flatten(OmegaConf.to_container(OmegaConf.load(path))).items():
            if not key.startswith(f"{group}."):
                rows.append(f"| `{group}={path.stem}` | `{key}` | `{value!r}` |")
    return [
        "## Settings a preset makes outside its group",
        "",
        "A few presets choose values in another group, because they only make sense together (a",
        "learning rate for a model size, a response budget for a task). They are applied when the",
        "preset is chosen; a value given on the command line still wins.",
        "",
        "| preset | key | value |",
        "|---|---|---|",
        *rows,
        "",
    ]


def render() -> str:
    head = [
        "# Configuration",
        "",
        "Generated from `launcher/schema.py` by `python scripts/gen_config_docs.py`; do not edit by hand.",
        "Presets in `conf/` choose values for these keys; override any key on the command line as",
        "`key=value`. Defaults below are the schema's; a preset may set others (`--cfg job` shows the",
        "composed result).",
        "",
        "## top level",
        "",
    ]
    body = section("", schema.Config)
    return "\n".join(head + body + [""] + cross_group_settings()).rstrip() + "\n"


def render_metrics() -> str:
    from trainer.stats import METRICS

    text = METRICS_DOC.read_text()
    head, rest = text.split(TABLE_START)
    tail = rest.split(TABLE_END)[1]
    rows = [f"| `{k}` | {v.replace('|', chr(92) + '|')} |" for k, v in METRICS.items()]
    table = "\n".join([TABLE_START, "| key | meaning |", "|---|---|", *rows, TABLE_END])
    return head + table + tail


if __name__ == "__main__":
    outputs = {OUT: render(), METRICS_DOC: render_metrics()}
    if "--check" in sys.argv:
        stale = [p for p, text in outputs.items() if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"{p.relative_to(ROOT)} is stale: run python scripts/gen_config_docs.py")
        sys.exit(1 if stale else 0)
    for p, text in outputs.items():
        p.parent.mkdir(exist_ok=True)
        p.write_text(text)
        print(f"wrote {p.relative_to(ROOT)}")
