"""Planning at corpus scale: scan and plan time and peak memory of ``build --dry-run``.

    python -m benchmarks.build.scale_bench [--sizes 100000 250000 1000000 3000000] [--data DIR]

Makes (or reuses) a synthetic corpus cheaply: a few real wav files of the sample corpus,
hard-linked under unique names (1,000 per folder), and a JSONL manifest whose rows carry a
``duration``, the layout of NeMo/Emilia-style manifests. Each size is a prefix of one
manifest. For each size a fresh process runs ``build --dry-run`` (scan + plan, nothing
decoded) into a fresh OUT and reports its scan and plan seconds and peak RSS; then the
growth per utterance between sizes, so fixed costs (imports, torch) cancel; then the largest
size ≤ 1M scanned by 2 parts at once against 1 part on the same cores. The peak RSS is the
planning process's (the scanning workers hold only their own piece's columns). One JSON
line per row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.linked_corpus import make_manifest
from benchmarks.common.timed_calls import timing

REPO = Path(__file__).resolve().parents[2]


def child(manifest: Path, out: Path, part: str, workers: int) -> None:
    """Run one dry run here, timing scan and plan; print one JSON line."""
    import preprocess.build as build_module
    from preprocess.config import load_config

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    k, n = (int(x) for x in part.split("/"))
    features, config = load_config(None)
    options = build_module.BuildOptions(manifest, out, workers, (k, n), dry_run=True)
    with timing(build_module, ["scan_part", "make_plan"]) as spent:
        started = time.perf_counter()
        build_module.build(options, features, config)
        wall = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "scan_s": round(spent["scan_part"], 3),
                "plan_s": round(spent["make_plan"], 3),
                "wall_s": round(wall, 3),
                "peak_rss_mb": round(peak / 1024, 1),
                "rss_before_mb": round(before / 1024, 1),
            }
        )
    )


def dry_runs(manifest: Path, parts: int, workers: int) -> list[dict[str, Any]]:
    """``parts`` dry-run processes at once into one fresh OUT; their rows."""
    out = Path(tempfile.mkdtemp(prefix="scale-out-", dir=manifest.parent))
    command = [
        sys.executable,
        "-m",
        "benchmarks.build.scale_bench",
        "--child",
        str(manifest),
        str(out),
    ]
    procs = [
        subprocess.Popen(
            [*command, f"{k}/{parts}", str(workers)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for k in range(parts)
    ]
    rows = []
    for proc in procs:
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"dry run of {manifest} failed with status {proc.returncode}")
        rows.append(json.loads(stdout.strip().splitlines()[-1]))
    shutil.rmtree(out)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[100_000, 250_000, 1_000_000, 3_000_000]
    )
    parser.add_argument("--workers", type=int, default=2, help="--workers of each build")
    parser.add_argument("--data", type=Path, default=Path("/tmp/melcache-scale"))
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        manifest, out, part, workers = args.child
        child(Path(manifest), Path(out), part, int(workers))
        return
    args.data.mkdir(parents=True, exist_ok=True)
    sizes = sorted(args.sizes)
    for size in sizes:  # the biggest last: the smaller manifests are its prefixes' links
        make_manifest(args.data, size)
    measured: dict[int, dict[str, Any]] = {}
    for size in sizes:
        row = dry_runs(args.data / f"manifest-{size}.jsonl", 1, args.workers)[0]
        measured[size] = row
        print(json.dumps({"row": "dry run", "utterances": size, **row}), flush=True)
    for small, big in itertools.pairwise(sizes):
        extra = big - small
        grown = {
            "bytes_per_utt": round(
                (measured[big]["peak_rss_mb"] - measured[small]["peak_rss_mb"]) * 2**20 / extra, 1
            ),
            "us_per_utt": round(
                (
                    measured[big]["scan_s"]
                    + measured[big]["plan_s"]
                    - measured[small]["scan_s"]
                    - measured[small]["plan_s"]
                )
                * 1e6
                / extra,
                2,
            ),
        }
        print(json.dumps({"row": "growth", "from": small, "to": big, **grown}), flush=True)
    # The same cores either way: 1 part of 2 workers, 2 parts of 1 worker (as 2 machines
    # sharing OUT would run, here squeezed onto one), and 1 part of 1 worker for scale.
    size = max((s for s in sizes if s <= 1_000_000), default=sizes[0])
    manifest = args.data / f"manifest-{size}.jsonl"
    single = dry_runs(manifest, 1, 1)[0]
    one = dry_runs(manifest, 1, args.workers)[0]
    two = dry_runs(manifest, 2, max(1, args.workers // 2))
    print(
        json.dumps(
            {
                "row": "parts",
                "utterances": size,
                "one_part_one_worker_wall_s": single["wall_s"],
                f"one_part_{args.workers}_workers_wall_s": one["wall_s"],
                "two_parts_wall_s": max(r["wall_s"] for r in two),
                "two_parts_scan_s": [r["scan_s"] for r in two],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
