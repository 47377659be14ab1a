"""One owner per folder: a lock file naming its holder's host and pid, held while it runs.

The kernel's ``flock`` decides who holds it: it is released however the holder ends (a
``kill -9`` included), so a stale lock is simply taken, and NFSv4 shares it between machines.
The file's content (host, pid, start time) only names the holder in the refusal. On a
filesystem that cannot lock, the holder it names is judged by :func:`process_alive` instead.
The file is never deleted: unlinking a locked file lets a second process lock a fresh one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from melcache.bounded import loads_json
from melcache.errors import UserError
from melcache.format import HOST_TAG


def process_alive(host: str, pid: int) -> bool:
    """Whether the process may still be running: a process here, or anything elsewhere."""
    if host not in ("", HOST_TAG):
        return True  # another machine's process cannot be asked; assume it runs
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    fields = process_stat(pid)  # None: no /proc here, or it exited just now
    return fields is None or fields[0] not in ("Z", "X")  # a zombie writes nothing


def process_stat(pid: int) -> list[str] | None:
    """The fields of Linux's ``/proc/PID/stat`` after the command name (state, ppid, pgrp,
    ...); ``None`` where there is no /proc or the process is gone. A killed build's orphaned
    pool workers stay zombies (state Z) under a PID 1 that never reaps (containers)."""
    try:  # "pid (comm) state ..."; comm may hold spaces and parentheses
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields or None


class FolderLock:
    """``path`` locked by this process until :meth:`release`; :class:`UserError` naming the
    holder when another live process holds it (``what`` says what the folder is for)."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = Path(path)
        # O_NONBLOCK: a FIFO planted under the lock's name must not block the open.
        flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
        self.fd: int | None = os.open(self.path, flags, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                raise OSError(f"{self.path} is not a regular file")
            self._take(what)
            info = {"host": socket.gethostname(), "tag": HOST_TAG, "pid": os.getpid()}
            info["started"] = time.strftime("%Y-%m-%d %H:%M:%S")
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps(info).encode(), 0)
        except BaseException:
            self.release()
            raise

    def _take(self, what: str) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = self._holder()
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            holder = self._holder()  # this filesystem cannot lock: trust a live pid
            if holder is None or not process_alive(holder["tag"], holder["pid"]):
                return
        who = "another process" if holder is None else _describe(holder)
        raise UserError(
            f"{self.path.parent} is in use by {who} ({what}); wait for it to end or choose "
            f"another folder (its lock is {self.path})"
        )

    def _holder(self) -> dict | None:
        """The holder the file names, or None when it names none (being written, foreign)."""
        try:
            info = loads_json(os.pread(self.fd, 4096, 0))
            return {"host": str(info.get("host", info["tag"])), "tag": str(info["tag"]),
                    "pid": int(info["pid"]), "started": str(info.get("started", "?"))}  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def release(self) -> None:
        """Stop naming this process and unlock (closing the descriptor unlocks)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):  # a full disk: the lock goes with the fd anyway
            os.ftruncate(self.fd, 0)
        os.close(self.fd)
        self.fd = None


def _describe(holder: dict) -> str:
    return f"pid {holder['pid']} on host {holder['host']} (since {holder['started']})"
