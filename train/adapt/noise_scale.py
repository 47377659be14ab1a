"""The gradient noise scale (``train.adapt.noise_scale``): how large a batch, in valid mel frames, is
still worth its cost (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

B_simple = tr(Σ) / |G|², Σ the per-frame gradient covariance and G the true gradient. Data
parallel training measures both at almost no cost: each rank's own gradient ĝⱼ, over its nⱼ
frames, is a small-batch estimate, the all-reduced Ḡ over all N frames a large-batch one. Ranks
hold unequal frame counts, where the textbook two-batch formula is biased, so tr(Σ) comes from
the estimator weighted by each rank's count (E|ĝⱼ|² = |G|² + tr(Σ)/nⱼ):

    Ŝ = Σⱼ (|ĝⱼ|² − |Ḡ|²) / Σⱼ (1/nⱼ − 1/N),     |G|²^ = |Ḡ|² − Ŝ / N.

Both are noisy per step (|G|² most when the batch is far below B_simple), so each is smoothed
by its own bias-corrected EMA before the ratio is taken, as k-diffusion's ``gns.py`` does; the
band is ± one standard error of the ratio from the EMAs of their squares. |ĝⱼ|² is taken in a
DDP comm hook, from the gradient bucket before its all-reduce (the gradient-sync path); the
per-rank terms travel in the one small device all-reduce of step scalars (``train/trainer.py``)
and nothing is read on the host until a logging step. Under fp16 the hook's gradients carry
the loss scale, divided out here, and an overflowed step is not folded in.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from train.parallel.env import Env


class NoiseScale:
    """Per-rank gradient norms from DDP's buckets and the smoothed B_simple of the job."""

    def __init__(self, env: Env, decay: float) -> None:
        self.env, self.decay = env, decay
        device = env.device
        # Squared norm of each parameter's local gradient, summed in parameter order: a sum
        # per bucket would change in its last bits when DDP rebuilds its buckets (after its
        # first step), and a resumed run would drift from the uninterrupted one.
        self.local_sq = torch.zeros(0, dtype=torch.float64, device=device)
        self.position: dict[int, int] = {}  # id(parameter) → its place in local_sq
        self._slots: dict[tuple[int, ...], torch.Tensor] = {}  # a bucket's places, on the device
        # EMAs of Ŝ, |G|², Ŝ², |G|⁴, Ŝ·|G|², N and the weight Σ decayᵏ (bias correction).
        self.ema = torch.zeros(7, dtype=torch.float64, device=device)

    def register(self, ddp: torch.nn.Module) -> None:
        """Hook the DDP model: each bucket's local squared norms are kept before its all-reduce."""
        params = list(ddp.module.parameters())
        self.position = {id(p): i for i, p in enumerate(params)}
        self.local_sq = torch.zeros(len(params), dtype=torch.float64, device=self.env.device)
        ddp.register_comm_hook(self, noise_hook)

    def keep_bucket(self, bucket: dist.GradBucket) -> None:
        """Note the squared norms of one bucket's gradients (called by :func:`noise_hook`)."""
        places = tuple(self.position[id(p)] for p in bucket.parameters())
        if places not in self._slots:  # once per bucket layout: no copy to the device per step
            self._slots[places] = torch.tensor(places, device=self.local_sq.device)
        norms = torch._foreach_norm(bucket.gradients(), 2, dtype=torch.float64)
        self.local_sq.index_copy_(0, self._slots[places], torch.stack(norms) ** 2)

    def local_terms(
        self, frames: int, global_frames: torch.Tensor, grad_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This rank's [|ĝⱼ|², 1/nⱼ], to be summed over ranks. The hook saw this rank's
        gradient scaled as the trainer's loss is, W · Σ ∇ℓ / N, and under fp16 times the loss
        scale ``grad_scale`` (AdaptDL divides it out too); ĝⱼ = Σ ∇ℓ / nⱼ."""
        factor = global_frames / (self.env.world_size * frames)
        if grad_scale is not None:
            factor = factor / grad_scale.double()
        mean_sq = self.local_sq.sum() * factor**2
        self.discard()
        return torch.stack([mean_sq, torch.full_like(mean_sq, 1.0 / frames)])

    def update(
        self, summed: torch.Tensor, big_norm: torch.Tensor, global_frames: torch.Tensor, keep: Any
    ) -> None:
        """Fold in one step: ``summed`` = :meth:`local_terms` summed over ranks, ``big_norm`` =
        |Ḡ| (all-reduced, unclipped), ``keep`` a 0-d bool (false: a skipped step, ignored)."""
        world, big_sq = self.env.world_size, big_norm.double() ** 2
        trace = (summed[0] - world * big_sq) / (summed[1] - world / global_frames)
        grad_sq = big_sq - trace / global_frames
        now = torch.stack([trace, grad_sq, trace**2, grad_sq**2, trace * grad_sq, global_frames])
        now = torch.cat([now, torch.ones_like(now[:1])])
        blended = self.decay * self.ema + (1 - self.decay) * now
        keep = keep & torch.isfinite(now).all()
        self.ema.copy_(torch.where(keep, blended, self.ema))

    def discard(self) -> None:
        """Forget this step's local norms (a step every rank dropped)."""
        self.local_sq.zero_()

    def summary(self) -> dict[str, float]:
        """tr(Σ), |G|², B_simple and its band (host values: call at logging steps only)."""
        trace, grad_sq, trace2, grad2, cross, frames, weight = self.ema.tolist()
        if weight == 0:
            return {}
        trace, grad_sq = trace / weight, grad_sq / weight
        var_t, var_g = trace2 / weight - trace**2, grad2 / weight - grad_sq**2
        cov = cross / weight - trace * grad_sq
        # Samples the EMA averages over (Kish's effective size of geometric weights).
        n_eff = min((1 + self.decay) / (1 - self.decay), weight / (1 - self.decay))
        scale = trace / grad_sq if grad_sq > 0 else math.inf
        # Delta method: relative variance of a ratio of two correlated means.
        rel = var_t / trace**2 + var_g / grad_sq**2 - 2 * cov / (trace * grad_sq) if grad_sq else 0
        band = abs(scale) * math.sqrt(max(rel, 0.0) / max(n_eff, 1.0))
        return {
            "noise_trace": trace,
            "noise_grad_sq": grad_sq,
            "noise_scale": scale,
            "noise_scale_lo": scale - band,
            "noise_scale_hi": scale + band,
            "noise_batch": frames / weight,  # the frames per step it was measured at
        }

    def state_dict(self) -> dict[str, Any]:
        """The EMAs (equal on every rank)."""
        return {"ema": self.ema.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave."""
        self.ema.copy_(state["ema"])


def noise_hook(state: NoiseScale, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce of ``bucket`` (torch's hook), after noting its local squared norms."""
    state.keep_bucket(bucket)
    return default_hooks.allreduce_hook(None, bucket)
