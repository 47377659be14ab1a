"""First-step checks of a plugged-in model: collectives in its forward, what it returns, which
parameters its loss leaves without a gradient; and DDP's unused-parameter error in names.

Why collectives matter: out-of-memory recovery (``train/memory/oom.py``) reruns a forward on one rank
only (a stand-in pass), so a collective inside a forward (``vector_quantize_pytorch``'s
k-means statistics, a SyncBatchNorm) leaves the ranks out of step and gloo or NCCL abort the
run, long after the start. The first forward of every run is therefore watched: torch routes
every ``torch.distributed`` collective through the dispatcher as a ``c10d`` op, which a
``TorchDispatchMode`` sees whichever way the model calls it.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from melcache.errors import UserError, user_code_error
from train.model.contract import check_outputs

log = logging.getLogger(__name__)

_FIX = (
    "compute such statistics outside the training forward (or in eval mode), or set "
    "train.parallel.allow_forward_collectives = true (which turns out-of-memory recovery off)"
)


class _CountCollectives(TorchDispatchMode):
    """Counts ``c10d`` ops, each against the innermost module running when it was called."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack, self.seen = stack, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.seen[
                (self.stack[-1] if self.stack else "<root>", func.overloadpacket.__name__)
            ] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_collectives(model: nn.Module) -> Iterator[Counter]:
    """Inside: every collective called, counted per (module name, op)."""
    names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    stack: list[str] = []

    def enter(module: nn.Module, args: Any) -> None:
        if id(module) in names:
            stack.append(names[id(module)])

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in names and stack:
            stack.pop()

    mode = _CountCollectives(stack)
    hooks = [
        nn.modules.module.register_module_forward_pre_hook(enter),
        nn.modules.module.register_module_forward_hook(leave),
    ]
    try:
        with mode:
            yield mode.seen
    finally:
        for hook in hooks:
            hook.remove()


class FirstStep:
    """The checks of a run's first step; later steps pass through untouched."""

    def __init__(
        self, model: nn.Module, impl: str, *, allow_collectives: bool, unused: bool, compiled: bool
    ) -> None:
        self.model, self.impl = model, impl
        self.allow_collectives, self.allow_unused = allow_collectives, unused
        # Dynamo does not trace through a Python dispatch mode: a compiled run is not watched.
        self.pending_forward = not (compiled or allow_collectives)
        if compiled and not allow_collectives:
            log.info("train.compile = true: the first forward is not watched for collectives")
        self.pending_backward = True

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around the model call: on the first one, refuse collectives (unless allowed)."""
        if not self.pending_forward:
            yield
            return
        self.pending_forward = False
        with count_collectives(self.model) as seen:
            yield
        if seen:
            found = ", ".join(f"{op} ×{n} in module {where!r}" for (where, op), n in seen.items())
            raise UserError(
                f"{self.impl}'s training forward calls torch.distributed collectives ({found}): "
                f"out-of-memory recovery would leave the ranks out of step; {_FIX}"
            )

    def failed(self, exc: Exception, batch: Any, step: int) -> UserError:
        """The model's own code raised ``exc`` in its forward: one line naming the model and
        the batch, then the model's own frames (:func:`melcache.errors.user_code_error`)."""
        given = f"bucket {batch.bucket}, first key {batch.keys[0]!r}, mel {list(batch.mel.shape)}"
        return user_code_error(f"{self.impl} failed in its forward at step {step} ({given})", exc)

    def outputs(self, out: Any) -> None:
        """The first forward's outputs, checked (:func:`train.model.contract.check_outputs`)."""
        if self.pending_backward:
            check_outputs(out, self.impl)

    def gradients(self) -> None:
        """After the first step's backward: name parameters without a gradient (DDP would
        otherwise fail at the next step, naming indices, and one process never at all)."""
        if not self.pending_backward:
            return
        self.pending_backward = False
        missing = [
            n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is None
        ]
        if missing and not self.allow_unused:
            raise UserError(
                f"{self.impl}: parameters got no gradient from the loss: {_names(missing)}; make "
                "the loss use them, freeze them (requires_grad = False), or set "
                "train.parallel.find_unused_parameters = true"
            )


def translate_ddp_error(exc: RuntimeError, model: nn.Module) -> Exception:
    """DDP's "did not receive grad" error with parameter names instead of indices."""
    found = re.search(r"did not receive grad for rank (\d+): ([\d ,]+)", str(exc))
    if found is None:
        return exc
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    indices = [int(i) for i in re.findall(r"\d+", found.group(2))]
    names = [trainable[i] for i in indices if i < len(trainable)]
    return UserError(
        f"DDP: parameters got no gradient on rank {found.group(1)} in the last step: "
        f"{_names(names)}; make the loss use them every step, freeze them, or set "
        "train.parallel.find_unused_parameters = true"
    )


def _names(names: list[str], shown: int = 8) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
