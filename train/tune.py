"""``python -m train tune``: per length bucket, the largest batch budget that fits the device.

A GPU tool, after NeMo's OOMptimizer: on the device it runs on, with the real model, precision,
activation checkpointing, optimizer, EMA and loss scaler (a :class:`~train.trainer.Trainer` of
the given config: in one process, or under torchrun for ``train.parallel.strategy = "fsdp2" | "hsdp"``,
every rank trying the same batch at the same time), each bucket, longest first, gets a
bisection of real training steps (``Trainer.train_step``: forward, backward, optimizer step) on
a batch of ``B`` utterances all as long as the bucket's longest (but one, a frame and a token
shorter, so the batch is padded as real ones are), with text as long as the
longest text of the shard that holds it; for a model whose sequence is text then frames
(``data.sequence = "text+frames"``) the text makes the bucket's longest ``text + frames``
(from the table and the text-length sidecar, ``melcache/loader/sequence.py``) and the budget
counts those positions; for an encoder-decoder whose text is an axis of its own
(``"text,frames"``) the text is the bucket's longest real text (the sidecar's, not a worst case)
beside its longest frames, and the answer is two budgets, ``data.batch_frames`` and
``data.batch_text`` (``B ×`` each padded length), since the loader bounds each axis by its own. ``B`` doubles from the previous bucket's answer until
a step runs out of memory, then bisects to the largest ``B`` that fits (exact: the search is
over whole utterances). The budget is ``B × padded length``: shorter utterances of the bucket
pack more of them into it, and their attention costs less.

"Fits" means the step raises no ``torch.OutOfMemoryError`` with memory capped at
``train.memory.target`` (default 90 %) of the device: on CUDA, torch's caching allocator is
capped (``torch.cuda.set_per_process_memory_fraction``) and the peak is
``torch.cuda.max_memory_reserved``. On CPU, the same search runs against ``--memory-limit-mib``:
:class:`~train.memory.probes.MemoryCap` counts the bytes of live tensors (every tensor an op creates, until it is
freed, plus the model, optimizer and EMA tensors there before) and raises
``torch.OutOfMemoryError`` past the cap, as a GPU would. That is what
``torch.cuda.max_memory_allocated`` counts, without the allocator's rounding, caching and
kernel workspaces: the CPU numbers test the search, they do not size a GPU.

Under torchrun (sharded strategies) every rank counts with :class:`~train.memory.probes.MemoryCap`, on CUDA too,
and the ranks agree: a rank past its cap raises only before the next collective or at the
end of the step, and then every rank raises, so none is left waiting in an all-gather for a
rank that gave up on the step. A batch fits when it fits on every rank.

It prints a table and writes a TOML snippet for the trainer::

    python -m train tune --shards shards --config base --output budgets.toml
    torchrun ... -m train --shards shards --config base --config budgets.toml ...
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from melcache.batch_plans import round_up
from melcache.errors import UserError
from melcache.fields.format import cache_fields
from melcache.index import read_index
from melcache.loader import bucket_lengths
from melcache.loader.batch import Batch, stand_in_extras
from melcache.loader.sequence import sequence_tops, text_tops
from melcache.location import member_location
from melcache.reader import ShardCheck, read_shard
from train.config.tables import Config
from train.memory.probes import MIB, CapProbe, CudaProbe, MemoryCap, agreement, tensor_bytes
from train.optim.scaler import HysteresisScaler
from train.parallel.env import Env
from train.parallel.fsdp import abandon_step, sharded
from train.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Row:
    """One bucket's answer."""

    bucket: int
    max_frames: int  # its longest utterance
    budget: int  # padded frames per micro-batch: samples × padded length
    samples: int  # of the longest length, per batch
    peak_mib: float  # the peak memory of that step
    text_tokens: int  # the text length the steps used
    text_budget: int = 0  # data.sequence = "text,frames": padded text tokens per micro-batch


def tune(
    cfg: Config, shards: str, *, memory_limit_mib: float | None = None, env: Env | None = None
) -> tuple[list[Row], str]:
    """The budget of every bucket of cache ``shards`` (see the module docstring) and a line
    saying where it was measured. ``memory_limit_mib`` is required on CPU, ignored on CUDA.
    ``env``: the torchrun job (``train.parallel.env.setup``) that searches a sharded strategy
    with every rank in step; one process when None."""
    if memory_limit_mib is not None and not (
        math.isfinite(memory_limit_mib) and memory_limit_mib > 0
    ):
        raise UserError(
            f"--memory-limit-mib {memory_limit_mib:g} is invalid: expected a positive number"
        )
    if env is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        env = Env(rank=0, world_size=1, local_rank=0, device=device)
    if env.distributed and not sharded(cfg.train.parallel, env):
        raise UserError(
            'train tune under torchrun searches train.parallel.strategy = "fsdp2" or "hsdp"; with '
            f'"{cfg.train.parallel.strategy}" every rank holds what one process does: run it with python'
        )
    device, target = env.device, cfg.train.memory.target
    if device.type == "cpu" and memory_limit_mib is None:
        raise UserError(
            "train tune sizes batches for a GPU; on CPU give --memory-limit-mib N to search "
            "against N MiB of live tensors instead"
        )
    longest = max(s["max_frames"] for s in read_index(shards)["shards"])
    roomy = cfg.data.max_batch_size * round_up(longest, cfg.data.pad_multiple)
    # batch_text 0: the roomy batch_frames bounds the text too, never below the longest text
    roomy_data = dataclasses.replace(cfg.data, batch_frames=roomy, batch_text=0)
    cfg = dataclasses.replace(cfg, data=roomy_data)
    quiet = logging.getLogger("train.trainer")  # the trials' skipped steps are the search
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    capped = device.type == "cuda" and not env.distributed  # the allocator's own cap
    with tempfile.TemporaryDirectory(prefix="melcache-tune-") as out:
        trainer = Trainer(cfg, shards, Path(out), env)
        try:
            if capped:
                probe: Any = CudaProbe(device, target)
                where = f"{torch.cuda.get_device_name(device)}, {target:.0%} of its memory"
            else:
                probe, where = _cap_probe(trainer, target, memory_limit_mib)
            rows = _search_buckets(trainer, probe, shards)
        finally:
            trainer.close()
            quiet.setLevel(level)
            if capped:  # the cap was for the search only
                torch.cuda.set_per_process_memory_fraction(1.0, device)
    where += f", {trainer.parts.precision}, {cfg.model.impl}"
    if env.distributed:
        where += f", {cfg.train.parallel.strategy} on {env.world_size} ranks"
    if cfg.train.activation_checkpointing:
        where += ", activation checkpointing"
    return rows, where


def _cap_probe(
    trainer: Trainer, target: float, memory_limit_mib: float | None
) -> tuple[CapProbe, str]:
    """A :class:`~train.memory.probes.MemoryCap` probe: on CPU against ``memory_limit_mib``; on CUDA under torchrun
    against the device's memory, counting live tensors, so that the ranks can agree (an
    allocator's error on one rank alone would leave the others in a collective)."""
    device = trainer.env.device
    if device.type == "cuda":
        limit = target * torch.cuda.get_device_properties(device).total_memory
        where = f"{torch.cuda.get_device_name(device)}, {target:.0%} of its memory in live tensors"
    else:
        limit = target * memory_limit_mib * MIB
        where = f"cpu, {target:.0%} of {memory_limit_mib:g} MiB of live tensors"
    baseline = tensor_bytes(trainer_tensors(trainer))
    cap = MemoryCap(limit, baseline, device=device.type, agree=agreement(trainer.env))
    return CapProbe(cap), where


def _search_buckets(trainer: Trainer, probe: Any, shards: str) -> list[Row]:
    data, asked = trainer.cfg.data, trainer.parts.loader.spec.data
    index = read_index(shards)
    listed = cache_fields(index, shards)  # checked once, then each field the model asks for
    fields = {name: listed[name] for name in asked.fields}
    # A model of fields alone is batched, bucket by bucket, in its first field's frames.
    counted = index["shards"] if asked.read_mel else fields[asked.fields[0]]["shards"]
    n_mels = trainer.parts.loader.features.n_mels if asked.read_mel else 0
    rows: list[Row] = []
    fits_at_least = 1
    spec = trainer.parts.loader.spec
    declared = sequence_tops(spec.sources[:1], asked)[0]  # data.sequence = "text+frames"
    texts = text_tops(spec.sources[:1], asked)[0]  # "text,frames": each shard's longest text
    for bucket, max_frames in sorted(bucket_lengths(tuple(counted)).items())[::-1]:
        if texts is not None:  # the bucket's longest real text, beside its longest frames
            tokens = _longest_sequence(spec.sources[0].shards, texts, bucket)
        elif declared is None:  # the longest text of the shard of the longest frames
            tokens = _longest_text(shards, index, bucket, spec.tokenizer)
        else:  # the bucket's longest text + frames, its frames as long as the bucket's longest
            tokens = _longest_sequence(spec.sources[0].shards, declared, bucket) - max_frames
        longest = {
            name: (max(s["max_frames"] for s in e["shards"] if s["bucket"] == bucket), e)
            for name, e in fields.items()
        }
        worst = WorstBatch(
            bucket, max_frames, tokens, data.pad_multiple, n_mels, asked.extras,
            {name: (frames, tuple(e["shape"]), e["dtype"]) for name, (frames, e) in longest.items()},
        )  # fmt: skip
        peaks: dict[int, int] = {}  # batch size → peak memory of a step that fitted
        fits = functools.partial(_fits, trainer, probe, worst, peaks)
        size = largest_fitting(fits, start=fits_at_least, most=data.max_batch_size)
        if size == 0:
            raise UserError(
                f"bucket {bucket}: one utterance of {max_frames} frames does not fit in "
                f"{probe.limit / MIB:.0f} MiB with this model; turn on "
                "train.activation_checkpointing or bf16, or rebuild with a lower max_seconds"
            )
        # The budget counts what the loader's plan does: frames, or text + frames positions.
        length = max_frames if declared is None else max_frames + tokens
        budget = size * round_up(length, data.pad_multiple)
        text_budget = size * round_up(max(1, tokens), data.pad_multiple) if texts else 0
        rows.append(Row(bucket, max_frames, budget, size, peaks[size] / MIB, tokens, text_budget))
        fits_at_least = size  # a shorter bucket fits at least as many utterances
    return rows[::-1]


@dataclasses.dataclass(frozen=True)
class WorstBatch:
    """The worst batch of a bucket: every utterance its longest, with the longest text, but
    the last one frame and one token shorter (:func:`ragged`)."""

    bucket: int
    frames: int
    tokens: int
    pad_multiple: int
    n_mels: int
    extras: tuple[str, ...] = ()  # the fields the model asks for
    fields: Mapping[str, tuple[int, tuple[int, ...], str]] = dataclasses.field(
        default_factory=dict
    )  # derived fields asked for: their longest frames, shape per frame and stored dtype

    def batch(self, size: int) -> Batch:
        """``size`` utterances of this bucket's worst, as the loader hands a batch."""
        frames = round_up(self.frames, self.pad_multiple)
        width = round_up(max(1, self.tokens), self.pad_multiple)
        fields = {  # as the loader hands them: integers widened to int64, floats to float32
            name: torch.zeros(size, longest, *shape, dtype=_widened(dtype))
            for name, (longest, shape, dtype) in self.fields.items()
        }
        return Batch(
            mel=torch.zeros(size, frames, self.n_mels, dtype=torch.float16),
            mel_lengths=ragged(size, self.frames),
            text=torch.ones(size, width, dtype=torch.int64),
            text_lengths=ragged(size, max(1, self.tokens)),
            keys=[f"tune-{i}" for i in range(size)],
            speaker=[None] * size,
            bucket=self.bucket,
            extras=stand_in_extras(self.extras, size),
            fields=fields,
            field_lengths={name: ragged(size, f[0]) for name, f in self.fields.items()},
        )


def ragged(size: int, longest: int) -> torch.Tensor:
    """``size`` lengths of ``longest``, the last one shorter where it can be: a real batch has
    padding, and a model may take a cheaper path where it has none. ChatTTS's GPT (a
    ``transformers`` Llama) drops its attention mask when no row is padded, and SDPA's causal
    kernel then needs no mask; measured on CPU, a padded batch of its longest bucket took 38 %
    more memory than the same batch unpadded, and budgets tuned on the unpadded one ran 14 %
    over their target."""
    lengths = torch.full((size,), longest)
    if size > 1 and longest > 1:
        lengths[-1] -= 1
    return lengths


def _widened(dtype: str) -> torch.dtype:
    return torch.float32 if dtype.startswith("float") else torch.int64


def _fits(
    trainer: Trainer, probe: Any, worst: WorstBatch, peaks: dict[int, int], size: int
) -> bool:
    """Whether a training step on ``worst.batch(size)`` fits (its peak → ``peaks``)."""
    peak = _trial(trainer, probe, worst.batch(size))
    if peak is not None:
        peaks[size] = peak
    return peak is not None


def largest_fitting(fits: Callable[[int], bool], *, start: int, most: int) -> int:
    """The largest ``n`` in ``1..most`` with ``fits(n)`` (0 if none), for a monotone ``fits``:
    check ``start``, double until a failure or ``most``, then bisect."""
    low, high = 0, most + 1  # fits(low) holds (or low = 0), fits(high) fails (or high > most)
    probe = min(max(1, start), most)
    while probe < high:
        if not fits(probe):
            high = probe
            break
        low = probe
        probe = min(2 * probe, most) if probe < most else most + 1
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    if low == 0 and start > 1:  # the hint was too hopeful
        return largest_fitting(fits, start=1, most=start - 1)
    return low


def _trial(trainer: Trainer, probe: Any, batch: Batch) -> int | None:
    """The peak memory of one training step on ``batch``, or None if it ran out of memory."""
    try:
        with probe.measure():
            verdict = trainer.train_step([batch])
    except (torch.OutOfMemoryError, UserError) as exc:  # FSDP2's trainer ends a run on one
        if isinstance(exc, UserError) and not probe.raised:
            raise  # not the cap's: a real problem
        verdict = None
        abandon_step(trainer.parts.raw_model)
        trainer.parts.optimizer.zero_grad(set_to_none=True)
        # A fresh scaler: the failed step's unscale_ is on record.
        trainer.parts.scaler = HysteresisScaler.for_run(
            trainer.cfg.train, trainer.env.device, trainer.parts.precision
        )
    trainer.parts.budgets.load_state_dict({"caps": {}, "single_failures": {}, "skipped_steps": 0})
    if verdict is None or verdict.skipped:
        return None
    return probe.peak


def trainer_tensors(trainer: Trainer) -> Iterator[torch.Tensor]:
    """What a trainer holds between steps: the model's, the optimizer's (none before its
    first step) and the EMA's tensors (a :class:`~train.memory.probes.MemoryCap`'s baseline)."""
    yield from trainer.parts.raw_model.state_dict().values()
    for state in trainer.parts.optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    if trainer.parts.ema is not None:
        yield from trainer.parts.ema.shadow


def _longest_sequence(shards: Sequence[Mapping[str, Any]], tops: Sequence[int], bucket: int) -> int:
    """The longest of ``bucket``'s shards' ``tops`` (each shard's longest text + frames, or
    text)."""
    return max(top for entry, top in zip(shards, tops, strict=True) if entry["bucket"] == bucket)


def _longest_text(
    shards: str, index: Mapping[str, Any], bucket: int, tokenizer: Callable[[str], Any]
) -> int:
    """Tokens of the longest text in the shard that holds ``bucket``'s longest utterance."""
    entry = max(
        (s for s in index["shards"] if s["bucket"] == bucket), key=lambda s: s["max_frames"]
    )
    samples = read_shard(member_location(shards, entry["name"]), entry, ShardCheck("fast"))
    return max(len(tokenizer(s.text)) for s in samples)


def render(rows: list[Row], where: str) -> tuple[str, str]:
    """The table to print and the TOML snippet to write."""
    lines = [
        f"Per-bucket budgets measured on {where}:",
        "",
        "| bucket | max length (frames) | budget (frames) | samples per batch | peak MiB |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.bucket} | {r.max_frames} | {r.budget} | {r.samples} | {r.peak_mib:.1f} |"
        for r in rows
    ]
    toml = [f"# python -m train tune: {where}", "[data.batch_frames]"]
    toml += [
        f"{r.bucket} = {r.budget}  # ≤ {r.max_frames} frames: {r.samples} per batch, "
        f"peak {r.peak_mib:.1f} MiB"
        for r in rows
    ]
    if any(r.text_budget for r in rows):  # data.sequence = "text,frames": the text's own
        toml += ["", "[data.batch_text]"]
        toml += [f"{r.bucket} = {r.text_budget}  # ≤ {r.text_tokens} tokens" for r in rows]
    return "\n".join(lines), "\n".join(toml) + "\n"
