"""Budgets on the declared sequence: sequence positions per second at equal peak memory, from
``train tune`` budgets on frames (today) against ``train tune`` budgets on ``text + frames``
(``data.sequence``), side by side in one run.

    python -m benchmarks.train.sequence_tune_bench --cache CACHE [--memory-limit-mib 384]
        [--config tiny] [--max-batch-size 64]

The model is ``--config``'s (``configs/tiny.toml``: the reference prefix LM, whose sequence is
the text's tokens then the mel frames), fp32. For each arm ``train tune`` searches the
per-bucket table: on CUDA against the device's memory (``train.memory.target`` of it, the
allocator's peak), on CPU against ``--memory-limit-mib`` of live tensors
(``train.memory.probes.MemoryCap``); then each arm's trainer, with its table, trains on the
batches its own loader yields, in alternating turns of ``--turn`` steps (``--rounds`` each), so
a change in the machine's load falls on both: text + frames positions (real, not padding) per
second of training steps, and the peak memory over ``--peak-steps`` more steps (CUDA: the
allocator's peak allocated; CPU: live tensors under the same counter, not timed, as counting
slows each op). Prints one JSON line per arm. ``benchmarks/gpu_bench.sh`` runs it on a GPU
with ``configs/base.toml`` and room for 512 rows, where memory, not the row cap, binds.
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


def config(arm: str, preset: str, max_batch_size: int) -> Config:
    overrides = ["train.precision=fp32", f"data.max_batch_size={max_batch_size}"]
    return load_config(REPO / "configs" / f"{preset}.toml", [*overrides, f'data.sequence="{arm}"'])


def positions(batch: object) -> int:
    """Real text + frames positions of a batch."""
    return int((batch.text_lengths + batch.mel_lengths).sum())  # type: ignore[attr-defined]


def timed_turn(trainer: Trainer, batches: Iterator, steps: int) -> tuple[float, int]:
    """Seconds and real positions of ``steps`` training steps."""
    seconds, count = 0.0, 0
    cuda = trainer.env.device.type == "cuda"
    for batch in itertools.islice(batches, steps):
        start = time.perf_counter()
        trainer.train_step([batch])
        if cuda:  # the step's kernels, not their launch
            torch.cuda.synchronize(trainer.env.device)
        seconds += time.perf_counter() - start
        count += positions(batch)
    return seconds, count


def peak_mib(trainer: Trainer, batches: Iterator, steps: int) -> float:
    """The largest peak memory of ``steps`` training steps (the model's and optimizer's
    tensors included), MiB: on CUDA the allocator's peak allocated, else live tensors."""
    device = trainer.env.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        for batch in itertools.islice(batches, steps):
            trainer.train_step([batch])
        return torch.cuda.max_memory_allocated(device) / MIB
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
    p.add_argument("--config", default="tiny", help="a preset of configs/")
    p.add_argument("--max-batch-size", type=int, default=64)
    args = p.parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":  # shared cores: a second OpenMP thread's spinning swamps the timing
        torch.set_num_threads(1)
    trainers, streams, tables = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="sequence-tune-") as out:
        for arm in ARMS:
            cfg = config(arm, args.config, args.max_batch_size)
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
            env = Env(rank=0, world_size=1, local_rank=0, device=device)
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
