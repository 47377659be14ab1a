"""What one step of a job costs its ranks: the FLOP model, a cost model timed on this
machine's device, and the efficiency and padding of planned batches (the rows of
``benchmarks/schedule_bench.py``'s plans and synthetic parts).

The FLOP model is ``configs/base.toml``'s transformer (d 512, 12 layers, a prefix LM over
text + mel): per utterance slot ``24·d²·S + 4·d·S²`` with ``S`` = padded text + mel length.
Efficiency is Σ over steps of the ranks' mean cost ÷ Σ of their max: the share of the step's
GPU time the ranks would not spend waiting for the slowest.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from melcache.batch_plans import COST_CUT_PLAN, padding_fraction, round_up
from melcache.loader.batch import BYTE_VOCAB_SIZE, utf8_tokens
from melcache.loader.data_config import ATTENTION_FRAMES
from melcache.loader.schedule import make_schedule
from melcache.loader.spec import StreamSpec
from melcache.loader.stream import planned_stream
from melcache.reader import RawSample
from melcache.sections import find_config
from train.config.tables import load_config
from train.model import build_model

DIM = 512  # configs/base.toml


def step_cost(mel_frames: int, text_tokens: int, batch: int) -> float:
    """FLOP model of one forward of ``batch`` slots of padded length ``mel + text``."""
    length = mel_frames + text_tokens
    return batch * (24 * DIM * DIM * length + 4 * DIM * length * length)


def efficiency(costs: Sequence[Sequence[float]]) -> float:
    """Σ over steps of the ranks' mean cost ÷ Σ of their max: the GPU time not spent waiting."""
    return sum(sum(c) / len(c) for c in costs) / sum(max(c) for c in costs)


def summary(name: str, ranks: int, buckets: list[list[int]], costs: list[list[float]]) -> dict:
    """One JSON-able line: share of steps in one bucket and the efficiency."""
    same = sum(len(set(b)) == 1 for b in buckets) / len(buckets)
    return {"measure": name, "ranks": ranks, "steps": len(buckets),
            "one_bucket_share": round(same, 3), "efficiency": round(efficiency(costs), 3)}  # fmt: skip


# A batch's shape: padded mel frames, padded text tokens, utterances.
Shape = tuple[int, int, int]
CostModel = Callable[[int, int, int], float]


def timed_cost_model(
    shapes: Mapping[int, Shape], preset: str, repeats: int
) -> tuple[CostModel, dict]:
    """A cost model measured on this machine's device (CUDA when present, else CPU): the
    ``preset`` model's forward + backward timed for one utterance slot of each bucket's
    typical padded shape (median of ``repeats`` after a warm-up), fitted as ``a·S + b·S²``
    seconds per slot (``S`` = text + mel), so a batch costs ``B × (a·S + b·S²)``."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # on shared cores, a second OpenMP thread's spinning swamps it
        torch.set_num_threads(1)
    config = load_config(find_config(preset)).model
    model = build_model(config).to(device).train()
    seconds = {}
    for bucket, (mel, text, _) in sorted(shapes.items()):
        inputs = (torch.randn(1, mel, config.n_mels, device=device),
                  torch.tensor([mel], device=device),
                  torch.randint(1, BYTE_VOCAB_SIZE, (1, text), device=device),
                  torch.tensor([text], device=device))  # fmt: skip
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            model(*inputs)["loss_sum"].backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds[bucket] = statistics.median(times[1:])
    lengths = np.array([mel + text for mel, text, _ in (shapes[b] for b in seconds)], float)
    terms = np.stack([lengths, lengths**2], axis=1)
    (a, b), *_ = np.linalg.lstsq(terms, np.array(list(seconds.values())), rcond=None)
    a, b = max(float(a), 0.0), max(float(b), 0.0)
    row = {"measure": "cost model", "device": device.type, "preset": preset,
           "shapes_mel_text_batch": {k: list(v) for k, v in sorted(shapes.items())},
           "seconds_per_slot": {k: round(v, 4) for k, v in seconds.items()},
           "fit_a_per_token": a, "fit_b_per_token2": b}  # fmt: skip
    return (lambda mel, text, batch: batch * (a * (mel + text) + b * (mel + text) ** 2)), row


def typical_shapes(spec: StreamSpec, steps: int) -> dict[int, Shape]:
    """Each bucket's median batch shape over one rank's first ``steps`` planned batches."""
    stream = planned(spec, False)
    by_bucket: dict[int, list[Shape]] = {}
    for _, (bucket, samples) in zip(range(steps), stream, strict=False):
        by_bucket.setdefault(bucket, []).append(shape_of(samples, spec.data.pad_multiple))
    stream.close()
    return {b: tuple(int(np.median(c)) for c in zip(*v, strict=True))  # type: ignore[misc]
            for b, v in by_bucket.items()}  # fmt: skip


def planned(spec: StreamSpec, unsynced: bool) -> Iterator[tuple[int, list[RawSample]]]:
    """One rank's batches (bucket, samples) from the loader's readers, no mel decoded."""
    if unsynced:  # the same sub-streams, each rank choosing among all of them by itself
        schedule = make_schedule(spec.subs, spec.schedule.weights, seed=spec.seed, sync=False)
        spec = dataclasses.replace(spec, schedule=schedule)
    for _, _, samples, _, entries in planned_stream(spec, 0):
        yield entries[0]["bucket"], samples


SpecOf = Callable[[int], StreamSpec]  # the spec of rank r of a job


def plan_rows(
    name: str, spec_of: SpecOf, ranks: int, steps: int, unsynced: bool, measured: CostModel | None
) -> dict:
    """One rank's plan after the other (ranks plan independently, so only one rank's shards
    are open at a time): the efficiency by the FLOP model and (``efficiency_measured``) by the
    cost model timed on the device; the padding of the mel frames (``padding_pct``: padded
    ``B × T`` against real frames, ``T`` rounded up to ``pad_multiple``)."""
    per_rank, real, padded = [], 0, 0
    for r in range(ranks):
        spec = spec_of(r)
        stream = planned(spec, unsynced)
        batches = [next(stream) for _ in range(steps)]
        per_rank.append([(b, shape_of(samples, spec.data.pad_multiple)) for b, samples in batches])
        real += sum(s.frames for _, samples in batches for s in samples)
        padded += sum(shape[0] * shape[2] for _, shape in per_rank[-1])
        stream.close()
    steps_of = list(zip(*per_rank, strict=True))
    buckets = [[b for b, _ in step] for step in steps_of]
    row = summary(name, ranks, buckets,
                  [[step_cost(*shape) for _, shape in step] for step in steps_of])  # fmt: skip
    row["padding_pct"] = round(100 * padding_fraction(real, padded), 2)
    if measured is not None:
        costs = [[measured(*shape) for _, shape in step] for step in steps_of]
        row["efficiency_measured"] = round(efficiency(costs), 3)
    return row


def plan_cuts(plans: Sequence[int], attentions: Sequence[int]) -> list[tuple[int, int | None]]:
    """(batch plan, ``data.attention_frames`` in effect) of each cut to plan: plans 1 and 2
    once (they use no attention frames: None), plans from 3 on (the cost cut) at each of
    ``attentions`` (0: the loader's default)."""
    return [
        (plan, (a or ATTENTION_FRAMES) if plan >= COST_CUT_PLAN else None)
        for plan in plans
        for a in (attentions if plan >= COST_CUT_PLAN else [0])
    ]


def attention_values(asked: Sequence[str], described: Mapping | None) -> list[int]:
    """``data.attention_frames`` of each of ``asked``: a number, or ``fit``, the timed cost
    model's own (``a ÷ b`` of its ``a·S + b·S²``: where its quadratic term equals the linear;
    left out without a timed model)."""
    out = []
    for value in asked:
        if value != "fit":
            out.append(int(value))
        elif described is not None and described["fit_b_per_token2"] > 0:
            out.append(round(described["fit_a_per_token"] / described["fit_b_per_token2"]))
    return out


def shape_of(samples: list[RawSample], pad_multiple: int) -> Shape:
    mel = round_up(max(s.frames for s in samples), pad_multiple)
    text = round_up(max(len(utf8_tokens(s.text)) for s in samples), pad_multiple)
    return mel, text, len(samples)
