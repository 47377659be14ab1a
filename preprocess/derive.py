"""``preprocess derive``: run an encoder over every cached mel and store its output as a field.

No mel shard is rewritten: each mel shard gets a field shard of the same name in the field's
version folder (:mod:`melcache.fields.format`), written whole and acknowledged by a receipt in
``CACHE/.derive/NAME-DIGEST/``. Part K of N derives the shards whose number ≡ K mod N; the
part that finds every receipt writes ``rows.npy`` and lists the field in ``index.json``
(atomically), as the build's parts do. A part killed at any moment resumes when rerun and
ends with the same bytes.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from melcache.bounded import read_json
from melcache.errors import UserError
from melcache.features import features_from_dict
from melcache.fields.format import (
    FIELDS_KEY,
    ROWS_NAME,
    VALUES_NAME,
    FieldEncoder,
    cache_fields,
    field_folder,
    name_problem,
    provenance_digest,
    rows_array,
    values_array,
)
from melcache.format import INDEX_NAME, write_atomic
from melcache.index import index_storage, read_index, write_index
from preprocess.inputs.records import RECEIPTS
from preprocess.job.owners import live_builds, running_build, sweep_temps
from preprocess.job.part import Meeting
from preprocess.job.pool import ordered_map
from preprocess.write.field_shard import (
    DeriveJob,
    derive_shard,
    init_worker,
    load_encoder,
    log_floor_value,
)

log = logging.getLogger(__name__)
STATE = ".derive"


@dataclasses.dataclass(frozen=True)
class DeriveOptions:
    """What ``derive`` was asked to do."""

    cache: Path
    field: str
    encoder: str  # package.module:factory
    checkpoint: str | None = None
    part: tuple[int, int] = (0, 1)
    workers: int = 1
    device: str = "cpu"
    replace: bool = False


def derive(options: DeriveOptions) -> dict[str, Any] | None:
    """Derive (or resume) this part of a field; the field's index entry once complete, else
    ``None`` (other parts remain)."""
    cache = options.cache
    problem = name_problem(options.field)
    if problem:
        raise UserError(f"--field {options.field!r}: expected {problem}")
    index = _finished_index(cache)
    encoder = load_encoder(options.encoder, options.checkpoint, options.device)
    provenance = _provenance(options, encoder, index)
    digest = provenance_digest(provenance)
    old = cache_fields(index, str(cache / INDEX_NAME)).get(options.field)
    if old is not None and old["provenance_digest"] == digest:
        log.info("%s: field %r is already derived with this provenance", cache, options.field)
        return old
    if old is not None and not options.replace:
        raise UserError(_differs(cache, options.field, old["provenance"], provenance))
    folder = cache / field_folder(options.field, digest)
    state = cache / STATE / f"{options.field}-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    k, n = options.part
    workers = 1 if options.device.startswith("cuda") else options.workers
    meeting = Meeting(k, n)
    try:
        with running_build(state, options.part):
            jobs = [
                _job(options, index, i, (folder, state), digest, encoder.scalar)
                for i in range(len(index["shards"]))
            ]
            todo = [job for i, job in enumerate(jobs) if i % n == k and not _done(job)]
            _run(todo, options, workers, encoder)
        meeting.barrier()
        if any(not _done(job) for job in jobs) or (meeting.collective and k != 0):
            log.info("part %d/%d done; the index lists the field once every part is", k, n)
            return None
        sweep_temps(folder)
        return _finish(cache, options.field, provenance, encoder, jobs, old)
    finally:
        meeting.close()


def _finished_index(cache: Path) -> dict[str, Any]:
    """The index of a finished cache that no build is writing; one line otherwise."""
    building = live_builds(cache / RECEIPTS)
    if building or (not (cache / INDEX_NAME).exists() and (cache / RECEIPTS).is_dir()):
        who = f" (pid {building[0]['pid']} on {building[0]['host']})" if building else ""
        raise UserError(
            f"{cache} is still being built{who}: derive once its build has written index.json"
        )
    return read_index(cache)


def _provenance(
    options: DeriveOptions, encoder: FieldEncoder, index: dict[str, Any]
) -> dict[str, Any]:
    """What made the field: the encoder, its weights' sha256, its config, the mel it read."""
    features = features_from_dict(index["features"], source=str(options.cache / INDEX_NAME))
    wanted = dict(encoder.features)
    for key, value in wanted.items():
        if index["features"].get(key) != value:
            raise UserError(
                f"{options.cache}: features.{key} = {index['features'].get(key)!r}, the encoder "
                f"{options.encoder} reads {key} = {value!r}"
            )
    weights = encoder.weights
    return {
        "encoder": options.encoder,
        "checkpoint": None if weights is None else str(weights),
        "checkpoint_sha256": None if weights is None else _sha256(weights),
        "config": json.loads(json.dumps(dict(encoder.config), sort_keys=True)),
        "features_digest": features.digest(),
        "storage": index_storage(index),
        "dtype": encoder.dtype,
        "shape": list(encoder.shape),
        "frame_rate": encoder.frame_rate,
        "mel_multiple": encoder.mel_multiple,
        "bf16": options.device.startswith("cuda") and encoder.bf16,
        # Only where set, so the provenance digests of per-frame fields stay as they were.
        **({"per_utterance": True} if encoder.per_utterance else {}),
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _differs(cache: Path, name: str, have: dict[str, Any], new: dict[str, Any]) -> str:
    key = next((k for k in new if k != "checkpoint" and have.get(k) != new[k]), "encoder")
    return (
        f"{cache}: field {name!r} exists with {key} = {have.get(key)!r}, this derive has "
        f"{key} = {new[key]!r}: pass --replace to derive it again, or another --field"
    )


def _job(
    options: DeriveOptions,
    index: dict[str, Any],
    i: int,
    folders: tuple[Path, Path],
    digest: str,
    scalar: bool,
) -> DeriveJob:
    """Shard ``i``'s job; ``folders``: the field's version folder and derive's state."""
    entry, (folder, state) = index["shards"][i], folders
    return DeriveJob(
        cache=str(options.cache),
        mel_entry=entry,
        out=folder,
        receipt=state / f"{entry['name']}.json",
        field=options.field,
        digest=digest,
        n_mels=int(index["features"]["n_mels"]),
        storage=index_storage(index),
        pad_value=log_floor_value(index["features"]),
        scalar=scalar,
    )


def _done(job: DeriveJob) -> bool:
    """Whether the job's receipt and field shard are there, of its mel shard and size."""
    try:
        receipt = read_json(job.receipt)
        shard = receipt["shard"]
        size = (job.out / shard["name"]).stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return shard["mel_sha256"] == job.mel_entry["sha256"] and size == shard["bytes"]


def _run(
    todo: list[DeriveJob], options: DeriveOptions, workers: int, encoder: FieldEncoder
) -> None:
    total = sum(job.mel_entry["samples"] for job in todo)
    initargs = (encoder, options.device)
    with (
        ordered_map(min(workers, max(1, len(todo))), init_worker, initargs) as run,
        tqdm(total=total, desc=f"derive {options.field}", unit="utt", disable=None) as bar,
    ):
        for receipt in run(derive_shard, todo):
            bar.update(receipt["shard"]["samples"])


def _finish(
    cache: Path,
    name: str,
    provenance: dict[str, Any],
    encoder: FieldEncoder,
    jobs: list[DeriveJob],
    old: dict[str, Any] | None,
) -> dict[str, Any]:
    """Write rows.npy (and a scalar field's values.npy), then list the field in index.json;
    drop a replaced version after."""
    receipts = [read_json(job.receipt) for job in jobs]
    digest = provenance_digest(provenance)
    folder = cache / field_folder(name, digest)
    rows = rows_array([tuple(row) for r in receipts for row in r["rows"]])
    write_atomic(folder / ROWS_NAME, rows)
    shards = [r["shard"] for r in receipts]
    scalar: dict[str, Any] = {"per_utterance": True} if encoder.per_utterance else {}
    if encoder.scalar:
        values = values_array([v for r in receipts for v in r["values"]], encoder.dtype)
        write_atomic(folder / VALUES_NAME, values)
        scalar["values"] = _file_entry(VALUES_NAME, values)
    entry = {
        "provenance_digest": digest,
        "folder": field_folder(name, digest),
        "provenance": provenance,
        "dtype": encoder.dtype,
        "shape": list(encoder.shape),
        "frame_rate": encoder.frame_rate,
        "shards": shards,
        "rows": _file_entry(ROWS_NAME, rows),
        "totals": {
            "frames": sum(s["frames"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
        },
        **scalar,
    }
    # Two derives of different fields may finish at once: one index update at a time, each
    # reading the index afresh, so neither drops the other's entry.
    with open(cache / STATE / "index.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        index = read_index(cache)
        index.setdefault(FIELDS_KEY, {})[name] = entry
        write_index(cache, index)
    if old is not None and old["folder"] != entry["folder"]:
        shutil.rmtree(cache / old["folder"], ignore_errors=True)
    return entry


def _file_entry(name: str, data: bytes) -> dict[str, Any]:
    return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def default_device() -> str:
    """``cuda`` where there is a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"
