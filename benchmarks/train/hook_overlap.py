"""Does a DDP comm hook's traffic overlap the backward? Measured on 2 gloo processes.

    python -m benchmarks.train.hook_overlap [--dim 256] [--layers 4] [--bucket-mb 1] [--steps 6]

For DDP's own all-reduce hook and our PowerSGD (``train/parallel/powersgd.py``, rank 4, compressing
from the first step), the TextToMel backward is timed under DDP and, in alternate steps, on
the bare module (compute only); the hook's own time on the backward thread is timed too.
Exposed communication = DDP backward − compute-only backward. torch's all-reduce hook
returns a pending future at once, so gloo reduces on its own threads while the backward goes
on. Our PowerSGD hook runs its two all-reduces and its QR and matmuls inside the hook and
returns a finished future (what keeps it from hanging on gloo): the backward waits for each
bucket in turn, so none of its communication is hidden. On a CPU the all-reduce's overlap is
also bounded by free cores (gloo's threads share them with the backward).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from train.model import TextToMel
from train.parallel.env import leave_together
from train.parallel.powersgd import PowerSGD, powersgd_hook

HOOKS = ("allreduce", "powersgd-r4")
WARM_UP = 2  # DDP rebuilds its buckets after the first step


def _timed(hook: Callable, spent: list[float]) -> Callable:
    """``hook``, adding the seconds each call holds the backward thread to ``spent``."""

    def timed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()
        future = hook(state, bucket)
        spent.append(time.perf_counter() - start)
        return future

    return timed


def _backward_s(model: torch.nn.Module, inputs: tuple) -> float:
    """Seconds of one backward into fresh gradients (DDP waits for every bucket's future
    before it returns; the bare module has no hooks at all)."""
    loss = model(*inputs)["loss_sum"]
    start = time.perf_counter()
    loss.backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def _measure_hook(hook: str, args: argparse.Namespace, inputs: tuple) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TextToMel(n_mels=100, dim=args.dim, layers=args.layers)
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    spent: list[float] = []
    if hook == "allreduce":
        ddp.register_comm_hook(None, _timed(default_hooks.allreduce_hook, spent))
    else:
        state = PowerSGD(model, rank=int(hook[-1]), start_iter=0, seed=0)
        ddp.register_comm_hook(state, _timed(powersgd_hook, spent))
    synced, alone, in_hook, buckets = [], [], [], 0
    for step in range(WARM_UP + args.steps):
        spent.clear()
        seconds = _backward_s(ddp, inputs), _backward_s(model, inputs)
        buckets = len(spent)  # one hook call per bucket
        if step >= WARM_UP:
            synced.append(seconds[0])
            alone.append(seconds[1])
            in_hook.append(sum(spent))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    alone_s = []
    for _ in range(args.steps):  # the same bytes in one all-reduce, nothing to overlap with
        start = time.perf_counter()
        dist.all_reduce(flat)
        alone_s.append(time.perf_counter() - start)
    return {
        "hook": hook,
        "parameters": flat.numel(),
        "buckets": buckets,
        "compute_ms": 1e3 * statistics.median(alone),
        "synced_ms": 1e3 * statistics.median(synced),
        "in_hook_ms": 1e3 * statistics.median(in_hook),
        "allreduce_alone_ms": 1e3 * statistics.median(alone_s),
    }


def _worker(rank: int, init: str, result: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # two processes on the machine's cores, as the trainer tests run
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    generator = torch.Generator().manual_seed(1)
    mel = torch.randn(8, 192, 100, generator=generator)
    text = torch.randint(1, 200, (8, 32), generator=generator)
    inputs = (mel, torch.full((8,), 192), text, torch.full((8,), 32))
    rows = [_measure_hook(hook, args, inputs) for hook in HOOKS]
    if rank == 0:
        Path(result).write_text(json.dumps(rows))
    leave_together()


def report(rows: list[dict[str, Any]]) -> str:
    """A markdown table: backward times, exposed communication, time in the hook."""
    lines = [
        f"TextToMel, {rows[0]['parameters']:,} parameters, {rows[0]['buckets']} DDP buckets, "
        "2 gloo ranks, median backward:",
        "",
        "| hook | compute only ms | synced ms | exposed ms | in the hook ms | "
        "one all-reduce of all gradients ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        exposed = r["synced_ms"] - r["compute_ms"]
        lines.append(
            f"| {r['hook']} | {r['compute_ms']:.1f} | {r['synced_ms']:.1f} | {exposed:.1f} | "
            f"{r['in_hook_ms']:.1f} | {r['allreduce_alone_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure on 2 gloo processes and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=6, help="timed steps after 2 warm-up")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        init, result = Path(tmp) / "init", Path(tmp) / "result.json"
        mp.spawn(_worker, args=(str(init), str(result), args), nprocs=2, join=True)
        rows = json.loads(result.read_text())
    print(report(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
