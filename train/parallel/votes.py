"""What every rank must agree on each step: the graceful-stop flag (SIGTERM/SIGINT) and
the host vote that carries it, out-of-memory losses and spikes in one small all-reduce.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from train.parallel.env import Env


class StopFlag:
    """SIGTERM / SIGINT ask for a graceful stop: finish the step, checkpoint, exit 0.

    The handler only sets a flag. Ranks may get the signal at different moments, so the
    trainer sums the flag over ranks in the :class:`HostVote` that ends every step: every rank
    stops after the same step.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopFlag]:
        """Handlers active inside the ``with`` (main thread only; a no-op elsewhere)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    @property
    def local(self) -> float:
        """1.0 once this process got a signal (the value it contributes to the all-reduce)."""
        return 0.0 if self.received is None else 1.0


class HostVote:
    """One small all-reduce per step, on the host (a gloo group of its own), through which the
    ranks agree on what only one of them may know: a stop signal, a step lost to an
    out-of-memory error.

    Both are known on the host (a signal handler ran; the failing op's launch raised), so a
    vote never waits for the device, and in a job without a process group it is the local
    value. A dict gathered from every rank travels the same way when a step needs details.
    """

    def __init__(self, env: Env) -> None:
        self.world_size = env.world_size
        self.group = dist.new_group(backend="gloo") if env.distributed else None

    def sum(self, values: list[float]) -> list[float]:
        """``values`` summed over ranks (every rank calls this at the same point)."""
        if self.group is None:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor.tolist()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable, from our own ranks only), in rank order."""
        if self.group is None:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        return values
