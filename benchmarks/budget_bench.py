"""Batch fill and padding: one global frame budget against the per-bucket table of `train tune`.

    python -m benchmarks.budget_bench [--hours 4] [--memory-limit-mib 384]
        [--data /tmp/melcache-bench]

Makes (or reuses) the loader benchmark's corpus and cache (``benchmarks.loader_bench``:
espeak-ng speech, the default build config's 10 length buckets), runs ``python -m train tune``
on CPU with ``configs/tiny.toml`` (fp32, ``max_batch_size`` 64 as the loader benchmark's) against
``--memory-limit-mib`` of live tensors (384 puts the global budget near that benchmark's 8,000), then
plans one epoch of every shard exactly as the loader does (``melcache.batch_plans.plan_batches``,
same seed) under

- one global budget: the smallest entry of the tuned table (the longest bucket's, but for
  rounding to whole utterances), the largest single number that is safe for every bucket:
  what a hand-set ``batch_frames`` has to be;
- the tuned table.

Prints one JSON line per bucket and one for the whole epoch (batches, mean utterances and
padded frames per batch, padding %); ``python -m benchmarks.results --only budgets`` renders
them into docs/results.md. The memory profile is the tiny
model's on CPU (``train.memory.probes.MemoryCap``); a GPU and the base model have a larger quadratic
share, so their short buckets gain more.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from benchmarks.loader_bench import prepare
from melcache.batch_plans import BATCH_PLAN, make_rng, padding_fraction, plan_batches, round_up
from melcache.index import read_index
from melcache.location import member_location
from melcache.reader import ShardCheck, read_shard
from train.config.tables import load_config
from train.tune import tune

REPO = Path(__file__).resolve().parents[1]
SEED = 0


def plan_epoch(
    shards: list[dict[str, Any]], frames: list[list[int]], budget: Any, cfg: Any
) -> dict[int, dict[str, float]]:
    """Per bucket: batches, utterances, valid and padded frames of one epoch under ``budget``
    (a number or a {bucket: frames} table)."""
    out: dict[int, dict[str, float]] = {}
    for shard_id, (entry, lengths) in enumerate(zip(shards, frames, strict=True)):
        bucket = entry["bucket"]
        limit = budget if isinstance(budget, int) else budget[str(bucket)]
        batches = plan_batches(
            lengths,
            rng=make_rng(SEED, BATCH_PLAN, 0, shard_id),
            batch_frames=limit,
            max_batch_size=cfg.data.max_batch_size,
            pad_multiple=cfg.data.pad_multiple,
        )
        sums = out.setdefault(bucket, dict.fromkeys(("batches", "samples", "frames", "padded"), 0))
        for batch in batches:
            longest = round_up(max(lengths[i] for i in batch), cfg.data.pad_multiple)
            sums["batches"] += 1
            sums["samples"] += len(batch)
            sums["frames"] += sum(lengths[i] for i in batch)
            sums["padded"] += len(batch) * longest
    return out


def describe(sums: dict[str, float]) -> dict[str, float]:
    return {
        "batches": sums["batches"],
        "samples_per_batch": round(sums["samples"] / sums["batches"], 1),
        "padded_frames_per_batch": round(sums["padded"] / sums["batches"]),
        "padding_pct": round(100 * padding_fraction(sums["frames"], sums["padded"]), 2),
    }


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hours", type=float, default=4.0, help="corpus size (default 4)")
    parser.add_argument("--memory-limit-mib", type=float, default=384.0)
    parser.add_argument("--data", type=Path, default=Path("/tmp/melcache-bench"))
    args = parser.parse_args(argv)
    args.data.mkdir(parents=True, exist_ok=True)
    _, cache = prepare(args)
    overrides = ["train.precision=fp32", "data.max_batch_size=64"]
    cfg = load_config(REPO / "configs" / "tiny.toml", overrides)
    rows, where = tune(cfg, str(cache), memory_limit_mib=args.memory_limit_mib)
    table = {str(r.bucket): r.budget for r in rows}
    one_budget = min(table.values())
    shards = read_index(cache)["shards"]
    frames = [
        [s.frames for s in read_shard(member_location(cache, e["name"]), e, ShardCheck("fast"))]
        for e in shards
    ]
    plans = {
        "global": plan_epoch(shards, frames, one_budget, cfg),
        "table": plan_epoch(shards, frames, table, cfg),
    }
    for row in rows:
        line = {"bucket": row.bucket, "max_frames": row.max_frames, "tuned_budget": row.budget}
        for name, plan in plans.items():
            line.update({f"{name}_{k}": v for k, v in describe(plan[row.bucket]).items()})
        print(json.dumps(line), flush=True)
    total = {"bucket": "all", "global_budget": one_budget, "tuned_on": where}
    for name, plan in plans.items():
        sums = {k: sum(p[k] for p in plan.values()) for k in ("batches", "samples", "frames")}
        sums["padded"] = sum(p["padded"] for p in plan.values())
        total.update({f"{name}_{k}": v for k, v in describe(sums).items()})
    print(json.dumps(total), flush=True)


if __name__ == "__main__":
    main()
