"""fp16 loss scaling with hysteresis and a floor (``train.amp.hysteresis``, ``train.amp.min_scale``).

torch's GradScaler halves the scale at every overflow. Megatron-LM's and DeepSpeed's dynamic
scalers back off only after ``hysteresis`` overflows (the count refills when the scale grows
again), and never below a minimum scale, so an isolated overflow costs its step but not the
next 2,000 steps' precision, and a run of them cannot drive the scale to zero. This subclass
keeps torch's unscale and skip logic and replaces only :meth:`update`, on the device as
torch's is (no host read). Each step's overflow flag is handed to the metrics, where its
window mean is the ``amp_skip_rate``; the trainer warns when it stays high. A spike skip
(``train/adapt/spikes.py``) rides on the same found-inf flag without counting as an overflow.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from train.config.train_table import TrainConfig

# Share of a logging window's steps skipped for overflow above which the trainer warns.
HIGH_SKIP_RATE = 0.05
_SPIKE = "spike"  # the spike flag's key among the per-device overflow flags, for one step


class HysteresisScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (torch's defaults) whose backoff waits for ``hysteresis``
    overflows and stops at ``min_scale``."""

    def __init__(
        self, device: str, *, enabled: bool, hysteresis: int, min_scale: float, **torch_args: Any
    ) -> None:
        super().__init__(device, enabled=enabled, **torch_args)
        self.hysteresis, self.min_scale = hysteresis, min_scale
        self._left: torch.Tensor | None = None  # overflows still allowed before a backoff
        self._left_at_start = hysteresis  # until the first update puts it on the device
        self.overflow: torch.Tensor | None = None  # the last update's flag (0-d float)

    @classmethod
    def for_run(cls, t: TrainConfig, device: torch.device, precision: str) -> HysteresisScaler:
        """The run's scaler: on under fp16 only, with ``train.amp.hysteresis`` and
        ``train.amp.min_scale``."""
        return cls(
            device.type,
            enabled=precision == "fp16",
            hysteresis=t.amp.hysteresis,
            min_scale=t.amp.min_scale,
        )

    def grad_scale(self) -> torch.Tensor | None:
        """The factor this step's gradients carry before unscaling: the scale tensor on the
        device (no host read), or ``None`` without fp16."""
        return self._scale if self._enabled else None

    def step(
        self, optimizer: torch.optim.Optimizer, *args: Any, skip: torch.Tensor | None = None
    ) -> Any:
        """torch's step, also skipped where ``skip`` (a spike: a 0-d bool on the device) is
        true: the flag joins the overflow flags the optimizer reads (fp16), or becomes the fused
        AdamW's found-inf flag (no scaling), but :meth:`update` never sees it as an overflow."""
        if skip is None:
            return super().step(optimizer, *args)
        if not self._enabled:
            optimizer.found_inf = skip.float()
            return super().step(optimizer, *args)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        found[_SPIKE] = skip.float()  # unscale_ filled the device entries before
        try:
            return super().step(optimizer, *args)
        finally:
            del found[_SPIKE]

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Megatron's rule: an overflow resets the growth count and spends one hysteresis;
        once none is left, each overflow halves the scale (not below ``min_scale``);
        ``growth_interval`` clean steps in a row double it and refill the hysteresis."""
        if not self._enabled or new_scale is not None:
            super().update(new_scale)
            return
        scale, growth = self._check_scale_growth_tracker("update")
        found = sum(
            f.to(scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for f in state["found_inf_per_device"].values()
        )
        if self._left is None:
            self._left = torch.full_like(growth, self._left_at_start)
        overflow = found > 0
        left = torch.where(overflow, self._left - 1, self._left)
        backoff = overflow & (left <= 0)
        grown = torch.where(overflow, torch.zeros_like(growth), growth + 1)
        grows = grown >= self._growth_interval
        new = torch.where(backoff, (scale * self._backoff_factor).clamp(min=self.min_scale), scale)
        scale.copy_(torch.where(grows, new * self._growth_factor, new))
        growth.copy_(torch.where(grows, torch.zeros_like(grown), grown))
        self._left.copy_(torch.where(grows, torch.full_like(left, self.hysteresis), left))
        self.overflow = overflow.float()
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def state_dict(self) -> dict[str, Any]:
        """torch's state plus the hysteresis left."""
        state = super().state_dict()
        if state:
            left = self._left_at_start if self._left is None else int(self._left)
            state["hysteresis_left"] = left
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave (a plain GradScaler's state too)."""
        state = dict(state)
        self._left_at_start = int(state.pop("hysteresis_left", self.hysteresis))
        self._left = None
        super().load_state_dict(state)
