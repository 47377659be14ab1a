"""Tools for fault-injection tests: builds to kill, a tiny disk, permissions that bind on root.

Every process started here runs in its own session, so a test can SIGKILL the build alone
(as ``kill -9 PID`` would) or its whole process group (as a job scheduler would), and a
``finally`` can always reap what is left.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import REPO

from melcache.format import INDEX_NAME, REJECTED_NAME

RECEIPTS = ".build"  # preprocess.build.RECEIPTS; importing build would import torch here
# Capabilities that let root read and search anything whatever its mode bits say.
READ_OVERRIDES = "-dac_override,-dac_read_search"


def build_args(src: Path, out: Path, *extra: str) -> list[str]:
    """``build --src SRC --out OUT EXTRA…``: arguments for ``run_preprocess``."""
    return ["build", "--src", str(src), "--out", str(out), *extra]


def build_command(src: Path, out: Path, *extra: str) -> list[str]:
    """``python -m preprocess build --src SRC --out OUT EXTRA…`` as a command line."""
    return [sys.executable, "-m", "preprocess", *build_args(src, out, *extra)]


@contextlib.contextmanager
def started(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``command`` in a new session (stdout and stderr to ``log``); SIGKILL its group on exit."""
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def receipts(out: Path) -> int:
    """Shards a build in ``out`` has acknowledged so far."""
    return len(list((out / RECEIPTS).glob("*.json")))


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Poll ``condition`` every 5 ms until it holds (True) or ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


def group_gone(pgid: int, timeout: float) -> bool:
    """Whether every process of group ``pgid`` (orphaned pool workers too) exits in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _live_members(pgid):
            return True
        time.sleep(0.02)
    return False


def _live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies: an orphan exits into a zombie that
    only its new parent can reap, and PID 1 of a container may never do so."""
    if not Path("/proc/self/stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid pgrp ..."; comm may hold spaces and parentheses
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(pgrp) == pgid and state != "Z":
            live.append(int(stat.parent.name))
    return live


def pool_workers(pid: int) -> list[int]:
    """Child process ids of ``pid`` (Linux /proc); the test is skipped elsewhere."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if not children.exists():
        pytest.skip("needs /proc/PID/task/PID/children (Linux) to find the pool workers")
    return [int(x) for x in children.read_text().split()]


def cache_digests(cache: Path) -> dict[str, str]:
    """sha256 of every shard, of index.json and of rejected.jsonl."""
    paths = [*sorted(cache.glob("*.tar")), cache / INDEX_NAME, cache / REJECTED_NAME]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def tree(root: Path) -> list[str]:
    """Every path under ``root``, relative and sorted: a snapshot to compare."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---- a small disk ------------------------------------------------------------------------
@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``mount`` syntax, e.g. ``900k``) on ``folder``, or skip."""
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount/umount here: cannot make a small disk to fill")
    done = _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(folder))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs (needs root or CAP_SYS_ADMIN): {done.stderr}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True, timeout=60).returncode:
            subprocess.run(["umount", "-l", str(folder)], check=True, timeout=60)  # busy: detach


def resize_tmpfs(folder: Path, size: str) -> None:
    """Grow a tmpfs mounted by :func:`small_tmpfs` in place, keeping its files (space freed)."""
    done = _mount("-o", f"remount,size={size}", str(folder))
    assert done.returncode == 0, f"cannot resize the tmpfs on {folder}: {done.stderr}"


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=60)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout, done.stderr.strip())


# ---- permissions that bind -----------------------------------------------------------------
@functools.cache
def _read_override_prefix() -> tuple[tuple[str, ...], str]:
    """A command prefix under which mode bits bind, or ``((), reason)`` when none works."""
    if os.geteuid() != 0:
        return (), ""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return (), "running as root without setpriv: a chmod 000 file stays readable"
    # Root keeps its uid (so the interpreter and packages under /root stay reachable) but
    # loses the two capabilities that bypass permission bits, for the command and its children.
    prefix = (setpriv, f"--bounding-set={READ_OVERRIDES}", f"--inh-caps={READ_OVERRIDES}")
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"melcache-unreadable-{os.getpid()}"
    probe.write_text("secret")
    probe.chmod(0)
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-c", f"open({str(probe)!r}).read()"],
            capture_output=True,
            timeout=60,
        )
    finally:
        probe.unlink()
    if done.returncode == 0:
        return (), "root still reads a chmod 000 file after dropping CAP_DAC_OVERRIDE here"
    return prefix, ""


def unprivileged_prefix() -> list[str]:
    """Prefix for a command that must not read files it has no permission for; else skip."""
    prefix, reason = _read_override_prefix()
    if reason:
        pytest.skip(reason)
    return list(prefix)
