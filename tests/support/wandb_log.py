"""Read back what W&B wrote offline: the records of a ``run-ID.wandb`` file.

wandb 0.31 no longer ships its Python reader (``wandb.sdk.internal.datastore``); the file is
still its documented transaction log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0),
then LevelDB log records in 32 KiB blocks (4-byte CRC, 2-byte length, 1-byte type: FULL,
FIRST, MIDDLE, LAST), each payload a ``wandb_internal.Record`` protobuf, decoded here with
wandb's own generated classes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7  # both the file's and each record's
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(path: Path) -> Iterator[bytes]:
    """Each record's bytes, reassembled across blocks."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's trailer: zero padding
            pos += left
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        body = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0:  # preallocated zeros at the end
            break
        parts.append(body)
        if kind in (FULL, LAST):
            yield b"".join(parts)
            parts = []


def read_run(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """The run id and the history rows (``{key: value}``) of one ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    run_id, rows = "", []
    for payload in payloads(path):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return run_id, rows


def offline_runs(folder: Path) -> list[tuple[str, list[dict[str, Any]]]]:
    """Every offline run under ``folder/wandb``, oldest first."""
    return [read_run(p) for p in sorted(Path(folder).glob("wandb/offline-run-*/run-*.wandb"))]
