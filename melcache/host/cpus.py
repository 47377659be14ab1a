"""How many CPUs this process may use, for default worker counts.

``os.cpu_count()`` counts the machine's cores. A Slurm job or a container gets fewer: an
affinity mask (``taskset``, Slurm's ``--cpus-per-task`` with task binding) and a cgroup CPU
quota (Docker ``--cpus``, Kubernetes limits) that throttles the whole group once it is spent.
Defaults from the machine's count oversubscribe (LitData #417), so both bounds count here.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclasses.dataclass(frozen=True)
class Allotment:
    """The CPUs this process may use and why: ``affinity`` CPUs in its mask, ``quota`` CPUs
    of cgroup time per period (``None``: no quota is set)."""

    affinity: int
    quota: float | None

    @property
    def cpus(self) -> int:
        """The smaller bound, at least 1; a fractional quota rounds down (1.5 CPUs of time
        keep one worker busy, a second would spend half its time throttled)."""
        if self.quota is None:
            return max(1, self.affinity)
        return max(1, min(self.affinity, math.floor(self.quota)))

    def describe(self) -> str:
        """``"affinity mask 4, cgroup quota 2.5"``: why, for the line that states a default."""
        quota = "no cgroup quota" if self.quota is None else f"cgroup quota {self.quota:g}"
        return f"affinity mask {self.affinity}, {quota}"


def allotment(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> Allotment:
    """This process's :class:`Allotment` (the cgroup files are read from ``root``)."""
    if hasattr(os, "sched_getaffinity"):
        affinity = len(os.sched_getaffinity(0))
    else:  # macOS, Windows: no affinity masks to honour
        affinity = os.cpu_count() or 1
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:  # not Linux
        lines = []
    return Allotment(affinity, cgroup_quota(lines, root))


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity mask, capped by a cgroup quota."""
    return allotment().cpus


def cgroup_quota(lines: list[str], root: Path = CGROUP_ROOT) -> float | None:
    """CPUs of quota for the cgroups named by ``/proc/self/cgroup``'s ``lines``: v2's
    ``cpu.max`` or v1's ``cpu.cfs_quota_us`` ÷ ``cpu.cfs_period_us``, the smallest along the
    path up to the root (a parent's limit binds its children); ``None`` where none is set."""
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: "0::/path"
            found += [_v2(folder) for folder in _up(root, path)]
        elif "cpu" in controllers.split(","):  # v1: "4:cpu,cpuacct:/path"
            mount = root / controllers
            found += [_v1(folder) for folder in _up(mount, path)]
    limits = [q for q in found if q is not None]
    return min(limits) if limits else None


def _up(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and its parents up to ``mount``. Inside a container the path names
    the host's hierarchy while ``mount`` is the container's own root, which is then all
    that exists."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [mount.joinpath(*parts[:end]) for end in range(len(parts), -1, -1)]


def _v2(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
