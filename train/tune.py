"""``python -m train tune``: per length bucket, the largest batch budget that fits the device.

A GPU tool, after NeMo's OOMptimizer: on the device it runs on, with the real model, precision,
activation checkpointing, optimizer, EMA and loss scaler (a :class:`~train.trainer.Trainer` of
the given config: in one process, or under torchrun for ``train.strategy = "fsdp2" | "hsdp"``,
every rank trying the same batch at the same time), each bucket, longest first, gets a
bisection of real training steps (``Trainer.train_step``: forward, backward, optimizer step) on
a batch of ``B`` utterances all as long as the bucket's longest, with text as long as the
longest text of the shard that holds it. ``B`` doubles from the previous bucket's answer until
a step runs out of memory, then bisects to the largest ``B`` that fits (exact: the search is
over whole utterances). The budget is ``B × padded length``: shorter utterances of the bucket
pack more of them into it, and their attention costs less.

"Fits" means the step raises no ``torch.OutOfMemoryError`` with memory capped at
``train.memory_target`` (default 90 %) of the device: on CUDA, torch's caching allocator is
capped (``torch.cuda.set_per_process_memory_fraction``) and the peak is
``torch.cuda.max_memory_reserved``. On CPU, the same search runs against ``--memory-limit-mib``:
:class:`MemoryCap` counts the bytes of live tensors (every tensor an op creates, until it is
freed, plus the model, optimizer and EMA tensors there before) and raises
``torch.OutOfMemoryError`` past the cap, as a GPU would. That is what
``torch.cuda.max_memory_allocated`` counts, without the allocator's rounding, caching and
kernel workspaces: the CPU numbers test the search, they do not size a GPU.

Under torchrun (sharded strategies) every rank counts with :class:`MemoryCap`, on CUDA too,
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
import gc
import logging
import math
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from melcache.batching import round_up
from melcache.errors import UserError
from melcache.index import read_index
from melcache.location import member_location
from melcache.reader import ShardCheck, read_shard
from train.collate import Batch, stand_in_extras
from train.config import Config
from train.data import bucket_lengths
from train.distributed import Env
from train.parallel import abandon_step, sharded
from train.scaler import HysteresisScaler
from train.trainer import Trainer

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Row:
    """One bucket's answer."""

    bucket: int
    max_frames: int  # its longest utterance
    budget: int  # padded frames per micro-batch: samples × padded length
    samples: int  # of the longest length, per batch
    peak_mib: float  # the peak memory of that step
    text_tokens: int  # the text length the steps used


# The dispatcher namespaces of torch.distributed's collectives (eager and functional).
COLLECTIVES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}


class MemoryCap(TorchDispatchMode):
    """Live tensor bytes, counted op by op; ``torch.OutOfMemoryError`` past ``limit_bytes``.

    Every tensor an op returns that does not share storage with its inputs is a new
    allocation; a finaliser on its storage takes it off the count when the storage is freed.
    ``baseline_bytes`` stands for tensors that existed before (model, optimizer state). A
    CPU stand-in for a GPU's memory: it raises where a GPU would run out.

    With ``agree`` (the largest of every rank's value, under torchrun) it raises only where
    every rank is at the same point: before each collective and at :meth:`settle`, when any
    rank is past its cap. A rank that raised alone would leave the others waiting in FSDP2's
    next all-gather.
    """

    def __init__(
        self,
        limit_bytes: float,
        baseline_bytes: int = 0,
        *,
        device: str = "cpu",
        agree: Callable[[float], float] | None = None,
    ) -> None:
        super().__init__()
        self.limit, self.device, self.agree = limit_bytes, device, agree
        self.current = self.peak = baseline_bytes
        self.over = self.raised = False  # this rank is past the cap; the cap raised
        self._live: dict[int, int] = {}  # storage address → bytes

    def reset_peak(self) -> None:
        """Start a new trial: a new peak from what is live now."""
        self.peak = self.current
        self.over = self.raised = False

    def settle(self) -> None:
        """Under ``agree``: raise on every rank if any rank went past its cap (every rank
        calls this at the same point, outside the mode)."""
        if self.agree is not None and self.agree(float(self.over)) > 0:
            self._raise()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.agree is not None and func.namespace in COLLECTIVES:
            self.settle()  # every rank reaches this collective: all raise here, or none
        out = func(*args, **(kwargs or {}))
        inputs = {_address(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device:
                self._count(_local(tensor), inputs)
        return out

    def _count(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or address in inputs or address in self._live:
            return
        self._live[address] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, address)
        if self.current > self.limit:
            self.over = True
            if self.agree is None:
                self._raise()

    def _raise(self) -> None:
        self.raised = True
        raise torch.OutOfMemoryError(
            f"out of memory (cap): {self.peak / MIB:.1f} MiB of live tensors > "
            f"{self.limit / MIB:.1f} MiB{'' if self.agree is None else ' on some rank'}"
        )

    def _free(self, address: int) -> None:
        self.current -= self._live.pop(address)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and their optimizer state), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _address(tensor: torch.Tensor) -> int:
    return _local(tensor).untyped_storage().data_ptr()


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's: its local shard's)."""
    seen = {_address(t): _local(t).untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def agreement(env: Env) -> Callable[[float], float] | None:
    """Under torchrun: the largest of every rank's value, on a gloo group of its own (it runs
    between the training collectives); None in one process."""
    if not env.distributed:
        return None
    group = dist.new_group(backend="gloo")

    def largest(value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return tensor.item()

    return largest


class _CudaProbe:
    """The caching allocator capped at ``fraction`` of the device; peaks from torch.cuda."""

    def __init__(self, device: torch.device, fraction: float) -> None:
        self.device = device
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        self.limit = fraction * torch.cuda.get_device_properties(device).total_memory

    @contextmanager
    def measure(self) -> Iterator[None]:
        torch.cuda.empty_cache()  # a failed trial's blocks must not crowd the next one
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        torch.cuda.synchronize(self.device)

    @property
    def peak(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    raised = False  # its errors come from the allocator


class _CapProbe:
    """:class:`MemoryCap` around each trial, counting from the trainer's tensors; under
    torchrun the ranks agree on the verdict and the peak is the largest rank's."""

    def __init__(self, cap: MemoryCap) -> None:
        self.cap, self.limit, self.peak = cap, cap.limit, 0.0

    @property
    def raised(self) -> bool:
        """Whether the cap (not some other error) ended the last trial."""
        return self.cap.raised

    @contextmanager
    def measure(self) -> Iterator[None]:
        gc.collect()  # a failed trial's tensors in reference cycles leave the count now
        self.cap.reset_peak()
        with self.cap:
            yield
        self.cap.settle()  # past the last collective (the optimizer step)
        agree = self.cap.agree
        self.peak = self.cap.peak if agree is None else agree(self.cap.peak)


def tune(
    cfg: Config, shards: str, *, memory_limit_mib: float | None = None, env: Env | None = None
) -> tuple[list[Row], str]:
    """The budget of every bucket of cache ``shards`` (see the module docstring) and a line
    saying where it was measured. ``memory_limit_mib`` is required on CPU, ignored on CUDA.
    ``env``: the torchrun job (``train.distributed.setup``) that searches a sharded strategy
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
    if env.distributed and not sharded(cfg.train, env):
        raise UserError(
            'train tune under torchrun searches train.strategy = "fsdp2" or "hsdp"; with '
            f'"{cfg.train.strategy}" every rank holds what one process does: run it with python'
        )
    device, target = env.device, cfg.train.memory_target
    if device.type == "cpu" and memory_limit_mib is None:
        raise UserError(
            "train tune sizes batches for a GPU; on CPU give --memory-limit-mib N to search "
            "against N MiB of live tensors instead"
        )
    longest = max(s["max_frames"] for s in read_index(shards)["shards"])
    roomy = cfg.data.max_batch_size * round_up(longest, cfg.data.pad_multiple)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_frames=roomy))
    quiet = logging.getLogger("train.trainer")  # the trials' skipped steps are the search
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    capped = device.type == "cuda" and not env.distributed  # the allocator's own cap
    with tempfile.TemporaryDirectory(prefix="melcache-tune-") as out:
        trainer = Trainer(cfg, shards, Path(out), env)
        try:
            if capped:
                probe: Any = _CudaProbe(device, target)
                where = f"{torch.cuda.get_device_name(device)}, {target:.0%} of its memory"
            else:
                probe, where = _cap_probe(trainer, target, memory_limit_mib)
            rows = _search_buckets(trainer, probe, shards)
        finally:
            trainer.close()
            quiet.setLevel(level)
            if capped:  # the cap was for the search only
                torch.cuda.set_per_process_memory_fraction(1.0, device)
    where += f", {trainer.precision}, {cfg.model.impl}"
    if env.distributed:
        where += f", {cfg.train.strategy} on {env.world_size} ranks"
    if cfg.train.activation_checkpointing:
        where += ", activation checkpointing"
    return rows, where


def _cap_probe(
    trainer: Trainer, target: float, memory_limit_mib: float | None
) -> tuple[_CapProbe, str]:
    """A :class:`MemoryCap` probe: on CPU against ``memory_limit_mib``; on CUDA under torchrun
    against the device's memory, counting live tensors, so that the ranks can agree (an
    allocator's error on one rank alone would leave the others in a collective)."""
    device = trainer.env.device
    if device.type == "cuda":
        limit = target * torch.cuda.get_device_properties(device).total_memory
        where = f"{torch.cuda.get_device_name(device)}, {target:.0%} of its memory in live tensors"
    else:
        limit = target * memory_limit_mib * MIB
        where = f"cpu, {target:.0%} of {memory_limit_mib:g} MiB of live tensors"
    baseline = tensor_bytes(_trainer_tensors(trainer))
    cap = MemoryCap(limit, baseline, device=device.type, agree=agreement(trainer.env))
    return _CapProbe(cap), where


def _search_buckets(trainer: Trainer, probe: Any, shards: str) -> list[Row]:
    data = trainer.cfg.data
    index = read_index(shards)
    rows: list[Row] = []
    fits_at_least = 1
    for bucket, max_frames in sorted(bucket_lengths(tuple(index["shards"])).items())[::-1]:
        tokens = _longest_text(shards, index, bucket, trainer.loader.spec.tokenizer)
        shape = _Shape(
            bucket, max_frames, tokens, data.pad_multiple, trainer.loader.features.n_mels,
            trainer.loader.spec.data.extras,
        )  # fmt: skip
        peaks: dict[int, int] = {}  # batch size → peak memory of a step that fitted
        fits = functools.partial(_fits, trainer, probe, shape, peaks)
        size = largest_fitting(fits, start=fits_at_least, most=data.max_batch_size)
        if size == 0:
            raise UserError(
                f"bucket {bucket}: one utterance of {max_frames} frames does not fit in "
                f"{probe.limit / MIB:.0f} MiB with this model; turn on "
                "train.activation_checkpointing or bf16, or rebuild with a lower max_seconds"
            )
        budget = size * round_up(max_frames, data.pad_multiple)
        rows.append(Row(bucket, max_frames, budget, size, peaks[size] / MIB, tokens))
        fits_at_least = size  # a shorter bucket fits at least as many utterances
    return rows[::-1]


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The worst batch of a bucket: every utterance its longest, with the longest text."""

    bucket: int
    frames: int
    tokens: int
    pad_multiple: int
    n_mels: int
    extras: tuple[str, ...] = ()  # the fields the model asks for

    def batch(self, size: int) -> Batch:
        frames = round_up(self.frames, self.pad_multiple)
        width = round_up(max(1, self.tokens), self.pad_multiple)
        return Batch(
            mel=torch.zeros(size, frames, self.n_mels, dtype=torch.float16),
            mel_lengths=torch.full((size,), self.frames),
            text=torch.ones(size, width, dtype=torch.int64),
            text_lengths=torch.full((size,), max(1, self.tokens)),
            keys=[f"tune-{i}" for i in range(size)],
            speaker=[None] * size,
            bucket=self.bucket,
            extras=stand_in_extras(self.extras, size),
        )


def _fits(trainer: Trainer, probe: Any, shape: _Shape, peaks: dict[int, int], size: int) -> bool:
    """Whether a training step on ``size`` utterances of ``shape`` fits (its peak → ``peaks``)."""
    peak = _trial(trainer, probe, shape.batch(size))
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
        abandon_step(trainer.raw_model)
        trainer.optimizer.zero_grad(set_to_none=True)
        t = trainer.cfg.train  # a fresh scaler: the failed step's unscale_ is on record
        trainer.scaler = HysteresisScaler(
            trainer.env.device.type,
            enabled=trainer.scaler.is_enabled(),
            hysteresis=t.amp_hysteresis,
            min_scale=t.amp_min_scale,
        )
    trainer.budgets.load_state_dict({"caps": {}, "single_failures": {}, "skipped_steps": 0})
    if verdict is None or verdict.skipped:
        return None
    return probe.peak


def _trainer_tensors(trainer: Trainer) -> Iterator[torch.Tensor]:
    yield from trainer.raw_model.state_dict().values()
    for state in trainer.optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    if trainer.ema is not None:
        yield from trainer.ema.shadow


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
    return "\n".join(lines), "\n".join(toml) + "\n"
