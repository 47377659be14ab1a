"""Checkpoints that are complete or invisible: temp folder, marker written last, atomic rename.

Layout of ``OUT/checkpoints``::

    step-00001000/        a complete checkpoint (it holds COMPLETE.json)
      shared.pt           rank 0: model, optimizer, scheduler, scaler, EMA, step, config
      rank-00000.pt       each rank: its RNG states and its loader's exact-resume state (a job
                          of another size reads them all: its loader resumes from every one)
      rank-00001.pt
      weights/            FSDP2 runs: every rank's shards of model, optimizer and EMA (DCP),
                          which shared.pt then lacks (``train/run/dcp.py``)
      COMPLETE.json       written last: step, world size, files
    .tmp-step-00001500/   being written, or left by a killed writer: never "latest"

Every rank writes its own file into the temp folder, the ranks meet at a barrier, and rank 0
writes the marker, renames the folder to its final name and drops all but the newest
``keep`` checkpoints. A writer killed at any point leaves at most a temp folder, removed at
the next start. With ``async_save`` the state is first copied to CPU memory (so training can
modify the live tensors) and written by one background thread, one save in flight; the
barrier then runs on a separate gloo group so it never mixes with the training collectives.
With several nodes, ``OUT`` must be on a filesystem every node sees (rank 0 commits the
folder that all ranks write into).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from melcache.bounded import loads_json, open_regular, read_limited
from melcache.errors import UserError
from train.parallel.env import Env
from train.run import dcp

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
SHARED = "shared.pt"
FINAL = re.compile(r"^step-(\d{8})$")
TEMP_PREFIX = ".tmp-"


def rank_file(rank: int) -> str:
    """Name of one rank's private state file."""
    return f"rank-{rank:05d}.pt"


class Checkpointer:
    """``save(step, shared, local)`` / ``load()`` over the folder layout above."""

    def __init__(self, folder: Path, env: Env, *, keep: int, async_save: bool) -> None:
        self.folder, self.env, self.keep = Path(folder), env, keep
        self._group = dist.new_group(backend="gloo") if env.distributed else None
        self._pool = concurrent.futures.ThreadPoolExecutor(1) if async_save else None
        self._inflight: concurrent.futures.Future | None = None
        if env.is_main:
            self.folder.mkdir(parents=True, exist_ok=True)
            for stale in self.folder.glob(TEMP_PREFIX + "*"):
                log.info("removing unfinished checkpoint %s", stale)
                shutil.rmtree(stale)
        self._barrier()  # nobody writes before the stale folders are gone

    def save(
        self,
        step: int,
        shared: Mapping[str, Any],
        local: Mapping[str, Any],
        sharded: Mapping[str, Any] | None = None,
    ) -> None:
        """Write checkpoint ``step`` (every rank calls this, at the same step).

        ``shared`` is written by rank 0 only (other ranks may pass an empty dict); each rank
        writes its shards of ``sharded`` (DTensors) in DCP format. In async mode this returns
        once the state is copied to CPU; call :meth:`wait` before exit.
        """
        self.wait()  # one save in flight
        files = {rank_file(self.env.rank): dict(local)}
        if self.env.is_main:
            files[SHARED] = dict(shared)
        if sharded is not None:
            files[dcp.WEIGHTS] = dict(sharded)
        if self._pool is None:
            self._write(step, files)
        else:
            self._inflight = self._pool.submit(self._write, step, _to_cpu(files))

    def load_sharded(self, path: Path, template: dict[str, Any]) -> None:
        """Fill ``template`` in place from checkpoint ``path``'s DCP shards (every rank)."""
        try:
            dcp.load(template, path / dcp.WEIGHTS, self._group)
        except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as exc:
            raise UserError(
                f"{path / dcp.WEIGHTS} cannot be loaded as this model's sharded weights: "
                f"{_one_line(exc)}"
            ) from None

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its error."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            inflight.result()

    def close(self) -> None:
        """Finish the save in flight and stop the writer thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()

    def complete(self) -> list[Path]:
        """Every checkpoint whose marker exists, newest first."""
        return complete_checkpoints(self.folder)

    def latest(self) -> Path | None:
        """The newest checkpoint whose marker exists, or None."""
        return next(iter(self.complete()), None)

    def restore(self) -> tuple[Path, dict[str, Any], dict[str, Any]] | None:
        """``(path, shared, local)`` of the newest checkpoint every rank can load, or None when
        there is none. An unreadable one (a file of it, or its DCP ``weights/`` folder: its
        ``.metadata`` or a shard file missing, cut short or damaged) is named in a one-line
        warning and the next older one tried (all ranks agree on which); :class:`UserError`
        when none is left."""
        complete, problems = self.complete(), []
        for i, path in enumerate(complete):
            state, mine = None, ""
            try:
                state = self.load(path)
            except CorruptCheckpoint as exc:
                mine = str(exc)
            found = [p for p in self._gather(mine) if p]
            if not found:
                return path, *state
            problems.append(found[0])
            if self.env.is_main and i + 1 < len(complete):
                log.warning("%s; falling back to %s", found[0], complete[i + 1])
        if problems:
            raise UserError(
                f"{problems[-1]}; no earlier checkpoint is left in {self.folder} "
                f"({len(problems)} unreadable): start a new --out, or move the folder away "
                "to train from scratch"
            )
        return None

    def load(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(shared, local)`` of checkpoint ``path`` for this rank, loaded ``weights_only``;
        :class:`CorruptCheckpoint` naming the file that cannot be read."""
        marker = _read_marker(path / MARKER)
        world_size = marker["world_size"]
        shared = read_state(path / SHARED)
        if world_size == self.env.world_size:
            state = shared, read_state(path / rank_file(self.env.rank))
        else:
            state = shared, self._resized(path, world_size, shared["step"])
        listed = marker.get("files")
        if (path / dcp.WEIGHTS).exists() or (isinstance(listed, list) and dcp.WEIGHTS in listed):
            _check_weights(path / dcp.WEIGHTS)  # loaded later, into the sharded model
        return state

    def _resized(self, path: Path, world_size: int, step: int) -> dict[str, Any]:
        """This rank's local state from checkpoint ``path`` of a job of ``world_size`` ranks:
        every old rank's loader state (the loader resumes from all of them), the RNG of the
        old rank of this number (``None`` past the old ranks: seeded afresh) and no PowerSGD
        error feedback (it is per rank and restarts at zero)."""
        mine = read_state(path / rank_file(self.env.rank)) if self.env.rank < world_size else None
        return {
            "step": step,
            "rank": self.env.rank,
            "rng": None if mine is None else mine["rng"],
            "loader": self.loader_states(path, world_size),
            "resized_from": world_size,
        }

    def loader_states(self, path: Path, world_size: int | None = None) -> list[dict[str, Any]]:
        """Every rank's loader state in checkpoint ``path``, in rank order (what a job of
        another size or mix resumes its loader from)."""
        if world_size is None:
            world_size = _read_marker(path / MARKER)["world_size"]
        return [read_state(path / rank_file(rank))["loader"] for rank in range(world_size)]

    def _write(self, step: int, files: dict[str, dict[str, Any]]) -> None:
        name = f"step-{step:08d}"
        temp = self.folder / (TEMP_PREFIX + name)
        try:
            temp.mkdir(parents=True, exist_ok=True)
            for file_name, state in files.items():
                if file_name == dcp.WEIGHTS:
                    dcp.save(state, temp / file_name, self._group)
                else:
                    _write(state, temp / file_name)
        except (OSError, RuntimeError) as exc:  # torch reports a full disk as RuntimeError
            shutil.rmtree(temp, ignore_errors=True)  # a half-written checkpoint must not fill it
            raise self._write_error(name, exc) from None
        self._barrier()  # every rank's file is on disk
        if self.env.is_main:
            self._commit(step, temp, self.folder / name)

    def _write_error(self, name: str, exc: BaseException) -> UserError:
        """Why checkpoint ``name`` could not be written, and what is left to resume from."""
        free = shutil.disk_usage(self.folder).free / 2**20
        kept = self.latest()
        left = f"the previous checkpoint {kept.name} was kept" if kept else "no checkpoint yet"
        return UserError(
            f"cannot write checkpoint {name} in {self.folder} ({free:.0f} MiB free): "
            f"{_one_line(exc)}; {left}"
        )

    def _commit(self, step: int, temp: Path, final: Path) -> None:
        names = [SHARED] + [rank_file(r) for r in range(self.env.world_size)]
        if (temp / dcp.WEIGHTS).is_dir():
            names.append(dcp.WEIGHTS)
        marker = {"step": step, "world_size": self.env.world_size, "files": names}
        try:
            with open(temp / MARKER, "w", encoding="utf-8") as f:
                json.dump(marker, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            shutil.rmtree(temp, ignore_errors=True)
            raise self._write_error(final.name, exc) from None
        if final.exists():  # same step saved again (e.g. a re-run of a finished job)
            _remove(final)
        os.replace(temp, final)
        _fsync_dir(self.folder)
        log.info("checkpoint %s written", final)
        done = sorted(p for p in self.folder.glob("step-*") if FINAL.match(p.name))
        for old in done[: -self.keep]:
            _remove(old)

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def _gather(self, value: str) -> list[str]:
        """Every rank's ``value``, in rank order."""
        if self._group is None:
            return [value]
        values: list[str] = [""] * self.env.world_size
        dist.all_gather_object(values, value, group=self._group)
        return values


def _write(state: dict[str, Any], path: Path) -> None:
    """``torch.save`` then fsync, so the marker is never on disk before the data."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: Path) -> None:
    """Delete the marker first: a half-deleted checkpoint must not look complete."""
    (path / MARKER).unlink(missing_ok=True)
    shutil.rmtree(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _to_cpu(obj: Any) -> Any:
    """Deep copy with every tensor copied to CPU memory, detached from the live training state."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class CorruptCheckpoint(UserError):
    """A checkpoint file that cannot be read; the message names it and the reason."""


# What torch.load raises on bytes that are not a torch checkpoint (torch's zip reader and
# the weights_only unpickler do not wrap their errors): empty (EOFError), a cut zip
# (RuntimeError), random bytes (UnpicklingError, ValueError, ...).
_UNREADABLE = (RuntimeError, *dcp.UNPICKLING_ERRORS)


def _read_marker(marker: Path) -> dict[str, Any]:
    """The fields of ``marker`` (COMPLETE.json); :class:`CorruptCheckpoint` when it cannot be
    read or does not record the world size as a positive integer."""
    try:
        fields = loads_json(read_limited(marker).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpoint(f"{marker} cannot be read: {_one_line(exc)}") from None
    world_size = fields.get("world_size") if isinstance(fields, dict) else None
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise CorruptCheckpoint(f"{marker} records no world_size as a positive integer")
    return fields


def _check_weights(folder: Path) -> None:
    """:class:`CorruptCheckpoint` naming the file when DCP folder ``folder`` is damaged."""
    try:
        dcp.check(folder)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(_one_line(exc)) from None


def complete_checkpoints(folder: Path) -> list[Path]:
    """Every checkpoint in ``folder`` whose marker exists, newest first."""
    done = [p for p in folder.glob("step-*") if FINAL.match(p.name) and (p / MARKER).is_file()]
    return sorted(done, key=lambda p: p.name, reverse=True)


def read_state(file: Path, *, mmap: bool = False) -> dict[str, Any]:
    """``torch.load(weights_only=True)``: tensors and plain data only, never pickled code.
    ``mmap``: tensors are mapped, read only where used (an export reads no optimizer state)."""
    try:
        with open_regular(file) as f:  # a FIFO or a folder in its place is refused, not waited on
            source = str(file) if mmap else f  # torch maps a file by its name
            state = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise CorruptCheckpoint(
            f"{file} holds more than weights and plain data, refused (weights_only): "
            f"{_one_line(exc)}"
        ) from None
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{file} is missing") from None
    except OSError as exc:  # open_regular's own message names the file and what it is
        reason = exc.strerror or str(exc).removeprefix(f"{file} ")
        raise CorruptCheckpoint(f"{file} cannot be read: {reason}") from None
    except _UNREADABLE as exc:
        reason = type(exc).__name__ + (f": {_one_line(exc)}" if str(exc).strip() else "")
        raise CorruptCheckpoint(
            f"{file} is not a readable torch checkpoint (cut short or damaged?): {reason}"
        ) from None
    if not isinstance(state, dict):
        raise CorruptCheckpoint(f"{file} holds a {type(state).__name__}, not a checkpoint's dict")
    return state


def _one_line(exc: BaseException) -> str:
    """An exception's reason on one line: torch's span several, the first sentence of the
    unpickler's own line (or the first line) says what is wrong, the rest how to get past it."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    line = next((x for x in lines if x.startswith("WeightsUnpickler error:")), lines[0])
    return line.split(". ")[0].removeprefix("WeightsUnpickler error: ")
