"""What a resume costs on another job size, against a resume of the same job, early and late
in an epoch.

    python -m benchmarks.loader.elastic_bench [--cache DIR] [--json FILE]

Two parts, each at 1 % and 90 % of an epoch:

- plan: :func:`melcache.loader.resume.elsewhere.unread` for one bucket sub-stream of a 200 h-sized
  cache (100,000 batches per epoch in 2,000 units), from a job of 512 ranks × 4 workers whose
  slots stand up to 3 batches apart, for a job of 256 × 4; the same job's resume computes
  nothing here (its positions are the state's);
- loader: a real 4-rank job (workers 0) on ``--cache`` (default: the sample corpus, built
  once) streamed until its largest bucket is that far into an epoch; then rank 0 of the same
  job (one state) and of a 3-rank job (every rank's state) each timed from
  ``load_state_dict`` to its first batch.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common.caches import build_sample_cache
from melcache.batch_plans import BATCH_PLAN_VERSION
from melcache.loader import DataConfig, StreamLoader, make_loader
from melcache.loader.deal import fresh_deal
from melcache.loader.resume.elsewhere import unread
from melcache.loader.schedule import SubStream

# One utterance a batch, one length range a bucket: the sample corpus's largest sub-stream has
# 17 batches an epoch, so a 4-rank job stops near any fraction of one.
DATA = {"batch_frames": 3000, "max_batch_size": 1, "sync_split": 1, "num_workers": 0}
ROUNDS = 5


def plan_cost(fraction: float) -> float:
    """Seconds :func:`unread` takes for the synthetic sub-stream at ``fraction`` of an epoch."""
    units = 2_000
    sub = SubStream(0, 0, tuple((i,) for i in range(units)), (50,) * units, 50 * units * 30_000)
    slots = 512 * 4
    share = sub.per_epoch // slots
    rng = random.Random(0)
    taken = [max(0, int(fraction * share) + rng.randint(-3, 3)) for _ in range(slots)]
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        unread(sub, fresh_deal(BATCH_PLAN_VERSION), slots, taken)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def job_epochs(loader: StreamLoader, stream: int) -> float:
    """Epochs of sub-stream ``stream`` the job has read, as rank 0's first slot counts them
    (the ranks of a one-cache job take one batch of it each a step)."""
    taken = loader.state_dict()["positions"][0][stream][0]
    sub, spec = loader.spec.subs[stream], loader.spec
    return spec.deal(stream).read_by_job(spec.num_slots, taken) / sub.per_epoch


def loader_costs(cache: str, fraction: float) -> tuple[float, float, float]:
    """Seconds from ``load_state_dict`` to the first batch (the same job, another size), and
    how far into an epoch the largest bucket was (the nearest batch of a small cache's)."""
    data = DataConfig(**DATA)
    old = [make_loader(cache, data, rank=r, world_size=4, seed=1) for r in range(4)]
    largest = max(range(len(old[0].spec.subs)), key=lambda u: old[0].spec.subs[u].per_epoch)
    per_epoch = old[0].spec.subs[largest].per_epoch
    streams = [iter(loader) for loader in old]
    # A small cache's epoch has few batches: the states of the step nearest the fraction
    # within a few epochs.
    reached, states = -1.0, []
    for _ in range(8 * per_epoch):
        [next(stream) for stream in streams]
        now = job_epochs(old[0], largest) % 1
        if abs(now - fraction) < abs(reached - fraction):
            reached, states = now, [loader.state_dict() for loader in old]
    for loader in old:
        loader.close()
    out = []
    for world_size, given in ((4, states[0]), (3, states)):
        times = []
        for _ in range(ROUNDS):
            loader = make_loader(cache, data, rank=0, world_size=world_size, seed=1)
            start = time.perf_counter()
            loader.load_state_dict(given)
            next(iter(loader))
            times.append(time.perf_counter() - start)
            loader.close()
        out.append(statistics.median(times))
    return out[0], out[1], reached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", help="a cache folder (default: the sample corpus, built)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or str(build_sample_cache(Path(tmp)))
        rows = []
        for fraction in (0.01, 0.9):
            same, other, reached = loader_costs(cache, fraction)
            rows.append({
                "epoch_fraction": fraction,
                "loader_epoch_fraction": round(reached, 3),
                "plan_unread_ms_2048_slots": round(plan_cost(fraction) * 1e3, 2),
                "loader_same_job_ms": round(same * 1e3, 1),
                "loader_4_to_3_ranks_ms": round(other * 1e3, 1),
            })  # fmt: skip
    for row in rows:
        print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
