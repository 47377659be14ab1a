"""Spike skips (``train.adapt.skip_spikes``): a step whose loss or gradient norm is far above its
recent past trains nothing, on every rank, without the host waiting for the device.

As in OLMo-core: a step is a spike when its global loss or its (all-reduced, unclipped)
gradient norm exceeds the mean of the last ``spike_window`` trained steps by more than
``spike_sigma`` standard deviations, once ``spike_min_history`` steps are in the window; a
non-finite loss or norm is a spike too (not with fp16, whose scaler skips those). Both
inputs are equal on every rank, so every rank decides alike on its own device: the decision
is a 0-d tensor handed to the fused AdamW as its ``found_inf`` flag (the update, and its step
count, are skipped on the device; under fp16 through the scaler, ``train/optim/scaler.py``) and to
the EMA and PowerSGD, which keep their state.

The host learns of the skip one step later, through the per-step :class:`HostVote` the ranks
already hold (no extra synchronisation: the flag of step N is read after step N + 1's
backward was launched, by when the device is long done with step N); :meth:`flush` votes the
last flag before a checkpoint. There the skip is counted and logged like an out-of-memory
skip, and a vote that is not unanimous (ranks that disagree: a bug) ends the run.

With ``train.adapt.spike_rewind_after = N``, N spike skips in a row (steps that ran out of memory
in between do not break the streak) make :attr:`SpikeSkipper.rewind_due` true: the trainer
then goes back to the last checkpoint (``train/run/resume.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from train.config.train_table import TrainConfig
from train.parallel.env import Env

log = logging.getLogger(__name__)

# What the lagged host copy holds, in order: the flag, then the numbers its record reports
# (not "loss": metrics.jsonl's readers take records with a loss for logged windows).
_FIELDS = ("spike", "step_loss", "step_grad_norm", "loss_mean", "loss_std", "norm_mean", "norm_std")


class SpikeSkipper:
    """Windows of past losses and gradient norms on the device, and the spikes voted so far."""

    def __init__(self, cfg: TrainConfig, env: Env) -> None:
        self.sigma, self.window = cfg.adapt.spike_sigma, cfg.adapt.spike_window
        self.min_history = cfg.adapt.spike_min_history
        self.fp16 = cfg.precision == "fp16"  # "auto" is never fp16
        self.env = env
        device = env.device
        self.values = torch.zeros(2, self.window, dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.long, device=device)  # trained steps seen
        self.skipped = 0  # spikes voted (host)
        self.rewind_after = cfg.adapt.spike_rewind_after
        self.streak = 0  # spikes voted in a row
        self.rewinds = 0
        self._pending: _HostCopy | None = None  # the last step's _FIELDS, on the host

    def decide(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """Whether this step is a spike (0-d bool on the device); a trained step enters the
        window. ``loss`` and ``norm`` must be equal on every rank."""
        now = torch.stack([loss.double(), norm.double()])
        filled = torch.clamp(self.count, max=self.window)
        valid = (torch.arange(self.window, device=now.device) < filled).double()
        mean = (self.values * valid).sum(1) / filled.clamp(min=1)
        var = (((self.values - mean[:, None]) * valid) ** 2).sum(1) / (filled - 1).clamp(min=1)
        std = var.sqrt()
        ready = filled >= self.min_history
        finite = torch.isfinite(now).all()
        spike = ready & (now > mean + self.sigma * std).any()
        # Not finite: fp16's overflow, which its scaler skips and counts; a spike otherwise.
        spike = spike & finite if self.fp16 else spike | ~finite
        trained = ~spike & finite
        slot = (self.count % self.window).reshape(1)
        kept = torch.where(trained, now, self.values.index_select(1, slot)[:, 0])
        self.values.index_copy_(1, slot, kept[:, None])
        self.count += trained.long()
        fields = torch.stack([spike.double(), *now, mean[0], std[0], mean[1], std[1]])
        self._pending = _HostCopy(fields)
        return spike

    def vote_value(self) -> float:
        """This rank's flag of the last step not yet voted (0 if none): its share of the vote."""
        return 0.0 if self._pending is None else self._pending.read()[0]

    def settle(self, votes: float, step: int) -> list[dict[str, Any]]:
        """Count the last step's spike if the ranks voted one (``votes``: flags summed over
        ranks, at ``step``, the step it was decided in); its record for metrics.jsonl."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        if votes == 0:
            self.streak = 0
            return []
        if votes != self.env.world_size:
            raise RuntimeError(
                f"step {step}: {votes:g} of {self.env.world_size} ranks saw a loss spike; the "
                "ranks' losses and gradient norms should be equal (a bug)"
            )
        self.skipped += 1
        self.streak += 1
        record = {"event": "spike", "step": step}
        record.update(zip(_FIELDS[1:], pending.read()[1:], strict=True))
        if self.env.is_main:
            log.warning(
                "step %d skipped: loss %.4g (window %.4g ± %.3g), grad norm %.4g (%.4g ± %.3g)",
                step, record["step_loss"], record["loss_mean"], record["loss_std"],
                record["step_grad_norm"], record["norm_mean"], record["norm_std"],
            )  # fmt: skip
        return [record]

    @property
    def rewind_due(self) -> bool:
        """Whether the spikes voted in a row reached ``train.adapt.spike_rewind_after``."""
        return 0 < self.rewind_after <= self.streak

    def rewound(self, skipped: int, rewinds: int) -> None:
        """After a rewind restored this skipper from a checkpoint: the streak is over, and the
        counts of the run go on from ``skipped`` and ``rewinds`` (before it), the rewind counted."""
        self.streak, self.skipped, self.rewinds = 0, skipped, rewinds + 1

    def state_dict(self) -> dict[str, Any]:
        """The windows and counters (equal on every rank); the caller flushes first."""
        return {
            "values": self.values.cpu(),
            "count": int(self.count),
            "skipped": self.skipped,
            "streak": self.streak,
            "rewinds": self.rewinds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave; the window length must match."""
        values = state["values"]
        if tuple(values.shape) != tuple(self.values.shape):
            raise ValueError(
                f"spike window of {values.shape[1]} steps, not train.adapt.spike_window = {self.window}"
            )
        self.values.copy_(values)
        self.count.fill_(int(state["count"]))
        self.skipped = int(state["skipped"])
        # Checkpoints from before rewinds hold neither count.
        self.streak, self.rewinds = int(state.get("streak", 0)), int(state.get("rewinds", 0))
        self._pending = None  # a flag of a step the restored state never saw


class _HostCopy:
    """A device tensor's copy on the host that does not block: on CUDA, pinned memory filled
    by an async copy, waited for when read (a step later: long done); on CPU, the tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event = None
        self.tensor = tensor
        if tensor.device.type == "cuda":
            self.tensor = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.tensor.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> list[float]:
        """The values (waits for the copy on CUDA)."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensor.tolist()
