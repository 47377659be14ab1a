"""Derive one field shard (in a pool worker): read a mel shard, run the encoder, write the
field shard atomically, then its receipt.

Batches are runs of utterances whose mel, padded to the encoder's ``mel_multiple``, has the
same length, so no padding enters the encoder beyond what it gets run on one utterance alone:
each utterance's values do not depend on its batch-mates, and batches are a pure function of
the shard, so any split into parts or workers writes the same bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from melcache.codec import decode_mel
from melcache.errors import UserError, user_code_error
from melcache.fields.format import BOUND_NAME, FieldEncoder, bound_member, encode_field
from melcache.format import META_MEMBER, temp_path, write_atomic
from melcache.location import member_location
from melcache.reader import ShardCheck, load_shard, read_shard, shard_samples
from melcache.table import sample_digest
from melcache.tar.writer import HashingStream, open_tar_writer

# Mel frames per encoder call: big enough to fill a GPU, small enough for CPU memory.
BATCH_FRAMES = 32_768


@dataclasses.dataclass(frozen=True)
class DeriveJob:
    """What a worker needs to derive one field shard (picklable)."""

    cache: str
    mel_entry: dict[str, Any]
    out: Path  # the field's version folder
    receipt: Path
    field: str
    digest: str  # provenance digest
    n_mels: int
    storage: str
    pad_value: float  # the log floor: silence, what the loader pads with
    scalar: bool = False  # one number per utterance: its values go to values.npy too


_encoder: FieldEncoder | None = None
_device = torch.device("cpu")


def load_encoder(spec: str, checkpoint: str | None, device: str) -> FieldEncoder:
    """Import ``package.module:factory`` and call it; one line for every way it can fail."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(f"--encoder {spec!r}: expected package.module:factory")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"--encoder {spec!r} cannot be imported: {exc}") from None
    try:
        made = factory(checkpoint=checkpoint, device=device)
    except UserError:
        raise
    except Exception as exc:  # the user's factory, or what is no factory (os:system)
        raise user_code_error(
            f"--encoder {spec!r} failed when called as a factory (checkpoint={checkpoint!r}, "
            f"device={device!r})",
            exc,
        ) from None
    if not isinstance(made, FieldEncoder):
        raise UserError(f"--encoder {spec!r} returned {type(made).__name__}, not a FieldEncoder")
    return made


def init_worker(encoder: FieldEncoder, device: str) -> None:
    """Take the encoder derive loaded (a forked worker inherits it: no second load); one
    thread, so float sums do not depend on ``--workers`` (as the build's writers)."""
    global _encoder, _device
    torch.set_num_threads(1)
    _device = torch.device(device)
    if _device.type == "cuda":  # the same kernels every run: parts must agree byte for byte
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    _encoder = encoder


def derive_shard(job: DeriveJob) -> dict[str, Any]:
    """Write one field shard and its receipt; return the receipt."""
    assert _encoder is not None, "worker not initialised"  # internal invariant
    mel_location = member_location(job.cache, job.mel_entry["name"])
    samples = read_shard(mel_location, job.mel_entry, ShardCheck("fast"))
    # Each sample's json member verbatim: a model that reads fields alone reads no mel shard.
    metas = [bytes(s[META_MEMBER]) for s in shard_samples(load_shard(mel_location), mel_location)]
    mels = [decode_mel(s.mel, s.storage, job.n_mels, f"{mel_location}:{s.key}") for s in samples]
    names = [f"{mel_location}:{s.key}" for s in samples]
    values = encode_all(_encoder, mels, job.pad_value, _device, names)
    final = job.out / job.mel_entry["name"]
    temp, member, rows = temp_path(final), f"{job.field}.npy", []
    try:
        with open(temp, "wb") as raw:
            stream = HashingStream(raw)
            with open_tar_writer(stream) as writer:
                bound = bound_member(job.mel_entry, job.field, job.digest)
                writer.write({"__key__": "", BOUND_NAME[1:]: bound})
                for sample, meta, value in zip(samples, metas, values, strict=True):
                    data = encode_field(value)
                    written = writer.write({"__key__": sample.key, member: data, META_MEMBER: meta})
                    _, start, size = written.spans[member]  # rows.npy's, from the writer itself
                    rows.append((start, size, len(value), sample_digest(data)))
            size_bytes = writer.offset
        os.replace(temp, final)
    except OSError as exc:
        raise UserError(f"cannot write {final}: {exc.strerror}; free space and rerun") from None
    finally:
        temp.unlink(missing_ok=True)
    frames = [len(v) for v in values]
    receipt = {
        "digest": job.digest,
        "shard": {
            "name": job.mel_entry["name"],
            "bucket": job.mel_entry["bucket"],
            "samples": len(values),
            "frames": sum(frames),
            "min_frames": min(frames),
            "max_frames": max(frames),
            "bytes": size_bytes,
            "mel_sha256": job.mel_entry["sha256"],
            **stream.hexdigests(),
        },
        "rows": rows,
        "mel_frames": job.mel_entry["frames"],
    }
    if job.scalar:  # each utterance's number, for values.npy (JSON keeps a float's bits)
        receipt["values"] = [v.item() for v in values]
    write_atomic(job.receipt, json.dumps(receipt).encode())
    return receipt


def encode_all(
    encoder: FieldEncoder,
    mels: list[np.ndarray],
    pad_value: float,
    device: torch.device,
    names: list[str],
) -> list[np.ndarray]:
    """The field of every mel, in order, from batches of equal padded length; an output the
    field cannot store is one line naming its utterance (``names``: shard and key)."""
    out: list[np.ndarray | None] = [None] * len(mels)
    for rows in _batches(encoder, [len(m) for m in mels]):
        length = -(-len(mels[rows[0]]) // encoder.mel_multiple) * encoder.mel_multiple
        batch = np.full((len(rows), length, mels[rows[0]].shape[1]), pad_value, np.float32)
        for i, row in enumerate(rows):
            batch[i, : len(mels[row])] = mels[row]
        try:
            result = run_encoder(encoder, torch.from_numpy(batch), device)
        except Exception as exc:  # the user's module: name it and its batch, keep its frames
            module = type(encoder.module)
            raise user_code_error(
                f"the encoder {module.__module__}.{module.__qualname__} failed on {names[rows[0]]} "
                f"(its batch's first key; mel {list(batch.shape)})",
                exc,
            ) from None
        for i, row in enumerate(rows):
            value = result[i][None] if encoder.per_utterance else result[i]  # stored [1, *shape]
            try:
                out[row] = _stored(value, encoder, len(mels[row]))
            except UserError as exc:
                raise UserError(f"{names[row]}: {exc}") from None
    return out  # type: ignore[return-value]


def run_encoder(encoder: FieldEncoder, mel: torch.Tensor, device: torch.device) -> np.ndarray:
    """``encoder.module`` on one batch: on CUDA under bf16 autocast where allowed."""
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda" and encoder.bf16
        else contextlib.nullcontext()
    )
    with torch.inference_mode(), autocast:
        result = encoder.module(mel.to(device))
    return result.float().cpu().numpy() if result.is_floating_point() else result.cpu().numpy()


def _stored(values: np.ndarray, encoder: FieldEncoder, mel_frames: int) -> np.ndarray:
    frames = encoder.field_frames(mel_frames)
    if values.shape != (frames, *encoder.shape):
        gave, declared = tuple(values.shape), [frames, *encoder.shape]
        if encoder.per_utterance:  # the module's own shapes, without the stored frame axis
            gave, declared = gave[1:], declared[1:]
        raise UserError(
            f"the encoder gave {gave} for {mel_frames} mel frames, it declares "
            f"[{', '.join(map(str, declared))}]"
            + (" per utterance" if encoder.per_utterance else "")
        )
    kind = np.dtype(encoder.dtype)
    if values.dtype.kind == "f" and not np.isfinite(values).all():  # never into a field
        bad = int(np.size(values) - np.isfinite(values).sum())
        raise UserError(f"the encoder gave {bad} non-finite values (NaN or infinity), refused")
    if (
        kind.kind in "iu"
        and values.dtype.kind == "f"
        and not np.all(np.isfinite(values) & (values == np.round(values)))
    ):
        raise UserError(f"the encoder's output is not integral, its dtype is {encoder.dtype}")
    if kind.kind in "iu":
        info = np.iinfo(kind)
        if values.size and (values.min() < info.min or values.max() > info.max):
            raise UserError(
                f"the encoder's output {values.min()}..{values.max()} does not fit {kind}"
            )
    stored = values.astype(kind)
    if kind.kind == "f" and not np.isfinite(stored).all():
        raise UserError(f"the encoder's output {values.min()}..{values.max()} overflows {kind}")
    return stored


def _batches(encoder: FieldEncoder, frames: list[int]) -> Iterator[list[int]]:
    """Rows grouped by padded length (shortest first), each group cut to BATCH_FRAMES."""
    groups: dict[int, list[int]] = {}
    for row, n in enumerate(frames):
        groups.setdefault(-(-n // encoder.mel_multiple), []).append(row)
    for padded in sorted(groups):
        rows = groups[padded]
        size = max(1, BATCH_FRAMES // (padded * encoder.mel_multiple))
        for start in range(0, len(rows), size):
            yield rows[start : start + size]


def log_floor_value(features: dict[str, Any]) -> float:
    """The loader's padding value, ln(log_floor)."""
    return math.log(features["log_floor"])
