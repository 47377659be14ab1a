"""Training throughput on one device, row by row: on-the-fly features → melcache → bf16 → ….

    python -m benchmarks.gpu_bench [--device auto|cuda|cpu] [--model base|tiny] [--steps 50]
        [--warmup 20] [--minutes 60] [--batch-frames N] [--workers 2] [--accum 4]
        [--rows otf-fp32,cache-fp32,...|all] [--data /tmp/melcache-gpu-bench] [--json OUT]
        [--memory-limit-mib N (CPU, for the budget rows)]

Makes (or reuses) a speech corpus with ``benchmarks.speech`` (espeak-ng when on ``PATH``,
synthetic speech-like audio otherwise: no download, no network), builds (or reuses) its cache
with the real ``python -m preprocess build``, then runs the rows below one after another in
this one process. Every row builds a fresh :class:`train.trainer.Trainer` from
``configs/<model>.toml`` and calls its real ``train_step``; only the batches' source and the
options named in the row change:

- ``otf-fp32``: the seed's baseline, ``OnTheFlyMels`` from ``benchmarks.loader_bench``
  (decode, resample, log-mel in DataLoader workers), random batches of a fixed size; fp32;
- ``cache-fp32``: the cache through the trainer's streaming loader; fp32;
- ``cache-bf16``: + bf16 autocast;
- ``accum-sync`` / ``accum-nosync``: + ``--accum`` micro-batches per optimizer step, every
  micro-batch all-reducing its gradients / only the last (DDP ``no_sync``, the trainer's way);
- ``ckpt`` / ``compile``: ``accum-nosync`` + activation checkpointing / + ``torch.compile``
  (``compile`` only when asked for: compiling the base model takes a minute or more);
- ``copy-compute``: ``cache-bf16`` with the host-to-device copies on the compute stream instead
  of the trainer's side stream (``melcache/loader/prefetch.py``): what overlapping them is worth;
- ``budget-global`` / ``budget-tuned``: ``cache-bf16`` with one frame budget for every bucket
  (the largest that is safe for all: the tuned budget of the longest bucket) / with the
  per-bucket table. The table comes from ``train.tune.tune`` on this device before the rows run
  (on CPU against ``--memory-limit-mib`` of live tensors).

The process joins a one-rank process group (NCCL on CUDA, gloo on CPU), so the model is
wrapped in DDP exactly as under torchrun and ``no_sync`` has something to skip; with one rank
the all-reduce is local, so that row shows DDP's own cost, not the network's. Do not launch
this under torchrun.

Each row runs ``--warmup`` then ``--steps`` micro-batches (accumulation rows: as many
optimizer steps as give the same number of micro-batches). The device is synchronised only at
the ends of the timed window. Per row: samples/s and non-padding mel frames/s, padding %,
data-wait % (time blocked in ``next(loader)`` ÷ window time), mean GPU utilisation over the
window (NVML via ``pynvml`` if importable, else ``nvidia-smi`` every 0.2 s; null on CPU or
when neither works), peak memory allocated/reserved (CUDA, reset per row) or the process's
peak RSS so far (CPU; it cannot be reset), and the mean training loss of the row. Prints one
JSON line per row as it finishes, then a markdown table.

The default corpus is an hour, not ten minutes: a 40,000-frame batch is about seven minutes
of audio, and the cache's batches can only be as full as its shards are large.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import train.trainer
from benchmarks.loader_bench import OnTheFlyMels
from benchmarks.speech import make_corpus
from melcache.batch_plans import padding_fraction, round_up
from melcache.errors import UserError
from melcache.features import FeatureConfig, features_from_dict
from melcache.loader.batch import PAD_ID, Batch
from train.config.tables import Config, load_config
from train.parallel.env import Env
from train.run.metrics import peak_memory
from train.trainer import Trainer
from train.tune import tune

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
# Few, large shards: a batch can hold no more than one shard (one length bucket), and each
# shard should hold several batches of --batch-frames. Four shards serve up to four workers.
BUILD_TOML = "[build]\nnum_buckets = 4\nmin_shards = 4\n"
SAMPLE_PERIOD_S = 0.2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One configuration to time: where batches come from and the trainer options."""

    name: str
    what: str
    on_the_fly: bool = False
    precision: str = "bf16"
    accumulate: bool = False
    no_sync: bool = True  # with accumulation: all-reduce only on the last micro-batch
    compile: bool = False
    checkpointing: bool = False
    side_stream: bool = True  # host-to-device copies on a side stream (the trainer's way)
    budgets: str = "config"  # data.batch_frames: the config's, "global" or "tuned" (train tune)


ROWS = {
    row.name: row
    for row in (
        Row(name="otf-fp32", what="on-the-fly mels, fp32", on_the_fly=True, precision="fp32"),
        Row(name="cache-fp32", what="shard cache, fp32", precision="fp32"),
        Row(name="cache-bf16", what="+ bf16 autocast"),
        Row(
            name="copy-compute", what="cache-bf16, copies on the compute stream", side_stream=False
        ),
        Row(
            name="accum-sync",
            what="+ grad accumulation, sync every micro",
            accumulate=True,
            no_sync=False,
        ),
        Row(name="accum-nosync", what="+ grad accumulation, no_sync", accumulate=True),
        Row(
            name="ckpt", what="accum-nosync + activation ckpt", accumulate=True, checkpointing=True
        ),
        Row(name="compile", what="accum-nosync + torch.compile", accumulate=True, compile=True),
        Row(name="budget-global", what="cache-bf16, one budget safe for all", budgets="global"),
        Row(name="budget-tuned", what="cache-bf16, per-bucket budgets", budgets="tuned"),
    )
}
DEFAULT_ROWS = [name for name in ROWS if name != "compile"]


# --- data ---------------------------------------------------------------------------------


def prepare_data(data: Path, minutes: float) -> tuple[Path, Path]:
    """The corpus (made if missing) and its cache (built by the real build if missing)."""
    data.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(data / f"speech-{minutes:g}m", minutes / 60, seed=0)
    cache = data / f"cache-{minutes:g}m"
    if not (cache / "index.json").exists():
        config = data / "gpu_bench_build.toml"
        config.write_text(BUILD_TOML)
        command = [sys.executable, "-m", "preprocess", "build", "--src", str(corpus)]
        command += ["--out", str(cache), "--config", str(config)]
        log.info("building %s", cache)
        subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return corpus, cache


class PadToBatch:
    """DataLoader ``collate_fn`` (picklable) turning ``OnTheFlyMels`` items into a
    :class:`Batch` laid out as the cache's loader lays it out: float16 mels padded with
    ``ln(log_floor)`` to a multiple of ``pad_multiple``, 0-padded UTF-8 tokens."""

    def __init__(self, pad_multiple: int, pad_value: float) -> None:
        self.pad_multiple, self.pad_value = pad_multiple, pad_value

    def __call__(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> Batch:
        mel_lengths = torch.tensor([mel.shape[0] for mel, _ in items])
        text_lengths = torch.tensor([len(tokens) for _, tokens in items])
        frames = round_up(int(mel_lengths.max()), self.pad_multiple)
        mel = torch.full((len(items), frames, items[0][0].shape[1]), self.pad_value)
        width = round_up(max(1, int(text_lengths.max())), self.pad_multiple)
        text = torch.full((len(items), width), PAD_ID)
        for row, (m, tokens) in enumerate(items):
            mel[row, : len(m)] = m
            text[row, : len(tokens)] = tokens
        keys = [str(i) for i in range(len(items))]
        speaker = [None] * len(items)
        return Batch(mel.half(), mel_lengths, text, text_lengths, keys, speaker, bucket=-1)


def on_the_fly_batches(
    corpus: Path, features: FeatureConfig, batch_size: int, workers: int, pad_multiple: int
) -> Generator[Batch, None, None]:
    """The seed's loader, endless: random batches of ``batch_size`` featurised on the fly.
    Closing the generator stops its workers."""
    loader = DataLoader(
        OnTheFlyMels(corpus, features),
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        collate_fn=PadToBatch(pad_multiple, math.log(features.log_floor)),
        pin_memory=torch.cuda.is_available(),
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers > 0 else None,
        generator=torch.Generator().manual_seed(0),
    )
    if len(loader) == 0:
        raise UserError(f"{corpus} holds fewer than {batch_size} utterances: raise --minutes")
    epoch = None
    try:
        while True:
            epoch = iter(loader)
            yield from epoch
    finally:
        shutdown = getattr(epoch, "_shutdown_workers", None)
        if shutdown is not None:  # now, not whenever the iterator is collected
            shutdown()


def baseline_batch_size(index: dict[str, Any], cfg: Config) -> int:
    """Utterances per baseline batch: as many of the longest as fit the frame budget, so a
    padded baseline batch never exceeds what the cache rows may load."""
    longest = round_up(max(int(s["max_frames"]) for s in index["shards"]), cfg.data.pad_multiple)
    return max(1, min(cfg.data.max_batch_size, cfg.data.batch_frames // longest))


# --- measurement --------------------------------------------------------------------------


class UtilSampler:
    """Samples the GPU's utilisation every 0.2 s in a daemon thread; ``mean(t0, t1)`` over
    a window of ``time.perf_counter()`` times. ``mean`` is ``None`` without samples."""

    def __init__(self, device: torch.device) -> None:
        self.samples: list[tuple[float, float]] = []
        self._read = _nvml_reader(device) or _nvidia_smi_reader(device)
        self._stop = threading.Event()
        self._thread = None
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-util", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_PERIOD_S):
            value = self._read()
            if value is not None:
                self.samples.append((time.perf_counter(), value))

    def mean(self, start: float, end: float) -> float | None:
        window = [value for t, value in self.samples if start <= t <= end]
        return round(sum(window) / len(window), 1) if window else None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _nvml_reader(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(_pci_bus_id(device))
    except Exception as exc:  # no pynvml, or no NVML: nvidia-smi is the fallback
        log.info("NVML unavailable (%s); trying nvidia-smi", exc)
        return None
    return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def _nvidia_smi_reader(device: torch.device) -> Any:
    exe = shutil.which("nvidia-smi")
    if device.type != "cuda" or exe is None:
        return None
    command = [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
    command += ["-i", _pci_bus_id(device)]

    def read() -> float | None:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=5)
            return float(done.stdout.strip().splitlines()[0])
        except (subprocess.SubprocessError, ValueError, IndexError):
            return None  # counted as no sample, never as 0 %

    return read


def _pci_bus_id(device: torch.device) -> str:
    """The device's PCI bus id, which NVML and nvidia-smi accept whatever
    ``CUDA_VISIBLE_DEVICES`` renumbered."""
    props = torch.cuda.get_device_properties(device)
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(
    trainer: Trainer, batches: Iterator[Batch], steps: int, sampler: UtilSampler
) -> dict[str, Any]:
    """Run ``steps`` optimizer steps; time them, and the share spent waiting for batches."""
    accum, device = trainer.cfg.train.grad_accum, trainer.env.device
    counts = dict.fromkeys(("samples", "frames", "padded"), 0)
    wait = 0.0
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        micro = [next(batches) for _ in range(accum)]
        wait += time.perf_counter() - t0
        for batch in micro:  # host tensors: counting costs no device sync
            counts["samples"] += len(batch)
            counts["frames"] += int(batch.mel_lengths.sum())
            counts["padded"] += batch.mel.shape[0] * batch.mel.shape[1]
        trainer.train_step(micro)
    synchronize(device)
    end = time.perf_counter()
    elapsed = end - start
    return {
        "micro_batches": steps * accum,
        "seconds": round(elapsed, 3),
        "samples_per_s": round(counts["samples"] / elapsed, 2),
        "frames_per_s": round(counts["frames"] / elapsed, 1),
        "mean_batch": round(counts["samples"] / (steps * accum), 1),
        "padding_pct": round(100 * padding_fraction(counts["frames"], counts["padded"]), 1),
        "data_wait_pct": round(100 * wait / elapsed, 1),
        "gpu_util_pct": sampler.mean(start, end),
    }


def run_row(row: Row, args: argparse.Namespace, env: Env, sampler: UtilSampler) -> dict:
    """Build a fresh trainer for ``row``, warm it up, time it, release it."""
    cfg = load_config(args.config, row_overrides(row, args))
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(env.device)
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as out:
        trainer = Trainer(cfg, str(args.cache), Path(out), env)
        if not row.side_stream:
            trainer.parts.copies.stream = None
        warmup, steps = (-(-n // cfg.train.grad_accum) for n in (args.warmup, args.steps))
        sync = contextlib.nullcontext()
        if not row.no_sync:  # the trainer always uses no_sync; this row must not
            sync = mock.patch.object(train.trainer, "no_sync", _always_sync)
        batches = row_batches(row, args, trainer)  # a generator: starts nothing yet
        try:
            with sync:
                if warmup > 0:
                    timed_steps(trainer, batches, warmup, sampler)
                    trainer.meter.summary()  # the loss reported is the timed window's
                result = timed_steps(trainer, batches, steps, sampler)
            memory = peak_memory(env.device)  # before summary(), which starts a new window
            loss = trainer.meter.summary()["loss"]  # one host read, after the window
        finally:
            batches.close()
            trainer.close()
    # The trainer runs fp32 matmuls as TF32 on CUDA (set_float32_matmul_precision("high")).
    cuda_fp32 = env.device.type == "cuda" and trainer.parts.precision == "fp32"
    return {
        "row": row.name,
        "what": row.what,
        "precision": "tf32" if cuda_fp32 else trainer.parts.precision,
        "grad_accum": cfg.train.grad_accum,
        "batch_frames": cfg.data.batch_frames,
        **result,
        "peak_allocated_mib": _mib(memory.get("cuda_max_allocated_mib")),
        "peak_reserved_mib": _mib(memory.get("cuda_max_reserved_mib")),
        "peak_rss_mib": _mib(memory.get("peak_rss_mib")),
        "loss": round(loss, 4),
    }


def _always_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def row_overrides(row: Row, args: argparse.Namespace) -> list[str]:
    """Config overrides (``table.key=value``) that turn the model's config into ``row``."""
    overrides = [
        f"data.num_workers={args.workers}",
        f"train.precision={row.precision!r}",
        f"train.grad_accum={args.accum if row.accumulate else 1}",
        f"train.compile={str(row.compile).lower()}",
        f"train.activation_checkpointing={str(row.checkpointing).lower()}",
    ]
    if row.budgets != "config":
        table = args.tuned
        if row.budgets == "global":
            table = min(table.values())
        overrides.append(f"data.batch_frames={_toml(table)}")
    elif args.batch_frames is not None:
        overrides.append(f"data.batch_frames={args.batch_frames}")
    return overrides


def _toml(budget: int | dict[str, int]) -> str:
    """A budget as a TOML value: a number, or an inline table {bucket = frames}."""
    if isinstance(budget, int):
        return str(budget)
    return "{" + ", ".join(f"{b} = {f}" for b, f in budget.items()) + "}"


def tuned_budgets(args: argparse.Namespace) -> dict[str, int]:
    """``train tune``'s table for the budget rows' config, measured in this (one) process
    before it joins its process group."""
    cfg = load_config(args.config, row_overrides(ROWS["cache-bf16"], args))
    rows, where = tune(cfg, str(args.cache), memory_limit_mib=args.memory_limit_mib)
    log.info("tuned on %s: %s", where, {r.bucket: r.budget for r in rows})
    return {str(r.bucket): r.budget for r in rows}


def row_batches(
    row: Row, args: argparse.Namespace, trainer: Trainer
) -> Generator[Batch, None, None]:
    """The trainer's own streaming loader, or the on-the-fly baseline with the same budget."""
    if not row.on_the_fly:
        return iter(trainer.parts.loader)
    index = trainer.parts.loader.index
    features = features_from_dict(index["features"])
    size = baseline_batch_size(index, trainer.cfg)
    pad = trainer.cfg.data.pad_multiple
    return on_the_fly_batches(args.corpus, features, size, args.workers, pad)


# --- command line -------------------------------------------------------------------------


def join_process_group(device: torch.device) -> Env:
    """A one-rank process group in this process, so the trainer wraps the model in DDP."""
    if dist.is_initialized():
        raise UserError("gpu_bench runs as one process: launch it with python, not torchrun")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    extra = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **extra)
    return Env(rank=0, world_size=1, local_rank=0, device=device)


def markdown_table(rows: list[dict]) -> str:
    columns = [
        ("row", "row"),
        ("what", "what"),
        ("samples/s", "samples_per_s"),
        ("frames/s", "frames_per_s"),
        ("batch", "mean_batch"),
        ("pad %", "padding_pct"),
        ("data-wait %", "data_wait_pct"),
        ("GPU util %", "gpu_util_pct"),
        ("peak alloc MiB", "peak_allocated_mib"),
        ("peak reserved MiB", "peak_reserved_mib"),
        ("peak RSS MiB", "peak_rss_mib"),
        ("loss", "loss"),
    ]
    lines = ["| " + " | ".join(title for title, _ in columns) + " |"]
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        cells = ["–" if row[key] is None else str(row[key]) for _, key in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument(
        "--model", choices=["base", "tiny"], help="default: base on CUDA, else tiny"
    )
    parser.add_argument("--steps", type=int, default=50, help="timed micro-batches per row")
    parser.add_argument("--warmup", type=int, default=20, help="untimed micro-batches first")
    parser.add_argument("--minutes", type=float, default=60.0, help="corpus size (≥ 10 advised)")
    parser.add_argument("--batch-frames", type=int, help="frame budget (default: the config's)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers, every row")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per step (accum-*)")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma list, or 'all'")
    parser.add_argument("--data", type=Path, default=Path("/tmp/melcache-gpu-bench"))
    parser.add_argument("--json", type=Path, help="also write the rows here as JSON lines")
    parser.add_argument(
        "--memory-limit-mib",
        type=float,
        help="on CPU, the memory the budget rows are tuned for (MiB of live tensors)",
    )
    args = parser.parse_args(argv)
    args.rows = list(ROWS) if args.rows == "all" else [r.strip() for r in args.rows.split(",")]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown row {unknown[0]!r}; known: {', '.join(ROWS)} or all")
    for name in ("steps", "warmup", "workers", "accum"):
        if getattr(args, name) < (0 if name in ("warmup", "workers") else 1):
            parser.error(f"--{name} = {getattr(args, name)} is too small")
    if args.minutes <= 0:
        parser.error(f"--minutes = {args.minutes} must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise UserError("--device cuda, but torch sees no CUDA device")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    args.model = args.model or ("base" if cuda else "tiny")
    args.config = REPO / "configs" / f"{args.model}.toml"
    started = time.perf_counter()
    args.corpus, args.cache = prepare_data(args.data, args.minutes)
    log.info("data ready in %.1f s", time.perf_counter() - started)
    if any(ROWS[name].budgets != "config" for name in args.rows):
        if not cuda and args.memory_limit_mib is None:
            raise UserError("the budget rows on CPU need --memory-limit-mib (see train tune)")
        args.tuned = tuned_budgets(args)
    env = join_process_group(device)
    sampler = UtilSampler(device)
    results: list[dict] = []
    try:
        for name in args.rows:
            row_started = time.perf_counter()
            result = run_row(ROWS[name], args, env, sampler)
            result.update(model=args.model, device=str(device))
            result["row_seconds"] = round(time.perf_counter() - row_started, 1)
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        sampler.close()
        dist.destroy_process_group()
    if args.json is not None:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in results))
    print(f"\n{args.model} model on {device}, {args.steps} timed micro-batches per row\n")
    print(markdown_table(results))
    log.info("total %.1f s", time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:
        sys.exit(f"error: {exc}")
