"""Which part of a build this process is, and how the parts wait for each other.

``--part K/N`` says it outright. Under ``torchrun`` the part is the rank, and the parts wait
for each other with gloo barriers; otherwise they meet through files in the shared ``OUT``
(each part's scan, then each shard's receipt). ``RANK`` and ``WORLD_SIZE`` alone, which many
launchers export, do not split a build: that would write 1/N of a cache and exit 0.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable

import torch.distributed as dist

log = logging.getLogger(__name__)
_POLL_SECONDS = 2.0
_REPORT_SECONDS = 30.0
_BARRIER_TIMEOUT = datetime.timedelta(days=3)  # a part may scan or write for many hours


def under_torchrun() -> bool:
    """Whether torchrun started this process (its agent sets ``TORCHELASTIC_RUN_ID``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def choose_part(asked: tuple[int, int] | None) -> tuple[int, int]:
    """The part to build: ``--part`` if given, else torchrun's rank, else the whole corpus
    (with a warning when ``RANK``/``WORLD_SIZE`` suggest the user expected a split)."""
    if asked is not None:
        return asked
    if under_torchrun():
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    world = os.environ.get("WORLD_SIZE", "1")
    if world not in ("", "1"):
        log.warning(
            "WORLD_SIZE=%s RANK=%s are set but this is not torchrun: building the WHOLE corpus. "
            "Pass --part K/N to build one part of N.",
            world,
            os.environ.get("RANK", "?"),
        )
    return 0, 1


class Meeting:
    """Where the parts of one build wait for each other: gloo under torchrun, else polling."""

    def __init__(self, part: int, parts: int) -> None:
        self.part, self.parts = part, parts
        self.collective = parts > 1 and under_torchrun()
        if self.collective and not dist.is_initialized():
            dist.init_process_group("gloo", timeout=_BARRIER_TIMEOUT)

    def close(self) -> None:
        """Leave the process group, if this meeting joined one."""
        if self.collective and dist.is_initialized():
            dist.destroy_process_group()

    def wait(self, what: str, done: Callable[[], int]) -> None:
        """Return once ``done()`` counts all parts; say every 30 s how many are done."""
        if self.collective:
            log.info("part %d/%d: waiting for the other parts' %s", self.part, self.parts, what)
            dist.barrier()
            return
        reported = time.monotonic()
        while (count := done()) < self.parts:
            if time.monotonic() - reported >= _REPORT_SECONDS:
                log.info(
                    "part %d/%d: waiting for the other parts' %s: %d of %d done "
                    "(every part must run, at once or before this one)",
                    self.part,
                    self.parts,
                    what,
                    count,
                    self.parts,
                )
                reported = time.monotonic()
            time.sleep(_POLL_SECONDS)

    def barrier(self) -> None:
        """Under torchrun, wait for every rank; otherwise nothing (files carry the state)."""
        if self.collective:
            dist.barrier()
