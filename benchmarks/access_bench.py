"""Random access through the per-utterance table: correctness, latency, size and build cost.

    python -m benchmarks.access_bench [--hours 1] [--workers 2] [--rounds 2] [--lookups 10000]
                                      [--plan-size 1000000] [--data DIR]

1. Makes (or reuses) the espeak-ng corpus of ``--hours`` (``benchmarks.speech``) and builds it
   ``--rounds`` times with the table and as many without (the writers' rows and the end's
   table step replaced by nothing), alternating, each in a fresh process and OUT; reports the
   wall and CPU seconds (every process of the build) of each, and the end step's seconds.
2. Checks that ``cache[key]`` and ``cache[i]`` equal the streamed sample (loader reader,
   sha256 checked) for every utterance of that cache.
3. Times ``--lookups`` random keys and random rows on the warm cache (after one pass):
   median and p99 per lookup, and the table's bytes per utterance.
4. The table of a ``--plan-size`` plan: the scale benchmark's manifest
   (``benchmarks.scale_bench``) planned by ``build --dry-run``, its rows laid out exactly as
   the writer lays out their samples (json member as written, fp16 mel of the planned
   frames, tar headers and padding; digests random), encoded by the build's own
   ``encode_table``: bytes per utterance and encode seconds. Decoding 1M utterances is out of
   reach on 2 cores, so the scan cost per utterance measured in (1) is what it adds there.

One JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.speech import make_corpus

REPO = Path(__file__).resolve().parents[1]


def child_build(src: Path, out: Path, workers: int, table: bool) -> None:
    """One build in this process; prints its wall and the table step's seconds."""
    import preprocess.write.finish as finish
    import preprocess.write.mel_shard as writer
    from preprocess.arguments import main

    spent = {"table_s": 0.0}
    write = finish.write_cache_table

    def timed(*args: Any, **kwargs: Any) -> dict[str, Any]:
        started = time.perf_counter()
        entry = write(*args, **kwargs) if table else {}
        spent["table_s"] += time.perf_counter() - started
        return entry

    finish.write_cache_table = timed  # type: ignore[assignment]
    if not table:  # the writers' share too: each shard's rows (forked workers inherit this)
        writer.save_shard_rows = lambda *args: None  # type: ignore[assignment]
    started = time.perf_counter()
    args = ["build", "--src", str(src), "--out", str(out), "--workers", str(workers)]
    if main(args) != 0:
        raise SystemExit(f"build of {src} failed")
    print(json.dumps({"wall_s": time.perf_counter() - started, **spent}))


def timed_build(src: Path, out: Path, workers: int, table: bool) -> dict[str, float]:
    """A fresh build in a child process; its wall, CPU (all its processes) and table seconds.
    CPU time is what a loaded shared machine disturbs least."""
    import resource
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "benchmarks.access_bench", "--child"]
    command += [str(src), str(out), str(workers), str(int(table))]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "cpu_s": cpu}


def check_equal(cache_dir: Path) -> int:
    """Every utterance by key and by row against the stream; returns how many were compared."""
    import melcache
    from melcache.codec import decode_mel
    from melcache.index import read_index
    from melcache.reader import ShardCheck, read_shard

    index = read_index(cache_dir)
    n_mels = index["features"]["n_mels"]
    row = 0
    with melcache.open(cache_dir) as cache:
        for shard in index["shards"]:
            for raw in read_shard(str(cache_dir / shard["name"]), shard, ShardCheck("sha256")):
                mel = decode_mel(raw.mel, raw.storage, n_mels, raw.key)
                for got in (cache[raw.key], cache[row]):
                    same = (got.key, got.text, got.speaker, got.frames) == (
                        raw.key,
                        raw.text,
                        raw.speaker,
                        raw.frames,
                    )
                    if not same or not np.array_equal(got.mel, mel):
                        raise SystemExit(f"{raw.key}: lookup differs from the stream")
                row += 1
        if row != len(cache):
            raise SystemExit(f"streamed {row} utterances, the table has {len(cache)}")
    return row


def latencies(cache_dir: Path, lookups: int) -> dict[str, Any]:
    """Median and p99 microseconds of random lookups by key and by row, warm."""
    import melcache

    rng = np.random.default_rng(0)
    with melcache.open(cache_dir) as cache:
        keys = cache.keys()
        for row in range(len(cache)):  # warm: page cache and open files
            cache[row]
        picks = rng.integers(0, len(cache), lookups).tolist()
        by_key, by_row = [], []
        for row in picks:
            key = keys[row]
            started = time.perf_counter()
            cache[key]
            by_key.append(time.perf_counter() - started)
            started = time.perf_counter()
            cache[row]
            by_row.append(time.perf_counter() - started)
        table_bytes = (cache_dir / "utterances.table").stat().st_size
        utterances = len(cache)

    def summary(times: list[float]) -> dict[str, float]:
        return {
            "median_us": round(statistics.median(times) * 1e6, 1),
            "p99_us": round(float(np.percentile(times, 99)) * 1e6, 1),
        }

    return {
        "lookups": lookups,
        "utterances": utterances,
        "by_key": summary(by_key),
        "by_row": summary(by_row),
        "table_bytes_per_utt": round(table_bytes / utterances, 2),
    }


def plan_table(size: int, data: Path) -> dict[str, Any]:
    """The table of the scale benchmark's ``size``-utterance plan (see the module docstring)."""
    from benchmarks.scale_bench import make_corpus as make_manifest
    from melcache.format import encode_sample, shard_name
    from melcache.table import TableRows, encode_table
    from preprocess.build import BuildOptions, build
    from preprocess.config import load_config
    from preprocess.plan.shard_plan import planned_shard

    manifest = make_manifest(data, size)
    rows_by_source = {}
    with open(manifest, encoding="utf-8") as lines:
        for line in lines:  # a manifest row's source is its audio_filepath
            row = json.loads(line)
            rows_by_source[row["audio_filepath"]] = (row["text"], row["speaker"])
    features, config = load_config(None)
    out = Path(tempfile.mkdtemp(prefix="access-plan-", dir=data))
    outcome = build(BuildOptions(manifest, out, 2, dry_run=True), features, config)
    plan, scan = outcome.plan, outcome.scan
    assert plan is not None and scan is not None  # a one-part dry run always plans
    rng = np.random.default_rng(0)
    columns: dict[str, list[int]] = {
        name: []
        for name in (
            "offset",
            "json_at",
            "json_size",
            "mel_at",
            "mel_size",
            "frames",
            "text_length",
            "digest",
        )
    }
    rows = TableRows({}, [], [], [], [])
    for number in range(len(plan)):
        task = planned_shard(plan, scan, number)
        offset = 0
        for item in task.items:
            text, speaker = rows_by_source[item.source]
            frames = int(features.num_frames(item.samples))
            meta = {
                "text": text,
                "speaker": speaker,
                "seconds": round(item.samples / features.sample_rate, 4),
                "frames": frames,
                "sample_rate": features.sample_rate,
                "source": item.source,
                "bucket": task.bucket,
            }
            json_size = len(encode_sample(item.key, b"", meta)["json"])
            mel_size = 128 + frames * features.n_mels * 2  # np.save header + fp16 values
            json_at = 512
            mel_at = json_at + -(-json_size // 512) * 512 + 512
            for name, value in (
                ("offset", offset),
                ("json_at", json_at),
                ("json_size", json_size),
                ("mel_at", mel_at),
                ("mel_size", mel_size),
                ("frames", frames),
                ("text_length", len(text)),
                ("digest", int(rng.integers(0, 2**32))),
            ):
                columns[name].append(value)
            offset += mel_at + -(-mel_size // 512) * 512
            rows.keys.append(item.key)
            rows.sources.append(item.source)
            rows.speakers.append(speaker)
        rows.shard_counts.append(len(task.items))
    rows.columns = {name: np.array(values, np.int64) for name, values in columns.items()}
    index = {
        "shards": [
            {"name": shard_name(plan.bucket(i), i), "sha256": None} for i in range(len(plan))
        ]
    }
    started = time.perf_counter()
    table = encode_table(rows, index)
    return {
        "utterances": len(rows.keys),
        "shards": len(plan),
        "table_bytes": len(table),
        "table_bytes_per_utt": round(len(table) / len(rows.keys), 2),
        "encode_s": round(time.perf_counter() - started, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lookups", type=int, default=10_000)
    parser.add_argument("--plan-size", type=int, default=1_000_000, help="0: skip")
    parser.add_argument("--data", type=Path, default=Path("/tmp/melcache-bench"))
    parser.add_argument("--scale-data", type=Path, default=Path("/tmp/melcache-scale"))
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        src, out, workers, table = args.child
        child_build(Path(src), Path(out), int(workers), table == "1")
        return
    corpus = make_corpus(args.data / f"speech-{args.hours:g}h", args.hours, seed=0)
    cache = args.data / f"access-{args.hours:g}h"
    walls: dict[bool, list[float]] = {True: [], False: []}
    cpus: dict[bool, list[float]] = {True: [], False: []}
    table_s: list[float] = []
    for _ in range(args.rounds):  # alternating, so both see the same machine load
        for table in (False, True):
            row = timed_build(corpus, cache, args.workers, table)
            walls[table].append(row["wall_s"])
            cpus[table].append(row["cpu_s"])
            if table:
                table_s.append(row["table_s"])
    index = json.loads((cache / "index.json").read_text())
    best_with, best_without = min(walls[True]), min(walls[False])
    print(
        json.dumps(
            {
                "row": "build",
                "hours": index["totals"]["hours"],
                "utterances": index["totals"]["utterances"],
                "wall_with_table_s": [round(w, 2) for w in walls[True]],
                "wall_without_table_s": [round(w, 2) for w in walls[False]],
                "cpu_with_table_s": [round(c, 2) for c in cpus[True]],
                "cpu_without_table_s": [round(c, 2) for c in cpus[False]],
                "median_cpu_ratio": round(
                    statistics.median(cpus[True]) / statistics.median(cpus[False]), 3
                ),
                "end_step_s": [round(t, 3) for t in table_s],
                "end_step_share": round(min(table_s) / best_with, 4),
                "best_wall_ratio": round(best_with / best_without, 3),
            }
        ),
        flush=True,
    )
    print(json.dumps({"row": "equal to the stream", "utterances": check_equal(cache)}), flush=True)
    print(json.dumps({"row": "random lookups, warm", **latencies(cache, args.lookups)}), flush=True)
    if args.plan_size:
        args.scale_data.mkdir(parents=True, exist_ok=True)
        print(
            json.dumps({"row": "plan table", **plan_table(args.plan_size, args.scale_data)}),
            flush=True,
        )


if __name__ == "__main__":
    main()
