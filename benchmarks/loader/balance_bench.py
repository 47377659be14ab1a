"""Who is heard how often (#53): ``[data.balance]`` on a drawn 50 h cache, against no balance.

    python -m benchmarks.loader.balance_bench [--hours 50] [--speakers 300] [--rounds 5]

A cache is drawn as ``benchmarks/common/synthetic_cache.py`` draws it (the build's own buckets and
shards, no audio), its utterances dealt to ``--speakers`` speakers with Zipf-like hours (the
largest over 20× the median) and three languages holding 70 / 25 / 5 % of the hours. The
loader's own planning code then runs over it, with ``speaker_temperature = 0.5`` and
``language_temperature = 0.3`` and without balance, side by side:

1. ``shares``: the hours the batches of every sub-stream's epoch 0 hold (counted from the
   batches a one-rank stream yields), per speaker and per language, as a total-variation
   distance from the target;
2. ``throughput``: planned samples/s of one stream (shards answered from the drawn table, no
   mel decoded, so the selection's own cost is all that differs), in alternating rounds:
   median and spread of each, and the median ratio within a round;
3. ``ranks``: padding and the FLOP model's efficiency of bucket-synchronous steps at 8, 64 and
   512 ranks (``benchmarks/loader/step_costs.py``);
4. with ``--cache DIR`` (a built cache with a table): the real loader's samples/s (2 workers,
   mels decoded) with ``speaker_temperature = 0.5`` and without, in alternating rounds.

Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.common.synthetic_cache import LOCATION, SyntheticCache, draw_cache, reading
from benchmarks.loader.step_costs import plan_rows
from melcache.batch_plans import padding_fraction, round_up
from melcache.features import FeatureConfig
from melcache.loader import make_loader
from melcache.loader.balance import Chosen, Rows, weigh
from melcache.loader.batch import utf8_tokens
from melcache.loader.data_config import DataConfig
from melcache.loader.schedule import make_schedule, substreams
from melcache.loader.spec import MixCache, StreamSpec
from melcache.loader.stream import planned_stream

BALANCE = {"speaker_temperature": 0.5, "language_temperature": 0.3}
LANGUAGES = {"en": 0.70, "zh": 0.25, "de": 0.05}
DATA = DataConfig(batch_frames=32_000, num_workers=0)


def speakers_and_languages(
    cache: SyntheticCache, speakers: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Each utterance's speaker (1..speakers, Zipf-like hours) and language code, in table
    order; a speaker speaks one language, the languages filled to their hour shares."""
    frames = np.array([s.frames for shard in cache.shards for s in cache.samples[shard["name"]]])
    rng = np.random.default_rng([seed, 53])
    share = 1 / np.arange(1, speakers + 1) ** 1.1
    speaker = rng.choice(speakers, len(frames), p=share / share.sum()) + 1
    hours = np.bincount(speaker, frames, speakers + 1)
    language_of = np.zeros(speakers + 1, np.int64)
    filled = np.zeros(len(LANGUAGES))
    wanted = np.array(list(LANGUAGES.values())) * hours.sum()
    for s in np.argsort(-hours).tolist():  # the largest first, into the emptiest language
        language_of[s] = int(np.argmax(wanted - filled))
        filled[language_of[s]] += hours[s]
    return speaker, language_of[speaker]


def balanced_spec(
    cache: SyntheticCache, chosen: Chosen | None, rank: int, world_size: int, spread: bool = False
) -> StreamSpec:
    """The spec ``make_loader`` would give, with ``chosen`` (or no selection); ``spread``:
    ``data.balance.spread``, an utterance's copies a batch apart."""
    first = tuple(chosen.shard_rows.tolist()) if chosen is not None else ()
    balance = {**BALANCE, **({"spread": True} if spread else {})}
    data = dataclasses.replace(DATA, balance=balance if chosen is not None else {})
    subs = substreams([cache.shards], data, True, [chosen] if chosen is not None else ())
    return StreamSpec(
        sources=(MixCache(LOCATION, cache.shards, first_rows=first),),
        subs=subs,
        schedule=make_schedule(subs, [1.0], seed=0, sync=True),
        data=data,
        rank=rank,
        world_size=world_size,
        seed=0,
        n_mels=FeatureConfig().n_mels,
        pad_value=0.0,
        tokenizer=utf8_tokens,
    )


def epoch_shares(
    spec: StreamSpec, rows_of_key: dict[str, int], groups: dict[str, np.ndarray], target: dict
) -> dict[str, float]:
    """Total-variation distance from ``target`` of the hours every sub-stream's epoch 0
    holds, per group, counted from the batches one rank's stream yields; with the share of
    copies in a batch that holds another copy of their utterance, and the padding."""
    left = {u: sub.per_epoch for u, sub in enumerate(spec.subs)}
    stream_of = {unit[0]: u for u, sub in enumerate(spec.subs) for unit in sub.units}
    heard = np.zeros(len(next(iter(groups.values()))))
    copies = beside = padded = 0
    for visit, _, samples, _, _ in planned_stream(spec, 0):
        epoch, first = visit
        stream = stream_of[first]
        if epoch == 0 and stream in left:
            for sample in samples:
                heard[rows_of_key[sample.key]] += sample.frames
            copies += len(samples)
            beside += len(samples) - len({sample.key for sample in samples})
            padded += len(samples) * round_up(
                max(s.frames for s in samples), spec.data.pad_multiple
            )
            left[stream] -= 1
            if left[stream] == 0:
                del left[stream]
        if not left:
            break
    out = {
        "copies_beside_their_own": round(beside / max(copies, 1), 4),
        "padding_pct": round(100 * padding_fraction(heard.sum(), padded), 2),
    }
    for name, codes in groups.items():
        got = np.bincount(codes, heard)
        got = got / got.sum()
        want = np.resize(target[name], len(got))
        out[f"{name}_tv"] = round(0.5 * float(np.abs(got - want).sum()), 4)
    return out


def windows(
    spec: StreamSpec, rows_of_key: dict[str, int], codes: np.ndarray, target: np.ndarray
) -> list[float]:
    """Total-variation distance from ``target`` of the hours each of the first 5 windows of
    200 batches of one rank's stream holds, per ``codes`` (a language): what a resume with a
    new τ streams, its sub-streams started afresh under it."""
    out = []
    stream = planned_stream(spec, 0)
    for _ in range(5):
        heard = np.zeros(len(target))
        for _, _, samples, _, _ in itertools.islice(stream, 200):
            for sample in samples:
                heard[codes[rows_of_key[sample.key]]] += sample.frames
        out.append(round(0.5 * float(np.abs(heard / heard.sum() - target).sum()), 4))
    stream.close()
    return out


def throughput(cache: SyntheticCache, chosen: Chosen, rounds: int, batches: int) -> dict:
    """Planned samples/s with and without balance, in alternating rounds."""
    rates: dict[str, list[float]] = {"balanced": [], "plain": []}
    for _ in range(rounds):
        for name, pick in (("plain", None), ("balanced", chosen)):
            stream = planned_stream(balanced_spec(cache, pick, 0, 1), 0)
            start, samples = time.perf_counter(), 0
            for _, _, held, _, _ in itertools.islice(stream, batches):
                samples += len(held)
            rates[name].append(samples / (time.perf_counter() - start))
            stream.close()
    ratios = [b / p for b, p in zip(rates["balanced"], rates["plain"], strict=True)]
    return {
        "measure": "planned samples/s, one stream (no mel decoded)",
        **{f"{k}_median": round(statistics.median(v)) for k, v in rates.items()},
        **{f"{k}_spread": [round(min(v)), round(max(v))] for k, v in rates.items()},
        "ratio_median": round(statistics.median(ratios), 3),
    }


def loader_throughput(cache: str, rounds: int, batches: int) -> dict:
    """Part 4: the real loader's samples/s with and without balance, alternating rounds."""
    rates: dict[str, list[float]] = {"balanced": [], "plain": []}
    for _ in range(rounds):
        for name, balance in (("plain", {}), ("balanced", {"speaker_temperature": 0.5})):
            data = DataConfig(batch_frames=32_000, num_workers=2, balance=balance)
            loader = make_loader(cache, data)
            stream = iter(loader)
            next(stream)  # the workers started
            start, samples = time.perf_counter(), 0
            for batch in itertools.islice(stream, batches):
                samples += len(batch)
            rates[name].append(samples / (time.perf_counter() - start))
            loader.close()
    ratios = [b / p for b, p in zip(rates["balanced"], rates["plain"], strict=True)]
    return {
        "measure": f"loader samples/s, 2 workers, {cache}",
        **{f"{k}_median": round(statistics.median(v)) for k, v in rates.items()},
        **{f"{k}_spread": [round(min(v)), round(max(v))] for k, v in rates.items()},
        "ratio_median": round(statistics.median(ratios), 3),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hours", type=float, default=50.0)
    p.add_argument("--speakers", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", type=int, default=400, help="planned batches a round")
    p.add_argument("--ranks", type=int, nargs="*", default=[8, 64, 512])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--cache", help="a built cache: the real loader's samples/s (part 4)")
    args = p.parse_args(argv)
    if args.cache:
        print(json.dumps(loader_throughput(args.cache, args.rounds, args.batches)))
    cache = draw_cache(args.hours)
    speaker, language = speakers_and_languages(cache, args.speakers)
    keys = [s.key for shard in cache.shards for s in cache.samples[shard["name"]]]
    frames = np.array([s.frames for shard in cache.shards for s in cache.samples[shard["name"]]])
    names = list(LANGUAGES)
    meta = [
        {"speaker": str(s), "language": names[lang]}
        for s, lang in zip(speaker, language, strict=True)
    ]
    rows = Rows(frames.astype(np.int64), speaker.astype(np.int64), meta)
    shard_rows = np.concatenate([[0], np.cumsum([s["samples"] for s in cache.shards])])
    chosen = weigh(rows, shard_rows, "", BALANCE, LOCATION)
    hours = np.bincount(speaker, frames)
    print(json.dumps({
        "hours": round(cache.hours, 1), "utterances": len(keys), "speakers": args.speakers,
        "largest_over_median_speaker": round(float(hours.max() / np.median(hours[hours > 0])), 1),
        "language_hours": [round(float(h), 3) for h in np.bincount(language, frames) / frames.sum()],
    }))  # fmt: skip
    groups = {"speaker": speaker, "language": language}
    target = {
        name: np.bincount(codes, chosen.weights * frames) / float(chosen.weights @ frames)
        for name, codes in groups.items()
    }
    natural = {name: np.bincount(codes, frames) / frames.sum() for name, codes in groups.items()}
    rows_of_key = {key: i for i, key in enumerate(keys)}
    with reading(cache):
        for name, pick, spread in (("balanced", chosen, False),
                                   ("balanced, spread = true", chosen, True),
                                   ("plain", None, False)):  # fmt: skip
            spec = balanced_spec(cache, pick, 0, 1, spread)
            goal = target if pick is not None else natural
            print(json.dumps({"measure": f"epoch 0 shares, {name}", "target": "balance" if pick is not None else "natural",
                              "target_language": [round(float(v), 3) for v in target["language"]],
                              **epoch_shares(spec, rows_of_key, groups, goal)}))  # fmt: skip
        print(json.dumps({"measure": "windows of 200 batches after a change of τ: language TV",
                          "tv": windows(balanced_spec(cache, chosen, 0, 1), rows_of_key,
                                        language, target["language"])}))  # fmt: skip
        print(json.dumps(throughput(cache, chosen, args.rounds, args.batches)))
        for world in args.ranks:
            for name, pick in (("plain", None), ("balanced", chosen)):
                row = plan_rows(f"plans {name}", lambda r, w=world, c=pick: balanced_spec(cache, c, r, w),
                                world, max(30, args.steps * 8 // world), False, None)  # fmt: skip
                print(json.dumps(row))


if __name__ == "__main__":
    main()
