"""Gradient clipping by a fixed or an adaptive norm (``optim.clip``), on the device, no host reads.

- ``"norm"``: at ``optim.grad_clip`` (0: off), torch's ``clip_grad_norm_``.
- ``"zclip"`` (Kumar et al. 2025, ZClip): the z-score of the norm against an EMA of past
  norms' mean and variance (α ``zclip_alpha``); a norm with z above ``zclip_z`` is scaled
  down to μ + (z_thr² / z)·σ (their reciprocal rule), and the clipped norm enters the EMA.
  The first ``zclip_warmup`` steps only collect norms (their mean and variance start the EMA).
- ``"autoclip"`` (Seetharaman et al. 2020, AutoClip): at the ``autoclip_percentile``-th
  percentile of the norms seen so far (the last ``autoclip_window`` of them, the current
  one included).

``optim.grad_clip`` stays a ceiling under the adaptive rules. A step skipped as a spike
(``train/adapt/spikes.py``) leaves the adaptive state as it was. Written here rather than taken
from the ZClip and AutoClip packages: both read the norm on the host every step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from melcache.errors import UserError
from train.config.tables import OptimConfig

_EPS = 1e-6  # torch's clip_grad_norm_ adds the same to the norm


class GradClip:
    """Take the global gradient norm and clip to the rule of ``optim.clip``."""

    def __init__(self, cfg: OptimConfig, device: torch.device, *, sharded: bool) -> None:
        self.mode, self.ceiling = cfg.clip, cfg.grad_clip or math.inf
        if sharded and self.mode != "norm":
            raise UserError(
                f'optim.clip = "{self.mode}" is not available with train.parallel.strategy fsdp2/hsdp '
                '(sharded gradients): use optim.clip = "norm"'
            )
        self.cfg = cfg
        self._norm: torch.Tensor | None = None  # the last total_norm as torch computed it
        self._model: nn.Module | None = None  # whose parameters ``_params`` lists
        self._params: list[nn.Parameter] = []
        self._with_grads: list[nn.Parameter] = []  # those with a gradient at the last total_norm
        zero = torch.zeros((), dtype=torch.float64, device=device)
        # zclip: steps seen, then Σ norm and Σ norm² in warm-up, mean and variance after it.
        self.state = {"steps": zero.clone(), "first": zero.clone(), "second": zero.clone()}
        if self.mode == "autoclip":
            self.state["norms"] = torch.full(
                (cfg.autoclip_window,), math.nan, dtype=torch.float64, device=device
            )

    def total_norm(self, model: nn.Module) -> torch.Tensor:
        """The unclipped global norm of the gradients (a plain tensor, equal on every rank)."""
        if model is not self._model:  # listed once: walking the modules costs as much as the norm
            self._model, self._params = model, list(model.parameters())
        self._with_grads = [p for p in self._params if p.grad is not None]
        grads = [p.grad for p in self._with_grads]
        self._norm = torch.nn.utils.get_total_norm(grads, foreach=True)  # DTensor under FSDP2
        return self._norm.full_tensor() if isinstance(self._norm, DTensor) else self._norm

    def clip(self, model: nn.Module, norm: torch.Tensor, skip: torch.Tensor | None) -> None:
        """Scale the gradients down to this step's limit; a trained step (``skip`` false or
        ``None``) updates the adaptive state. Call right after :meth:`total_norm` of ``model``."""
        assert model is self._model, "clip() follows total_norm() of the same model"
        params = self._with_grads
        if self.mode == "norm":
            if math.isfinite(self.ceiling):
                torch.nn.utils.clip_grads_with_norm_(params, self.ceiling, self._norm, foreach=True)
            return
        keep = torch.ones((), dtype=torch.bool, device=norm.device) if skip is None else ~skip
        limit = self._zclip(norm.double(), keep) if self.mode == "zclip" else self._auto(norm, keep)
        limit = torch.clamp(limit, max=self.ceiling)
        coef = torch.clamp(limit / (norm.double() + _EPS), max=1.0).to(norm.dtype)
        torch._foreach_mul_([p.grad for p in params], coef)

    def _zclip(self, norm: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        s, alpha, z_max = self.state, self.cfg.zclip_alpha, self.cfg.zclip_z
        warm = s["steps"] < self.cfg.zclip_warmup
        mean, var = s["first"], s["second"]
        std = var.clamp(min=0).sqrt()
        z = (norm - mean) / (std + _EPS)
        limit = torch.where(z > z_max, mean + (z_max**2 / z) * std, norm)
        limit = torch.where(warm, torch.full_like(norm, math.inf), limit)
        clipped = torch.minimum(norm, limit)
        # Warm-up sums; at its last step they turn into the mean and variance.
        steps = s["steps"] + 1
        first_w, second_w = s["first"] + norm, s["second"] + norm**2
        ends = steps == self.cfg.zclip_warmup
        w_mean = first_w / steps
        first_w = torch.where(ends, w_mean, first_w)
        second_w = torch.where(ends, (second_w / steps - w_mean**2).clamp(min=0), second_w)
        e_mean = alpha * mean + (1 - alpha) * clipped
        e_var = alpha * var + (1 - alpha) * (clipped - e_mean) ** 2
        new = {
            "steps": steps,
            "first": torch.where(warm, first_w, e_mean),
            "second": torch.where(warm, second_w, e_var),
        }
        for key, value in new.items():
            s[key].copy_(torch.where(keep & torch.isfinite(norm), value, s[key]))
        return limit

    def _auto(self, norm: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        s = self.state
        slot = (s["steps"].long() % self.cfg.autoclip_window).reshape(1)
        norms = s["norms"].clone()
        norms.index_copy_(0, slot, norm.double().reshape(1))
        limit = torch.nanquantile(norms, self.cfg.autoclip_percentile / 100)
        use = keep & torch.isfinite(norm)
        s["norms"].copy_(torch.where(use, norms, s["norms"]))
        s["steps"].add_(use.double())
        return limit

    def state_dict(self) -> dict[str, Any]:
        """The adaptive state as CPU tensors (equal on every rank)."""
        return {key: value.cpu() for key, value in self.state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave (for the same ``optim.clip``)."""
        if set(state) != set(self.state):
            raise ValueError(f'clipping state for another optim.clip, not "{self.mode}"')
        for key, value in state.items():
            if value.shape != self.state[key].shape:
                raise ValueError(f"{key} of {tuple(value.shape)}, not optim.autoclip_window")
            self.state[key].copy_(value)
