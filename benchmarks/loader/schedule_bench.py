"""Ranks in step: how much of a DDP step's compute the ranks would waste waiting, sync on vs off.

    python -m benchmarks.loader.schedule_bench [--hours 3] [--data /tmp/melcache-schedule] [--steps 120]

Makes (or reuses) an espeak-ng corpus with ``benchmarks.common.speech`` and its cache with the real
``preprocess build`` (default build config: 10 length buckets, ~35 utterances a shard), then:

1. ``loader``: 8 real loaders in this process (rank r of 8, one logical worker each,
   ``batch_frames`` 32000), ``--steps`` steps each, with ``data.sync_buckets`` true and false
   (false is the stream of the previous release). Per step: whether all ranks' batches are
   of one bucket, and the FLOP-model cost of each rank's batch; efficiency = Σ mean ÷ Σ max
   over ranks (the share of the step's GPU time the ranks would not spend waiting).
2. ``plans``: the same from the loader's own readers without decoding a mel (shards read,
   batches planned, costs from the planned utterances' lengths), at 8, 64 and 512 ranks: sync
   on; "unsynced" (the same bucket sub-streams, each rank drawing its bucket by itself, which is
   what the previous release's stream amounts to); and the previous release's stream itself
   where the cache has enough shards for it.
3. ``throughput``: loader samples/s (2 workers), sync on vs off, in alternating turns (a
   change in the machine's load falls on both alike): median turn, spread, and the median of
   the ratio within a round.
4. ``reads``: one slot of a job of 1, 2, 8 and 64 slots, in this process, sync on vs off in
   alternating turns of ``--steps`` batches (``--rounds`` each): CPU time per sample and shard
   bytes read per sample (a slot that shares a unit of shards with
   others reads only its batches' samples, by the cache's table, where the cache has one).
5. ``synthetic`` (not run by default): caches of ``--synthetic-hours`` drawn without audio at
   the default shard size (``benchmarks/common/synthetic_cache.py``), planned by the loader's own
   code at ``--ranks``, for each ``data.sync_split`` of ``--sync-split`` and
   ``data.attention_frames`` of ``--attention-frames``: efficiency (FLOP model and the cost
   model timed on that cache's shapes), padding, and ``loader.epochs()`` against the job's
   batches consumed.

The cost models and the plans' rows are ``benchmarks/loader/step_costs.py``'s. Prints one JSON line
per measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
import types
from collections.abc import Iterator, Sequence
from pathlib import Path

import melcache.access as access_module
import melcache.loader.reads.shards as shard_reads
from benchmarks.common.caches import speech_cache
from benchmarks.common.synthetic_cache import LOCATION, draw_cache, reading, synthetic_spec
from benchmarks.loader.step_costs import (
    CostModel,
    attention_values,
    plan_cuts,
    plan_rows,
    step_cost,
    summary,
    timed_cost_model,
    typical_shapes,
)
from melcache.batch_plans import BATCH_PLAN_VERSION
from melcache.loader import DataConfig, StreamLoader, make_loader
from melcache.loader.spec import StreamSpec
from melcache.loader.stream import planned_stream

BATCH_FRAMES = 32_000


def measure_loaders(cache: Path, data: DataConfig, ranks: int, steps: int) -> dict:
    """Part 1: real loaders, rank r of ``ranks``, batches decoded."""
    streams = [iter(make_loader(cache, data, rank=r, world_size=ranks)) for r in range(ranks)]
    buckets, costs = [], []
    for _ in range(steps):
        batches = [next(s) for s in streams]
        buckets.append([b.bucket for b in batches])
        costs.append([step_cost(b.mel.shape[1], b.text.shape[1], len(b)) for b in batches])
    for stream in streams:
        stream.close()
    return summary(f"loader sync_buckets={data.sync_buckets}", ranks, buckets, costs)


def measure_plans(
    cache: Path,
    data: DataConfig,
    ranks: int,
    steps: int,
    how: str,
    measured: CostModel | None,
    plan: int = BATCH_PLAN_VERSION,
) -> dict:
    """Part 2: the same from plans, at any number of ranks, by :func:`plan_rows` (``plan``:
    the even cut's, ``melcache.batch_plans.plan_even_batches``)."""
    sync = how != "previous"
    options = dataclasses.replace(data, sync_buckets=sync, num_workers=0)

    def spec_of(rank: int) -> StreamSpec:
        spec = make_loader(cache, options, rank=rank, world_size=ranks).spec
        return dataclasses.replace(spec, plan=plan)

    return plan_rows(f"plans {how}", spec_of, ranks, steps, how == "unsynced", measured)


def measure_synthetic(
    hours: float,
    data: DataConfig,
    ranks: Sequence[int],
    steps: int,
    timed: tuple[str, int] | None,
    splits: Sequence[int] = (1,),
    plans: Sequence[int] = (BATCH_PLAN_VERSION,),
    attentions: Sequence[str] = ("0",),
) -> Iterator[dict]:
    """Part 5: a drawn cache of ``hours`` at the default shard size
    (``benchmarks/common/synthetic_cache.py``): the plans' rows at each rank count (``steps`` steps,
    fewer at many ranks: each rank re-plans a unit per batch there; ``timed``: the preset and
    repeats of the timed cost model), then ``epochs()`` of rank 0 of 8 against the batches the
    job has consumed; the plans at each ``data.sync_split`` of ``splits`` and batch plan of
    ``plans`` (1: this release before) and ``data.attention_frames`` of ``attentions``
    (:func:`attention_values`), side by side."""
    measured: CostModel | None = None
    described: dict | None = None
    cache = draw_cache(hours)
    options = dataclasses.replace(data, sync_buckets=True, num_workers=0)
    head = {"hours": round(cache.hours, 1), "shards": len(cache.shards),
            "utterances": sum(s["samples"] for s in cache.shards)}  # fmt: skip
    with reading(cache):
        if timed is not None:  # timed on this cache's shapes (buckets up to 32 s)
            shapes = typical_shapes(synthetic_spec(cache, options, rank=0, world_size=8), steps)
            measured, described = timed_cost_model(shapes, *timed)
            yield {**head, **described}
        cuts = plan_cuts(plans, attention_values(attentions, described))
        for world, split, (plan, attention) in itertools.product(ranks, splits, cuts):
            split_options = dataclasses.replace(options, sync_split=split,
                                                attention_frames=attention or 0)  # fmt: skip

            def spec_of(
                rank: int, world: int = world, at: DataConfig = split_options, plan: int = plan
            ) -> StreamSpec:
                return synthetic_spec(cache, at, rank=rank, world_size=world, plan=plan)

            row = plan_rows("synthetic plans", spec_of, world, max(30, steps * 8 // world), False,
                            measured)  # fmt: skip
            yield {**head, "sync_split": split, "batch_plan": plan, "attention_frames": attention,
                   **row}  # fmt: skip
        yield {**head, **epochs_against_batches(synthetic_spec(cache, options, rank=0,
                                                               world_size=8))}  # fmt: skip


def epochs_against_batches(spec: StreamSpec) -> dict:
    """``loader.epochs()`` of one rank (its positions set from the planned stream, as its
    consumer's would be) at a quarter, a half and 92 % of an epoch of the job's batches."""
    mix = types.SimpleNamespace(features=None, indexes=[{}], weights=[1.0])
    loader = StreamLoader(spec, mix, pin_memory=False)  # type: ignore[arg-type]
    per_epoch = sum(sub.per_epoch for sub in spec.subs)
    of_shard = {spec.sources[sub.source].shards[i]["name"]: u
                for u, sub in enumerate(spec.subs) for unit in sub.units for i in unit}  # fmt: skip
    marks = {round(share * per_epoch / spec.world_size): share for share in (0.25, 0.5, 0.92)}
    consumed, said = [0] * len(spec.subs), {}
    for step, (_, after, samples, _, entries) in enumerate(planned_stream(spec, 0), 1):
        stream = of_shard[entries[0]["name"]]
        consumed[stream] += sum(s.frames for s in samples)
        loader._positions[0][stream] = (*after, consumed[stream])
        if step in marks:
            said[f"at {marks[step]:.2f} of an epoch ({step * spec.world_size} batches)"] = (
                loader.epochs()[LOCATION]
            )
        if step >= max(marks):
            break
    return {"measure": "epochs() of rank 0 of 8", "batches_per_epoch": per_epoch, **said}


def measure_throughput(cache: Path, data: DataConfig, seconds: float, rounds: int) -> list[dict]:
    """Part 3: samples/s of one loader per setting, in alternating turns: per setting the
    median turn and the spread, and the median over rounds of the on ÷ off ratio within a
    round (which a change in the machine's load moves less than the totals)."""
    # Sync off is the stream of earlier releases: frames only (data.sequence needs sync on).
    settings = {sync: make_loader(cache, dataclasses.replace(
                    data, sync_buckets=sync, sequence=data.sequence if sync else "frames"))
                for sync in (False, True)}  # fmt: skip
    streams = {sync: iter(loader) for sync, loader in settings.items()}
    for stream in streams.values():
        next(stream)  # workers started
    rates: dict[bool, list[float]] = {sync: [] for sync in settings}
    for turn in range(2 * rounds):
        sync = bool(turn % 2) ^ bool(turn // 2 % 2)  # off, on, on, off, ...
        start, count = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            count += len(next(streams[sync]))
        rates[sync].append(count / (time.perf_counter() - start))
    for stream in streams.values():
        stream.close()
    ratios = [on / off for on, off in zip(rates[True], rates[False], strict=True)]
    rows = [{"measure": f"throughput sync_buckets={sync}", "workers": data.num_workers,
             "turns": len(r), "samples_per_s_median": round(statistics.median(r)),
             "samples_per_s_min": round(min(r)), "samples_per_s_max": round(max(r))}
            for sync, r in rates.items()]  # fmt: skip
    rows.append({"measure": "throughput on / off", "median": round(statistics.median(ratios), 3),
                 "min": round(min(ratios), 3), "max": round(max(ratios), 3)})  # fmt: skip
    return rows


def measure_reads(cache: Path, data: DataConfig, slots: int, batches: int, turns: int) -> dict:
    """Part 4: one slot of a job of ``slots`` (rank 0 of ``slots`` ranks, in this process),
    sync on vs off in ``turns`` alternating turns of ``batches`` batches: loader CPU time per
    sample (the median turn's, and the median ratio within a round) and shard bytes read per
    sample (whole shards and ranged reads counted where they happen)."""
    read = {"bytes": 0}
    whole, ranged = shard_reads.read_shard, access_module._Shards.read

    def count_whole(location: str, entry: dict, *rest: object) -> list:
        read["bytes"] += entry["bytes"]
        return whole(location, entry, *rest)

    def count_ranged(self: object, name: str, offset: int, length: int) -> bytes:
        read["bytes"] += length
        return ranged(self, name, offset, length)

    shard_reads.read_shard, access_module._Shards.read = count_whole, count_ranged
    row: dict = {"measure": "reads per slot", "slots": slots}
    try:
        streams = {}
        for sync in (False, True):
            options = dataclasses.replace(data, sync_buckets=sync, num_workers=0)
            streams[sync] = iter(make_loader(cache, options, rank=0, world_size=slots))
            next(streams[sync])
        rates: dict[bool, list[float]] = {False: [], True: []}
        bytes_read, samples = {False: 0, True: 0}, {False: 0, True: 0}
        for turn in range(2 * turns):
            sync = bool(turn % 2) ^ bool(turn // 2 % 2)  # off, on, on, off, ...
            read["bytes"], count, start = 0, 0, time.process_time()
            for _ in range(batches):
                count += len(next(streams[sync]))
            rates[sync].append(count / (time.process_time() - start))
            bytes_read[sync] += read["bytes"]
            samples[sync] += count
        for stream in streams.values():
            stream.close()
    finally:
        shard_reads.read_shard, access_module._Shards.read = whole, ranged
    for sync, name in ((False, "off"), (True, "on")):
        row[f"sync_{name}_samples_per_cpu_s"] = round(statistics.median(rates[sync]))
        row[f"sync_{name}_kb_read_per_sample"] = round(bytes_read[sync] / samples[sync] / 1e3, 1)
    ratios = [on / off for on, off in zip(rates[True], rates[False], strict=True)]
    row["cpu_rate_on_over_off_median"] = round(statistics.median(ratios), 3)
    return row


def plans_part(cache: Path, data: DataConfig, args: argparse.Namespace) -> Iterator[dict]:
    """Part 2 at each rank count: the timed cost model first (unless ``--cost-preset none``),
    then sync on (at each ``--batch-plan`` and, for plans 3 and 4, ``--attention-frames``), unsynced
    and the previous release."""
    measured, described = None, None
    if args.cost_preset != "none":
        spec = make_loader(cache, dataclasses.replace(data, num_workers=0), world_size=8).spec
        shapes = typical_shapes(spec, args.steps)
        measured, described = timed_cost_model(shapes, args.cost_preset, args.cost_repeats)
        yield described
    shards = len(json.loads((cache / "index.json").read_text())["shards"])
    cuts = plan_cuts(args.batch_plan, attention_values(args.attention_frames, described))
    for ranks in args.ranks:
        for how in ("on", "unsynced", "previous"):
            if how == "previous" and ranks > shards:
                yield {"measure": "plans previous", "ranks": ranks,
                       "refused": f"{shards} shards < {ranks} workers"}  # fmt: skip
                continue
            for plan, attention in cuts if how == "on" else [(BATCH_PLAN_VERSION, None)]:
                options = dataclasses.replace(data, attention_frames=attention or 0)
                row = measure_plans(cache, options, ranks, args.steps, how, measured, plan)
                if how == "on":
                    row = {**row, "batch_plan": plan, "attention_frames": attention}
                yield row


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hours", type=float, default=3.0,
                   help="hours of the espeak-ng corpus made under --data (default: 3)")  # fmt: skip
    p.add_argument("--data", type=Path, default=Path("/tmp/melcache-schedule"),
                   help="folder of the corpus and its cache, made once and reused")  # fmt: skip
    p.add_argument("--cache", type=Path, help="an existing cache instead of --hours/--data")
    p.add_argument("--steps", type=int, default=120, help="steps per rank (default: 120)")
    p.add_argument("--ranks", type=int, nargs="*", default=[8, 64, 512],
                   help="job sizes of the plans and synthetic parts")  # fmt: skip
    p.add_argument("--turn-seconds", type=float, default=3.0,
                   help="throughput part: seconds a turn (default: 3)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=6,
                   help="throughput and reads parts: rounds of one turn each (default: 6)")  # fmt: skip
    p.add_argument("--read-slots", type=int, nargs="*", default=[1, 2, 8, 64],
                   help="reads part: job sizes in slots")  # fmt: skip
    p.add_argument("--cost-preset", default="tiny", help="trainer preset timed, or none")
    p.add_argument("--cost-repeats", type=int, default=3,
                   help="timed passes per shape after a warm-up (default: 3)")  # fmt: skip
    p.add_argument("--synthetic-hours", type=float, nargs="*", default=[3.0, 50.0, 200.0],
                   help="synthetic part: hours of each drawn cache")  # fmt: skip
    p.add_argument("--sync-split", type=int, nargs="*", default=[1, 4, 6], help="synthetic part")
    p.add_argument("--attention-frames", nargs="*", default=["0"],
                   help="plans (sync on) and synthetic parts, batch plans 3 and 4: data.attention_frames "
                   "values, a number or fit (the timed cost model's own); default 0 (the "
                   "loader's default, 3072)")  # fmt: skip
    p.add_argument("--batch-plan", type=int, nargs="*", default=[1, BATCH_PLAN_VERSION],
                   help="plans (sync on) and synthetic parts: the even cuts (1: the sort by "
                   "jittered length, 2: equal frames, 3: equal cost, 4: equal cost, each epoch "
                   "dealt whole)")  # fmt: skip
    p.add_argument("--sequence", default="frames",
                   help='throughput part, sync on: data.sequence ("text+frames": planned on '
                   "text + frames, the bytes tokenizer)")  # fmt: skip
    p.add_argument(
        "--parts",
        nargs="*",
        default=["loader", "plans", "throughput", "reads"],
        help="also: synthetic (drawn caches of --synthetic-hours, no audio)",
    )
    args = p.parse_args(argv)
    real_parts = {"loader", "plans", "throughput", "reads"} & set(args.parts)
    cache = args.cache or (
        speech_cache(args.data / "corpus", args.data / "cache", args.hours)
        if real_parts
        else Path()
    )
    data = DataConfig(batch_frames=BATCH_FRAMES, num_workers=0, shard_check="off")
    if "loader" in args.parts:
        for sync in (True, False):
            options = dataclasses.replace(data, sync_buckets=sync)
            print(json.dumps(measure_loaders(cache, options, 8, args.steps)), flush=True)
    if "plans" in args.parts:
        for row in plans_part(cache, data, args):
            print(json.dumps(row), flush=True)
    if "synthetic" in args.parts:
        for hours in args.synthetic_hours:
            timed = None if args.cost_preset == "none" else (args.cost_preset, args.cost_repeats)
            rows = measure_synthetic(hours, data, args.ranks, args.steps, timed, args.sync_split,
                                     args.batch_plan, args.attention_frames)  # fmt: skip
            for row in rows:
                print(json.dumps(row), flush=True)
    loader_data = dataclasses.replace(
        data, num_workers=2, shard_check="fast", sequence=args.sequence
    )
    if "throughput" in args.parts:
        for line in measure_throughput(cache, loader_data, args.turn_seconds, args.rounds):
            print(json.dumps(line), flush=True)
    if "reads" in args.parts:
        for slots in args.read_slots:
            row = measure_reads(cache, loader_data, slots, args.steps, args.rounds)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
