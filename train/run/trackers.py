"""TensorBoard and W&B (``train.trackers``), fed the records ``metrics.jsonl`` gets, and never
able to slow or stop the run.

Rank 0 hands each record to every tracker's bounded queue (``put_nowait``: microseconds) and a
background thread per tracker opens it (imports its package, ``wandb.init``) and delivers the
records. A tracker that stalls (W&B offline hanging on a node without network, wandb #4217)
or fails costs the run nothing: it gets one warning, what it cannot take is dropped and
counted, and the run goes on; at the end the run waits at most ``CLOSE_SECONDS`` for it.
``metrics.jsonl`` stays the record that is always written. The W&B run id is part of a
checkpoint (:class:`TrackerState`), so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from melcache.errors import UserError
from train.parallel.env import Env
from train.run.tracker_backends import DESTINATIONS, MODULES, OPENERS, Backend, Opening

log = logging.getLogger(__name__)

QUEUE_RECORDS = 10_000  # ~4 MB of records: hours of logging at log_every = 1 before a drop
CLOSE_SECONDS = 10.0  # what a run's end waits for a tracker to deliver what it holds
_STOP = None  # the queue's last item: close the backend


class TrackerState:
    """What a checkpoint keeps of a run's tracking: the W&B run id (a plain string, so the
    checkpoint stays ``weights_only``-loadable)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.wandb_run_id: str | None = None
        if "wandb" in names:  # W&B's own variable names the run of a fresh start
            self.wandb_run_id = os.environ.get("WANDB_RUN_ID") or secrets.token_hex(4)

    def state_dict(self) -> dict[str, str]:
        return {} if self.wandb_run_id is None else {"wandb_run_id": self.wandb_run_id}

    def load_state_dict(self, state: dict[str, str]) -> None:
        """Continue the checkpoint's W&B run (a run that adds W&B on resume keeps its new id)."""
        saved = state.get("wandb_run_id")
        if saved is None or self.wandb_run_id is None:
            return
        wanted = os.environ.get("WANDB_RUN_ID")
        if wanted and wanted != saved:
            log.warning(
                "WANDB_RUN_ID=%s is set, but the checkpoint's W&B run %s is resumed", wanted, saved
            )
        self.wandb_run_id = saved


class Tracked:
    """One tracker behind its bounded queue and background thread."""

    def __init__(
        self,
        name: str,
        opener: Callable[[], Backend],
        *,
        capacity: int | None = None,
        close_seconds: float | None = None,
    ) -> None:
        self.name = name
        self.capacity = QUEUE_RECORDS if capacity is None else capacity
        self.close_seconds = CLOSE_SECONDS if close_seconds is None else close_seconds
        self._dropped = self._lost = 0  # records refused at the queue; left in it at a failure
        self._queue: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue(self.capacity)
        self._failed = threading.Event()
        self._warned = threading.Lock()  # held for good once the one warning is out
        # A daemon: a tracker hung in a network call must not keep the process alive.
        self._thread = threading.Thread(
            target=self._run, args=(opener,), name=f"tracker-{name}", daemon=True
        )
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Records that never reached the tracker (so far)."""
        return self._dropped + self._lost

    def put(self, kind: str, *args: Any) -> None:
        """Queue one call (``"scalars"`` or ``"picture"``) without ever blocking the loop."""
        if self._failed.is_set():
            self._dropped += 1
            return
        try:
            self._queue.put_nowait((kind, args))
        except queue.Full:
            self._dropped += 1
            self._warn(
                f"tracker {self.name} is not keeping up ({self.capacity} records queued): "
                "its records are dropped and counted from here on; the run goes on"
            )

    def close(self) -> None:
        """Let the tracker deliver what it holds and close, for ``close_seconds`` at most."""
        deadline = time.monotonic() + self.close_seconds
        # A full queue means a stuck thread: the join below then times out as well.
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=self.close_seconds)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            lost = self.dropped + self._queue.qsize()
            self._warn(
                f"tracker {self.name} did not finish within {self.close_seconds:g} s; "
                f"about {lost} records did not reach it; the run ends anyway"
            )
        elif self.dropped:
            log.info("tracker %s: %d records were dropped", self.name, self.dropped)

    def _run(self, opener: Callable[[], Backend]) -> None:
        backend = None
        try:
            backend = opener()
            while (item := self._queue.get()) is not _STOP:
                kind, args = item
                getattr(backend, kind)(*args)
            backend.close()
        except Exception as exc:  # the tracker's failure, never the run's
            self._failed.set()
            self._lost = self._queue.qsize() + 1  # and the call that failed
            self._warn(
                f"tracker {self.name} failed ({type(exc).__name__}: {exc}); it is off for "
                "the rest of the run, which goes on"
            )
            self._close_quietly(backend)

    def _close_quietly(self, backend: Backend | None) -> None:
        """Release a failed tracker's files and threads if it still can."""
        if backend is None:
            return
        try:
            backend.close()
        except Exception as exc:  # already warned: the reason for this one goes to the debug log
            log.debug("tracker %s: close after its failure: %s", self.name, exc)

    def _warn(self, message: str) -> None:
        """The tracker's one warning; later problems go to the debug log."""
        if self._warned.acquire(blocking=False):
            log.warning(message)
        else:
            log.debug(message)


class Trackers:
    """Every tracker of the run (none on ranks other than 0): one call fans a record out."""

    def __init__(self, tracked: list[Tracked] | None = None) -> None:
        self.tracked = tracked or []

    def record(self, record: dict[str, Any]) -> None:
        """A ``metrics.jsonl`` record (``{"step": N, ...}``) to every tracker, as scalars."""
        if self.tracked:
            step, values = record["step"], scalars(record)
            for tracker in self.tracked:
                tracker.put("scalars", step, values)

    def picture(self, step: int, tag: str, path: Path) -> None:
        """A PNG the run wrote (a validation picture) to every tracker."""
        for tracker in self.tracked:
            tracker.put("picture", step, tag, Path(path))

    def close(self) -> None:
        """Close every tracker, each waiting at most its ``close_seconds``; call in a ``finally``."""
        for tracker in self.tracked:
            tracker.close()


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a record by name; an event's (``{"event": "spike", ...}``) prefixed with
    its kind (``spike/loss``), and ``event/KIND`` = 1 marking when it happened."""
    event = record.get("event")
    prefix = f"{event}/" if isinstance(event, str) else ""
    out = {f"event/{event}": 1.0} if prefix else {}
    for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + key] = float(value) if math.isfinite(value) else value
    return out


def open_trackers(names: tuple[str, ...], env: Env, opening: Opening, **limits: Any) -> Trackers:
    """The run's trackers on rank 0 (none elsewhere), each opening on its own thread. A
    tracker whose package is not installed is refused here, in one line, before training."""
    if not env.is_main or not names:
        return Trackers()
    for name in names:
        if importlib.util.find_spec(MODULES[name]) is None:
            raise UserError(
                f"train.trackers names {name}, but its package {MODULES[name]} is not "
                "installed: pip install 'melcache[trackers]'"
            )
        _check_destination(name, DESTINATIONS[name](opening))
    return Trackers([Tracked(name, lambda o=OPENERS[name]: o(opening), **limits) for name in names])


def _check_destination(name: str, folder: Path) -> None:
    """Refuse, in one line before the first step, a tracker that could not write a record:
    every record of the run would be lost, and the run would say so only at its end."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = (
            "is a file, not a folder" if folder.is_file() else f"cannot be made ({exc.strerror})"
        )
        raise UserError(f"tracker {name} writes into {folder}, which {reason}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"tracker {name} writes into {folder}, which is not writable")
