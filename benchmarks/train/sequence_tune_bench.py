"""Budgets on the declared sequence: sequence positions per second at equal peak memory, from
``train tune`` budgets on frames (today) against ``train tune`` budgets on ``text + frames``
(``data.sequence``), side by side in one run.

    python -m benchmarks.train.sequence_tune_bench --cache CACHE [--memory-limit-mib 384]

The model is ``configs/tiny.toml``'s (fp32, ``max_batch_size`` 64): the reference prefix LM,
whose sequence is the text's tokens then the mel frames. For each arm ``train tune`` searches
the per-bucket table on CPU against ``--memory-limit-mib`` of live tensors
(``train.memory.probes.MemoryCap``); then each arm's trainer, with its table, trains on the
batches its own loader yields, in alternating turns of ``--turn`` steps (``--rounds`` each), so
a change in the machine's load falls on both: text + frames positions (real, not padding) per
second of training steps, and the peak of live tensors over ``--peak-steps`` more steps under
the same counter (not timed: counting slows each op). Prints one JSON line per arm.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from train.config.tables import Config, load_config
from train.memory.probes import MIB, MemoryCap, tensor_bytes
from train.parallel.env import Env
from train.trainer import Trainer
from train.tune import _trainer_tensors, tune

REPO = Path(__file__).resolve().parents[2]
ARMS = ("frames", "text+frames")


def config(arm: str) -> Config:
    overrides = ["train.precision=fp32", "data.max_batch_size=64", f'data.sequence="{arm}"']
    return load_config(REPO / "configs" / "tiny.toml", overrides)


def positions(batch: object) -> int:
    """Real text + frames positions of a batch."""
    return int((batch.text_lengths + batch.mel_lengths).sum())  # type: ignore[attr-defined]


def timed_turn(trainer: Trainer, batches: Iterator, steps: int) -> tuple[float, int]:
    """Seconds and real positions of ``steps`` training steps."""
    seconds, count = 0.0, 0
    for batch in itertools.islice(batches, steps):
        start = time.perf_counter()
        trainer.train_step([batch])
        seconds += time.perf_counter() - start
        count += positions(batch)
    return seconds, count


def peak_mib(trainer: Trainer, batches: Iterator, steps: int) -> float:
    """The largest peak of live tensors of ``steps`` training steps (the model's and
    optimizer's tensors included), MiB."""

    cap = MemoryCap(float("inf"), tensor_bytes(_trainer_tensors(trainer)))
    peak = 0
    for batch in itertools.islice(batches, steps):
        cap.reset_peak()
        with cap:
            trainer.train_step([batch])
        peak = max(peak, cap.peak)
    return peak / MIB


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True)
    p.add_argument("--memory-limit-mib", type=float, default=384.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--turn", type=int, default=15)
    p.add_argument("--peak-steps", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # shared cores: a second OpenMP thread's spinning swamps the timing
    trainers, streams, tables = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="sequence-tune-") as out:
        for arm in ARMS:
            cfg = config(arm)
            rows, where = tune(cfg, args.cache, memory_limit_mib=args.memory_limit_mib)
            tables[arm] = {str(r.bucket): r.budget for r in rows}
            print(json.dumps({"measure": "tune", "sequence": arm, "where": where,
                              "budgets": tables[arm],
                              "samples": {r.bucket: r.samples for r in rows},
                              "peak_mib": {r.bucket: round(r.peak_mib, 1) for r in rows}}),
                  flush=True)  # fmt: skip
            cfg = dataclasses.replace(
                cfg, data=dataclasses.replace(cfg.data, batch_frames=tables[arm])
            )
            env = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
            trainers[arm] = Trainer(cfg, args.cache, Path(out) / arm.replace("+", "_"), env)
            streams[arm] = iter(trainers[arm].parts.loader)
            timed_turn(trainers[arm], streams[arm], 3)  # warm-up
        rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for _ in range(args.rounds):
            for arm in ARMS:
                seconds, count = timed_turn(trainers[arm], streams[arm], args.turn)
                rates[arm].append(count / seconds)
        for arm in ARMS:
            peak = peak_mib(trainers[arm], streams[arm], args.peak_steps)
            print(json.dumps({"measure": "train", "sequence": arm,
                              "positions_per_s_median": round(statistics.median(rates[arm])),
                              "positions_per_s_turns": [round(r) for r in rates[arm]],
                              "peak_mib": round(peak, 1)}), flush=True)  # fmt: skip
        ratio = [d / f for f, d in zip(rates["frames"], rates["text+frames"], strict=True)]
        print(
            json.dumps(
                {"measure": "ratio", "median_within_round": round(statistics.median(ratio), 3)}
            )
        )
        for trainer in trainers.values():
            trainer.close()


if __name__ == "__main__":
    main()
