"""Read an offline W&B run file (`run-*.wandb`) back: its protobuf records, without the SDK.

The file is a 7-byte header (`:W&B`, magic 0xBEE1, version 0) then a LevelDB-style log: 32 KiB
blocks of records, each `crc32 (4) | length (2, LE) | type (1: full, 2: first, 3: middle, 4: last)`.
"""

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list[pb.Record]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    out, pos, chunks = [], HEADER, []
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # trailer padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:
            break
        chunks.append(data[pos + HEADER : pos + HEADER + length])
        pos += HEADER + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(b"".join(chunks))
            out.append(rec)
            chunks = []
    return out


def summary(path: Path) -> dict:
    """{'run': the run record, 'history': [{key: json value}, ...]} of one offline run."""
    import json

    run, history = None, []
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = rec.run
        elif kind == "history":
            history.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in rec.history.item
                }
            )
    return {"run": run, "history": history}
