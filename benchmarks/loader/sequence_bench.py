"""One sequence, two lengths: padding and ranks in step for a model whose sequence is text then
frames (ChatTTS's GPT), planned on frames (today) against planned on ``text + frames``
(``data.sequence``, ``melcache/loader/sequence.py``), side by side on one cache.

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
  model ``B·(24·d²·S + 4·d·S²)``, ``d`` = 768 (ChatTTS's hidden size), ``S`` = max ``S_i``.

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

from melcache.batch_plans import round_up
from melcache.fields.format import FieldEncoder
from melcache.loader import DataConfig, make_loader
from melcache.loader.batch import token_ids, utf8_tokens
from melcache.loader.sequence import text_lengths
from melcache.loader.stream import planned_stream

DIM = 768  # ChatTTS's GPT hidden size
ARMS = ("frames", "text+frames")


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
    share = lambda real, padded: round(100 * (1 - sums[real] / sums[padded]), 2)  # noqa: E731
    efficiency = sum(sum(c) / len(c) for c in costs) / sum(max(c) for c in costs)
    return {
        "ranks": ranks, "steps": steps, "efficiency": round(efficiency, 3),
        "padding_pct": share("real", "padded"), "padding_rounded_pct": share("real", "rounded"),
        "text_pct": share("text", "text_pad"), "frames_pct": share("frames", "frames_pad"),
        "positions_per_batch": round(sums["padded"] / (ranks * steps)),
    }  # fmt: skip


def distribution(cache: str, tokenizer: Callable[[str], Any], folder: str) -> dict:
    """Utterances by seconds (rows) and text tokens per second (columns): the cache's text ×
    frames distribution, from its table and the text-length sidecar."""
    from melcache.access import Cache
    from melcache.loader.sequence import sidecar_folder

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
    args = p.parse_args(argv)
    tokenizer: Callable[[str], Any] = utf8_tokens
    if args.tokenizer:
        from examples.chattts_gpt.tokenizer import ChatTTSTokenizer

        tokenizer = ChatTTSTokenizer(args.tokenizer)
    print(json.dumps(distribution(args.cache, tokenizer, "")), flush=True)
    for arm in args.sequences:
        fields = {"fields": (args.field,), "read_mel": False} if args.field else {}
        data = DataConfig(batch_frames=args.batch_frames, max_batch_size=64, num_workers=1,
                          attention_frames=args.attention_frames, sequence=arm, **fields)  # fmt: skip
        for ranks, steps in zip(args.ranks, args.steps, strict=False):
            row = measure(args.cache, data, tokenizer, ranks, steps)
            print(json.dumps({"measure": "plan", "sequence": arm, **row}), flush=True)


if __name__ == "__main__":
    main()
