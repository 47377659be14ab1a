"""What a tracker costs the loop: step times without one, with a tracker double whose every
call sleeps 60 s (a W&B offline run hung on a node without network, wandb #4217), and with the
real TensorBoard writer, side by side.

One process, the tiny model, the same batches held in memory (``trainer_bench.InMemory``),
``train.log_every = 1`` so every step hands a record to the trackers (the worst case).
Each round trains every setting for ``--steps`` steps, in rotating order, each setting in its
own run folder and trainer; a step's time is the trainer's own ``step_time_s`` from
metrics.jsonl (the window's wall time, which holds the hand-off of the record before it, not
the bounded wait for the tracker at the end of each ``fit``). The slowdown is the median of the
per-round ratios of median step times. On shared cores that ratio moves by more than the
1 % it is checked against, so the loop's own CPU time is given too: the main thread's
``time.thread_time`` over each ``fit``, per step, which other processes on the machine do not
inflate (a tracker thread's work is not in it; a hanging one does none). The hand-off itself (``Trackers.record`` of a metrics record to
the hanging tracker, queued and, once its queue is full, dropped) is also timed alone over
many records and given as a share of the step without a tracker: what the loop pays for it.

Usage::

    python -m benchmarks.train.tracker_bench [--shards DIR | --data DIR] [--steps 40] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.common.caches import build_sample_cache  # noqa: E402
from benchmarks.train.trainer_bench import TINY, InMemory  # noqa: E402
from train.config.tables import load_config  # noqa: E402
from train.parallel.env import Env  # noqa: E402
from train.run import tracker_backends, trackers  # noqa: E402
from train.run.metrics import read_metrics  # noqa: E402
from train.run.trackers import Tracked, Trackers  # noqa: E402
from train.trainer import Trainer  # noqa: E402

SETTINGS = {"none": [], "hanging": ["tensorboard"], "tensorboard": ["tensorboard"]}


class Hanging:
    """A tracker double whose every call, opening included, sleeps 60 s."""

    def __init__(self, opening: object = None) -> None:
        time.sleep(60)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        time.sleep(60)

    def picture(self, step: int, tag: str, path: Path) -> None:
        time.sleep(60)

    def close(self) -> None:
        time.sleep(60)


def make_trainer(shards: str, out: Path, names: list[str], batches: list | None) -> Trainer:
    """A tiny trainer logging every step to ``names``, over in-memory batches."""
    overrides = ["data.num_workers=0", "train.log_every=1", f"train.trackers={json.dumps(names)}"]
    cfg = load_config(TINY, overrides)
    trainer = Trainer(cfg, shards, out, Env(0, 1, 0, torch.device("cpu")))
    if batches is None:
        source = iter(trainer.parts.loader)
        batches = [next(source) for _ in range(40)]
    trainer.parts.loader.close()
    trainer.parts.loader = InMemory(batches)
    trainer.save = lambda: None  # checkpoint I/O is not what is measured
    return trainer


def run_steps(trainer: Trainer, setting: str, steps: int) -> tuple[float, float]:
    """Train ``steps`` more steps: the median ``step_time_s`` (ms, the first step left out)
    and the main thread's CPU ms per step."""
    start = trainer.step
    opener = Hanging if setting == "hanging" else tracker_backends.TensorBoard
    tracker_backends.OPENERS["tensorboard"] = opener
    cpu_start = time.thread_time()
    trainer.fit(max_steps=start + steps)
    cpu_ms = 1000 * (time.thread_time() - cpu_start) / steps
    records = [r for r in read_metrics(trainer.out / "metrics.jsonl") if "step_time_s" in r]
    wall_ms = [1000 * r["step_time_s"] for r in records if r["step"] > start + 1]
    return statistics.median(wall_ms), cpu_ms


def hand_off_us() -> dict[str, float]:
    """µs per ``Trackers.record`` to a hanging tracker: while its queue fills, and once full
    (each record then dropped and counted)."""
    record = {"loss": 1.66, "mel_loss": 0.96, "stop_loss": 0.7, "lr": 1e-3, "grad_norm": 2.2}
    record.update(step_time_s=0.59, samples_per_s=11.0, frames_per_s=1959.0, padding_pct=16.4)
    record.update(data_wait_pct=0.2, peak_rss_mib=827.0, skipped_steps=0, frames_per_step=1163)
    hanging = Tracked("hanging", Hanging, close_seconds=0.1)
    fan_out = Trackers([hanging])
    times = []
    for _ in range(2):  # queueing (the first QUEUE_RECORDS), then dropping
        start = time.perf_counter()
        for step in range(trackers.QUEUE_RECORDS):
            fan_out.record({**record, "step": step})
        times.append(1e6 * (time.perf_counter() - start) / trackers.QUEUE_RECORDS)
    fan_out.close()
    return {"queued_us": round(times[0], 2), "dropped_us": round(times[1], 2)}


def measure(shards: str, steps: int, rounds: int) -> dict:
    torch.set_num_threads(1)  # two shared cores: one thread gives steadier numbers
    trackers.CLOSE_SECONDS = 0.5  # the hanging double's bounded wait at each fit's end
    with tempfile.TemporaryDirectory() as tmp:
        first = make_trainer(shards, Path(tmp) / "none", [], None)
        batches = first.parts.loader.batches
        runs = {"none": first}
        for name in ("hanging", "tensorboard"):
            runs[name] = make_trainer(shards, Path(tmp) / name, SETTINGS[name], batches)
        for name in SETTINGS:  # warm up each trainer (allocator, kernels), untimed
            run_steps(runs[name], name, 3)
        per_round = []
        for r in range(rounds):
            order = list(SETTINGS)[r % 3 :] + list(SETTINGS)[: r % 3]
            per_round.append({name: run_steps(runs[name], name, steps) for name in order})
        for trainer in runs.values():
            trainer.close()
    out: dict = {"steps_per_round": steps, "rounds": rounds, "log_every": 1}
    for kind, at in (("ms_per_step", 0), ("cpu_ms_per_step", 1)):
        for name in SETTINGS:
            out[f"{name}_{kind}"] = round(statistics.median(r[name][at] for r in per_round), 3)
    for name in ("hanging", "tensorboard"):
        for kind, at in (("slowdown_pct", 0), ("cpu_slowdown_pct", 1)):
            ratios = [r[name][at] / r["none"][at] for r in per_round]
            out[f"{name}_{kind}"] = round(100 * (statistics.median(ratios) - 1), 2)
    out["rounds_ms"] = [{k: [round(v, 3) for v in r[k]] for k in r} for r in per_round]
    out["hand_off"] = hand_off_us()
    worst = max(out["hand_off"].values())
    out["hand_off_pct_of_step"] = round(100 * worst / (1000 * out["none_ms_per_step"]), 5)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", help="cache folder (default: build the sample corpus)")
    parser.add_argument("--data", type=Path, help="build the sample cache here and keep it")
    parser.add_argument("--steps", type=int, default=40, help="steps per setting per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shards = args.shards
        if shards is None:
            cache = (args.data or Path(tmp)) / "cache"
            shards = str(cache) if (cache / "index.json").exists() else build_sample_cache(cache)
        result = measure(shards, args.steps, args.rounds)
    print(
        f"ms per step (wall; main thread's CPU): no tracker {result['none_ms_per_step']}; "
        f"{result['none_cpu_ms_per_step']}, hanging tracker {result['hanging_ms_per_step']} "
        f"({result['hanging_slowdown_pct']:+.2f} %); {result['hanging_cpu_ms_per_step']} "
        f"({result['hanging_cpu_slowdown_pct']:+.2f} %), TensorBoard "
        f"{result['tensorboard_ms_per_step']} ({result['tensorboard_slowdown_pct']:+.2f} %); "
        f"{result['tensorboard_cpu_ms_per_step']} ({result['tensorboard_cpu_slowdown_pct']:+.2f}"
        f" %); hand-off to the hanging tracker {result['hand_off']} µs per record = "
        f"{result['hand_off_pct_of_step']} % of a step",
        file=sys.stderr,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
