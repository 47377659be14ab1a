"""What a step measures after its backward, in one place for the trainer: the gradient norm,
clipping (``train/optim/clipping.py``), spike skips (``train/adapt/spikes.py``) and the noise scale
(``train/adapt/noise_scale.py``). The spike decision needs the global loss and the monitor the per-rank
gradient norms: both travel in one all-reduce of a few scalars on the device, none is read on
the host, and the run pays for it only with one of them on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from train.adapt.noise_scale import NoiseScale
from train.adapt.spikes import SpikeSkipper
from train.config.tables import Config
from train.optim.clipping import GradClip
from train.parallel.env import Env, all_reduce_sum


class StepMeasures:
    """The clipping rule, and the spike skipper and noise-scale monitor when configured."""

    def __init__(self, cfg: Config, env: Env, *, sharded: bool) -> None:
        self.env = env
        self.clipper = GradClip(cfg.optim, env.device, sharded=sharded)
        t = cfg.train
        self.spikes = SpikeSkipper(t, env) if t.adapt.skip_spikes else None
        self.monitor = NoiseScale(env, t.adapt.noise_scale_ema) if t.adapt.noise_scale else None

    def register(self, model: nn.Module) -> None:
        """Hook the DDP model for the monitor's per-rank norms (a no-op without it or DDP)."""
        if self.monitor is not None and self.env.distributed:
            self.monitor.register(model)

    def measure(
        self,
        model: nn.Module,
        loss_share: torch.Tensor,
        frames: int,
        global_frames: torch.Tensor,
        grad_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the backward (and unscaling): the unclipped global norm and this step's
        spike flag (``None`` without ``train.adapt.adapt.skip_spikes``); the gradients are clipped and the
        noise scale folded in. ``loss_share``: this rank's share of the global loss;
        ``frames``: its valid frames of the step, ``global_frames`` all ranks';
        ``grad_scale``: fp16's loss scale, which the monitor's per-rank norms still carry."""
        norm = self.clipper.total_norm(model)
        skip, scalars = None, [loss_share.detach().double().reshape(1)]
        if self.monitor is not None:
            scalars.append(self.monitor.local_terms(frames, global_frames, grad_scale))
        if self.spikes is not None or self.monitor is not None:
            summed = all_reduce_sum(torch.cat(scalars), self.env)
            if self.spikes is not None:
                skip = self.spikes.decide(summed[0], norm)
            if self.monitor is not None:
                keep = torch.isfinite(norm) if skip is None else ~skip
                self.monitor.update(summed[1:], norm, global_frames, keep)
        self.clipper.clip(model, norm, skip)
        return norm, skip

    def spike_vote(self) -> float:
        """This rank's share of the host vote: the last step's spike flag (0 without)."""
        return 0.0 if self.spikes is None else self.spikes.vote_value()

    def settle(self, votes: float, step: int) -> list[dict[str, Any]]:
        """Count the last step's spike skip if the ranks voted one; its records (the
        metrics window counted it on the device already: ``Meter.drop_step``)."""
        return [] if self.spikes is None else self.spikes.settle(votes, step)

    @property
    def rewind_due(self) -> bool:
        """Whether ``train.adapt.spike_rewind_after`` spikes in a row call for a rewind."""
        return self.spikes is not None and self.spikes.rewind_due

    def dropped(self) -> None:
        """A step every rank dropped (out of memory): forget its per-rank norms."""
        if self.monitor is not None:
            self.monitor.discard()

    def summary(self) -> dict[str, float]:
        """The noise scale's logged values (host reads: logging steps only) and the rewinds
        so far (with ``train.adapt.spike_rewind_after``)."""
        values = {} if self.monitor is None else self.monitor.summary()
        if self.spikes is not None and self.spikes.rewind_after:
            values["rewinds"] = self.spikes.rewinds
        return values

    def state_dict(self) -> dict[str, Any]:
        """Entries of the shared checkpoint (equal on every rank); flush the spike vote first."""
        state: dict[str, Any] = {"clip": self.clipper.state_dict()}
        if self.spikes is not None:
            state["spikes"] = self.spikes.state_dict()
        if self.monitor is not None:
            state["noise_scale"] = self.monitor.state_dict()
        return state

    def load_state_dict(self, shared: dict[str, Any]) -> None:
        """Restore from the shared checkpoint what :meth:`state_dict` put there (older
        checkpoints hold none of it; a part turned on since starts fresh)."""
        if "clip" in shared:
            self.clipper.load_state_dict(shared["clip"])
        if self.spikes is not None and "spikes" in shared:
            self.spikes.load_state_dict(shared["spikes"])
        if self.monitor is not None and "noise_scale" in shared:
            self.monitor.load_state_dict(shared["noise_scale"])
