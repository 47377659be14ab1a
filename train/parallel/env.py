"""Process group and device of this process: torchrun's environment, checked, and the
few collectives the trainer calls directly.

Launch is plain ``torchrun`` (single node ``--standalone``, multi-node ``--nnodes`` with a
rendezvous); without torchrun the trainer runs as one process with no process group.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os

import torch
import torch.distributed as dist

from melcache.errors import UserError

# What torchrun sets for every rank besides RANK.
_JOB_VARIABLES = ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class Env:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 writes metrics, the shared checkpoint file and the logs."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True under torchrun (even with one process), False for a plain ``python -m``."""
        return dist.is_available() and dist.is_initialized()


def setup() -> Env:
    """Join the torchrun job if there is one; pick the device (nccl on CUDA, gloo on CPU)."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return Env(0, 1, 0, torch.device("cuda" if cuda else "cpu"))
    _check_job_environment()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        store=_attempt_store(rank, world_size),
        rank=rank,
        world_size=world_size,
        device_id=device if cuda else None,
    )
    return Env(rank, world_size, local_rank, device)


def _check_job_environment() -> None:
    """RANK says "a distributed job": the rest of torchrun's variables must be there too."""
    missing = [name for name in _JOB_VARIABLES if name not in os.environ]
    if missing:
        raise UserError(
            f"RANK is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
            "launch with torchrun (which sets them all), or unset RANK to train in one process"
        )
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        if not os.environ.get(name, "0").isdigit():
            raise UserError(f"{name} = {os.environ[name]!r} is not a non-negative integer")


def _attempt_store(rank: int, world_size: int) -> dist.Store:
    """The rendezvous store, with keys private to this restart attempt.

    torchrun's agent keeps one TCPStore across ``--max-restarts``: without a per-attempt
    prefix, restarted ranks read the dead attempt's peer addresses and gloo cannot connect
    (pytorch#135712). Outside torchrun's agent, rank 0 hosts the store.
    """
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_hosts_it,
        timeout=datetime.timedelta(minutes=10),
    )
    return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def teardown(env: Env) -> None:
    """Leave the process group (lets torchrun see a clean exit)."""
    if env.distributed:
        dist.destroy_process_group()


def leave_together() -> None:
    """Leave the process group once every rank is done, first freeing what still uses it.

    For a rank that finished cleanly (the barrier waits for all). DDP's reducer and a comm
    hook's state sit in reference cycles: left to interpreter finalization they are freed
    after the group is gone and gloo calls std::terminate (SIGABRT in 4 of 10 two-rank
    spawned jobs of ``benchmarks.train.hook_overlap`` on a 2-core machine; none in 24 with this).
    """
    gc.collect()
    dist.barrier()  # no rank closes its connections while a peer still has work in flight
    dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, env: Env) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place, on its device, without waiting on the host."""
    if env.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier(env: Env) -> None:
    """Wait for every rank (start-up and checkpoint bookkeeping only, never the hot loop)."""
    if env.distributed:
        dist.barrier()
