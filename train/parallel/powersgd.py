"""PowerSGD gradient compression (Vogels et al., 2019) as a DDP communication hook.

Written here rather than taken from torch's ``powerSGD_hook`` (see docs/training.md, PowerSGD
compression) because that one, in torch 2.14.1:

- hangs on gloo once two buckets are in flight: its ``then`` callbacks block in
  ``fut.wait()`` on the gloo worker threads the next collective needs;
- keys its error and warm-start memory by DDP bucket index, which changes across restarts
  (a new DDP runs its first step with one bucket), so its state cannot be resumed;
- pickles that state, which ``torch.load(weights_only=True)`` refuses.

Here every collective runs in the hook itself, on the thread DDP calls it from, and the hook
returns a completed future: nothing waits inside a callback, on gloo or NCCL (where a
blocking ``all_reduce`` only makes the stream wait, not the host). Memory is keyed by
parameter name and per rank, saved as plain tensors. :meth:`PowerSGD.settle` rolls this
step's memory back when its gradients were not finite (an fp16 overflow), on the device.

The factors are computed from a fresh copy of each gradient, never from its view in DDP's
bucket (``gradient_as_bucket_view``): a resumed process runs its first step on DDP's initial
one-bucket layout while an uninterrupted one is on the rebuilt layout, so the same gradient
sits at another offset, and CPU GEMM kernels round ``view @ Q`` differently when the view is
not 16-byte aligned (seen on AMD EPYC, torch 2.14.1). A fresh tensor is always aligned.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from train.config.train_table import TrainConfig
from train.parallel.env import Env
from train.parallel.rng import derive_seed

# A matrix is compressed when rank-r factors are at least this many times smaller (torch's
# default): small matrices and every vector are all-reduced exactly.
MIN_COMPRESSION = 2.0


class PowerSGD:
    """Error-feedback and warm-start memory of one rank, and the step counter."""

    def __init__(self, model: nn.Module, *, rank: int, start_iter: int, seed: int) -> None:
        self.names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
        self.rank, self.start_iter, self.seed = rank, start_iter, seed
        self.iter = 0  # backward passes that all-reduced (optimizer steps, skipped ones too)
        self.error: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self.buckets = 0  # buckets seen in the last compressed step (for tests and logs)
        self._before: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def for_run(cls, model: nn.Module, env: Env, cfg: TrainConfig) -> "PowerSGD | None":
        """The state for ``comm_hook = "powersgd"`` under torchrun, else None."""
        if cfg.parallel.comm_hook != "powersgd" or not env.distributed:
            return None
        seed = derive_seed(cfg.seed, "powersgd")
        return cls(
            model,
            rank=cfg.parallel.powersgd_rank,
            start_iter=cfg.parallel.powersgd_start_iter,
            seed=seed,
        )

    def register(self, ddp: nn.Module) -> None:
        """Make this state and :func:`powersgd_hook` ``ddp``'s communication hook."""
        ddp.register_comm_hook(self, powersgd_hook)

    def compressible(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is sent as rank-r factors rather than whole."""
        if grad.dim() < 2:
            return False
        n, m = grad.shape[0], grad.numel() // grad.shape[0]
        r = min(n, m, self.rank)
        return n * m >= MIN_COMPRESSION * r * (n + m)

    def elements_sent(self, grads: list[torch.Tensor]) -> int:
        """Elements one rank all-reduces per step for ``grads`` once compression is on: the
        closed form the communication model and its test check the hook against."""
        sent = 0
        for g in grads:
            if self.compressible(g):
                n, m = g.shape[0], g.numel() // g.shape[0]
                sent += min(n, m, self.rank) * (n + m)
            else:
                sent += g.numel()
        return sent

    def settle(self, finite: torch.Tensor) -> None:
        """Keep this step's memory if ``finite`` (a 0-d bool tensor on the device), else put
        back the memory from before it; no host read."""
        for name, (error, q) in self._before.items():
            self.error[name] = torch.where(finite, self.error[name], error)
            self.q[name] = torch.where(finite, self.q[name], q)
        self._before = {}

    def roll_back(self) -> None:
        """Put back the memory from before this step (a step every rank dropped)."""
        for name, (error, q) in self._before.items():
            self.error[name], self.q[name] = error, q
        self._before = {}

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors by parameter name (``weights_only``-loadable), this rank's own."""
        return {"iter": self.iter, "buckets": self.buckets, "error": self.error, "q": self.q}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave; names must be this model's parameters."""
        unknown = sorted((set(state["error"]) | set(state["q"])) - set(self.names.values()))
        if unknown:
            raise ValueError(f"PowerSGD state names parameter {unknown[0]}, not in this model")
        self.iter, self.buckets = int(state["iter"]), int(state["buckets"])
        self.error, self.q = dict(state["error"]), dict(state["q"])

    def _initial_q(self, name: str, m: int, r: int, like: torch.Tensor) -> torch.Tensor:
        """Random Q, the same on every rank, from the seed and the parameter's name."""
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "powersgd", name))
        return torch.randn(m, r, generator=generator, dtype=like.dtype).to(like.device)


def powersgd_hook(state: PowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: plain mean all-reduce for ``start_iter`` steps, then PowerSGD with
    error feedback and warm start, one power iteration per step, two collectives a bucket."""
    buffer, world = bucket.buffer(), dist.get_world_size()
    if state.iter < state.start_iter:
        buffer.div_(world)
        dist.all_reduce(buffer)
    else:
        _compress_and_reduce(state, bucket, world)
    if bucket.is_last():
        state.iter += 1
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


def _compress_and_reduce(state: PowerSGD, bucket: dist.GradBucket, world: int) -> None:
    names = [state.names[id(p)] for p in bucket.parameters()]
    grads = dict(zip(names, bucket.gradients(), strict=True))
    state.buckets = bucket.index() + 1 if bucket.is_last() else state.buckets
    exact = [g for g in grads.values() if not state.compressible(g)]
    matrices, qs = {}, {}
    for name, g in grads.items():
        if not state.compressible(g):
            continue
        view = g.view(g.shape[0], -1)
        error = state.error.get(name)
        if error is None:
            error = torch.zeros_like(view)
        q = state.q.get(name)
        if q is None:
            q = state._initial_q(name, view.shape[1], min(*view.shape, state.rank), view)
        state._before[name] = (error, q)
        matrices[name] = view.add(error)  # a fresh, aligned matrix: see the module docstring
        qs[name] = _orthonormal(q)
    ps = {name: matrices[name] @ qs[name] for name in matrices}
    # One all-reduce for the exact tensors and the P factors, one for the Q factors.
    first = _flat([*exact, *ps.values()])
    if first.numel():  # the same on every rank: buckets and shapes are
        dist.all_reduce(first)
    _unflat(first, [*exact, *ps.values()])
    for g in exact:
        g.div_(world)
    for name, m in matrices.items():
        ps[name] = _orthonormal(ps[name])
        qs[name] = m.t() @ ps[name]
    second = _flat(list(qs.values()))
    if second.numel():
        dist.all_reduce(second)
    _unflat(second.div_(world), list(qs.values()))
    for name, m in matrices.items():
        approximation = ps[name] @ qs[name].t()
        grads[name].view_as(approximation).copy_(approximation)
        state.error[name] = m.sub_(approximation)
        state.q[name] = qs[name]


def _orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``matrix``'s (reduced QR)."""
    return torch.linalg.qr(matrix, mode="reduced").Q


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.empty(0)  # nothing to send; never reaches a collective
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
