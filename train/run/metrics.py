"""Training metrics without host syncs: counters on the host, loss sums on the device.

Batch sizes, frame and token counts come from the batches while they are still in host
memory, so counting them costs nothing. Losses and grad norms stay on the device as running
sums; every ``log_every`` steps :meth:`Meter.summary` all-reduces everything in one tensor
and reads it once. Rank 0 appends a JSON line to ``OUT/metrics.jsonl``, hands the same record
to the run's trackers (``train/run/trackers.py``: TensorBoard, W&B) and logs one line (step of
max, loss, samples/s, data wait, time left), as torchtitan and nanoGPT print theirs.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import re
import resource
import time
from pathlib import Path
from typing import Any

import torch

from melcache.batch_plans import padding_fraction
from melcache.bounded import loads_json, read_limited
from melcache.errors import UserError
from train.parallel.env import Env, all_reduce_sum
from train.run.trackers import Trackers

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"
# A record is ~400 bytes: a million logged steps. A larger file is not one this trainer wrote.
METRICS_LIMIT = 2**30
# Host counters summed over ranks; "wait_s" is the time this rank spent blocked on the loader.
_HOST_KEYS = ("samples", "frames", "padded_frames", "text_tokens", "wait_s",
              "padded_text", "padded_sequence")  # fmt: skip
_DROPPED = "_dropped_steps"  # device count of steps skipped on the device (spikes)


class Meter:
    """Sums over one logging window: call ``add_*`` every step, :meth:`summary` at log steps."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self._reset()

    def _reset(self) -> None:
        self.host = dict.fromkeys(_HOST_KEYS, 0.0)
        self.device: dict[str, torch.Tensor] = {}
        self.steps = 0
        self.skipped = 0
        self.start = time.perf_counter()

    def add_batch(
        self, mel_lengths: torch.Tensor, mel_shape: torch.Size, text_lengths: torch.Tensor
    ) -> None:
        """Count one micro-batch; its tensors must still be on the host (no device sync)."""
        self.host["samples"] += mel_shape[0]
        self.host["frames"] += int(mel_lengths.sum())
        self.host["padded_frames"] += mel_shape[0] * mel_shape[1]
        self.host["text_tokens"] += int(text_lengths.sum())
        if mel_shape[0]:  # padded to each row's longest: the text, and text then frames
            self.host["padded_text"] += mel_shape[0] * int(text_lengths.max())
            self.host["padded_sequence"] += mel_shape[0] * int((text_lengths + mel_lengths).max())

    def add_wait(self, seconds: float) -> None:
        """Time the loop spent blocked on the loader this step."""
        self.host["wait_s"] += seconds

    def add_device(self, name: str, value: torch.Tensor, *, replicated: bool = False) -> None:
        """Add a device scalar to the window's running sum.

        Per-rank shares of a global value (a loss sum ÷ the global frame count) are summed
        over ranks by :meth:`summary`; a ``replicated`` value, equal on every rank (the grad
        norm after the all-reduce), is divided by the world size first so the sum equals it.
        """
        value = value.detach().float()
        if replicated:
            value = value / self.env.world_size
        self.device[name] = self.device[name] + value if name in self.device else value

    def end_step(self) -> None:
        """Mark one optimizer step done."""
        self.steps += 1

    def drop_step(self, dropped: torch.Tensor) -> None:
        """A step the device may have skipped (``dropped``: a 0-d 1.0 or 0.0, equal on every
        rank; a spike): counted as skipped, not trained, without a host read. Its values must
        have been added × (1 − dropped)."""
        self.add_device(_DROPPED, dropped, replicated=True)

    def skip_step(self) -> None:
        """Mark one step skipped by every rank (out of memory): it counts in the step time,
        not in the loss averages or the rates."""
        self.skipped += 1

    def summary(self) -> dict[str, float]:
        """All-reduce the window's sums (one collective, one host read) and reset.

        Every rank must call this at the same step. Losses are global (Σ ranks), averaged
        over the window's trained steps; rates are whole-job rates over this rank's wall time.
        """
        elapsed = time.perf_counter() - self.start
        names = sorted(self.device)
        host = torch.tensor([self.host[k] for k in _HOST_KEYS], dtype=torch.float64)
        parts = [host.to(self.env.device)]
        if names:
            parts.append(torch.stack([self.device[n] for n in names]).double())
        totals = all_reduce_sum(torch.cat(parts), self.env).tolist()  # the one host sync
        sums = dict(zip([*_HOST_KEYS, *names], totals, strict=True))
        dropped = round(sums.pop(_DROPPED, 0.0))
        steps = max(self.steps - dropped, 1)
        out = {name: sums[name] / steps for name in names if name != _DROPPED}
        out.update(
            step_time_s=elapsed / max(self.steps + self.skipped, 1),
            skipped_steps=self.skipped + dropped,
            frames_per_step=sums["frames"]
            / max(self.steps, 1),  # valid frames, all ranks: the batch
            samples_per_s=sums["samples"] / elapsed,
            frames_per_s=sums["frames"] / elapsed,
            text_tokens_per_s=sums["text_tokens"] / elapsed,
            padding_pct=100.0 * padding_fraction(sums["frames"], sums["padded_frames"]),
            # A model whose sequence is text then frames (data.sequence) pads these too.
            text_padding_pct=100.0 * padding_fraction(sums["text_tokens"], sums["padded_text"]),
            sequence_padding_pct=100.0
            * padding_fraction(sums["frames"] + sums["text_tokens"], sums["padded_sequence"]),
            # An encoder-decoder (data.sequence = "text,frames") pads each axis on its own.
            axes_padding_pct=100.0
            * padding_fraction(
                sums["frames"] + sums["text_tokens"], sums["padded_frames"] + sums["padded_text"]
            ),
            data_wait_pct=100.0 * sums["wait_s"] / self.env.world_size / elapsed,
        )
        out.update(peak_memory(self.env.device))
        if self.env.device.type == "cuda":  # the next window's peak is its own
            torch.cuda.reset_peak_memory_stats(self.env.device)
        self._reset()
        return out


def peak_memory(device: torch.device) -> dict[str, float]:
    """CUDA peak allocated/reserved MiB on this rank, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return {
            "cuda_max_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20,
            "cuda_max_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20,
        }
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class MetricsLog:
    """Rank 0's ``metrics.jsonl``, trackers and progress lines; a no-op object on other ranks."""

    def __init__(
        self,
        out: Path,
        env: Env,
        *,
        start_step: int,
        max_steps: int,
        trackers: Trackers | None = None,
    ) -> None:
        self.enabled = env.is_main
        self.path = Path(out) / METRICS_NAME
        self.trackers = trackers or Trackers()
        self.max_steps = max_steps
        if self.enabled:
            _truncate_after(self.path, start_step)

    def event(self, step: int, record: dict[str, Any]) -> None:
        """Append ``{"step": step, **record}`` (an out-of-memory error, say) to metrics.jsonl."""
        if self.enabled:
            self._append({"step": step, **record})

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Append ``{"step": step, **values}`` to metrics.jsonl; a training window's record
        (one with a loss and a step time) also as one line in the log."""
        if not self.enabled:
            return
        record = {"step": step, **{k: _round(v) for k, v in values.items()}}
        self._append(record)
        if "loss" in values and "step_time_s" in values:
            log.info("%s", progress_line(step, self.max_steps, values))
        log.debug("step %d %s", step, record)

    def picture(self, step: int, tag: str, path: Path | None) -> None:
        """Hand a picture the run drew (``None``: none this time) to the trackers."""
        if self.enabled and path is not None:
            self.trackers.picture(step, tag, path)

    def _append(self, record: dict[str, Any]) -> None:
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:  # a full disk, most likely: the checkpoints are what matter
            raise UserError(f"cannot append to {self.path}: {exc.strerror or exc}") from None
        self.trackers.record(record)  # what metrics.jsonl holds, nothing else

    def close(self) -> None:
        """Close the trackers (each waits a bounded time)."""
        self.trackers.close()


def epochs_names(locations: list[str]) -> list[str]:
    """The metric name of each cache's epochs consumed: ``epochs`` for one cache, else
    ``epochs/I_NAME`` (its place in the mix and its folder's name, characters TensorBoard
    takes in a tag): no path, no space, as a tag must be."""
    if len(locations) == 1:
        return ["epochs"]
    names = [
        re.sub(r"[^A-Za-z0-9_.\-]", "_", str(loc).rstrip("/").rsplit("/", 1)[-1])
        for loc in locations
    ]
    return [f"epochs/{i}_{name}" for i, name in enumerate(names)]


def progress_line(step: int, max_steps: int, values: dict[str, Any]) -> str:
    """One window in a line: ``step 40/50 | loss 1.2345 | 123.4 samples/s | data wait 0.9 %
    | 0:00:12 left``; the time left is the window's step time × the steps to go."""
    left = datetime.timedelta(seconds=round(max(max_steps - step, 0) * values["step_time_s"]))
    return (
        f"step {step}/{max_steps} | loss {values['loss']:.4f} | "
        f"{values['samples_per_s']:.1f} samples/s | data wait {values['data_wait_pct']:.1f} % "
        f"| {left} left"
    )


def _round(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")
    return value


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl: JSON objects with an integer ``step``. Any other line
    (torn by a killed writer, edited by hand, not UTF-8, nested too deep) is skipped, and
    the lines skipped are named in one warning."""
    return [record for _, record in _step_records(Path(path))]


def _step_records(path: Path) -> list[tuple[bytes, dict[str, Any]]]:
    """Each step record of ``path`` with its line as written."""
    try:
        lines = read_limited(path, METRICS_LIMIT).splitlines()
    except OSError as exc:
        raise UserError(f"{path} cannot be read: {exc}") from None
    records, bad = [], []
    for number, line in enumerate(lines, start=1):
        try:
            record = loads_json(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            records.append((line, record))
        elif line.strip():
            bad.append(number)
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
        log.warning(
            "%s: skipped %d lines that are not step records: line %s", path, len(bad), shown
        )
    return records


def _truncate_after(path: Path, step: int) -> None:
    """On resume, drop records past the checkpoint's step: the resumed run logs them again."""
    if not path.exists():
        return
    keep = [line for line, record in _step_records(path) if record["step"] <= step]
    temp = path.with_name(path.name + ".tmp")
    temp.write_bytes(b"".join(line + b"\n" for line in keep))
    os.replace(temp, path)
