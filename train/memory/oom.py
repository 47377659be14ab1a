"""Out-of-memory errors that cost a step instead of the run, and the per-bucket budgets they lower.

A ``torch.OutOfMemoryError`` is raised on the host when the op whose allocation fails is
launched, so the rank it happens on knows at once, without waiting for the device. The trainer
(``train/trainer.py``) then, with :class:`Budgets`:

1. lets :meth:`Budgets.watch` swallow the error and computes nothing more this step except
   what DDP needs from every rank: one synchronised forward and backward, run on a
   one-utterance :meth:`Budgets.stand_in` if this rank's own last micro-batch is lost (the
   failed pass's tensors go with it; those of a backward the error interrupted are let go by
   :func:`release_interrupted_backward` when the step is dropped);
2. votes at the end of the step (``train.parallel.votes.HostVote``: one small all-reduce on the
   host, the stop signal riding along); if any rank lost its share, every rank drops the step's
   gradients and skips its optimizer step, and the ranks' failures are gathered;
3. :meth:`Budgets.settle` lowers the budget of each bucket that failed, identically on every
   rank: its forward passes are capped at 90 % of the padded frames that failed, by cutting
   larger batches into pieces (:meth:`Budgets.split`) whose gradients accumulate within the
   step, so a step still trains the same utterances. A single utterance failing twice in one
   bucket is as small as that bucket gets: the run ends (:attr:`Budgets.exhausted`), naming
   the bucket and length.

The caps are part of the checkpoint and every failure is a record in ``metrics.jsonl``. With
``train.memory.budget_regrow_steps`` = N, every N steps in a row without an error (on any rank) each
lowered cap grows back by what one error took (÷ 0.9), a record each: a budget lowered by a rare
long batch or a fragmented allocator may recover, and one that really was too large costs
one skipped step per N to find out again.

One case cannot be recovered: an error inside the synchronised backward, where the other ranks
may already wait in DDP's gradient all-reduce and DDP's reducer is left mid-reduction (fairseq
recovers from it only without c10d DDP). :meth:`Budgets.fatal` then writes the cut to
``OUT/oom-rank-NNNNN.json`` and ends the run with a message; the next start (the same command
again, or torchrun's ``--max-restarts``) resumes from the last checkpoint with the cut applied.
Without DDP (one process) that backward is recoverable like any other pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from melcache.bounded import loads_json, read_limited
from melcache.errors import UserError
from melcache.loader.batch import Batch, extras_rows, stand_in_extras
from train.parallel.env import Env

log = logging.getLogger(__name__)

# A bucket that ran out of memory keeps this share of the padded frames that failed.
CUT = 0.9
# Out-of-memory errors of a single utterance in one bucket before the run gives up.
SINGLE_UTTERANCE_TRIES = 2
PENDING_GLOB = "oom-rank-*.json"


@dataclasses.dataclass(frozen=True)
class Failure:
    """One forward or backward pass that ran out of memory on one rank."""

    rank: int
    bucket: int
    rows: int  # utterances in the pass
    frames: int  # padded frames per utterance
    key: str  # its first utterance
    stage: str  # "input copy", "forward", "backward", "synchronised backward"

    @property
    def size(self) -> int:
        """Padded frames of the whole pass."""
        return self.rows * self.frames


class Budgets:
    """Per-bucket caps on the padded frames of one pass, lowered by out-of-memory errors.

    Per step: :meth:`split` the micro-batches, :meth:`watch` each pass, :meth:`fatal` around
    the synchronised backward, :meth:`settle` the failures the ranks agreed on, :meth:`reset`.
    """

    def __init__(
        self, env: Env, pad_multiple: int, out: Path, *, no_recovery: str | None = None
    ) -> None:
        self.env, self.pad_multiple, self.out = env, pad_multiple, Path(out)
        self.no_recovery = no_recovery  # why an error must end the run (see no_recovery())
        self.caps: dict[int, int] = {}  # bucket → most padded frames per pass
        self.single_failures: dict[int, int] = {}  # bucket → OOMs of one utterance alone
        self.skipped_steps = 0
        self.clean_steps = 0  # steps since the last error or regrowth
        self.failure: Failure | None = None  # this rank's, this step
        self.exhausted: str | None = None  # why the run must end: a bucket can get no smaller
        self.pending: list[Path] = []  # cut files applied at start, removed once checkpointed

    @property
    def lost(self) -> bool:
        """Whether this rank's share of the current step is lost to an out-of-memory error."""
        return self.failure is not None

    def reset(self) -> None:
        """Start a new step."""
        self.failure = None

    def split(self, micro: list[Batch]) -> list[Batch]:
        """The step's micro-batches as passes: a batch over its bucket's cap is cut by rows
        into near-equal pieces under it (at least one utterance each)."""
        passes = []
        for batch in micro:
            rows, frames = batch.mel.shape[:2]
            cap = self.caps.get(batch.bucket)
            if cap is None or rows * frames <= cap:
                passes.append(batch)
                continue
            count = -(-rows // max(1, cap // frames))
            size = -(-rows // count)
            passes.extend(_rows(batch, start, start + size) for start in range(0, rows, size))
        return passes

    @contextlib.contextmanager
    def watch(self, piece: Batch, stage: str) -> Iterator[None]:
        """Swallow a ``torch.OutOfMemoryError`` raised inside: this rank's step is lost."""
        try:
            yield
        except torch.OutOfMemoryError:
            self.failure = self._failure(piece, stage)
            if self.no_recovery is not None:
                raise self._unrecoverable(self.failure) from None

    @contextlib.contextmanager
    def fatal(self, piece: Batch, step: int, latest: Callable[[], Path | None]) -> Iterator[None]:
        """Around the synchronised backward: under DDP an out-of-memory error there ends the
        run (see the module docstring), leaving its cut for the next start, which resumes
        from checkpoint ``latest()``."""
        try:
            yield
        except torch.OutOfMemoryError:
            if self.no_recovery is not None:
                raise self._unrecoverable(self._failure(piece, "backward")) from None
            if not self.env.distributed:  # no reducer mid-reduction: an ordinary lost step
                self.failure = self._failure(piece, "backward")
                return
            failure = self._failure(piece, "synchronised backward")
            self._write_pending(failure, step)
            cut = self._cut(failure)
            checkpoint = latest()
            resume = f"checkpoint {checkpoint}" if checkpoint is not None else "the start"
            raise UserError(
                f"step {step}: out of memory on rank {failure.rank} in the synchronised backward "
                f"of bucket {failure.bucket} ({failure.rows} × {failure.frames} padded frames, "
                f"{failure.key} first), where DDP's gradient all-reduce cannot be abandoned "
                f"safely; the run stops. Run the same command again: it resumes from {resume} "
                f"with that bucket's budget lowered to {cut} frames per pass"
            ) from None

    def _unrecoverable(self, failure: Failure) -> UserError:
        return UserError(
            f"out of memory on rank {failure.rank} in the {failure.stage} of bucket "
            f"{failure.bucket} ({failure.rows} × {failure.frames} padded frames, {failure.key} "
            f"first): {self.no_recovery}"
        )

    def stand_in(self, piece: Batch) -> Batch:
        """One utterance of ``pad_multiple`` frames and tokens, shaped like ``piece``: a pass
        that costs next to nothing, so that DDP sees this rank's synchronised pass."""
        n = self.pad_multiple
        lengths = torch.tensor([n])
        return Batch(
            mel=piece.mel.new_zeros(1, n, piece.mel.shape[2]),
            mel_lengths=lengths,
            text=torch.ones(1, n, dtype=torch.int64),
            text_lengths=lengths.clone(),
            keys=["stand-in"],
            speaker=[None],
            bucket=piece.bucket,
            extras=stand_in_extras(list(piece.extras), 1),
            fields={k: v.new_zeros(1, n, *v.shape[2:]) for k, v in piece.fields.items()},
            field_lengths={k: lengths.clone() for k in piece.fields},
        )

    def settle(self, failures: list[Failure]) -> list[dict[str, Any]]:
        """Lower the caps for the ranks' failures of one step (every rank passes the same
        list, so every rank ends with the same caps); one record per failure for the metrics.
        Sets :attr:`exhausted` when one utterance alone has failed twice in a bucket."""
        records = []
        if failures:
            self.clean_steps = 0
        for failure in sorted(failures, key=lambda f: f.rank):
            before = self.caps.get(failure.bucket)
            self.caps[failure.bucket] = self._cut(failure)
            records.append(
                {
                    "event": "out_of_memory",
                    **dataclasses.asdict(failure),
                    "budget_before": before,
                    "budget": self.caps[failure.bucket],
                }
            )
            if failure.rows > 1:
                continue
            tries = self.single_failures.get(failure.bucket, 0) + 1
            self.single_failures[failure.bucket] = tries
            if tries >= SINGLE_UTTERANCE_TRIES:
                self.exhausted = (
                    f"out of memory {tries} times on a single utterance of bucket "
                    f"{failure.bucket} ({failure.frames} padded frames, e.g. {failure.key}), "
                    "the smallest pass there is: this model cannot train on utterances that "
                    "long on this device. Turn on train.activation_checkpointing or bf16, or "
                    "rebuild the cache with a lower [build] max_seconds"
                )
        return records

    def clean_step(self, regrow_steps: int) -> list[dict[str, Any]]:
        """A step no rank lost: after ``regrow_steps`` in a row (0: never), every cap grows by
        1 / CUT; one record per cap. The same on every rank (host counts only)."""
        if regrow_steps == 0 or not self.caps:
            return []
        self.clean_steps += 1
        if self.clean_steps < regrow_steps:
            return []
        self.clean_steps, records = 0, []
        for bucket, cap in sorted(self.caps.items()):
            self.caps[bucket] = int(cap / CUT)
            records.append(
                {"event": "budget_regrown", "bucket": bucket, "budget_before": cap,
                 "budget": self.caps[bucket]}
            )  # fmt: skip
        return records

    def _cut(self, failure: Failure) -> int:
        return min(self.caps.get(failure.bucket, math.inf), int(CUT * failure.size))

    def _failure(self, piece: Batch, stage: str) -> Failure:
        rows, frames = piece.mel.shape[:2]
        key = piece.keys[0] if piece.keys else "?"
        if self.env.device.type == "cuda":  # give the failed pass's blocks back (fragmentation)
            torch.cuda.empty_cache()
        return Failure(self.env.rank, piece.bucket, rows, frames, key, stage)

    # ---- the checkpoint and the cuts left by a run that stopped ----------------------------
    def state_dict(self) -> dict[str, Any]:
        """Caps and counters as plain data (``weights_only``-loadable)."""
        return {
            "caps": {str(b): c for b, c in self.caps.items()},
            "single_failures": {str(b): n for b, n in self.single_failures.items()},
            "skipped_steps": self.skipped_steps,
            "clean_steps": self.clean_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave."""
        self.caps = {int(b): int(c) for b, c in state["caps"].items()}
        self.single_failures = {int(b): int(n) for b, n in state["single_failures"].items()}
        self.skipped_steps = int(state["skipped_steps"])
        self.clean_steps = int(state.get("clean_steps", 0))  # older checkpoints: none

    def apply_pending(self) -> list[dict[str, Any]]:
        """Apply the cuts a stopped run left in ``OUT`` (see :meth:`fatal`); they stay on disk
        until :meth:`checkpointed` (a checkpoint then holds them)."""
        self.pending = sorted(self.out.glob(PENDING_GLOB))
        failures = []
        for path in self.pending:
            try:
                fields = loads_json(read_limited(path).decode("utf-8"))
                fields.pop("step")
                failures.append(Failure(**fields))
            except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
                # Hand-edited or damaged: the cut it held is learnt again at the next error.
                log.warning("ignoring %s, which holds no budget cut: %s", path, exc)
        records = self.settle(failures)
        for record in records:
            log.warning("applying the cut left by a stopped run: %s", record)
        return records

    def checkpointed(self) -> None:
        """A checkpoint holding the caps is committed: the cut files are no longer needed."""
        if self.env.is_main:
            for path in self.pending:
                path.unlink(missing_ok=True)
        self.pending = []

    def _write_pending(self, failure: Failure, step: int) -> None:
        path = self.out / f"oom-rank-{failure.rank:05d}.json"
        temp = path.with_name(path.name + ".tmp")
        temp.write_text(json.dumps({**dataclasses.asdict(failure), "step": step}), encoding="utf-8")
        os.replace(temp, path)


def _rows(batch: Batch, start: int, stop: int) -> Batch:
    """Rows ``start:stop`` of ``batch``: views, contiguous (row slices), pinned if it was."""
    return dataclasses.replace(
        batch,
        mel=batch.mel[start:stop],
        mel_lengths=batch.mel_lengths[start:stop],
        text=batch.text[start:stop],
        text_lengths=batch.text_lengths[start:stop],
        keys=batch.keys[start:stop],
        speaker=batch.speaker[start:stop],
        extras=extras_rows(batch.extras, start, stop),
        fields={name: v[start:stop] for name, v in batch.fields.items()},
        field_lengths={name: v[start:stop] for name, v in batch.field_lengths.items()},
    )


def release_interrupted_backward(device: torch.device) -> None:
    """Free what a backward interrupted by an error still holds: the tasks it had queued, and
    through them its graph's saved activations, stay in the autograd engine's ready queue
    (the calling thread's on CPU, the device's own thread on CUDA) until the next backward
    there drains it (pytorch/pytorch#82218: an out-of-memory error in the backward leaks
    memory). Measured on CPU: a failed backward of ChatTTS's GPT kept 292 MiB live into the
    next steps, which then ran out of memory too; a one-element backward here frees it."""
    (torch.ones((), device=device, requires_grad=True) * 1).backward()


def no_recovery(sharded: bool, forward_collectives: bool) -> str | None:
    """Why this run cannot survive an out-of-memory error (``None``: it can): each reason is
    a pass a rank would drop or cut that the other ranks' collectives wait for."""
    if sharded:
        return (
            "train.parallel.strategy = fsdp2/hsdp cannot skip a pass (every pass all-gathers on every "
            "rank), so the run stops; lower data.batch_frames (`python -m train tune` finds "
            'budgets that fit) or use train.parallel.strategy = "ddp", which recovers'
        )
    if forward_collectives:
        return (
            "recovery is off (train.parallel.allow_forward_collectives = true: cutting a batch or a "
            "stand-in pass would change how many collectives a rank runs), so the run stops; "
            "train in a new --out with a lower data.batch_frames, or with "
            "train.activation_checkpointing = true"
        )
    return None
