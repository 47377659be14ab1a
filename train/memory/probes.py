"""How ``train tune`` measures a trial's peak memory: on CUDA the capped caching allocator
(:class:`CudaProbe`); on CPU, and on every rank under torchrun, :class:`MemoryCap`, which
counts live tensor bytes op by op and raises ``torch.OutOfMemoryError`` past a cap, as a GPU
would (:class:`CapProbe`), the ranks agreeing on the verdict so that none is left waiting in
a collective."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from train.parallel.env import Env

MIB = 2**20


# The dispatcher namespaces of torch.distributed's collectives (eager and functional).
COLLECTIVES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}


class MemoryCap(TorchDispatchMode):
    """Live tensor bytes, counted op by op; ``torch.OutOfMemoryError`` past ``limit_bytes``.

    Every tensor an op returns that does not share storage with its inputs is a new
    allocation; a finaliser on its storage takes it off the count when the storage is freed.
    ``baseline_bytes`` stands for tensors that existed before (model, optimizer state). A
    CPU stand-in for a GPU's memory: it raises where a GPU would run out.

    With ``agree`` (the largest of every rank's value, under torchrun) it raises only where
    every rank is at the same point: before each collective and at :meth:`settle`, when any
    rank is past its cap. A rank that raised alone would leave the others waiting in FSDP2's
    next all-gather.
    """

    def __init__(
        self,
        limit_bytes: float,
        baseline_bytes: int = 0,
        *,
        device: str = "cpu",
        agree: Callable[[float], float] | None = None,
    ) -> None:
        super().__init__()
        self.limit, self.device, self.agree = limit_bytes, device, agree
        self.current = self.peak = baseline_bytes
        self.over = self.raised = False  # this rank is past the cap; the cap raised
        self._live: dict[int, int] = {}  # storage address → bytes

    def reset_peak(self) -> None:
        """Start a new trial: a new peak from what is live now."""
        self.peak = self.current
        self.over = self.raised = False

    def settle(self) -> None:
        """Under ``agree``: raise on every rank if any rank went past its cap (every rank
        calls this at the same point, outside the mode)."""
        if self.agree is not None and self.agree(float(self.over)) > 0:
            self._raise()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.agree is not None and func.namespace in COLLECTIVES:
            self.settle()  # every rank reaches this collective: all raise here, or none
        out = func(*args, **(kwargs or {}))
        inputs = {_address(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device:
                self._count(_local(tensor), inputs)
        return out

    def _count(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or address in inputs or address in self._live:
            return
        self._live[address] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, address)
        if self.current > self.limit:
            self.over = True
            if self.agree is None:
                self._raise()

    def _raise(self) -> None:
        self.raised = True
        raise torch.OutOfMemoryError(
            f"out of memory (cap): {self.peak / MIB:.1f} MiB of live tensors > "
            f"{self.limit / MIB:.1f} MiB{'' if self.agree is None else ' on some rank'}"
        )

    def _free(self, address: int) -> None:
        self.current -= self._live.pop(address)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and their optimizer state), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _address(tensor: torch.Tensor) -> int:
    return _local(tensor).untyped_storage().data_ptr()


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's: its local shard's)."""
    seen = {_address(t): _local(t).untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def agreement(env: Env) -> Callable[[float], float] | None:
    """Under torchrun: the largest of every rank's value, on a gloo group of its own (it runs
    between the training collectives); None in one process."""
    if not env.distributed:
        return None
    group = dist.new_group(backend="gloo")

    def largest(value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return tensor.item()

    return largest


class CudaProbe:
    """The caching allocator capped at ``fraction`` of the device; peaks from torch.cuda."""

    def __init__(self, device: torch.device, fraction: float) -> None:
        self.device = device
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        self.limit = fraction * torch.cuda.get_device_properties(device).total_memory

    @contextmanager
    def measure(self) -> Iterator[None]:
        torch.cuda.empty_cache()  # a failed trial's blocks must not crowd the next one
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        torch.cuda.synchronize(self.device)

    @property
    def peak(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    raised = False  # its errors come from the allocator


class CapProbe:
    """:class:`MemoryCap` around each trial, counting from the trainer's tensors; under
    torchrun the ranks agree on the verdict and the peak is the largest rank's."""

    def __init__(self, cap: MemoryCap) -> None:
        self.cap, self.limit, self.peak = cap, cap.limit, 0.0

    @property
    def raised(self) -> bool:
        """Whether the cap (not some other error) ended the last trial."""
        return self.cap.raised

    @contextmanager
    def measure(self) -> Iterator[None]:
        gc.collect()  # a failed trial's tensors in reference cycles leave the count now
        self.cap.reset_peak()
        with self.cap:
            yield
        self.cap.settle()  # past the last collective (the optimizer step)
        agree = self.cap.agree
        self.peak = self.cap.peak if agree is None else agree(self.cap.peak)
