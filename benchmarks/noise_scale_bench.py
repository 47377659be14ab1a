"""The noise-scale monitor (``train/adapt/noise_scale.py``) against the brute-force B_simple.

    python -m benchmarks.noise_scale_bench [--steps N] [--json FILE]

Linear regression, where every per-example gradient is exact: a fixed population of 50,000
examples x ~ N(0, I₃₂), y = x·w* + ε, at fixed weights w (no optimizer step, so the true
value does not move). Brute force: all per-example gradients gᵢ = (x·w − y)·x, G their mean,
tr(Σ) their mean squared deviation, B_simple = tr(Σ)/|G|². The monitor: W gloo processes,
each a DDP replica of the same linear model with the monitor's comm hook, each drawing its own
unequal batch (nⱼ examples) per step, the loss normalised as the trainer's (Σ losses · W / N),
the per-rank terms all-reduced and folded in exactly as the trainer does. Printed per world
size: both values and their ratio, and the textbook two-batch estimate (the mean rank batch
as the small batch) for comparison.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from train.adapt.noise_scale import NoiseScale
from train.parallel.env import Env, leave_together

DIM, POPULATION, NOISE = 32, 50_000, 1.0
BATCHES = {2: (16, 48), 4: (8, 16, 24, 48)}  # unequal examples per rank and step


def population() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The examples and the weights at which B_simple is measured (the same in every process)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(POPULATION, DIM, generator=gen, dtype=torch.float64)
    w_true = torch.randn(DIM, generator=gen, dtype=torch.float64)
    y = x @ w_true + NOISE * torch.randn(POPULATION, generator=gen, dtype=torch.float64)
    w = w_true + 0.2 * torch.randn(DIM, generator=gen, dtype=torch.float64)
    return x, y, w


def brute_force() -> dict[str, float]:
    """tr(Σ), |G|² and B_simple from every per-example gradient of the population."""
    x, y, w = population()
    grads = (x @ w - y)[:, None] * x
    mean = grads.mean(0)
    trace = float(((grads - mean) ** 2).sum(1).mean())
    grad_sq = float(mean @ mean)
    return {"trace": trace, "grad_sq": grad_sq, "b_simple": trace / grad_sq}


def _worker(rank: int, world: int, steps: int, init: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    env = Env(rank, world, rank, torch.device("cpu"))
    x, y, w = population()
    model = torch.nn.Linear(DIM, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(w[None])
    ddp = DistributedDataParallel(model)
    monitor = NoiseScale(env, decay=0.999)
    monitor.register(ddp)
    sizes = BATCHES[world]
    n, total = sizes[rank], sum(sizes)
    frames = torch.tensor(float(total), dtype=torch.float64)
    gen = torch.Generator().manual_seed(1 + rank)
    textbook = torch.zeros(2, dtype=torch.float64)  # Σ|ĝⱼ|²/W and |Ḡ|², for the textbook formula
    for _ in range(steps):
        pick = torch.randint(POPULATION, (n,), generator=gen)
        loss = 0.5 * ((ddp(x[pick])[:, 0] - y[pick]) ** 2).sum() * world / total
        loss.backward()
        norm = torch.linalg.vector_norm(model.weight.grad)
        terms = monitor.local_terms(n, frames)
        summed = terms.clone()
        dist.all_reduce(summed)
        monitor.update(summed, norm, frames, torch.tensor(True))
        textbook += torch.stack([summed[0] / world, norm.double() ** 2])
        model.weight.grad = None
    if rank == 0:
        small_b, big_b = total / world, total
        small, big = (textbook / steps).tolist()
        grad_sq = (big_b * big - small_b * small) / (big_b - small_b)
        trace = (small - big) / (1 / small_b - 1 / big_b)
        out = {**monitor.summary(), "textbook_b_simple": trace / grad_sq}
        Path(result).write_text(json.dumps(out))
    leave_together()


def measure(world: int, steps: int) -> dict[str, Any]:
    """The monitor's values after ``steps`` steps on ``world`` gloo ranks, with the truth."""
    with tempfile.TemporaryDirectory() as tmp:
        init, result = Path(tmp) / "init", Path(tmp) / "result.json"
        mp.spawn(_worker, args=(world, steps, str(init), str(result)), nprocs=world, join=True)
        got = json.loads(result.read_text())
    truth = brute_force()
    return {
        "world_size": world,
        "batches": list(BATCHES[world]),
        "steps": steps,
        "brute_force_b_simple": truth["b_simple"],
        "monitor_b_simple": got["noise_scale"],
        "band": [got["noise_scale_lo"], got["noise_scale_hi"]],
        "ratio": got["noise_scale"] / truth["b_simple"],
        "trace_ratio": got["noise_trace"] / truth["trace"],
        "textbook_ratio": got["textbook_b_simple"] / truth["b_simple"],
    }


def main(argv: list[str] | None = None) -> int:
    """Measure on 2 and 4 ranks; print one JSON line each (and write them to --json)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = [measure(world, args.steps) for world in sorted(BATCHES)]
    for row in rows:
        print(json.dumps(row))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
