"""Process group, device, DDP wrapping, seeding, RNG state and the graceful-stop flag.

Launch is plain ``torchrun`` (single node ``--standalone``, multi-node ``--nnodes`` with a
rendezvous); without torchrun the trainer runs as one process with no process group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from melcache.errors import UserError
from train.config.train_table import TrainConfig

# What torchrun sets for every rank besides RANK.
_JOB_VARIABLES = ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

log = logging.getLogger(__name__)


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


def all_reduce_sum(tensor: torch.Tensor, env: Env) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place, on its device, without waiting on the host."""
    if env.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier(env: Env) -> None:
    """Wait for every rank (start-up and checkpoint bookkeeping only, never the hot loop)."""
    if env.distributed:
        dist.barrier()


def wrap_model(
    model: nn.Module, env: Env, cfg: TrainConfig, powersgd: Any | None = None
) -> nn.Module:
    """``torch.compile`` (optional), then DDP with bucket-view gradients.

    Compile goes inside DDP, as in nanoGPT, so DDP's ``no_sync`` runs eagerly around the
    compiled module. ``static_graph`` stays off: with ``no_sync`` it crashes or silently
    skips the gradient all-reduce (pytorch#143580, accelerate#3679). Buffers are broadcast
    from rank 0 once, at wrapping, not before every forward: a forward then holds no
    collective, so a rank whose forward ran out of memory can run it again on a stand-in
    without falling out of step with the others (``train/memory/oom.py``).
    """
    if cfg.compile:
        model = torch.compile(model)
    if not env.distributed or isinstance(getattr(model, "_orig_mod", model), FSDPModule):
        return model  # sharded by train.parallel.fsdp.shard already
    ddp = DistributedDataParallel(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        find_unused_parameters=cfg.find_unused_parameters,
        forward_sync_buffers=False,
        bucket_cap_mb=cfg.bucket_cap_mb,
    )
    _register_comm_hook(ddp, cfg, powersgd)
    return ddp


def _register_comm_hook(ddp: DistributedDataParallel, cfg: TrainConfig, powersgd: Any) -> None:
    """Gradient compression (none: DDP's C++ all-reduce). bf16/fp16 from torch's own
    ``ddp_comm_hooks`` halve the bytes on the wire (bf16 needs NCCL ≥ 2.10); PowerSGD
    (``train/parallel/powersgd.py``, a ``train.parallel.powersgd.PowerSGD``) sends low-rank factors with error
    feedback after ``powersgd_start_iter`` plain steps."""
    if cfg.comm_hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif cfg.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif powersgd is not None:
        powersgd.register(ddp)


def no_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` around forward *and* backward of a micro-batch that must not
    all-reduce; a no-op for the last micro-batch and for an unwrapped model. FSDP2 gets
    ``set_requires_gradient_sync(sync)``: no reduce-scatter until the last micro-batch."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    if sync or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def derive_seed(seed: int, *parts: int | str) -> int:
    """A 32-bit seed from the config seed and a purpose (``"init"``, a rank, …): all the
    trainer's randomness flows from ``seed`` through here, never from time or pid."""
    words = [seed] + [
        p if isinstance(p, int) else int.from_bytes(p.encode(), "little") for p in parts
    ]
    return int(np.random.SeedSequence(words).generate_state(1)[0])


def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python's ``random`` and NumPy's global generator."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def use_deterministic_algorithms() -> None:
    """Make CUDA kernels deterministic (embedding backward, scatter, cuBLAS workspaces), so a
    resumed run is bitwise the uninterrupted one on GPUs too; slower, hence a config key."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    torch.use_deterministic_algorithms(True)


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every generator's state as tensors and builtins (``weights_only``-loadable)."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class StopFlag:
    """SIGTERM / SIGINT ask for a graceful stop: finish the step, checkpoint, exit 0.

    The handler only sets a flag. Ranks may get the signal at different moments, so the
    trainer sums the flag over ranks in the :class:`HostVote` that ends every step: every rank
    stops after the same step.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopFlag]:
        """Handlers active inside the ``with`` (main thread only; a no-op elsewhere)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    @property
    def local(self) -> float:
        """1.0 once this process got a signal (the value it contributes to the all-reduce)."""
        return 0.0 if self.received is None else 1.0


class HostVote:
    """One small all-reduce per step, on the host (a gloo group of its own), through which the
    ranks agree on what only one of them may know: a stop signal, a step lost to an
    out-of-memory error.

    Both are known on the host (a signal handler ran; the failing op's launch raised), so a
    vote never waits for the device, and in a job without a process group it is the local
    value. A dict gathered from every rank travels the same way when a step needs details.
    """

    def __init__(self, env: Env) -> None:
        self.world_size = env.world_size
        self.group = dist.new_group(backend="gloo") if env.distributed else None

    def sum(self, values: list[float]) -> list[float]:
        """``values`` summed over ranks (every rank calls this at the same point)."""
        if self.group is None:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor.tolist()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable, from our own ranks only), in rank order."""
        if self.group is None:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        return values
