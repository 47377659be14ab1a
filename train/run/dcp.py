"""Sharded weights in torch's distributed checkpoint (DCP) format, read without pickle.

Under FSDP2 every rank writes the shards it holds (``dcp.save``: one ``__R_0.distcp`` file
per rank plus a ``.metadata`` index) into ``step-N/weights/`` of the checkpoint folder
(``train/run/checkpoint.py`` commits it with the rest). Loading reshards to the job's mesh.

DCP's own reader unpickles ``.metadata`` with plain ``pickle.load``, which runs any code a
crafted file names; :class:`SafeReader` reads it with an unpickler that resolves DCP's
metadata classes, torch dtypes and ``torch.Size`` and refuses every other global (tensor data
is read ``weights_only`` by DCP itself). torch's own ``weights_only`` unpickler cannot: it
lacks the opcodes of the pickle protocol DCP writes.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import struct
from pathlib import Path, PosixPath
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from melcache.bounded import open_regular, read_limited

WEIGHTS = "weights"  # the DCP folder inside a checkpoint

# What an unpickler raises on bytes cut short or not a pickle: it wraps none of its errors.
UNPICKLING_ERRORS = (
    pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError,
    AttributeError, UnicodeDecodeError, struct.error, OverflowError,
)  # fmt: skip

# Every global a DCP .metadata file names: the dataclasses and enums of DCP's metadata.py,
# its storage record, torch.Size, dtypes and layouts (by name), and the checkpoint's path.
_ALLOWED = {
    (obj.__module__, obj.__qualname__): obj
    for obj in [*vars(dcp_metadata).values(), _StorageInfo, torch.Size]
    if isinstance(obj, type)
    and (dataclasses.is_dataclass(obj) or issubclass(obj, (enum.Enum, torch.Size)))
    and obj.__module__ in (dcp_metadata.__name__, _StorageInfo.__module__, "torch")
} | {("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
# The checkpoint's path: Python 3.13 pickles it as pathlib._local.PosixPath, older ones as
# pathlib.PosixPath; both names resolve here, so a checkpoint moves between them.
_ALLOWED[("pathlib", "PosixPath")] = _ALLOWED[("pathlib._local", "PosixPath")] = PosixPath


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves the globals in ``_ALLOWED`` only (Python's "restricting globals" recipe)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not DCP metadata, refused")
        return found


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata unpickling runs no code but DCP's classes'."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        # read_limited: a FIFO or /dev/zero in its place is refused, not waited on
        metadata = _MetadataUnpickler(io.BytesIO(read_limited(path))).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise ValueError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check(folder: Path) -> None:
    """Raise ``ValueError`` or ``OSError``, naming the file and the reason, when DCP checkpoint
    ``folder`` is damaged: ``.metadata`` missing or unreadable, or a shard file it names
    missing, not a regular file, outside the folder or shorter than the bytes it records."""
    metadata_path = Path(folder) / ".metadata"
    if not Path(folder).is_dir():
        raise ValueError(
            f"{folder} is missing" if not Path(folder).exists() else f"{folder} is not a folder"
        )
    try:
        metadata = SafeReader(str(folder)).read_metadata()
    except FileNotFoundError:
        raise ValueError(f"{metadata_path} is missing") from None
    except OSError:
        raise  # open_regular / read_limited name the file and what it is
    except UNPICKLING_ERRORS as exc:
        raise ValueError(
            f"{metadata_path} is not readable DCP metadata (cut short or damaged?): "
            f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        ) from None
    ends: dict[str, int] = {}  # shard file -> the last byte the metadata places in it
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        if Path(name).name != name:
            raise ValueError(f"{metadata_path} names a shard file outside its folder: {name!r}")
        path = Path(folder) / name
        if not path.exists():
            raise ValueError(f"{path} is missing")
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
        if size < end:
            raise ValueError(f"{path} is cut short: {size} bytes, its metadata places {end}")


def save(state: dict[str, Any], folder: Path, group: dist.ProcessGroup | None) -> None:
    """Write this rank's shards of ``state`` into ``folder`` (every rank calls this);
    ``group`` coordinates the ranks (a gloo group of its own, so a background writer never
    mixes with the training collectives)."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), process_group=group)


def load(template: dict[str, Any], folder: Path, group: dist.ProcessGroup | None) -> None:
    """Fill ``template`` (this job's own state, its DTensors sharded as now) in place; a
    ``ValueError`` naming the tensor when a shape differs (see :func:`check_shapes`)."""
    check_shapes(template, folder)
    try:
        dcp.load(template, storage_reader=SafeReader(str(folder)), process_group=group)
    except CheckpointException as exc:  # a BaseException, holding every rank's traceback
        raise ValueError(_first_failure(exc)) from None


def check_shapes(template: dict[str, Any], folder: Path) -> None:
    """Raise ``ValueError`` naming the first tensor of ``template`` whose shape in checkpoint
    ``folder`` differs (a run of another model shape): every rank reads the same metadata and
    has the same global shapes, so all refuse alike before DCP's collectives, where DCP would
    raise its "Size mismatch" traceback on every rank."""
    saved = SafeReader(str(folder)).read_metadata().state_dict_metadata
    flat, _ = flatten_state_dict(template)
    for key, value in flat.items():
        size = getattr(saved.get(key), "size", None)
        if isinstance(value, torch.Tensor) and size is not None and tuple(size) != value.shape:
            raise ValueError(
                f"{key} was saved as {list(size)} but is {list(value.shape)} in this model "
                "(another model.args, or weights of another run?); resume with the model the "
                "run was saved with, or train into a new --out"
            )


def _first_failure(exc: CheckpointException) -> str:
    """The first failing rank's own error, in one line."""
    for rank, (error, _) in sorted(exc.failures.items()):
        return f"rank {rank}: {type(error).__name__}: {' '.join(str(error).split())}"
    return "DCP failed on no named rank"


def read_full(folder: Path) -> dict[str, Any]:
    """Every tensor and value of a DCP checkpoint as plain (unsharded) ones, in one process
    without a process group: for inspection, export and tests."""
    # What torch's own dcp_to_torch_save does, with the safe reader (dcp.load fills a copy).
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader, planner = SafeReader(folder), _EmptyStateDictLoadPlanner()
    _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    return state
