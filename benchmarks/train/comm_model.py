"""Gradient-sync traffic per strategy: measured from the real hooks, and an α-β model at scale.

    python -m benchmarks.train.comm_model [--json FILE]

1. *Measured*: two gloo processes train the tiny TextToMel one step under each strategy
   (DDP fp32/bf16 hooks, our PowerSGD r1/r4, FSDP2, HSDP), with ``dist.all_reduce``,
   ``all_gather_single`` and ``reduce_scatter_single`` wrapped to count the bytes every
   collective carries; the count must equal the closed form (:func:`closed_form`), and per-rank
   memory of parameters, gradients and optimizer state is read off the live tensors.
2. *Modelled*: the same closed forms for TextToMel at 38 M / 300 M / 1 B parameters on three
   clusters, at 8–1,024 GPUs, timed with a ring α-β model (:func:`collective_s`): time per
   step, and its exposed share of the step without overlap and with overlap (the backward
   hides DDP's and PowerSGD's traffic, FSDP2 hides its all-gathers behind the whole step).

Every number of the model is an assumption written here: bus bandwidths are vendor link
rates × 0.85 (NCCL's all-reduce reaches 80–90 % of them), α = 8 µs per tree hop, compute
at 40 % of dense bf16 peak, a fixed global batch of 4 M frames a step (strong scaling).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from train.config.train_table import ParallelConfig
from train.model import TextToMel
from train.parallel.env import Env, leave_together
from train.parallel.fsdp import shard
from train.parallel.powersgd import PowerSGD

STRATEGIES = ("ddp-fp32", "ddp-bf16", "powersgd-r1", "powersgd-r4", "fsdp2", "hsdp")
TINY = {"dim": 96, "layers": 3}
SIZES = {"38M": {"dim": 512, "layers": 12}, "300M": {"dim": 1024, "layers": 24},
         "1B": {"dim": 2048, "layers": 20}}  # fmt: skip
_COUNTED = ("all_reduce", "all_gather_single", "reduce_scatter_single")


# ---- measured: one step of the real hooks on 2 gloo ranks ----------------------------------
def _wrap(model: torch.nn.Module, strategy: str, env: Env, bucket_mb: float) -> torch.nn.Module:
    if strategy in ("fsdp2", "hsdp"):
        cfg = ParallelConfig(strategy=strategy, hsdp_shard_size=1)  # hsdp: replicate 2 × shard 1
        return shard(model, env, cfg, torch.bfloat16)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    if strategy == "ddp-fp32":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif strategy == "ddp-bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        PowerSGD(model, rank=int(strategy[-1]), start_iter=0, seed=0).register(ddp)
    return ddp


_REAL = {name: getattr(dist, name) for name in _COUNTED}


def _payload(name: str, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    """all_reduce: the tensor; all_gather_single: the gathered output; reduce_scatter: input."""
    if name == "reduce_scatter_single":
        return kwargs["input"] if "input" in kwargs else args[1]
    return args[0] if args else next(iter(kwargs.values()))


def _count_collectives(sent: dict[str, int]) -> None:
    """Wrap the collectives the hooks and FSDP2 call (they look them up on ``dist``)."""
    for name, real in _REAL.items():

        def counting(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            tensor = _payload(_name, args, kwargs)
            sent[_name] = sent.get(_name, 0) + tensor.numel() * tensor.element_size()
            return _real(*args, **kwargs)

        setattr(dist, name, counting)


def _restore_collectives() -> None:
    for name, real in _REAL.items():
        setattr(dist, name, real)


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def _worker(rank: int, init: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    env, rows = Env(rank, 2, rank, torch.device("cpu")), []
    generator = torch.Generator().manual_seed(1)
    mel = torch.randn(4, 64, 100, generator=generator)
    text = torch.randint(1, 200, (4, 16), generator=generator)
    lengths = torch.tensor([64, 56, 48, 40]), torch.tensor([16, 12, 10, 8])
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        raw = TextToMel(n_mels=100, **TINY)
        model = _wrap(raw, strategy, env, bucket_mb=0.25)
        optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-4)
        sent: dict[str, int] = {}
        for step in range(2):  # count the second: DDP rebuilds its buckets after the first
            counters: dict[str, int] = {}
            if step == 1:
                counters = sent
                _count_collectives(counters)
            with torch.autocast("cpu", torch.bfloat16, enabled=strategy in ("fsdp2", "hsdp")):
                out = model(mel, lengths[0], text, lengths[1])
            out["loss_sum"].backward()
            _restore_collectives()
            optimizer.step()
            if step == 0:
                optimizer.zero_grad(set_to_none=True)
        params = list(raw.parameters())
        rows.append({
            "strategy": strategy,
            "sent": sent,
            "closed_form": closed_form(strategy, raw, 2),
            "param_bytes": _local_bytes(params),
            "grad_bytes": _local_bytes([p.grad for p in params]),
            "optim_bytes": _local_bytes(
                [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
            ),
        })  # fmt: skip
    if rank == 0:
        Path(result).write_text(json.dumps(rows))
    leave_together()


def measure() -> list[dict[str, Any]]:
    """One counted step per strategy on 2 gloo processes (spawned)."""
    with tempfile.TemporaryDirectory() as tmp:
        init, result = Path(tmp) / "init", Path(tmp) / "result.json"
        mp.spawn(_worker, args=(str(init), str(result)), nprocs=2, join=True)
        return json.loads(result.read_text())


# ---- closed forms ---------------------------------------------------------------------------
def _padded(p: torch.Tensor, shards: int) -> int:
    """Elements FSDP2 all-gathers for one parameter: dim 0 padded to a multiple of shards."""
    return -(-p.shape[0] // shards) * shards * math.prod(p.shape[1:])


def closed_form(strategy: str, model: TextToMel, ranks: int, shards: int = 0) -> dict[str, int]:
    """Bytes each rank hands to each collective per step (all_reduce: the tensor; all_gather:
    the gathered output; reduce_scatter: the full input). FSDP2 all-gathers bf16 parameters
    for the forward and again for the backward (the root's stay gathered: FSDP2 does not
    reshard the root after forward) and reduce-scatters fp32 gradients; HSDP does so within
    groups of ``shards`` ranks, then all-reduces its shard across the groups."""
    params = list(model.parameters())
    if strategy == "ddp-fp32":
        return {"all_reduce": 4 * sum(p.numel() for p in params)}
    if strategy == "ddp-bf16":
        return {"all_reduce": 2 * sum(p.numel() for p in params)}
    if strategy.startswith("powersgd"):
        state = PowerSGD(model, rank=int(strategy[-1]), start_iter=0, seed=0)
        return {"all_reduce": 4 * state.elements_sent(params)}
    shards = shards or (ranks if strategy == "fsdp2" else 1)
    gathered = sum(_padded(p, shards) for p in params)
    in_blocks = sum(_padded(p, shards) for p in model.blocks.parameters())
    out = {}
    if shards > 1:  # FSDP2 skips the collectives of one-rank shard groups
        out = {
            "all_gather_single": 2 * (gathered + in_blocks),
            "reduce_scatter_single": 4 * gathered,
        }
    if ranks // shards > 1:
        out["all_reduce"] = 4 * gathered // shards
    return out


# ---- modelled: α-β time of those bytes on named clusters ------------------------------------
@dataclasses.dataclass(frozen=True)
class Cluster:
    """Nodes of 8 GPUs: NVLink bus bandwidth inside, the node's NICs between (GB/s, one way)."""

    name: str
    nvlink_gbs: float
    node_nic_gbs: float
    peak_tflops: float  # dense bf16


CLUSTERS = (
    Cluster("A100 8×HDR200", nvlink_gbs=300, node_nic_gbs=8 * 25, peak_tflops=312),
    Cluster("H100 8×NDR400", nvlink_gbs=450, node_nic_gbs=8 * 50, peak_tflops=989),
    Cluster("H100, one 400 Gb NIC per node", nvlink_gbs=450, node_nic_gbs=50, peak_tflops=989),
)
GPUS = (8, 64, 256, 1024)
PER_NODE, EFFICIENCY, ALPHA_S, MFU, GLOBAL_FRAMES = 8, 0.85, 8e-6, 0.4, 4_000_000
MODELLED = ("ddp-fp32", "ddp-bf16", "powersgd-r1@25", "powersgd-r4@25", "powersgd-r1@200",
            "powersgd-r4@200", "fsdp2", "hsdp")  # fmt: skip


def _bandwidth_s(kind: str, full_bytes: float, ranks: int, link_gbs: float) -> float:
    """A ring's wire bytes over the bottleneck's bus bandwidth. Across nodes that bottleneck
    is the node's NICs, which carry the whole ring's traffic whatever the GPUs per node."""
    wire = (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks
    return wire * full_bytes / (link_gbs * EFFICIENCY * 1e9) if ranks > 1 else 0.0


def _latency_s(ranks: int) -> float:
    """One collective's start-up: a tree's depth of hops, both ways."""
    return 2 * ALPHA_S * math.ceil(math.log2(ranks)) if ranks > 1 else 0.0


def step_comm_s(strategy: str, model: TextToMel, gpus: int, cluster: Cluster) -> float:
    """Seconds of gradient-sync traffic per step (``powersgd-r4@200``: 200 MB buckets)."""
    name, _, bucket_mb = strategy.partition("@")
    units, nic = len(model.blocks) + 1, cluster.node_nic_gbs
    link = nic if gpus > PER_NODE else cluster.nvlink_gbs
    if name in ("fsdp2", "hsdp"):
        shards = gpus if name == "fsdp2" else min(gpus, PER_NODE)
        sent = closed_form(name, model, gpus, shards)
        within = link if name == "fsdp2" else cluster.nvlink_gbs
        seconds = sum(
            _bandwidth_s(k, b, shards, within) for k, b in sent.items() if k != "all_reduce"
        )
        seconds += 3 * units * _latency_s(shards)
        if "all_reduce" in sent:  # HSDP: every GPU's shard crosses the nodes, through the NICs
            replicas = gpus // shards
            seconds += _bandwidth_s("all_reduce", sent["all_reduce"] * shards, replicas, nic)
            seconds += units * _latency_s(replicas)
        return seconds
    sent = closed_form(name, model, gpus)["all_reduce"]
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    calls = math.ceil(grad_bytes / (float(bucket_mb or 25) * 2**20)) * (
        1 + name.startswith("powersgd")
    )
    return _bandwidth_s("all_reduce", sent, gpus, link) + calls * _latency_s(gpus)


def compute_s(model: TextToMel, gpus: int, cluster: Cluster) -> float:
    """Forward + backward of a fixed global batch split over ``gpus`` (6 flops/param/frame)."""
    params = sum(p.numel() for p in model.parameters())
    return 6 * params * GLOBAL_FRAMES / gpus / (cluster.peak_tflops * 1e12 * MFU)


def exposed_s(
    strategy: str, comm: float, compute: float, model: TextToMel, cluster: Cluster
) -> float:
    """Communication the step waits for, with overlap. DDP hides its buckets behind the
    backward (⅔ of compute), FSDP2/HSDP their gathers behind the whole step; our PowerSGD hook
    hides nothing (its collectives run in the hook, so the backward waits for them) and adds
    its matmuls (≈ 6·n·m·r flops a matrix)."""
    if strategy.startswith("powersgd"):
        r = int(strategy.split("@")[0][-1])
        flops = sum(6 * p.numel() * r for p in model.parameters() if p.dim() >= 2)
        return comm + flops / (cluster.peak_tflops * 1e12 * MFU)
    hidden = compute if strategy in ("fsdp2", "hsdp") else 2 / 3 * compute
    return max(0.0, comm - hidden)


def meta_model(size: str) -> TextToMel:
    """TextToMel of ``size`` on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return TextToMel(n_mels=100, **SIZES[size])


def model_rows() -> list[dict[str, Any]]:
    """Every cluster × size × GPU count × strategy of the α-β model."""
    rows = []
    for cluster in CLUSTERS:
        for size in SIZES:
            model = meta_model(size)
            for gpus in GPUS:
                compute = compute_s(model, gpus, cluster)
                for strategy in MODELLED:
                    comm = step_comm_s(strategy, model, gpus, cluster)
                    exposed = exposed_s(strategy, comm, compute, model, cluster)
                    rows.append({
                        "cluster": cluster.name, "size": size, "gpus": gpus,
                        "strategy": strategy, "compute_s": compute, "comm_s": comm,
                        "exposed_no_overlap": comm / (compute + comm),
                        "exposed_overlap": exposed / (compute + exposed),
                    })  # fmt: skip
    return rows


def memory_gb(strategy: str, model: TextToMel, gpus: int) -> float:
    """Per-rank parameters + gradients + AdamW state (fp32: 4 + 4 + 8 bytes a parameter),
    plus PowerSGD's error and warm-start memory; FSDP2 over all ranks, HSDP over a node."""
    params = sum(p.numel() for p in model.parameters())
    per_rank = 16 * params
    if strategy.startswith("powersgd"):
        state = PowerSGD(model, rank=int(strategy.split("@")[0][-1]), start_iter=0, seed=0)
        compressed = [p for p in model.parameters() if state.compressible(p)]
        per_rank += 4 * sum(p.numel() + p.shape[1] * state.rank for p in compressed)
    elif strategy in ("fsdp2", "hsdp"):
        per_rank /= gpus if strategy == "fsdp2" else min(gpus, PER_NODE)
    return per_rank / 1e9


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def report(measured: list[dict[str, Any]], modelled: list[dict[str, Any]]) -> str:
    """The three Markdown tables: measured bytes and memory, modelled shares, modelled memory."""
    out = ["Measured at 2 gloo ranks, tiny TextToMel (389 k params), bytes per rank per step:", ""]
    out.append(_table(
        ["strategy", "bytes sent (hooks)", "closed form", "params / grads / AdamW per rank"],
        [[r["strategy"], _bytes(r["sent"]), "equal" if r["sent"] == r["closed_form"] else
          f"DIFFERS: {_bytes(r['closed_form'])}",
          f"{r['param_bytes']:,} / {r['grad_bytes']:,} / {r['optim_bytes']:,}"] for r in measured],
    ))  # fmt: skip
    for cluster in CLUSTERS:
        out += [
            "",
            f"Exposed communication, {cluster.name}: % of the step without / with overlap",
            "",
        ]
        cells = {}
        for r in modelled:
            if r["cluster"] == cluster.name:
                cells.setdefault((r["size"], r["gpus"]), []).append(
                    f"{100 * r['exposed_no_overlap']:.0f} / {100 * r['exposed_overlap']:.0f}"
                )
        out.append(_table(["params", "GPUs", *MODELLED], [[*k, *v] for k, v in cells.items()]))
    out += ["", "Per-rank memory, GB (parameters + gradients + AdamW, fp32):", ""]
    kinds = ("ddp-fp32", "powersgd-r4", "fsdp2", "hsdp")
    out.append(_table(["params", "GPUs", *kinds], [
        [size, gpus, *(f"{memory_gb(k, meta_model(size), gpus):.2f}" for k in kinds)]
        for size in SIZES for gpus in (8, 64, 1024)
    ]))  # fmt: skip
    return "\n".join(out)


def _bytes(sent: dict[str, int]) -> str:
    short = {"all_reduce": "AR", "all_gather_single": "AG", "reduce_scatter_single": "RS"}
    return " + ".join(f"{short[k]} {v:,}" for k, v in sorted(sent.items()))


def main(argv: list[str] | None = None) -> int:
    """Measure on 2 gloo processes, model the clusters, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write every row here")
    args = parser.parse_args(argv)
    measured, modelled = measure(), model_rows()
    print(report(measured, modelled))
    if args.json:
        args.json.write_text(json.dumps({"measured": measured, "modelled": modelled}, indent=1))
    return 0 if all(r["sent"] == r["closed_form"] for r in measured) else 1


if __name__ == "__main__":
    raise SystemExit(main())
