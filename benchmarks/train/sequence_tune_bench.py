"""Budgets on the declared sequence: sequence positions per second at equal peak memory, from
``train tune`` budgets on frames (today) against ``train tune`` budgets on the sequence the
model declares (``data.sequence``), side by side in one run.

    python -m benchmarks.train.sequence_tune_bench --cache CACHE [--memory-limit-mib 384]
        [--config tiny] [--max-batch-size 64] [--model prefix|encoder-decoder]

``--model prefix`` (the default): ``--config``'s model (``configs/tiny.toml``: the reference
prefix LM, whose sequence is the text's tokens then the mel frames), planned on frames against
``"text+frames"``. ``--model encoder-decoder``: ``train.model:EncoderDecoder`` at
``--config``'s size, planned on frames (:class:`PlannedOnFrames`, the same model without its
declaration) against the ``"text,frames"`` it declares (each axis with its own tuned table,
``data.batch_frames`` and ``data.batch_text``). fp32. For each arm ``train tune`` searches the
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
from typing import Any, ClassVar

import torch

from train.config.tables import Config, load_config
from train.memory.probes import MIB, MemoryCap, tensor_bytes
from train.model import EncoderDecoder
from train.parallel.env import Env
from train.trainer import Trainer
from train.tune import _trainer_tensors, tune

REPO = Path(__file__).resolve().parents[2]
# Each model's arms: today's plan, then the declared sequence's, as [model] / [data] overrides.
MODELS = {
    "prefix": {
        "frames": ['data.sequence="frames"'],
        "text+frames": ['data.sequence="text+frames"'],
    },
    "encoder-decoder": {
        "frames": ['model.impl="benchmarks.train.sequence_tune_bench:PlannedOnFrames"'],
        "text,frames": ['model.impl="train.model:EncoderDecoder"'],
    },
}


class PlannedOnFrames(EncoderDecoder):
    """The reference encoder-decoder without its declaration: planned and budgeted on frames
    alone, as every model was before ``data.sequence``."""

    melcache_contract: ClassVar[dict[str, Any]] = {}


def config(overrides: list[str], preset: str, max_batch_size: int) -> Config:
    sized = ["train.precision=fp32", f"data.max_batch_size={max_batch_size}"]
    return load_config(REPO / "configs" / f"{preset}.toml", [*sized, *overrides])


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


def tuned_trainer(
    arm: str, overrides: list[str], args: argparse.Namespace, out: Path, device: torch.device
) -> Trainer:
    """``train tune``'s tables for one arm (printed), and a trainer planning with them."""
    cfg = config(overrides, args.config, args.max_batch_size)
    rows, where = tune(cfg, args.cache, memory_limit_mib=args.memory_limit_mib)
    frames = {str(r.bucket): r.budget for r in rows}
    text = {str(r.bucket): r.text_budget for r in rows} if any(r.text_budget for r in rows) else 0
    print(json.dumps({"measure": "tune", "model": args.model, "sequence": arm, "where": where,
                      "budgets": frames, **({"text_budgets": text} if text else {}),
                      "samples": {r.bucket: r.samples for r in rows},
                      "peak_mib": {r.bucket: round(r.peak_mib, 1) for r in rows}}),
          flush=True)  # fmt: skip
    data = dataclasses.replace(cfg.data, batch_frames=frames, batch_text=text)
    env = Env(rank=0, world_size=1, local_rank=0, device=device)
    name = arm.replace("+", "_").replace(",", "_")
    return Trainer(dataclasses.replace(cfg, data=data), args.cache, out / name, env)


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
    p.add_argument("--model", choices=sorted(MODELS), default="prefix")
    args = p.parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":  # shared cores: a second OpenMP thread's spinning swamps the timing
        torch.set_num_threads(1)
    arms = MODELS[args.model]
    trainers, streams = {}, {}
    with tempfile.TemporaryDirectory(prefix="sequence-tune-") as out:
        for arm, overrides in arms.items():
            trainers[arm] = tuned_trainer(arm, overrides, args, Path(out), device)
            streams[arm] = iter(trainers[arm].parts.loader)
            timed_turn(trainers[arm], streams[arm], 3)  # warm-up
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(args.rounds):
            for arm in arms:
                seconds, count = timed_turn(trainers[arm], streams[arm], args.turn)
                rates[arm].append(count / seconds)
        for arm in arms:
            peak = peak_mib(trainers[arm], streams[arm], args.peak_steps)
            print(json.dumps({"measure": "train", "model": args.model, "sequence": arm,
                              "positions_per_s_median": round(statistics.median(rates[arm])),
                              "positions_per_s_turns": [round(r) for r in rates[arm]],
                              "peak_mib": round(peak, 1)}), flush=True)  # fmt: skip
        today, declared = (rates[arm] for arm in arms)
        ratio = [d / f for f, d in zip(today, declared, strict=True)]
        print(json.dumps({"measure": "ratio", "model": args.model,
                          "median_within_round": round(statistics.median(ratio), 3)}))  # fmt: skip
        for trainer in trainers.values():
            trainer.close()


if __name__ == "__main__":
    main()
