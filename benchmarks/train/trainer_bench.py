"""Trainer overhead against a bare loop, and the data-wait share of a real run.

1. **Overhead**: one process, the same model, the same batches held in memory, the same
   precision. The bare loop is forward → loss ÷ frames → backward → AdamW step → zero_grad.
   The trainer runs :meth:`Trainer.fit` over the same batches (its loader swapped for the
   in-memory list), so it adds only what the trainer itself does per step: frame-count
   all-reduce, autocast, loss scaling, clipping, LR schedule, metrics, stop-flag polling.
   Checkpoint writes are left out (``save`` is a no-op here). A third loop, the bare loop
   plus the config's gradient clipping (``optim.grad_clip``, torch's ``clip_grad_norm_``),
   splits that overhead into what the recipe asks for and what the trainer's machinery adds.
   Each round times the loops back to back (order rotating), in wall time and in process CPU
   time; CPU time is the steadier measure on shared cores. An overhead is the median of the
   per-round ratios, with their interquartile range: the noise of the machine.
   The same rounds with the model shrunk to nothing (``SHRUNK``: one layer of width 8, one
   utterance a batch) give the trainer's machinery as milliseconds a step, which the ratios
   above cannot resolve on noisy cores.
2. **Data wait**: the README quick-start job (``torchrun --nproc-per-node 2``, tiny config)
   on the sample corpus, reading ``data_wait_pct`` from its metrics.jsonl; ``--wait-runs``
   jobs, their median and range. The load average is recorded before and after each part.

Both run on the GPU where there is one (the overhead on ``cuda:0``, synchronised at the ends
of each timed loop; the job with one rank per GPU), else on CPU.

Usage::

    python benchmarks/train/trainer_bench.py [--shards DIR] [--steps 30] [--rounds 5] [--wait-runs 3]

Without ``--shards`` the sample corpus is built into a temporary folder first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.common.caches import build_sample_cache  # noqa: E402
from train.config.tables import load_config  # noqa: E402
from train.parallel.env import Env  # noqa: E402
from train.trainer import Trainer  # noqa: E402

TINY = REPO / "configs" / "tiny.toml"
# The tiny config with its model shrunk to nothing: what is left of a step is the loop's own.
SHRUNK = [
    "model.args.dim=8",
    "model.args.layers=1",
    "model.args.heads=1",
    "data.batch_frames=1000",  # the sample corpus's longest utterance fits
    "data.max_batch_size=1",
]


class InMemory:
    """Stands in for the loader: cycles over batches already in memory."""

    def __init__(self, batches: list) -> None:
        self.batches = batches
        self.disk_cache = None  # no data.cache_dir: nothing read from a store

    def __iter__(self):
        while True:
            yield from self.batches

    def state_dict(self) -> dict:
        return {}

    def epochs(self) -> dict:
        """Epochs per cache, which the trainer logs: none for batches held in memory."""
        return {}

    def heard(self) -> dict:
        """What an epoch dealt under data.balance, which the trainer logs: nothing here."""
        return {}

    def close(self) -> None:
        pass


def timed(fn, device: torch.device) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``fn()``, its work on ``device`` finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def bare_steps(
    trainer: Trainer, model: torch.nn.Module, batches: list, steps: int, clip: float = 0.0
) -> None:
    """The minimal loop (same model class/config, same precision), clipping the gradients'
    norm at ``clip`` if given."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # the trainer's optimizer
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(trainer.parts.precision)
    device = trainer.env.device
    for i in range(steps):
        b = batches[i % len(batches)].to(device)  # the host batch, as the loader hands it over
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(b.mel, b.mel_lengths, b.text, b.text_lengths)
        (out["loss_sum"] / b.mel_lengths.sum()).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)


def trainer_steps(trainer: Trainer, steps: int) -> None:
    """``Trainer.fit`` over the in-memory batches."""
    trainer.fit(max_steps=trainer.step + steps)


def overhead(shards: str, steps: int, rounds: int, overrides: list[str]) -> dict:
    torch.set_num_threads(1)  # two shared cores: one thread gives steadier numbers
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    env = Env(rank=0, world_size=1, local_rank=0, device=device)
    cfg = load_config(TINY, [*overrides, "data.num_workers=0", "train.log_every=10"])
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(cfg, shards, Path(out), env)
        source = iter(trainer.parts.loader)
        batches = [next(source) for _ in range(steps)]
        trainer.parts.loader.close()
        trainer.parts.loader = InMemory(batches)
        trainer.save = lambda: None  # checkpoint I/O is not step overhead
        bare_model = type(trainer.parts.raw_model)(n_mels=cfg.model.n_mels, **cfg.model.args)
        bare_model.load_state_dict(trainer.parts.raw_model.state_dict())
        bare_model.to(device)
        clip = cfg.optim.grad_clip
        loops = {
            "bare": lambda: bare_steps(trainer, bare_model, batches, steps),
            "bare_clipped": lambda: bare_steps(trainer, bare_model, batches, steps, clip),
            "trainer": lambda: trainer_steps(trainer, steps),
        }
        bare_steps(trainer, bare_model, batches, 3)  # warm-up
        trainer_steps(trainer, 3)
        rounds_ms = []  # per round: {loop: (wall ms per step, CPU ms per step)}
        names = list(loops)
        for r in range(rounds):
            order = names[r % 3 :] + names[: r % 3]  # each loop first, second and last in turn
            times = {name: timed(loops[name], device) for name in order}
            rounds_ms.append({n: [round(1000 * x / steps, 2) for x in times[n]] for n in loops})
        trainer.close()
    out = {"device": str(device), "precision": trainer.parts.precision}
    out.update(steps_per_round=steps, rounds=rounds)
    out["grad_clip"] = clip
    for i, clock in enumerate(("wall", "cpu")):
        for name in loops:
            ms = statistics.median(r[name][i] for r in rounds_ms)
            out[f"{name}_ms_per_step_{clock}"] = round(ms, 2)
        for key, over, under in (
            ("overhead", "trainer", "bare"),  # the measure
            ("clipping", "bare_clipped", "bare"),  # of which the recipe's clipping
            ("overhead_over_clipped", "trainer", "bare_clipped"),  # of which the machinery
        ):
            ratios = [r[over][i] / r[under][i] for r in rounds_ms]
            out.update(_percent(f"{key}_pct_{clock}", ratios))
        over = [r["trainer"][i] - r["bare_clipped"][i] for r in rounds_ms]
        out[f"over_clipped_ms_per_step_{clock}"] = round(statistics.median(over), 3)
    out["rounds_ms"] = rounds_ms
    return out


def _percent(key: str, ratios: list[float]) -> dict:
    """The median of ``ratios`` as a percentage over 1 under ``key``, and under ``key_iqr``
    their interquartile range (with four rounds or more): the noise of this machine."""
    out = {key: round(100 * (statistics.median(ratios) - 1), 2)}
    if len(ratios) >= 4:
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        out[f"{key}_iqr"] = [round(100 * (q1 - 1), 2), round(100 * (q3 - 1), 2)]
    return out


def data_wait(shards: str, steps: int, runs: int) -> dict:
    """The steady data wait of ``runs`` jobs: their median, range and each."""
    jobs = [_one_job(shards, steps) for _ in range(runs)]
    waits = [job["data_wait_pct_steady"] for job in jobs]
    return {
        "command": jobs[0]["command"],
        "runs": runs,
        "data_wait_pct_steady_median": round(statistics.median(waits), 2),
        "data_wait_pct_steady_range": [min(waits), max(waits)],
        "jobs": jobs,
    }


def _one_job(shards: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(torch.cuda.device_count() or 2),  # one rank per GPU
            "-m",
            "train",
            "--shards",
            shards,
            "--config",
            str(TINY),
            "--out",
            out,
            "--max-steps",
            str(steps),
            "train.log_every=5",
        ]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
        records = [
            json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()
        ]
    steady = records[1:] or records  # the first window includes worker start-up
    return {
        "command": " ".join(cmd[1:]).replace(out, "OUT"),
        "data_wait_pct_first_window": records[0]["data_wait_pct"],
        "data_wait_pct_steady": round(statistics.mean(r["data_wait_pct"] for r in steady), 2),
        "step_time_s_steady": round(statistics.mean(r["step_time_s"] for r in steady), 4),
        "frames_per_s_steady": round(statistics.mean(r["frames_per_s"] for r in steady), 1),
        "padding_pct_mean": round(statistics.mean(r["padding_pct"] for r in records), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", help="cache folder (default: build the sample corpus)")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--wait-steps", type=int, default=40, help="steps of the real run")
    parser.add_argument("--wait-runs", type=int, default=3, help="real runs")
    parser.add_argument("--machinery-rounds", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="trainer config overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shards = args.shards or build_sample_cache(Path(tmp) / "cache")
        result = {"load_average": [os.getloadavg()[0]]}
        result["overhead"] = overhead(shards, args.steps, args.rounds, args.overrides)
        result["load_average"].append(os.getloadavg()[0])
        shrunk = [*args.overrides, *SHRUNK]
        result["machinery"] = overhead(shards, 200, args.machinery_rounds, shrunk)
        result["load_average"].append(os.getloadavg()[0])
        result["data_wait"] = data_wait(shards, args.wait_steps, args.wait_runs)
        result["load_average"].append(os.getloadavg()[0])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
