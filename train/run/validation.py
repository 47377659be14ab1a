"""Validation every ``train.validation.every`` steps on a second cache (``[data] val_shards`` or
``--val-shards``).

The set is fixed: at start each rank takes its first ``train.validation.batches`` batches of the
validation cache's stream (seed 0, epoch 0, split by rank like training) and keeps them in host
memory, so every validation sees the same utterances. The model runs in eval mode under
``no_grad``, with the EMA weights when the EMA is on, and with the RNG forked to a fixed seed
per rank (a model that samples noise or spans, like F5-TTS, gives the same loss for the same
weights, and the training stream of random numbers is left as it was: resume stays bitwise).
The loss is Σ loss_sum ÷ Σ count over all ranks, like the training loss, logged as
``val_loss`` in ``metrics.jsonl``. A model with ``predict_mel(batch) -> [B, T, n_mels]`` also
gets a picture, ``OUT/val/step-NNNNNNNN.png``: target above prediction for a few utterances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from melcache.errors import UserError
from melcache.loader.batch import Batch
from melcache.loader.stream_loader import make_loader
from train.config.tables import Config
from train.model.contract import ModelSpec, cast_mel, loader_data, model_inputs, normalise
from train.optim.optimizer import EMA
from train.parallel.env import Env, all_reduce_sum
from train.parallel.rng import derive_seed, rng_state, seed_all, set_rng_state

log = logging.getLogger(__name__)

PICTURED = 3  # utterances drawn per validation


class Validator:
    """The fixed validation batches of this rank and the loop over them."""

    def __init__(self, cfg: Config, spec: ModelSpec, env: Env, out: Path, **loader: Any) -> None:
        self.env, self.spec, self.out = env, spec, Path(out)
        # data.mix weighs the training caches, not this one
        data = dataclasses.replace(loader_data(cfg.data, spec), num_workers=0, mix={})
        stream = make_loader(
            cfg.data.val_shards, data, rank=env.rank, world_size=env.world_size, seed=0, **loader
        )
        try:
            self.batches = list(itertools.islice(iter(stream), cfg.train.validation.batches))
        finally:
            stream.close()
        self.seed = derive_seed(cfg.train.seed, "validation", env.rank)
        self.picture: Path | None = None  # the last run's picture, for the trackers

    @torch.no_grad()
    def run(
        self,
        model: torch.nn.Module,
        ema: EMA | None,
        step: int,
        autocast: Callable[[], contextlib.AbstractContextManager],
        stop: Callable[[], bool] = lambda: False,
    ) -> dict[str, Any]:
        """``{"val_loss": ...}`` of ``model`` (every rank calls this at the same step), or,
        when ``stop()`` (asked before each batch, on every rank alike) says so, the record
        of a validation stopped part way."""
        saved = rng_state(self.env.device)
        seed_all(self.seed)
        self.picture = None
        sums = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        with _eval_weights(model, ema):
            for i, host in enumerate(self.batches):
                if stop():
                    set_rng_state(saved, self.env.device)
                    log.info("validation stopped by a signal after %d of its batches", i)
                    return {"event": "validation_stopped", "batches": i, "of": len(self.batches)}
                batch = cast_mel(host.to(self.env.device), self.spec)
                with autocast():
                    out = normalise(model(*model_inputs(batch, self.spec)))
                count = out.get("loss_count", batch.mel_lengths.sum())
                sums += torch.stack([out["loss_sum"].double(), count.double()])
                if i == 0 and self.env.is_main and hasattr(model, "predict_mel"):
                    with autocast():
                        predicted = model.predict_mel(batch)
                    self._picture(batch, predicted, step)
        set_rng_state(saved, self.env.device)
        total, count = all_reduce_sum(sums, self.env).tolist()  # the one host read
        return {"val_loss": total / count}

    def _picture(self, batch: Batch, predicted: torch.Tensor, step: int) -> None:
        """Target above prediction for the first utterances (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.warning("no validation picture: it needs matplotlib (pip install 'melcache[plot]')")
            return
        rows = min(PICTURED, len(batch))
        fig, axes = plt.subplots(2, rows, figsize=(4 * rows, 5), squeeze=False)
        for col in range(rows):
            n = int(batch.mel_lengths[col])
            for row, (mel, what) in enumerate(((batch.mel, "target"), (predicted, "predicted"))):
                ax = axes[row][col]
                ax.imshow(mel[col, :n].float().cpu().numpy().T, origin="lower", aspect="auto")
                ax.set_title(f"{batch.keys[col]} {what}", fontsize=8)
        fig.suptitle(f"step {step}")
        fig.tight_layout()
        path = self.out / "val" / f"step-{step:08d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=80)
        plt.close(fig)
        self.picture = path


@contextlib.contextmanager
def _eval_weights(model: torch.nn.Module, ema: EMA | None) -> Iterator[None]:
    """Eval mode, and the EMA's weights swapped in, for the duration."""
    model.eval()
    kept = [p.detach().clone() for p in ema.params] if ema is not None else []
    if ema is not None:
        torch._foreach_copy_([p.data for p in ema.params], ema.shadow)
    try:
        yield
    finally:
        if ema is not None:
            torch._foreach_copy_([p.data for p in ema.params], kept)
        model.train()


def build_validator(
    cfg: Config, spec: ModelSpec, env: Env, out: Path, **loader: Any
) -> Validator | None:
    """The run's validator, or ``None`` when ``train.validation.every`` is 0."""
    if not cfg.train.validation.every:
        return None
    if not cfg.data.val_shards:
        raise UserError("train.validation.every is set but data.val_shards (--val-shards) is not")
    return Validator(cfg, spec, env, out, **loader)
