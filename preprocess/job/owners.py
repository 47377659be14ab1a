"""Who else writes this ``OUT``: builds say they are running, and sweep only what is stale.

Two builds may write one ``OUT`` at once: parts of a job array on several machines, a retry
started while the first attempt still runs, a command typed twice. Each shard is then
written whole by each, atomically, with the same bytes, so the cache ends correct; what must
not happen is one build deleting the temporary files another is still writing. Each build
leaves a marker in ``OUT/.build/`` while it runs, names the other builds it finds, and
removes a temporary file only when its writer (named in the file's name) is gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from melcache.format import HOST_TAG, temp_owner
from melcache.host.lock import process_alive

log = logging.getLogger(__name__)
MARKER_PREFIX = "running."


@contextlib.contextmanager
def running_build(folder: Path, part: tuple[int, int]) -> Iterator[None]:
    """Mark this build (part K of N) as running in ``folder`` (``OUT/.build``) while the
    block runs, and warn about each other build of the same part marked there that is still
    running (other parts are expected)."""
    for other in live_builds(folder):
        if other.get("part", [0, 1]) != list(part):
            continue
        log.warning(
            "another build is writing %s: pid %d on host %s, since %s; both end with the same "
            "cache (each writes whole shards atomically), the second does redundant work",
            folder.parent,
            other["pid"],
            other.get("host", other["tag"]),
            other.get("started", "?"),
        )
    marker = folder / f"{MARKER_PREFIX}{HOST_TAG}-{os.getpid()}"
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    info = {
        "host": socket.gethostname(),
        "tag": HOST_TAG,
        "pid": os.getpid(),
        "started": started,
        "part": list(part),
    }
    marker.write_text(json.dumps(info))
    try:
        yield
    finally:
        marker.unlink(missing_ok=True)


def live_builds(folder: Path) -> list[dict[str, Any]]:
    """The markers in ``folder`` of builds still running (those of killed ones are removed)."""
    live = []
    for marker in sorted(folder.glob(MARKER_PREFIX + "*")):
        try:
            other = json.loads(marker.read_text())
            host, pid = other["tag"], int(other["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half written by a build starting right now, or foreign: not ours to judge
        if not process_alive(host, pid):
            marker.unlink(missing_ok=True)  # left by a killed build
            continue
        live.append({**other, "pid": pid})
    return live


def sweep_temps(out: Path) -> None:
    """Remove the temporary files in ``out`` whose writers are gone (killed runs); leave those
    of processes still running here and of other machines, which may still be writing."""
    kept = 0
    for temp in sorted(out.glob("*.tmp")):
        owner = temp_owner(temp.name)
        if owner is not None and process_alive(*owner):
            kept += 1
            continue
        shutil.rmtree(temp, ignore_errors=True) if temp.is_dir() else temp.unlink(missing_ok=True)
    if kept:
        log.info("left %d temporary files of builds that may still be running", kept)
