"""Waiting in the all-reduce on a real multi-process gloo job, bucket sync on vs off.

    python -m benchmarks.train.allreduce_bench [--cache DIR | --hours 3 --data DIR] [--procs 2 4]
                                          [--steps 30] [--batch-frames 8000]

For each process count and ``data.sync_buckets`` setting (alternating, ``--repeats`` times) it
runs ``torchrun --standalone --nproc-per-node N -m benchmarks.train.allreduce_bench --rank-loop``:
a minimal data-parallel loop over ``make_loader`` (rank r of N, batches decoded in the main
process) with the model of the ``tiny`` preset (``configs/base.toml`` takes seconds per
utterance on a CPU), on CPU, one thread per process. Each step:

1. forward + backward of the rank's batch (``compute``);
2. the gradients' all-reduce, one flat fp32 tensor as DDP's buckets would carry them
   (``reduce``): a rank that finishes first waits here for the slowest;
3. a barrier, then the same all-reduce again, every rank arriving together (``comm``: the
   transfer alone).

A rank's wait is ``reduce − comm``; its share of step time is Σ wait ÷ Σ (compute + reduce),
over the steps after ``--warmup``. Rank 0 prints one JSON line per job with the mean share
over ranks (and the largest), the mean compute and comm per step; this parent prints the
median over repeats of each. Loading is left out of the step (a real job's workers load
ahead). With more processes than cores the ranks share cores: a waiting rank sleeps in gloo,
so the others run, but compute times stretch alike for both settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common.caches import speech_cache
from melcache.loader import DataConfig, make_loader
from melcache.sections import find_config
from train.config.tables import load_config
from train.model import build_model
from train.parallel.env import leave_together


def rank_loop(cache: Path, data: DataConfig, steps: int, warmup: int) -> dict | None:
    """One rank's loop (under torchrun); rank 0 returns the job's summary."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every rank builds the same model
    model = build_model(load_config(find_config("tiny")).model).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-4)
    stream = iter(make_loader(cache, data, rank=rank, world_size=world, seed=0))
    sums = {"compute": 0.0, "reduce": 0.0, "comm": 0.0, "wait": 0.0}
    for step in range(steps + warmup):
        batch = next(stream)
        start = time.perf_counter()
        out = model(batch.mel.float(), batch.mel_lengths, batch.text, batch.text_lengths)
        (out["loss_sum"] / batch.mel_lengths.sum()).backward()
        computed = time.perf_counter()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])  # fmt: skip
        dist.all_reduce(flat)
        reduced = time.perf_counter()
        dist.barrier()
        again = time.perf_counter()
        dist.all_reduce(flat.clone())
        comm = time.perf_counter() - again
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if step >= warmup:
            sums["compute"] += computed - start
            sums["reduce"] += reduced - computed
            sums["comm"] += comm
            sums["wait"] += max(0.0, reduced - computed - comm)
    stream.close()
    every: list[dict] = [{}] * world
    dist.all_gather_object(every, sums)
    leave_together()
    if rank != 0:
        return None
    shares = [s["wait"] / (s["compute"] + s["reduce"]) for s in every]
    return {
        "procs": world,
        "sync_buckets": data.sync_buckets,
        "steps": steps,
        "wait_share_mean": round(statistics.mean(shares), 3),
        "wait_share_max": round(max(shares), 3),
        "compute_s_per_step": round(statistics.mean(s["compute"] for s in every) / steps, 4),
        "comm_s_per_step": round(statistics.mean(s["comm"] for s in every) / steps, 4),
    }


def run_job(cache: Path, procs: int, sync: bool, args: argparse.Namespace) -> dict:
    """One torchrun job; rank 0's JSON line."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={procs}", "-m", "benchmarks.train.allreduce_bench", "--rank-loop",
        "--cache", str(cache), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--batch-frames", str(args.batch_frames), "--sync", "on" if sync else "off",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:  # the ranks' own words come first, torchrun's summary last
        said = (
            done.stderr
            if len(done.stderr) < 3000
            else f"{done.stderr[:1500]}\n...\n{done.stderr[-1500:]}"
        )
        raise SystemExit(f"torchrun failed ({done.returncode}):\n{said}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hours", type=float, default=3.0)
    p.add_argument("--data", type=Path, default=Path("/tmp/melcache-schedule"))
    p.add_argument("--cache", type=Path, help="an existing cache instead of --hours/--data")
    p.add_argument("--procs", type=int, nargs="*", default=[2, 4])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch-frames", type=int, default=8000)
    p.add_argument("--rank-loop", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sync", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_loop:
        data = DataConfig(batch_frames=args.batch_frames, max_batch_size=64, num_workers=0,
                          sync_buckets=args.sync == "on")  # fmt: skip
        row = rank_loop(args.cache, data, args.steps, args.warmup)
        if row is not None:
            print(json.dumps(row), flush=True)
        return
    cache = args.cache or speech_cache(args.data / "corpus", args.data / "cache", args.hours)
    for procs in args.procs:
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for turn in range(2 * args.repeats):
            sync = bool(turn % 2) ^ bool(turn // 2 % 2)  # off, on, on, off, ...
            runs[sync].append(run_job(cache, procs, sync, args))
        for sync, rows in runs.items():
            medians = {key: round(statistics.median(r[key] for r in rows), 4) for key in rows[0]
                       if isinstance(rows[0][key], float)}  # fmt: skip
            print(json.dumps({"measure": "all-reduce wait", "procs": procs, "sync_buckets": sync,
                              "repeats": len(rows), **medians}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
