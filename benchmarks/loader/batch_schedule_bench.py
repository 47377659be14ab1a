"""A fixed batch against a ramped one and the noise-scale closed loop, for the same frames.

    python -m benchmarks.loader.batch_schedule_bench [--shards DIR] [--micro 80] [--json FILE]

Three 2-rank gloo jobs of the tiny config on the sample corpus (``torchrun``), each drawing
``--micro`` micro-batches per rank in all (the same frames, to within a step):

- fixed: ``train.grad_accum = 4`` from the start;
- ramp: ``train.adapt.batch_ramp_steps`` over the first quarter, accumulation 1 → 2 → 4;
- closed loop: accumulation 1, doubled (up to 4) by ``train.adapt.batch_adaptive`` from the noise
  scale, at ``optim.lr`` × √(1/4) for accumulation 1 as the ramp starts, so that at 4 all
  three train at the same rate. It cannot know its step count ahead: it is resumed (exactly)
  in pieces until its loader has drawn ``--micro`` micro-batches.

Reported: steps, frames and the first logged step at which each reaches a target loss (the
highest of the three runs' best window losses, so every run reaches it). Then the overhead:
the schedule's own host work per step (ramp and closed-loop calls, timed inside one
in-process run) as a share of the step, and the monitor's (hook, all-reduce, EMA) as the step
time of the fixed job with ``train.adapt.noise_scale`` on against off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.caches import build_sample_cache
from train.adapt.batch_ramp import ramp_accum
from train.config.tables import load_config
from train.parallel.env import Env
from train.run.metrics import read_metrics
from train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.toml"
COMMON = [
    "data.num_workers=1",
    "train.precision=fp32",
    "train.log_every=5",
    "train.checkpoint.every=1000",
    "optim.warmup_steps=5",
]
ACCUM = 4


def job(shards: str, out: Path, steps: int, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "train", "--shards", shards, "--config", str(TINY), "--out", str(out)]
    cmd += ["--max-steps", str(steps), *COMMON, *extra]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")


def drawn(out: Path) -> int:
    """Micro-batches rank 0's loader has drawn, from the newest checkpoint."""
    latest = sorted((out / "checkpoints").glob("step-*"))[-1]
    return torch.load(latest / "rank-00000.pt", weights_only=True)["loader"]["batches"]


def windows(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def side_by_side(shards: str, micro: int, root: Path) -> dict[str, Any]:
    ramp_steps = micro // ACCUM // 4
    ramp_total, ramp_run = 0, 0
    while ramp_total < micro:
        ramp_total += ramp_accum(ramp_run, ACCUM, ramp_steps)
        ramp_run += 1
    runs = {
        "fixed": (micro // ACCUM, [f"train.grad_accum={ACCUM}"]),
        "ramp": (
            ramp_run,
            [f"train.grad_accum={ACCUM}", f"train.adapt.batch_ramp_steps={ramp_steps}"],
        ),
    }
    adaptive = [
        "train.adapt.noise_scale=true",
        "train.adapt.batch_adaptive=true",
        "train.adapt.noise_scale_ema=0.9",
    ]
    adaptive += [
        f"train.adapt.batch_max_accum={ACCUM}",
        "train.adapt.batch_cooldown=5",
        "optim.lr=1e-3",
    ]
    rows = {}
    for name, (steps, extra) in runs.items():
        job(shards, root / name, steps, extra)
        rows[name] = windows(root / name)
    out, steps = root / "closed", 0
    while not (out / "checkpoints").exists() or drawn(out) < micro:
        left = micro - (drawn(out) if steps else 0)
        accum = ACCUM if not steps else max(1, _last_accum(out))
        steps += max(1, left // accum)
        job(shards, out, steps, [*adaptive, "train.checkpoint.every=5"])
    rows["closed loop"] = windows(out)
    rises = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "batch_size"]
    target = max(min(r["loss"] for r in rs) for rs in rows.values())
    report: dict[str, Any] = {"target_loss": round(target, 4), "micro_per_rank": micro}
    for name, rs in rows.items():
        frames, reached = 0.0, None
        for before, r in zip([{"step": 0}, *rs], rs, strict=False):
            frames += r["frames_per_step"] * (r["step"] - before["step"])
            if reached is None and r["loss"] <= target:
                reached = {"step": r["step"], "frames": round(frames)}
        report[name] = {"steps": rs[-1]["step"], "frames": round(frames), "to_target": reached}
    report["closed loop"]["rises"] = [(r["step"], r["accum"]) for r in rises]
    last = rows["closed loop"][-1]
    report["closed loop"]["last_noise_scale"] = [last["noise_scale"], last["frames_per_step"]]
    return report


def _last_accum(out: Path) -> int:
    latest = sorted((out / "checkpoints").glob("step-*"))[-1]
    return torch.load(latest / "shared.pt", weights_only=True)["batch"]["accum"]


def schedule_overhead(shards: str, steps: int, root: Path) -> dict[str, float]:
    """Host time of the schedule's calls per step, over the step time, in one process."""
    overrides = [*COMMON, "data.num_workers=0", f"train.grad_accum={ACCUM}"]
    overrides.append(f"train.adapt.batch_ramp_steps={steps // 2}")
    env = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    trainer = Trainer(load_config(TINY, overrides), shards, root / "overhead", env)
    spent = [0.0]
    for name in ("accum_for", "observe"):
        real = getattr(trainer.parts.batch, name)

        def timed(*args, real=real):
            start = time.perf_counter()
            try:
                return real(*args)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(trainer.parts.batch, name, timed)
    try:
        start = time.perf_counter()
        trainer.fit(max_steps=steps)
        total = time.perf_counter() - start
    finally:
        trainer.close()
    return {"schedule_us_per_step": 1e6 * spent[0] / steps, "step_ms": 1e3 * total / steps,
            "schedule_pct_of_step": 100 * spent[0] / total}  # fmt: skip


def monitor_overhead(shards: str, steps: int, root: Path) -> dict[str, float]:
    """Steady step time of the fixed 2-rank job with and without the noise-scale monitor
    (alternating, 2 rounds: the median of each)."""
    times: dict[str, list[float]] = {"off": [], "on": []}
    for round_ in range(2):
        for name, extra in (("off", []), ("on", ["train.adapt.noise_scale=true"])):
            out = root / f"monitor-{name}-{round_}"
            job(shards, out, steps, [f"train.grad_accum={ACCUM}", *extra])
            steady = windows(out)[1:]  # the first window holds start-up
            times[name].extend(r["step_time_s"] for r in steady)
    times = {name: statistics.median(values) for name, values in times.items()}
    return {"step_s_monitor_off": times["off"], "step_s_monitor_on": times["on"],
            "monitor_pct_of_step": 100 * (times["on"] / times["off"] - 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the three jobs and the overhead measurements; print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards")
    parser.add_argument("--micro", type=int, default=80)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards = args.shards or build_sample_cache(root / "cache")
        report = side_by_side(shards, args.micro, root)
        report["overhead"] = schedule_overhead(shards, 40, root)
        report["overhead"].update(monitor_overhead(shards, 25, root))
    print(json.dumps(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
