"""One sequence, two lengths: padding and ranks in step for a model whose sequence is text then
frames (ChatTTS's GPT) or whose text and frames are two axes (an encoder-decoder), planned on
frames (today) against planned on ``text + frames`` and on ``text,frames`` (``data.sequence``,
``melcache/loader/sequence.py``), side by side on one cache.

    python -m benchmarks.loader.sequence_bench --cache CACHE [--tokenizer DIR] [--ranks 8 64 512]

For each arm, rank ``r`` of each job size plans its first ``--steps`` batches with the loader's
own readers (``planned_stream``: the batches the loader yields, no mel decoded). Per batch of
``B`` utterances of ``text_i`` tokens (``--tokenizer``: a ``BertTokenizerFast`` folder for
``examples.chattts_gpt.tokenizer:ChatTTSTokenizer``, else UTF-8 bytes) and ``frames_i``:

- ``padding_pct``: the padded share of the GPT's positions, ``1 − Σ S_i ÷ Σ B·max S_i`` with
  ``S_i = text_i + frames_i`` (the GPT pads its sequence to the longest row's ``S``);
  ``padding_rounded_pct`` with ``max S`` rounded up to ``pad_multiple``; ``text_pct`` and
  ``frames_pct``: the ``text`` and frames tensors' own padding (each to its longest);
- ``efficiency``: Σ over steps of the ranks' mean cost ÷ Σ of their max, by the GPT's FLOP
  model ``B·(24·d²·S + 4·d·S²)``, ``d`` = 768 (ChatTTS's hidden size), ``S`` = max ``S_i``;
- for an encoder-decoder of that width (layers alike each side), whose text and frames are
  padded each to its longest ``T`` and ``F``: ``axes_pct``, the padded share of all ``B·(T +
  F)`` positions, and ``efficiency_axes`` by ``B·(24·d²·(T + F) + 4·d·(T² + F² + T·F))``.

``--parts cells``: from the table and the text lengths alone, each bucket's units cut into
equal runs in 1 to 4 text cells (``two_axis_order``'s sort) for both models: the padding of
text, frames, both axes and ``S``, and the padded cost of each, summed over the cache; what
decides where 2-D cells pay.

``--field codes`` plans as the GPT example reads (``"mel": False``): on the field's frames.
With no trained DVAE at hand, :func:`half_rate_codes` derives codes of ChatTTS's shape and
rate (4 codebooks, half the mel's frames) whose values mean nothing; only their lengths are
planned on::

    python -m preprocess derive CACHE --field codes --encoder benchmarks.loader.sequence_bench:half_rate_codes

Also the cache's text × frames distribution (``distribution``: utterances by seconds and by
tokens per second) and the positions a batch holds. Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from melcache.access import Cache
from melcache.batch_plans import even_batch_count, even_units, round_up
from melcache.fields.format import FieldEncoder
from melcache.loader import DataConfig, make_loader
from melcache.loader.batch import token_ids, utf8_tokens
from melcache.loader.sequence import MOST_CELLS, sidecar_folder, text_lengths, two_axis_cost
from melcache.loader.stream import planned_stream

DIM = 768  # ChatTTS's GPT hidden size
ARMS = ("frames", "text+frames", "text,frames")


class _HalfRate(torch.nn.Module):
    """Codes ``[B, T / 2, 4]``: each pair of frames' mean log-mel, quantised to 0..625."""

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        pairs = mel.float().unflatten(1, (-1, 2)).mean(dim=(2, 3))  # [B, T / 2]
        codes = ((pairs + 12.0) * 30.0).clamp(0, 625).long()
        return codes[..., None].expand(-1, -1, 4)


def half_rate_codes(checkpoint: str | None = None, device: str = "cpu", **_: Any) -> FieldEncoder:
    """A stand-in for ChatTTS's DVAE encoder (``preprocess derive --encoder``): its codes'
    shape, dtype and frame rate, not its values."""
    return FieldEncoder(module=_HalfRate(), config={"stand_in": "half_rate_codes"},
                        dtype="int16", shape=(4,), frame_rate=0.5, mel_multiple=2)  # fmt: skip


def gpt_cost(longest: int, batch: int) -> float:
    """FLOP model of a forward of ``batch`` rows padded to ``longest`` positions."""
    return batch * (24 * DIM * DIM * longest + 4 * DIM * longest * longest)


def axes_cost(text: int, frames: int, batch: int) -> float:
    """FLOP model of an encoder-decoder forward: ``batch`` rows, text padded to ``text``
    (the encoder's), frames to ``frames`` (the decoder's, cross-attending to the text)."""
    quadratic = text * text + frames * frames + text * frames
    return batch * (24 * DIM * DIM * (text + frames) + 4 * DIM * quadratic)


def rank_batches(
    cache: str, data: DataConfig, tokenizer: Callable[[str], Any], rank: int, ranks: int, steps: int
) -> list[tuple[list[int], list[int]]]:
    """Rank ``rank`` of ``ranks``'s first ``steps`` batches: (text tokens, frames) per row."""
    loader = make_loader(cache, data, rank=rank, world_size=ranks, tokenizer=tokenizer)
    count = functools.lru_cache(maxsize=None)(lambda text: len(token_ids(tokenizer, text)))
    out, stream = [], planned_stream(loader.spec, 0)
    for _, (_, _, samples, _, _) in zip(range(steps), stream, strict=False):
        out.append(([count(s.text) for s in samples], [s.frames for s in samples]))
    stream.close()  # its shards' maps, before the next rank's: 512 ranks in one process
    loader.close()
    return out  # (a field's reader gives the field's frames as each sample's)


def measure(
    cache: str, data: DataConfig, tokenizer: Callable[[str], Any], ranks: int, steps: int
) -> dict:
    """Padding (each way) and efficiency of a job of ``ranks`` ranks' first ``steps`` steps."""
    sums = dict.fromkeys(
        ("real", "padded", "rounded", "text", "text_pad", "frames", "frames_pad"), 0
    )
    costs: list[list[float]] = [[] for _ in range(steps)]
    axes: list[list[float]] = [[] for _ in range(steps)]
    for rank in range(ranks):
        for step, (text, frames) in enumerate(
            rank_batches(cache, data, tokenizer, rank, ranks, steps)
        ):
            seq = [t + f for t, f in zip(text, frames, strict=True)]
            rows = len(seq)
            sums["real"] += sum(seq)
            sums["padded"] += rows * max(seq)
            sums["rounded"] += rows * round_up(max(seq), data.pad_multiple)
            sums["text"] += sum(text)
            sums["text_pad"] += rows * max(text)
            sums["frames"] += sum(frames)
            sums["frames_pad"] += rows * max(frames)
            costs[step].append(gpt_cost(max(seq), rows))
            axes[step].append(axes_cost(max(text), max(frames), rows))
    share = lambda real, padded: round(100 * (1 - sums[real] / sums[padded]), 2)  # noqa: E731
    efficiency = lambda c: round(sum(sum(r) / len(r) for r in c) / sum(max(r) for r in c), 3)  # noqa: E731
    both = sums["text_pad"] + sums["frames_pad"]
    return {
        "ranks": ranks, "steps": steps, "efficiency": efficiency(costs),
        "padding_pct": share("real", "padded"), "padding_rounded_pct": share("real", "rounded"),
        "text_pct": share("text", "text_pad"), "frames_pct": share("frames", "frames_pad"),
        "axes_pct": round(100 * (1 - sums["real"] / both), 2),
        "efficiency_axes": efficiency(axes),
        "positions_per_batch": round(sums["padded"] / (ranks * steps)),
    }  # fmt: skip


def distribution(cache: str, tokenizer: Callable[[str], Any], folder: str) -> dict:
    """Utterances by seconds (rows) and text tokens per second (columns): the cache's text ×
    frames distribution, from its table and the text-length sidecar."""
    with Cache(cache) as opened:
        index, rate = opened.index, opened.index["features"]
        frames = opened.lengths.astype(np.float64)
    per_row = text_lengths(cache, index, tokenizer, sidecar_folder(folder)).per_row
    seconds = frames * rate["hop_length"] / rate["sample_rate"]
    per_second = per_row / np.maximum(seconds, 1e-9)
    second_edges, rate_edges = [0, 2, 4, 8, 16, 33], [0, 2, 4, 6, 8, 12, 1e9]
    counts, _, _ = np.histogram2d(seconds, per_second, bins=[second_edges, rate_edges])
    return {
        "measure": "distribution", "utterances": len(per_row),
        "seconds_edges": second_edges, "tokens_per_second_edges": rate_edges[:-1],
        "counts": counts.astype(int).tolist(),
        "tokens_per_second_quantiles_5_50_95": np.quantile(per_second, [0.05, 0.5, 0.95]).round(2).tolist(),
    }  # fmt: skip


def cell_padding(cache: str, tokenizer: Callable[[str], Any], data: DataConfig, field: str) -> list:
    """Per count of text cells (1 to MOST_CELLS), over the cache's units cut into equal runs
    (each unit's count as the loader counts it): the padding of text, frames, both axes and
    ``S``, and the padded cost of an encoder-decoder's runs and of the GPT's, relative to
    one cell's. From the table and the text-length sidecar alone."""
    with Cache(cache) as opened:
        index = opened.index
    lengths = text_lengths(cache, index, tokenizer, sidecar_folder(""), field or None)
    shards, pad, attention = index["shards"], data.pad_multiple, data.attention
    sums = np.zeros((MOST_CELLS, 7))  # text, its padded, frames, padded, S padded, two costs
    for bucket in sorted({entry["bucket"] for entry in shards}):
        ids = [i for i, entry in enumerate(shards) if entry["bucket"] == bucket]
        budget = {"batch_frames": data.budget(bucket), "max_batch_size": data.max_batch_size,
                  "pad_multiple": pad}  # fmt: skip
        tops = [int(lengths.frames[lengths.shard_rows[i] : lengths.shard_rows[i + 1]].max())
                for i in ids]  # fmt: skip
        for unit in even_units([shards[i]["samples"] for i in ids], tops, **budget):
            rows = np.concatenate(
                [np.arange(*lengths.shard_rows[ids[j] : ids[j] + 2]) for j in unit]
            )
            t, f = lengths.per_row[rows].astype(np.int64), lengths.frames[rows].astype(np.int64)
            count = even_batch_count(len(rows), int(f.max()), **budget)
            padded_f, seq = -(-f // pad) * pad, t + f
            for cells in range(1, MOST_CELLS + 1):
                cell = np.searchsorted(np.quantile(t, np.linspace(0, 1, cells + 1)[1:-1]), t)
                for run in np.array_split(np.lexsort((-t, -padded_f, -cell)), count):
                    top_t, top_f = int(t[run].max()), int(f[run].max())
                    cost = two_axis_cost(round_up(top_t, pad), round_up(top_f, pad), attention)
                    sums[cells - 1, :4] += (t[run].sum(), len(run) * top_t, f[run].sum(), len(run) * top_f)  # fmt: skip
                    sums[cells - 1, 5] += len(run) * int(cost)
                for run in np.array_split(np.lexsort((-seq, -cell)), count):
                    top = round_up(int(seq[run].max()), pad)
                    sums[cells - 1, 4] += len(run) * int(seq[run].max())
                    sums[cells - 1, 6] += len(run) * top * (attention + top)
    return [_cell_row(cells, row, sums) for cells, row in enumerate(sums, start=1)]


def _cell_row(cells: int, row: np.ndarray, sums: np.ndarray) -> dict:
    real = sums[0, 0] + sums[0, 2]
    pct = lambda part, whole: round(100 * (1 - part / whole), 2)  # noqa: E731
    return {
        "measure": "cells", "cells": cells, "text_pct": pct(row[0], row[1]),
        "frames_pct": pct(row[2], row[3]), "axes_pct": pct(real, row[1] + row[3]),
        "padding_pct": pct(real, row[4]),
        "axes_cost_vs_one_cell": round(row[5] / sums[0, 5], 4),
        "sequence_cost_vs_one_cell": round(row[6] / sums[0, 6], 4),
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True)
    p.add_argument("--tokenizer", default="", help="a BertTokenizerFast folder (ChatTTS's)")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--steps", type=int, nargs="+", default=[120, 30, 30])
    p.add_argument("--batch-frames", type=int, default=32_000)
    p.add_argument("--attention-frames", type=int, default=6 * DIM)
    p.add_argument("--sequences", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--field", default="", help='plan on a derived field\'s frames ("mel": False)')
    p.add_argument("--batch-text", type=int, default=0, help="data.batch_text (text,frames)")
    p.add_argument("--parts", nargs="+", default=["plans", "cells"], choices=["plans", "cells"])
    args = p.parse_args(argv)
    tokenizer: Callable[[str], Any] = utf8_tokens
    if args.tokenizer:
        from examples.chattts_gpt.tokenizer import ChatTTSTokenizer

        tokenizer = ChatTTSTokenizer(args.tokenizer)
    print(json.dumps(distribution(args.cache, tokenizer, "")), flush=True)
    fields = {"fields": (args.field,), "read_mel": False} if args.field else {}
    settings = {"batch_frames": args.batch_frames, "max_batch_size": 64, "num_workers": 1,
                "attention_frames": args.attention_frames, **fields}  # fmt: skip
    if "cells" in args.parts:
        for row in cell_padding(args.cache, tokenizer, DataConfig(**settings), args.field):
            print(json.dumps(row), flush=True)
    for arm in args.sequences if "plans" in args.parts else ():
        text = {"batch_text": args.batch_text} if arm == "text,frames" else {}
        data = DataConfig(**settings, sequence=arm, **text)
        for ranks, steps in zip(args.ranks, args.steps, strict=False):
            row = measure(args.cache, data, tokenizer, ranks, steps)
            print(json.dumps({"measure": "plan", "sequence": arm, **row}), flush=True)


if __name__ == "__main__":
    main()
