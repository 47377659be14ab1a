"""A batch that grows: accumulation steps per optimizer step, by a ramp or by the noise scale.

The batch of a step is ``grad_accum`` micro-batches of ``data.batch_frames`` per rank, so the
frames per optimizer step move with accumulation alone; the loader's stream is the same
whatever the accumulation. Accumulation only ever rises, by integer factors (as OLMo-core's
batch-size schedule), and each rise multiplies the learning rate by √(new/old), the rule for
Adam (Malladi et al. 2022); ``optim.lr`` is the rate of the ``train.grad_accum`` batch.

- ``train.adapt.batch_ramp_steps`` > 0: from 1 micro-batch a step to ``train.grad_accum`` over
  that many steps, linear in frames per step (Megatron's ``--rampup-batch-size``), each
  accumulation the largest of the chain 1, 2, 4, … (doubling while it divides the target)
  under the line.
- ``train.adapt.batch_adaptive``: at logging steps, double accumulation (up to
  ``batch_max_accum``) when the gradient noise scale (``train/adapt/noise_scale.py``) predicts a gain
  above ``batch_gain``, then wait ``batch_cooldown`` steps. With B_noise the noise scale and
  B the batch, steps to a loss go as 1 + B_noise/B and frames as 1 + B/B_noise (McCandlish et
  al. 2018); the gain of B → kB is (steps saved) × (frames saved), k(1 + x)² / (x + k)² for x
  = B_noise / B, above 1 once x > √k. Both values come from the monitor's checkpointed EMAs,
  equal on every rank, so every rank decides alike and a resume decides as the first run did.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from train.config.train_table import TrainConfig

log = logging.getLogger(__name__)

FACTOR = 2  # the closed loop's rise


def chain(target: int) -> list[int]:
    """1, 2, 4, … while doubling divides ``target``, then ``target``: each an integer factor
    of the next."""
    steps = [1]
    while steps[-1] * 2 <= target and target % (steps[-1] * 2) == 0:
        steps.append(steps[-1] * 2)
    return steps if steps[-1] == target else [*steps, target]


def gain(noise_scale: float, batch: float, factor: int = FACTOR) -> float:
    """Predicted gain of a ``factor`` × larger batch (see the module docstring)."""
    x = noise_scale / batch
    return factor * (1 + x) ** 2 / (x + factor) ** 2


def ramp_accum(step: int, target: int, ramp_steps: int) -> int:
    """The ramp's accumulation at 0-based step ``step``: the largest of :func:`chain` under
    the line from 1 to ``target`` over ``ramp_steps`` (0: ``target`` from the start)."""
    if ramp_steps == 0:
        return target
    line = 1 + (target - 1) * min(1.0, step / ramp_steps)
    return max(a for a in chain(target) if a <= line + 1e-9)


class BatchSchedule:
    """The accumulation of each step and the learning-rate rescaling that goes with it."""

    def __init__(
        self,
        cfg: TrainConfig,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ) -> None:
        self.cfg, self.optimizer, self.scheduler = cfg, optimizer, scheduler
        self.accum = self._ramp(0)
        self.raised_at = 0  # the step of the closed loop's last rise
        self._scale_lr(self.accum / cfg.grad_accum)

    def accum_for(self, step: int) -> list[dict[str, Any]]:
        """Set :attr:`accum` for step ``step`` + 1 (the ramp); a record if it changed."""
        ramp = self._ramp(step)
        if ramp <= self.accum:
            return []
        return [self._change(step, ramp, "ramp")]

    def observe(self, step: int, values: dict[str, float]) -> list[dict[str, Any]]:
        """The closed loop, at a logging step (``values``: its summary); a record if it rose."""
        if not self.cfg.adapt.batch_adaptive or step % self.cfg.log_every:
            return []
        noise, batch = values.get("noise_scale"), values.get("noise_batch")
        cooled = step - self.raised_at >= self.cfg.adapt.batch_cooldown
        room = self.accum * FACTOR <= self.cfg.adapt.batch_max_accum
        if noise is None or not batch or not math.isfinite(noise) or not (cooled and room):
            return []
        predicted = gain(noise, batch)
        if predicted <= self.cfg.adapt.batch_gain:
            return []
        self.raised_at = step
        record = self._change(step, self.accum * FACTOR, "noise scale")
        record.update(noise_scale=noise, frames_per_step=batch, gain=predicted)
        return [record]

    def _ramp(self, step: int) -> int:
        return ramp_accum(step, self.cfg.grad_accum, self.cfg.adapt.batch_ramp_steps)

    def _change(self, step: int, accum: int, why: str) -> dict[str, Any]:
        before, self.accum = self.accum, accum
        self._scale_lr(accum / before)
        log.info("step %d: %d micro-batches a step, not %d (%s)", step + 1, accum, before, why)
        return {"event": "batch_size", "accum_before": before, "accum": accum, "why": why}

    def _scale_lr(self, ratio: float) -> None:
        """Learning rate × √ratio, in the schedule's peak (checkpointed with it) and now."""
        factor = math.sqrt(ratio)
        if factor == 1.0:
            return
        self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:  # set by the scheduler at its construction
                group["initial_lr"] *= factor

    def state_dict(self) -> dict[str, Any]:
        """The accumulation and the last rise (the learning rate is the scheduler's)."""
        return {"accum": self.accum, "raised_at": self.raised_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave (after the scheduler's state)."""
        self.accum, self.raised_at = int(state["accum"]), int(state["raised_at"])
