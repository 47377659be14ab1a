"""Optimizer, learning-rate schedule and the exponential moving average of the weights."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from train.config.tables import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """Fused AdamW; weight decay on matrices and embeddings only, not on biases, norms or scalars.

    The fused kernel (CUDA and CPU) updates every parameter in one pass: on the tiny model on
    CPU it takes 0.9 ms a step where the default per-tensor loop takes 5.5 ms.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)


class WarmupCosine:
    """Multiplier of the peak LR: linear warm-up, cosine decay to ``min_lr``, then flat.

    A callable object rather than a lambda so that ``LambdaLR.state_dict`` stores its plain
    fields (weights_only-loadable) and a resumed run can check them.
    """

    def __init__(self, cfg: OptimConfig) -> None:
        self.warmup, self.decay = cfg.warmup_steps, cfg.decay_steps
        self.floor = cfg.min_lr / cfg.lr

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / (self.decay - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-optimizer-step schedule (see :class:`WarmupCosine`)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(cfg))


class EMA:
    """Exponential moving average of the parameters, updated on the device without syncs.

    The effective decay ramps up as ``min(decay, (1 + n) / (10 + n))`` over the first
    updates (as in TensorFlow's ``ExponentialMovingAverage``), so early weights, which are
    far from the later ones, are forgotten fast.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shadow = [p.detach().clone().float() for p in self.params]
        self.updates = 0

    @torch.no_grad()
    def update(self, trained: torch.Tensor | None = None) -> None:
        """Blend the current weights in; call after every optimizer step. ``trained``: a 0-d
        bool on the device, false for a step the optimizer skipped there (no blend then)."""
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        current = [p.detach().float() for p in self.params]
        weight = 1.0 - decay if trained is None else trained.float() * (1.0 - decay)
        torch._foreach_lerp_(self.shadow, current, weight)

    def state_dict(self) -> dict[str, Any]:
        """The averaged weights by parameter name, plus the update count."""
        return {"updates": self.updates, "shadow": dict(zip(self.names, self.shadow, strict=True))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave; names must match the model."""
        missing = sorted(set(self.names) - set(state["shadow"]))
        if missing:
            raise ValueError(f"EMA state lacks parameter {missing[0]}")
        self.updates = int(state["updates"])
        for name, tensor in zip(self.names, self.shadow, strict=True):
            tensor.copy_(state["shadow"][name])
