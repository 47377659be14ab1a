"""Budgets on the declared sequence: sequence positions per second at equal peak memory, from
``train tune`` budgets on frames (today) against ``train tune`` budgets on the sequence the
model declares (``data.sequence``), side by side in one run.

    python -m benchmarks.train.sequence_tune_bench --cache CACHE [--memory-limit-mib 384]
        [--config tiny] [--max-batch-size 64] [--model prefix|encoder-decoder|chattts-gpt]
        [--set KEY=VALUE ...]

``--model prefix`` (the default): ``--config``'s model (``configs/tiny.toml``: the reference
prefix LM, whose sequence is the text's tokens then the mel frames, each padded to its own
longest), planned on frames against ``"text+frames"`` and against ``"text,frames"``. ``--model encoder-decoder``: ``train.model:EncoderDecoder`` at
``--config``'s size, planned on frames (:class:`PlannedOnFrames`, the same model without its
declaration) against the ``"text,frames"`` it declares (each axis with its own tuned table,
``data.batch_frames`` and ``data.batch_text``). ``--model chattts-gpt``: ChatTTS's GPT
(``--config examples/chattts_gpt/config.toml``, ``--set 'data.vocab="TOKENIZER"'``, a cache with
codes derived), planned on code frames (``benchmarks/train/gpt_on_frames.py``) against the
``"text+frames"`` it declares. fp32. For each arm ``train tune`` searches the
per-bucket table: on CUDA against the device's memory (``train.memory.target`` of it, the
allocator's peak), on CPU against ``--memory-limit-mib`` of live tensors
(``train.memory.probes.MemoryCap``); then each arm's trainer, with its table, trains on the
batches its own loader yields, in alternating turns of ``--turn`` steps (``--rounds`` each), so
a change in the machine's load falls on both: text + frames positions (real, not padding) per
second of training steps, and the peak memory over ``--peak-steps`` more steps (CUDA: the
allocator's peak allocated; CPU: live tensors under the same counter, not timed, as counting
slows each op). Prints one JSON line per arm (with its positions per step and their padded
share), then each declared arm's ratio to today's, then each one's bound (:func:`bound`): the
most its budgets could gain on any device, from the batches alone, so a ratio short of a
target on one device says whether another could reach it; over the timed batches, then over
every batch of one epoch of each arm's plan (:func:`epoch_steps`).
``benchmarks/gpu_bench.sh`` runs it on a GPU with ``configs/base.toml`` and room for 512 rows,
where memory, not the row cap, binds.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch

from melcache.batch_plans import padding_fraction
from melcache.loader import make_loader
from train.config.tables import Config, load_config
from train.memory.probes import MIB, MemoryCap, tensor_bytes
from train.model import EncoderDecoder
from train.parallel.env import Env
from train.trainer import Trainer
from train.tune import trainer_tensors, tune


def prefix_pairs(text: Any, frames: Any) -> Any:
    """Query-key pairs of one sequence attending over ``S = text + frames`` (ints or per-row
    tensors)."""
    return (text + frames) ** 2


def encoder_decoder_pairs(text: Any, frames: Any) -> Any:
    """Query-key pairs of the encoder over the text, the decoder over the frames and the
    frames over the text."""
    return text * text + frames * frames + text * frames


@dataclasses.dataclass(frozen=True)
class Model:
    """A model's arms (today's plan, then the declared sequence's, as [model] / [data]
    overrides) and how its step's work is counted: its query-key pairs, whether a row is its
    text then its frames padded at its end (``packed``, else each padded apart), and the
    derived field whose frames it reads (else the mel's)."""

    arms: dict[str, list[str]]
    pairs: Callable[[Any, Any], Any] = prefix_pairs
    packed: bool = False
    field: str | None = None


MODELS = {
    # The reference prefix LM pads its text and its frames each to their own longest, so it
    # is also planned on two axes, the layout its batches have.
    "prefix": Model({
        "frames": ['data.sequence="frames"'],
        "text+frames": ['data.sequence="text+frames"'],
        "text,frames": ['data.sequence="text,frames"'],
    }),
    "encoder-decoder": Model({
        "frames": ['model.impl="benchmarks.train.sequence_tune_bench:PlannedOnFrames"'],
        "text,frames": ['model.impl="train.model:EncoderDecoder"'],
    }, pairs=encoder_decoder_pairs),
    # ChatTTS's GPT (--config examples/chattts_gpt/config.toml, the chattts extra, a cache
    # with codes derived): its adapter packs each row, text then code frames.
    "chattts-gpt": Model({
        "frames": ['model.impl="benchmarks.train.gpt_on_frames:GPTPlannedOnFrames"'],
        "text+frames": ['model.impl="examples.chattts_gpt.adapter:GPT"'],
    }, packed=True, field="codes"),
}  # fmt: skip


class PlannedOnFrames(EncoderDecoder):
    """The reference encoder-decoder without its declaration: planned and budgeted on frames
    alone, as every model was before ``data.sequence``."""

    melcache_contract: ClassVar[dict[str, Any]] = {}


def config(overrides: list[str], preset: str, max_batch_size: int) -> Config:
    """``preset`` (a TOML file, or a preset's name as ``--config`` takes it) in fp32 with
    ``overrides``."""
    sized = ["train.precision=fp32", f"data.max_batch_size={max_batch_size}"]
    return load_config(Path(preset), [*sized, *overrides])


# What a step computes, padded, that its time can follow: one step (the optimizer's, launches),
# rows, positions, frames (the heads and loss run on those) and attended query-key pairs.
WORK = ("step", "rows", "positions", "frames", "pairs")


class Step(NamedTuple):
    """One timed training step: its real text + frames positions and its :data:`WORK`."""

    seconds: float
    positions: int
    work: tuple[int, ...]


def measured_step(model: Model, batch: Any, seconds: float) -> Step:
    """``batch``'s real positions and its work as padded, and its time."""
    text = batch.text_lengths.long()
    frames = (batch.field_lengths[model.field] if model.field else batch.mel_lengths).long()
    padded_frames = (batch.fields[model.field] if model.field else batch.mel).shape[1]
    rows = len(batch)
    if model.packed:  # each row its text then its frames, to the longest row's
        length = int((text + frames).max())
        pairs = model.pairs(0, length)
    else:  # the text to the longest text, the frames to the longest frames
        length = batch.text.shape[1] + padded_frames
        pairs = model.pairs(batch.text.shape[1], padded_frames)
    work = (1, rows, rows * length, rows * padded_frames, rows * pairs)
    return Step(seconds, int((text + frames).sum()), work)


def timed_turn(trainer: Trainer, batches: Iterator, steps: int, model: Model) -> list[Step]:
    """``steps`` training steps, each timed."""
    done = []
    cuda = trainer.env.device.type == "cuda"
    for batch in itertools.islice(batches, steps):
        start = time.perf_counter()
        trainer.train_step([batch])
        if cuda:  # the step's kernels, not their launch
            torch.cuda.synchronize(trainer.env.device)
        done.append(measured_step(model, batch, time.perf_counter() - start))
    return done


def rate(steps: list[Step]) -> float:
    """Real positions per second of ``steps``."""
    return sum(s.positions for s in steps) / sum(s.seconds for s in steps)


def padded_share(steps: list[Step]) -> float:
    """The share of padding among the positions ``steps`` computed."""
    padded = sum(s.work[WORK.index("positions")] for s in steps)
    return padding_fraction(sum(s.positions for s in steps), padded)


def epoch_steps(trainer: Trainer, cache: str, model: Model) -> list[Step]:
    """Every batch of one epoch that ``trainer``'s loader plans, from a loader of its own
    started afresh, each a :class:`Step` of no time: the whole epoch for :func:`bound`, not
    only the timed batches."""
    spec = trainer.parts.loader.spec
    loader = make_loader(cache, spec.data, seed=trainer.cfg.train.seed, tokenizer=spec.tokenizer)
    try:
        batches = sum(sub.per_epoch for sub in loader.spec.subs)
        return [measured_step(model, b, 0.0) for b in itertools.islice(iter(loader), batches)]
    finally:
        loader.close()


def bound(model: str, steps: dict[str, list[Step]]) -> list[dict[str, Any]]:
    """For each declared arm, the most its budgets could gain over today's on any device
    whose step time is a sum of nonnegative costs per item of :data:`WORK`
    (per step, per row, per padded position, per padded frame, per query-key pair): its real
    positions per step over today's × the largest ratio of today's mean work per step to its
    own, item by item (a ratio of two such sums is at most the largest ratio of their terms).
    From the batches alone: exact, with no timing or fit."""
    today, *declared = steps

    def mean(arm: str, item: int) -> float:
        return statistics.fmean(s.work[item] for s in steps[arm])

    out = []
    for arm in declared:
        more = statistics.fmean(s.positions for s in steps[arm]) / statistics.fmean(
            s.positions for s in steps[today]
        )
        lighter = {name: mean(today, i) / mean(arm, i) for i, name in enumerate(WORK)}
        out.append({"measure": "bound", "model": model, "sequence": arm,
                    "most_on_any_device": round(more * max(lighter.values()), 3),
                    "positions_per_step_ratio": round(more, 4),
                    "today_work_over_declared": {k: round(v, 4) for k, v in lighter.items()}})  # fmt: skip
    return out


def peak_mib(trainer: Trainer, batches: Iterator, steps: int) -> float:
    """The largest peak memory of ``steps`` training steps (the model's and optimizer's
    tensors included), MiB: on CUDA the allocator's peak allocated, else live tensors."""
    device = trainer.env.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        for batch in itertools.islice(batches, steps):
            trainer.train_step([batch])
        return torch.cuda.max_memory_allocated(device) / MIB
    cap = MemoryCap(float("inf"), tensor_bytes(trainer_tensors(trainer)))
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
    cfg = config([*args.set, *overrides], args.config, args.max_batch_size)
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
    p.add_argument("--config", default="tiny", help="a preset of configs/, or a TOML file")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for both arms (repeatable)",
    )
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--model", choices=sorted(MODELS), default="prefix")
    args = p.parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":  # shared cores: a second OpenMP thread's spinning swamps the timing
        torch.set_num_threads(1)
    model = MODELS[args.model]
    arms = model.arms
    trainers, streams = {}, {}
    with tempfile.TemporaryDirectory(prefix="sequence-tune-") as out:
        for arm, overrides in arms.items():
            trainers[arm] = tuned_trainer(arm, overrides, args, Path(out), device)
            streams[arm] = iter(trainers[arm].parts.loader)
            timed_turn(trainers[arm], streams[arm], 3, model)  # warm-up
        steps: dict[str, list[Step]] = {arm: [] for arm in arms}
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(args.rounds):
            for arm in arms:
                turn = timed_turn(trainers[arm], streams[arm], args.turn, model)
                steps[arm] += turn
                rates[arm].append(rate(turn))
        for arm in arms:
            peak = peak_mib(trainers[arm], streams[arm], args.peak_steps)
            print(json.dumps({"measure": "train", "model": args.model, "sequence": arm,
                              "positions_per_s_median": round(statistics.median(rates[arm])),
                              "positions_per_s_turns": [round(r) for r in rates[arm]],
                              "positions_per_step": round(statistics.fmean(s.positions for s in steps[arm])),
                              "padded_share": round(padded_share(steps[arm]), 4),
                              "peak_mib": round(peak, 1)}), flush=True)  # fmt: skip
        today, *declared = arms
        for arm in declared:
            ratio = [d / f for f, d in zip(rates[today], rates[arm], strict=True)]
            print(json.dumps({"measure": "ratio", "model": args.model, "sequence": arm,
                              "median_within_round": round(statistics.median(ratio), 3)}))  # fmt: skip
        for line in bound(args.model, steps):
            print(json.dumps({**line, "batches": "timed"}))
        epoch = {arm: epoch_steps(trainer, args.cache, model) for arm, trainer in trainers.items()}
        for line in bound(args.model, epoch):
            print(json.dumps({**line, "batches": f"one epoch ({len(epoch[line['sequence']])})"}))
        for trainer in trainers.values():
            trainer.close()


if __name__ == "__main__":
    main()
