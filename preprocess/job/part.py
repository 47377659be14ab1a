"""Which part of a build this process is, and how the parts wait for each other.

``--part K/N`` says it outright. Under ``torchrun`` the part is the rank, and the parts wait
for each other with gloo barriers; in a Slurm job array it is the task's place in the array
(``SLURM_ARRAY_TASK_ID`` − ``SLURM_ARRAY_TASK_MIN`` of ``SLURM_ARRAY_TASK_COUNT``, so arrays
numbered from 1 work too); otherwise the parts meet through files in the shared ``OUT`` (each
part's scan, then each shard's receipt). ``RANK`` and ``WORLD_SIZE`` alone, which many
launchers export, do not split a build: that would write 1/N of a cache and exit 0.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Mapping

import torch.distributed as dist

from melcache.errors import UserError

log = logging.getLogger(__name__)
_POLL_SECONDS = 2.0
_REPORT_SECONDS = 30.0
_BARRIER_TIMEOUT = datetime.timedelta(days=3)  # a part may scan or write for many hours


def under_torchrun() -> bool:
    """Whether torchrun started this process (its agent sets ``TORCHELASTIC_RUN_ID``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def choose_part(asked: tuple[int, int] | None) -> tuple[tuple[int, int], str]:
    """The part to build and where it came from: ``--part`` if given, else torchrun's rank,
    else the Slurm array task, else the whole corpus (with a warning when ``RANK``/
    ``WORLD_SIZE`` suggest the user expected a split)."""
    if asked is not None:
        return asked, "--part"
    array = slurm_array_part(os.environ)
    if under_torchrun():
        if array is not None:  # an array of torchrun jobs: which split is meant is a guess
            raise UserError(
                f"both torchrun (RANK={os.environ['RANK']}) and a Slurm array "
                f"({array[1]}) could name this build's part: pass --part K/N"
            )
        rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
        return (int(rank), int(world)), f"torchrun's RANK={rank} WORLD_SIZE={world}"
    if array is not None:
        return array
    world = os.environ.get("WORLD_SIZE", "1")
    if world not in ("", "1"):
        log.warning(
            "WORLD_SIZE=%s RANK=%s are set but this is not torchrun: building the WHOLE corpus. "
            "Pass --part K/N to build one part of N.",
            world,
            os.environ.get("RANK", "?"),
        )
    return (0, 1), "no --part, torchrun or Slurm array"


_ARRAY = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT")


def slurm_array_part(env: Mapping[str, str]) -> tuple[tuple[int, int], str] | None:
    """The part of a Slurm array task (``None`` outside an array) and the variables it came
    from. Values that do not describe one contiguous array are refused in one line: a
    stepped or listed array (``--array=0-8:2``, ``1,4,7``) has ids that ``ID − MIN`` would
    map onto parts some task never builds, and the cache would never finish."""
    if "SLURM_ARRAY_TASK_ID" not in env:
        return None
    said = " ".join(f"{name}={env.get(name, '(unset)')}" for name in _ARRAY)
    fix = "pass --part K/N (0-based) to each task"
    try:
        task, low, count = (int(env[name]) for name in _ARRAY)
        high = int(env.get("SLURM_ARRAY_TASK_MAX", low + count - 1))
    except (KeyError, ValueError):
        raise UserError(f"a Slurm array task with {said}: expected integers; {fix}") from None
    step = env.get("SLURM_ARRAY_TASK_STEP", "1")
    if count < 1 or not low <= task < low + count or high != low + count - 1 or step != "1":
        raise UserError(
            f"a Slurm array task with {said} SLURM_ARRAY_TASK_MAX={high} "
            f"SLURM_ARRAY_TASK_STEP={step} is not one of COUNT tasks numbered MIN, MIN+1, ...; "
            f"{fix}"
        )
    return (task - low, count), said


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
