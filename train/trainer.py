"""The training loop. Construction assembles the parts; :meth:`Trainer.fit` is the loop.

One optimizer step (``train_step``): take ``grad_accum`` micro-batches and cut any over its
bucket's lowered budget into passes (``train/memory/oom.py``); start copying them to the device
(``melcache/loader/prefetch.py``); all-reduce the number of valid mel frames they hold over all ranks;
run forward and backward of each pass, all but the last under ``no_sync`` so gradients are
all-reduced once; the loss is Σ per-frame losses ÷ that global frame count, so every frame of
every utterance weighs the same whatever the batching, accumulation or world size. Then the
ranks vote on the host (a stop signal; a share of the step lost to an out-of-memory error,
which drops the step everywhere; a spike the device flagged the step before); unscale
(fp16); measure (grad norm, clipping, spike flag, noise scale: ``train/adapt/step_measures.py``); step,
schedule, EMA. Nothing in the step reads a device value on the host. The number of
micro-batches a step takes follows ``train/adapt/batch_ramp.py``; after ``train.adapt.spike_rewind_after``
spike skips in a row the loop goes back to the last checkpoint (``train/run/resume.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from melcache.errors import UserError
from melcache.host.cpus import allotment
from melcache.loader import Batch
from train.config.tables import Config
from train.memory.oom import release_interrupted_backward
from train.model import describe
from train.model.contract import inverse_count, model_inputs, normalise, rescale_gradients
from train.model.guards import translate_ddp_error
from train.optim.precision import autocast
from train.optim.scaler import HIGH_SKIP_RATE
from train.parallel.ddp import no_sync
from train.parallel.env import Env, all_reduce_sum, setup, teardown
from train.parallel.votes import StopFlag
from train.run.folder import owned_run_folder
from train.run.metrics import Meter, MetricsLog, epochs_names
from train.run.parts import RunParts, build_run_parts, wrap_for_training
from train.run.resume import resume_or_start, rewind, save
from train.run.tracker_backends import Opening
from train.run.trackers import Trackers, open_trackers

log = logging.getLogger(__name__)


class Trainer:
    """The parts of one run in ``out`` (``train/run/parts.py``), restored, and the loop over them."""

    def __init__(self, cfg: Config, shards: str | list[str], out: Path, env: Env) -> None:
        self.cfg, self.env, self.out = cfg, env, Path(out)
        self.parts: RunParts = build_run_parts(cfg, shards, self.out, env)
        self.step = resume_or_start(self.parts)
        self._pending_records = self.parts.budgets.apply_pending()  # cuts a stopped run left
        if self.parts.loader.resume_changes:  # resumed by a job of another size or mix
            changes = list(self.parts.loader.resume_changes)
            self._pending_records.append({"event": "resumed_changed", "changes": changes})
        self.model = wrap_for_training(self.parts)
        self.meter = Meter(env)
        self.stop = StopFlag()
        self._lr = self.parts.optimizer.param_groups[0]["lr"]
        cpus = allotment()
        log.info(
            "model %s on %s × %d, %s, step %d; %d loader workers per rank (this process may "
            "use %d CPUs: %s)",
            describe(self.parts.raw_model),
            env.device,
            env.world_size,
            self.parts.precision,
            self.step,
            cfg.data.num_workers,
            cpus.cpus,
            cpus.describe(),
        )

    def fit(self, max_steps: int | None = None) -> str:
        """Train until ``max_steps`` (default: the config's) or a stop signal; say which."""
        t = self.cfg.train
        max_steps = t.max_steps if max_steps is None else max_steps
        metrics = MetricsLog(
            self.out, self.env, start_step=self.step, max_steps=max_steps, trackers=self._trackers()
        )
        for record in self._pending_records:
            metrics.event(self.step, record)
        self._pending_records = []
        if self.parts.budgets.exhausted:
            raise UserError(self.parts.budgets.exhausted)
        batches = iter(self.parts.loader)  # the loader never draws from the global torch RNG
        self.meter = Meter(self.env)  # the first window starts now, not at construction
        try:
            with self.stop.installed():
                while self.step < max_steps:
                    for record in self.parts.batch.accum_for(self.step):  # the ramp
                        metrics.event(self.step + 1, record)
                    t0 = time.perf_counter()
                    micro = [next(batches) for _ in range(self.parts.batch.accum)]
                    self.meter.add_wait(time.perf_counter() - t0)
                    verdict = self.train_step(micro)
                    self.step += 1
                    for record in verdict.records:  # a skipped step, a lowered budget
                        metrics.event(self.step, record)
                    if self.parts.budgets.exhausted:  # the same on every rank
                        raise UserError(self.parts.budgets.exhausted)
                    if (
                        self.parts.measures.rewind_due
                    ):  # spikes in a row: back to the last checkpoint
                        self._rewind(metrics)
                        continue
                    if verdict.stop or self.step % t.log_every == 0 or self.step == max_steps:
                        self._log_window(metrics)
                    if self.parts.validator is not None and self.step % t.validation.every == 0:
                        verdict = self._validate(metrics, verdict)
                    if (
                        verdict.stop
                        or self.step % t.checkpoint.every == 0
                        or self.step == max_steps
                    ):
                        for record in self._flush_spike():
                            metrics.event(self.step, record)
                        if self.parts.measures.rewind_due:  # that flush ended the streak
                            self._rewind(metrics)  # a stop signal stays set for the next step
                            continue
                        self.save()
                    if verdict.stop:
                        log.info(
                            "stopping at step %d (%s)", self.step, self.stop.received or "peer"
                        )
                        return "signal"
        finally:
            metrics.close()
        return "max_steps"

    def train_step(self, micro: list[Batch]) -> Verdict:
        """One optimizer step over ``micro``, or, if any rank ran out of memory, none on any."""
        self.parts.budgets.reset()
        passes = self.parts.budgets.split(micro)  # batches over their bucket's lowered budget, cut
        frames = sum(int(b.mel_lengths.sum()) for b in micro)  # host tensors: no sync
        inv_frames = self._inverse_global_frames(frames)
        # DDP averages gradients over ranks; × world size turns that mean into the sum.
        loss_sums = self._forward_backward(passes, inv_frames * self.env.world_size)
        votes = [self.stop.local, float(self.parts.budgets.lost), self.parts.measures.spike_vote()]
        stop, lost, spiked = self.parts.vote.sum(votes)
        # The last step's spike, learnt a step late: no host read of a device value.
        records = self.parts.measures.settle(spiked, self.step)
        if lost:
            return Verdict(stop=stop > 0, skipped=True, records=records + self._skip_step())
        self.parts.first.gradients()  # the first step: every parameter got one
        for batch in micro:
            self.meter.add_batch(batch.mel_lengths, batch.mel.shape, batch.text_lengths)
        inv_count = inverse_count(loss_sums, inv_frames, self.env)  # a model's own count
        self.parts.scaler.unscale_(self.parts.optimizer)
        if inv_count is not inv_frames:
            rescale_gradients(self.parts.raw_model, inv_count / inv_frames)
        loss_share = sum(s["loss_sum"] for s in loss_sums) * inv_count
        norm, skip = self.parts.measures.measure(
            self.parts.raw_model,
            loss_share,
            frames,
            self._all_frames,
            self.parts.scaler.grad_scale(),
        )
        self._meter_step(loss_sums, inv_count, norm, skip)
        if (
            self.parts.powersgd is not None
        ):  # an fp16 overflow or a spike must not poison its memory
            finite = torch.isfinite(norm)
            self.parts.powersgd.settle(finite if skip is None else ~skip & finite)
        self._lr = self.parts.optimizer.param_groups[0]["lr"]
        # Skips the step on a spike and (fp16) on inf/NaN gradients; the fused AdamW reads the
        # found-inf flag on the device (its step count too), so no host sync here.
        self.parts.scaler.step(self.parts.optimizer, skip=skip)
        self.parts.scaler.update()
        if self.parts.scaler.overflow is not None:  # equal on every rank: the gradients are
            self.meter.add_device("amp_skip_rate", self.parts.scaler.overflow, replicated=True)
        self.parts.optimizer.zero_grad(set_to_none=True)
        self.parts.scheduler.step()
        if self.parts.ema is not None:
            self.parts.ema.update(None if skip is None else ~skip)
        self.meter.end_step()
        records += self.parts.budgets.clean_step(self.cfg.train.memory.budget_regrow_steps)
        return Verdict(stop=stop > 0, skipped=False, records=records)

    def _meter_step(
        self,
        loss_sums: list[dict[str, torch.Tensor]],
        inv_count: torch.Tensor,
        norm: torch.Tensor,
        skip: torch.Tensor | None,
    ) -> None:
        """The step's losses and grad norm into the window; a spike's (``skip``) left out."""
        kept = inv_count if skip is None else inv_count * (~skip).float()
        for sums in loss_sums:
            for name, value in sums.items():
                if name.endswith("_sum"):
                    self.meter.add_device(name.removesuffix("_sum"), value * kept)
        if skip is not None:
            norm = norm * (~skip).float()
            self.meter.drop_step(skip.float())
        self.meter.add_device("grad_norm", norm, replicated=True)

    def _log_window(self, metrics: MetricsLog) -> None:
        """The window's summary into metrics.jsonl; the closed loop reads it."""
        values = self._summary()
        metrics.log(self.step, values)
        for record in self.parts.batch.observe(self.step, values):
            metrics.event(self.step, record)

    def _rewind(self, metrics: MetricsLog) -> None:
        """``train.adapt.spike_rewind_after`` spikes in a row: back to the last checkpoint, while
        the loader goes on, so the batches drawn since are skipped, not replayed (PaLM)."""
        start, drawn = self.step, self.parts.loader.state_dict()["batches"]
        self.step, drawn_then = rewind(self.parts)
        record = {
            "event": "rewind",
            "to_step": self.step,
            "spikes": self.cfg.train.adapt.spike_rewind_after,
            "batches_skipped": drawn - drawn_then,  # on each rank
        }
        metrics.event(start, record)
        self.meter = Meter(self.env)  # the window's steps are undone
        self._lr = self.parts.optimizer.param_groups[0]["lr"]
        if self.env.is_main:
            log.warning(
                "step %d: %d loss spikes in a row; back to step %d, skipping the %d batches "
                "drawn since on each rank",
                start, record["spikes"], self.step, record["batches_skipped"],
            )  # fmt: skip

    def _flush_spike(self) -> list[dict[str, Any]]:
        """Vote the last step's spike flag now (before a checkpoint, which then holds it)."""
        (votes,) = self.parts.vote.sum([self.parts.measures.spike_vote()])
        return self.parts.measures.settle(votes, self.step)

    def _inverse_global_frames(self, frames: int) -> torch.Tensor:
        """1 / the valid mel ``frames`` of this step summed over all ranks, on the device."""
        counts = torch.tensor([frames], dtype=torch.float64)
        if self.env.device.type == "cuda":  # a pageable source would serialise the copy
            counts = counts.pin_memory()
        counts = all_reduce_sum(counts.to(self.env.device, non_blocking=True), self.env)
        self._all_frames = counts[0]  # float64, for the noise scale
        return (1.0 / counts[0]).float()

    def _forward_backward(
        self, passes: list[Batch], loss_scale: torch.Tensor
    ) -> list[dict[str, torch.Tensor]]:
        """Forward and backward of each pass, only the last all-reducing gradients (DDP); the
        loss sums of each. Once this rank has run out of memory it computes no more of the
        step, except the synchronised pass DDP needs from every rank, on a stand-in."""
        sums, inputs = [], []
        with self.parts.budgets.watch(max(passes, key=lambda b: b.mel.numel()), "input copy"):
            inputs = self.parts.copies.start(passes)  # on CUDA, a side stream
        for i, batch in enumerate(inputs):
            last = i == len(passes) - 1
            with self.parts.budgets.watch(passes[i], "forward"), no_sync(self.model, sync=last):
                out = self._forward(self.parts.copies.ready(batch))
            if not (self.parts.budgets.lost or last):
                with (
                    self.parts.budgets.watch(passes[i], "backward"),
                    no_sync(self.model, sync=False),
                ):
                    self._backward(out, loss_scale)
            if self.parts.budgets.lost:
                break
            sums.append({k: v.detach() for k, v in out.items() if k.endswith(("_sum", "_count"))})
        if self.parts.budgets.lost and not self.env.distributed:
            return sums  # no DDP to keep in step with
        with self.parts.budgets.fatal(passes[-1], self.step + 1, self.parts.ckpt.latest):
            if self.parts.budgets.lost:
                stand_in = self.parts.budgets.stand_in(passes[-1]).to(self.env.device)
                out, loss_scale = self._forward(stand_in), torch.zeros_like(loss_scale)
            self._backward(out, loss_scale)  # DDP's gradient all-reduce runs in here
        return sums

    def _trackers(self) -> Trackers:
        """``train.trackers`` on rank 0, opening on their own threads from this step."""
        opening = Opening(self.out, self.step, self.parts.trackers.wandb_run_id, self.cfg.to_dict())
        return open_trackers(self.cfg.train.trackers, self.env, opening)

    def _val_args(self) -> tuple[Any, ...]:
        return self.parts.raw_model, self.parts.ema, self.step, self._autocast

    def _validate(self, metrics: MetricsLog, verdict: Verdict) -> Verdict:
        """Validate, stopping between its batches once any rank got a stop signal (a long pass
        must not hold up a job being preempted): the stop is recorded, then this step is
        checkpointed as for a stop during training."""
        assert self.parts.validator is not None  # internal invariant: the caller checked it

        def stop_now() -> bool:  # every rank votes at the same batch
            return self.parts.vote.sum([self.stop.local])[0] > 0

        values = self.parts.validator.run(*self._val_args(), stop=stop_now)
        if "val_loss" in values:
            metrics.log(self.step, values)
            metrics.picture(self.step, "val/mel", self.parts.validator.picture)
            return verdict
        metrics.event(self.step, values)
        return dataclasses.replace(verdict, stop=True)

    def _forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        try:
            with self._autocast(), self.parts.first.forward():  # collectives refused at the first
                out = normalise(self.model(*model_inputs(batch, self.parts.spec)))
        except (torch.OutOfMemoryError, torch.distributed.DistError, UserError):
            raise  # out-of-memory steps are survived; the group's and the guards' are ours
        except RuntimeError as exc:  # DDP's unused-parameter error, in names
            named = translate_ddp_error(exc, self.parts.raw_model)
            raise (
                self.parts.first.failed(exc, batch, self.step + 1) if named is exc else named
            ) from None
        except Exception as exc:  # the model's own code: named, with its frames
            raise self.parts.first.failed(exc, batch, self.step + 1) from None
        self.parts.first.outputs(out)
        return out

    def _backward(self, out: dict[str, torch.Tensor], loss_scale: torch.Tensor) -> None:
        self.parts.scaler.scale(out["loss_sum"] * loss_scale).backward()

    def _skip_step(self) -> list[dict[str, Any]]:
        """Every rank drops this step's gradients: it counts as done (the schedule goes on)
        but trains nothing. The failures are gathered and lower their buckets' budgets."""
        failures = [f for f in self.parts.vote.gather(self.parts.budgets.failure) if f is not None]
        self.parts.optimizer.zero_grad(set_to_none=True)
        release_interrupted_backward(self.env.device)
        if self.parts.powersgd is not None:
            self.parts.powersgd.roll_back()
        self.parts.measures.dropped()
        self.parts.scheduler.step()
        self.parts.budgets.skipped_steps += 1
        self.meter.skip_step()
        records = self.parts.budgets.settle(failures)
        if self.env.is_main:
            for r in records:
                log.warning(
                    "step %d skipped: out of memory on rank %d (%s) in bucket %d, %d × %d "
                    "padded frames; its budget is now %d frames per pass",
                    self.step + 1, r["rank"], r["stage"], r["bucket"], r["rows"], r["frames"],
                    r["budget"],
                )  # fmt: skip
        return records

    def save(self) -> None:
        """Checkpoint the current step (every rank calls this at the same step)."""
        save(self.parts, self.step)

    def close(self) -> None:
        """Finish the checkpoint in flight and stop the loader's workers; call in a ``finally``."""
        try:
            self.parts.ckpt.close()
        finally:
            self.parts.loader.close()

    def _summary(self) -> dict[str, float]:
        values = self.meter.summary()  # all ranks: one all-reduce, one host read
        values["lr"] = self._lr
        values.update(self.parts.measures.summary())  # the noise scale: a few more values
        epochs = self.parts.loader.epochs()  # per cache of the mix, by its location
        values.update(zip(epochs_names(list(epochs)), epochs.values(), strict=True))
        values.update(self.parts.loader.heard())  # data.balance: once an epoch, vs the target
        for name, count in (self.parts.loader.disk_cache or {}).items():  # data.cache_dir
            values[f"disk_cache_{name}"] = count
        if values.get("amp_skip_rate", 0.0) > HIGH_SKIP_RATE:
            log.warning(
                "%.0f %% of the steps logged at step %d skipped for fp16 overflow (scale now %g); "
                "if it stays high, train in bf16 or lower optim.lr",
                100 * values["amp_skip_rate"], self.step, self.parts.scaler.get_scale(),
            )  # fmt: skip
        # A window whose every step was skipped (out of memory) has no loss.
        if not math.isfinite(values.get("loss", 0.0)) and self.parts.precision != "fp16":
            raise UserError(  # a diverged run: one line, as for any bad setting
                f"the loss is {values['loss']} at step {self.step}: the run diverged; lower "
                "optim.lr (or check optim.weight_decay and the data), then resume from the last "
                "checkpoint or train into a new --out"
            )
        return values

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.parts.precision, self.env.device)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the ranks agreed on at the end of a step."""

    stop: bool  # a rank got SIGTERM/SIGINT: checkpoint and stop after this step
    skipped: bool  # a rank ran out of memory: no rank trained on this step
    records: list[dict[str, Any]]  # one per out-of-memory error, for metrics.jsonl


def run(cfg: Config, shards: str | list[str], out: Path) -> str:
    """Join the job, train, checkpoint, leave: the whole ``python -m train`` command."""
    env = setup()
    try:
        with owned_run_folder(out, env):
            trainer = Trainer(cfg, shards, out, env)
            try:
                return trainer.fit()
            finally:
                trainer.close()
    finally:
        teardown(env)
