"""Loader samples/s of this checkout against earlier commits, side by side.

    python -m benchmarks.loader.loader_ab --cache CACHE --against REV [REV ...] [--rounds 8]

Each setting is a commit (each ``--against`` revision checked out with ``git worktree`` into a
temporary folder, then ``checkout``: this one as it is, uncommitted edits included) and,
where the commit has the key, ``data.sync_buckets`` on or off. A turn is one fresh process that
streams the cache with 2 workers (``batch_frames`` 32000, shard check ``fast``) for
``--turn-seconds`` after its first batch; the rounds run the settings in alternating order,
so a change in the machine's load falls on all of them alike. Prints per setting its median
turn and spread, and the median (and range) within a round of its ratio to the first
setting (the first ``--against`` commit's). Commits must read this cache and have
``melcache.loader.make_loader`` or, before the loader moved beside the format, ``train.data``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One turn, run in the commit's folder: only the public loader API, as old commits have it.
TURN = """
import json, pathlib, sys, time
here = pathlib.Path.cwd().resolve()
# The loader beside the format (#36 on), or train.data in commits before it. Decided by the
# commit's tree: an editable install would otherwise find this checkout's melcache.loader.
if (here / "melcache" / "loader").is_dir():
    import melcache.loader as api
else:
    import train.data as api
module = sys.modules[api.make_loader.__module__]
if not pathlib.Path(module.__file__).resolve().is_relative_to(here):
    sys.exit(f"imported {module.__file__}, not the commit in {here}")
make_loader, DataConfig = api.make_loader, api.DataConfig
cache, seconds, sync = sys.argv[1], float(sys.argv[2]), sys.argv[3]
keys = dict(batch_frames=32000, num_workers=2, shard_check="fast")
if sync != "-":
    keys["sync_buckets"] = sync == "on"
stream = iter(make_loader(cache, DataConfig(**keys)))
next(stream)
start, count = time.perf_counter(), 0
while time.perf_counter() - start < seconds:
    count += len(next(stream))
print(json.dumps(count / (time.perf_counter() - start)))
"""


def has_sync_key(folder: Path) -> bool:
    """Whether the commit in ``folder`` has ``data.sync_buckets`` (added with the schedule)."""
    homes = [folder / "melcache" / "loader" / "data_config.py", folder / "train" / "config.py"]
    return any(p.is_file() and "sync_buckets" in p.read_text() for p in homes)


def turn(folder: Path, cache: Path, seconds: float, sync: str) -> float:
    """Samples/s of one fresh loader process of the commit in ``folder``."""
    env = {**os.environ, "PYTHONPATH": str(folder)}
    command = [sys.executable, "-c", TURN, str(cache), str(seconds), sync]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{folder}: the loader failed: {done.stderr.strip().splitlines()[-1]}")
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--against", nargs="+", required=True, help="earlier revisions (git)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--turn-seconds", type=float, default=3.0)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="melcache-ab-") as scratch:
        commits = [(rev, Path(scratch) / str(i)) for i, rev in enumerate(args.against)]
        for rev, folder in commits:
            git = ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet"]
            subprocess.run([*git, str(folder), rev], check=True)
        try:
            settings = [
                (rev, folder, sync)
                for rev, folder in [*commits, ("checkout", ROOT)]
                for sync in (("on", "off") if has_sync_key(folder) else ("-",))
            ]
            rates: list[list[float]] = [[] for _ in settings]
            for round_ in range(args.rounds):
                order = range(len(settings)) if round_ % 2 == 0 else reversed(range(len(settings)))
                for i in order:
                    _, folder, sync = settings[i]
                    rates[i].append(turn(folder, args.cache, args.turn_seconds, sync))
        finally:
            for _, folder in commits:
                remove = ["git", "-C", str(ROOT), "worktree", "remove", "--force"]
                subprocess.run([*remove, str(folder)], check=False)
    first = rates[0]
    for (rev, _, sync), rate in zip(settings, rates, strict=True):
        ratios = [a / b for a, b in zip(rate, first, strict=True)]
        print(json.dumps({
            "revision": rev, "sync_buckets": {"on": True, "off": False}.get(sync),
            "turns": len(rate), "samples_per_s_median": round(statistics.median(rate)),
            "samples_per_s_min": round(min(rate)), "samples_per_s_max": round(max(rate)),
            "ratio_to_first_median": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
