"""The training loop. Construction assembles the parts; :meth:`Trainer.fit` is the loop.

One optimizer step (``train_step``): take ``grad_accum`` micro-batches and cut any over its
bucket's lowered budget into passes (``train/oom.py``); start copying them to the device
(``train/prefetch.py``); all-reduce the number of valid mel frames they hold over all ranks;
run forward and backward of each pass, all but the last under ``no_sync`` so gradients are
all-reduced once; the loss is Σ per-frame losses ÷ that global frame count, so every frame of
every utterance weighs the same whatever the batching, accumulation or world size. Then the
ranks vote on the host (a stop signal; a share of the step lost to an out-of-memory error,
which drops the step everywhere; a spike the device flagged the step before); unscale
(fp16); measure (grad norm, clipping, spike flag, noise scale: ``train/adapt.py``); step,
schedule, EMA. Nothing in the step reads a device value on the host. The number of
micro-batches a step takes follows ``train/batchsize.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from melcache.errors import UserError
from train.adapt import StepMeasures
from train.batchsize import BatchSchedule
from train.checkpoint import Checkpointer
from train.config import Config
from train.contract import (
    declared,
    expected_features,
    inverse_count,
    loader_data,
    model_inputs,
    normalise,
    rescale_gradients,
)
from train.data import Batch, make_loader
from train.distributed import (
    Env,
    HostVote,
    StopFlag,
    all_reduce_sum,
    derive_seed,
    no_sync,
    rng_state,
    seed_all,
    set_rng_state,
    setup,
    teardown,
    use_deterministic_algorithms,
    wrap_model,
)
from train.guards import FirstStep, translate_ddp_error
from train.metrics import Meter, MetricsLog
from train.model import build_model, describe
from train.oom import Budgets, no_recovery
from train.optim import EMA, build_optimizer, build_scheduler
from train.parallel import load_weights, shard, sharded, weights_state
from train.powersgd import PowerSGD
from train.precision import AMP_DTYPES, resolve_precision
from train.prefetch import DeviceCopies
from train.resume import mel_stats, warn_config_changes
from train.runfolder import owned_run_folder
from train.scaler import HIGH_SKIP_RATE, HysteresisScaler
from train.tokenizers import build_tokenizer
from train.validation import build_validator

log = logging.getLogger(__name__)


class Trainer:
    """Model, loader, optimizer, checkpoints and metrics of one run in ``out``."""

    def __init__(self, cfg: Config, shards: str | list[str], out: Path, env: Env) -> None:
        self.cfg, self.env, self.out = cfg, env, Path(out)
        t, device = cfg.train, env.device
        self.precision = resolve_precision(t.precision, device)
        if device.type == "cuda":  # TF32 matmuls: ~fp32 accuracy at tensor-core speed
            torch.set_float32_matmul_precision("high")
        if t.deterministic:
            use_deterministic_algorithms()
        seed_all(derive_seed(t.seed, "init"))  # identical initial weights on every rank
        shards = [shards] if isinstance(shards, str) else list(shards)
        tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.vocab)
        self.raw_model = build_model(cfg.model, tokenizer.vocab_size).to(device).train()
        self.spec = declared(type(self.raw_model), cfg.model.impl)  # train/contract.py
        features = expected_features(cfg.model, self.spec)
        self.loader = make_loader(
            shards[0] if len(shards) == 1 else shards,
            loader_data(cfg.data, self.spec),
            rank=env.rank,
            world_size=env.world_size,
            seed=t.seed,
            expect_features=features,
            tokenizer=tokenizer,
        )
        self.validator = build_validator(  # None unless train.val_every (train/validation.py)
            cfg, self.spec, env, self.out, expect_features=features, tokenizer=tokenizer
        )
        self.sharded = sharded(t, env)  # FSDP2 / HSDP: DTensor parameters from here on
        param_dtype = AMP_DTYPES.get(self.precision, torch.float32)  # fp16 is refused
        self.raw_model = shard(self.raw_model, env, t, param_dtype)
        self.optimizer = build_optimizer(self.raw_model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim)
        self.batch = BatchSchedule(t, self.optimizer, self.scheduler)  # accumulation per step
        self.scaler = HysteresisScaler(
            device.type,
            enabled=self.precision == "fp16",
            hysteresis=t.amp_hysteresis,
            min_scale=t.amp_min_scale,
        )
        # A skipped step (fp16 overflow, out of memory) is normal, not a misordered schedule.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        self.ema = EMA(self.raw_model, t.ema_decay) if t.ema_decay > 0 else None
        self.ckpt = Checkpointer(
            self.out / "checkpoints", env, keep=t.keep_checkpoints, async_save=t.async_checkpoint
        )
        self.vote = HostVote(env)
        self.measures = StepMeasures(cfg, env, sharded=self.sharded)  # clipping, spikes, GNS
        self.budgets = Budgets(
            env,
            self.loader.spec.data.pad_multiple,
            self.out,
            no_recovery=no_recovery(self.sharded, t.allow_forward_collectives),
        )
        self.first = FirstStep(
            self.raw_model,
            cfg.model.impl,
            # FSDP2 all-gathers in every forward itself; it has no recovery for them to break.
            allow_collectives=t.allow_forward_collectives or self.sharded,
            unused=t.find_unused_parameters,
            compiled=t.compile,
        )
        self.copies = DeviceCopies(device)
        self.powersgd = PowerSGD.for_run(self.raw_model, env, t)
        self.step = self._resume_or_start(shards)
        self._pending_records = self.budgets.apply_pending()  # cuts a stopped run left
        if t.activation_checkpointing:
            _enable_activation_checkpointing(self.raw_model, cfg.model.impl)
        self.model = wrap_model(self.raw_model, env, t, self.powersgd)
        self.measures.register(self.model)
        self.meter = Meter(env)
        self.stop = StopFlag()
        self._lr = self.optimizer.param_groups[0]["lr"]
        log.info(
            "model %s on %s × %d, %s, step %d",
            describe(self.raw_model),
            device,
            env.world_size,
            self.precision,
            self.step,
        )

    def fit(self, max_steps: int | None = None) -> str:
        """Train until ``max_steps`` (default: the config's) or a stop signal; say which."""
        t = self.cfg.train
        max_steps = t.max_steps if max_steps is None else max_steps
        metrics = MetricsLog(self.out, self.env, start_step=self.step, max_steps=max_steps)
        for record in self._pending_records:
            metrics.event(self.step, record)
        self._pending_records = []
        if self.budgets.exhausted:
            raise UserError(self.budgets.exhausted)
        batches = iter(self.loader)  # the loader never draws from the global torch RNG
        self.meter = Meter(self.env)  # the first window starts now, not at construction
        try:
            with self.stop.installed():
                while self.step < max_steps:
                    for record in self.batch.accum_for(self.step):  # the ramp
                        metrics.event(self.step + 1, record)
                    t0 = time.perf_counter()
                    micro = [next(batches) for _ in range(self.batch.accum)]
                    self.meter.add_wait(time.perf_counter() - t0)
                    verdict = self.train_step(micro)
                    self.step += 1
                    metrics.advance()
                    for record in verdict.records:  # a skipped step, a lowered budget
                        metrics.event(self.step, record)
                    if self.budgets.exhausted:  # the same on every rank
                        raise UserError(self.budgets.exhausted)
                    if verdict.stop or self.step % t.log_every == 0 or self.step == max_steps:
                        values = self._summary()
                        metrics.log(self.step, values)
                        for record in self.batch.observe(self.step, values):  # closed loop
                            metrics.event(self.step, record)
                    if self.validator is not None and self.step % t.val_every == 0:
                        metrics.log(self.step, self.validator.run(*self._val_args()))
                    if verdict.stop or self.step % t.ckpt_every == 0 or self.step == max_steps:
                        for record in self._flush_spike():
                            metrics.event(self.step, record)
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
        self.budgets.reset()
        passes = self.budgets.split(micro)  # batches over their bucket's lowered budget, cut
        inv_frames = self._inverse_global_frames(micro)
        # DDP averages gradients over ranks; × world size turns that mean into the sum.
        loss_sums = self._forward_backward(passes, inv_frames * self.env.world_size)
        votes = [self.stop.local, float(self.budgets.lost), self.measures.spike_vote()]
        stop, lost, spiked = self.vote.sum(votes)
        # The last step's spike, learnt a step late: no host read of a device value.
        records = self.measures.settle(spiked, self.step)
        if lost:
            return Verdict(stop=stop > 0, skipped=True, records=records + self._skip_step())
        self.first.gradients()  # the first step: every parameter got one
        for batch in micro:
            self.meter.add_batch(batch.mel_lengths, batch.mel.shape, batch.text_lengths)
        inv_count = inverse_count(loss_sums, inv_frames, self.env)  # a model's own count
        self.scaler.unscale_(self.optimizer)
        if inv_count is not inv_frames:
            rescale_gradients(self.raw_model, inv_count / inv_frames)
        frames = sum(int(b.mel_lengths.sum()) for b in micro)
        loss_share = sum(s["loss_sum"] for s in loss_sums) * inv_count
        norm, skip = self.measures.measure(self.raw_model, loss_share, frames, self._all_frames)
        self._meter_step(loss_sums, inv_count, norm, skip)
        if self.powersgd is not None:  # an fp16 overflow or a spike must not poison its memory
            self.powersgd.settle(torch.isfinite(norm) if skip is None else ~skip)
        self._lr = self.optimizer.param_groups[0]["lr"]
        if skip is not None:  # the fused AdamW skips the update (and its step count) on it
            self.optimizer.found_inf = skip.float()
        # fp16: skips the step on inf/NaN gradients; the fused AdamW reads the found-inf flag
        # on the device, so GradScaler needs no host sync here.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scaler.overflow is not None:  # equal on every rank: the gradients are
            self.meter.add_device("amp_skip_rate", self.scaler.overflow, replicated=True)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update(None if skip is None else ~skip)
        self.meter.end_step()
        records += self.budgets.clean_step(self.cfg.train.budget_regrow_steps)
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

    def _flush_spike(self) -> list[dict[str, Any]]:
        """Vote the last step's spike flag now (before a checkpoint, which then holds it)."""
        (votes,) = self.vote.sum([self.measures.spike_vote()])
        return self.measures.settle(votes, self.step)

    def _inverse_global_frames(self, micro: list[Batch]) -> torch.Tensor:
        """1 / the valid mel frames of this step on all ranks, on the device."""
        frames = sum(int(b.mel_lengths.sum()) for b in micro)  # host tensors: no sync
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
        with self.budgets.watch(max(passes, key=lambda b: b.mel.numel()), "input copy"):
            inputs = self.copies.start(passes)  # on CUDA, a side stream
        for i, batch in enumerate(inputs):
            last = i == len(passes) - 1
            with self.budgets.watch(passes[i], "forward"), no_sync(self.model, sync=last):
                out = self._forward(self.copies.ready(batch))
            if not (self.budgets.lost or last):
                with self.budgets.watch(passes[i], "backward"), no_sync(self.model, sync=False):
                    self._backward(out, loss_scale)
            if self.budgets.lost:
                break
            sums.append({k: v.detach() for k, v in out.items() if k.endswith(("_sum", "_count"))})
        if self.budgets.lost and not self.env.distributed:
            return sums  # no DDP to keep in step with
        with self.budgets.fatal(passes[-1], self.step + 1, self.ckpt.latest):
            if self.budgets.lost:
                stand_in = self.budgets.stand_in(passes[-1]).to(self.env.device)
                out, loss_scale = self._forward(stand_in), torch.zeros_like(loss_scale)
            self._backward(out, loss_scale)  # DDP's gradient all-reduce runs in here
        return sums

    def _val_args(self) -> tuple[Any, ...]:
        return self.raw_model, self.ema, self.step, self._autocast

    def _forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        try:
            with self._autocast(), self.first.forward():  # collectives refused at the first
                out = normalise(self.model(*model_inputs(batch, self.spec)))
        except RuntimeError as exc:  # DDP's unused-parameter error, in names
            named = translate_ddp_error(exc, self.raw_model)
            if named is exc:
                raise
            raise named from None
        self.first.outputs(out)
        return out

    def _backward(self, out: dict[str, torch.Tensor], loss_scale: torch.Tensor) -> None:
        self.scaler.scale(out["loss_sum"] * loss_scale).backward()

    def _skip_step(self) -> list[dict[str, Any]]:
        """Every rank drops this step's gradients: it counts as done (the schedule goes on)
        but trains nothing. The failures are gathered and lower their buckets' budgets."""
        failures = [f for f in self.vote.gather(self.budgets.failure) if f is not None]
        self.optimizer.zero_grad(set_to_none=True)
        if self.powersgd is not None:
            self.powersgd.roll_back()
        self.measures.dropped()
        self.scheduler.step()
        self.budgets.skipped_steps += 1
        self.meter.skip_step()
        records = self.budgets.settle(failures)
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
        shared: dict[str, Any] = {}
        weights = {}  # model, optimizer, EMA: in shared.pt (DDP) or every rank's shards (FSDP2)
        if self.env.is_main or self.sharded:
            weights = weights_state(self.raw_model, self.optimizer, self.ema, self.sharded)
        if self.env.is_main:
            shared = {
                "step": self.step,
                "config": self.cfg.to_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "budgets": self.budgets.state_dict(),
                "batch": self.batch.state_dict(),
                **self.measures.state_dict(),
                **({} if self.sharded else weights),
            }
        local = {
            "step": self.step,
            "rank": self.env.rank,
            "rng": rng_state(self.env.device),
            "loader": self.loader.state_dict(),
        }
        if self.powersgd is not None:
            local["powersgd"] = self.powersgd.state_dict()
        self.ckpt.save(self.step, shared, local, weights if self.sharded else None)
        if self.budgets.pending:  # cuts a stopped run left: on disk until a checkpoint holds them
            self.ckpt.wait()
            self.budgets.checkpointed()

    def close(self) -> None:
        """Finish the checkpoint in flight and stop the loader's workers; call in a ``finally``."""
        try:
            self.ckpt.close()
        finally:
            self.loader.close()

    def _summary(self) -> dict[str, float]:
        values = self.meter.summary()  # all ranks: one all-reduce, one host read
        values["lr"] = self._lr
        values.update(self.measures.summary())  # the noise scale: a few more values
        for where, epochs in self.loader.epochs().items():  # per cache of the mix
            values[f"epochs {where}"] = epochs
        if values.get("amp_skip_rate", 0.0) > HIGH_SKIP_RATE:
            log.warning(
                "%.0f %% of the steps logged at step %d skipped for fp16 overflow (scale now %g); "
                "if it stays high, train in bf16 or lower optim.lr",
                100 * values["amp_skip_rate"], self.step, self.scaler.get_scale(),
            )  # fmt: skip
        # A window whose every step was skipped (out of memory) has no loss.
        if not math.isfinite(values.get("loss", 0.0)) and self.precision != "fp16":
            raise FloatingPointError(f"loss is {values['loss']} at step {self.step}")
        return values

    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = AMP_DTYPES.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.env.device.type, dtype=dtype)

    def _resume_or_start(self, shards: list[str]) -> int:
        """Restore the latest complete checkpoint in ``out``, or prepare a fresh start."""
        t = self.cfg.train
        restored = self.ckpt.restore()
        if restored is None:
            if self.cfg.data.mel_stats and hasattr(self.raw_model, "set_mel_stats"):
                stats = mel_stats(shards, self.loader.features.n_mels, self.loader.weights)
                self.raw_model.set_mel_stats(*(x.to(self.env.device) for x in stats))
            if self.env.is_main:
                self.out.mkdir(parents=True, exist_ok=True)
                (self.out / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1))
            # Dropout masks must differ between ranks: one stream per (seed, rank).
            seed_all(derive_seed(t.seed, "train", self.env.rank))
            return 0
        latest, shared, local = restored
        try:
            warn_config_changes(shared["config"], self.cfg.to_dict(), latest)
            weights = shared
            if self.sharded:
                weights = weights_state(self.raw_model, self.optimizer, self.ema, True)
                self.ckpt.load_sharded(latest, weights)
            load_weights(self.raw_model, self.optimizer, self.ema, weights, self.sharded)
            self.scheduler.load_state_dict(shared["scheduler"])
            self.scaler.load_state_dict(shared["scaler"])
            if "budgets" in shared:  # checkpoints from before per-bucket caps have none
                self.budgets.load_state_dict(shared["budgets"])
            if "batch" in shared:  # checkpoints from before the batch schedule have none
                self.batch.load_state_dict(shared["batch"])
            self.measures.load_state_dict(shared)
            self.loader.load_state_dict(local["loader"])
            if self.powersgd is not None and "powersgd" in local:
                self.powersgd.load_state_dict(local["powersgd"])
            set_rng_state(local["rng"], self.env.device)
            step = int(shared["step"])
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            detail = " ".join(str(exc).split())  # torch's messages span lines
            raise UserError(
                f"{latest} does not fit this config (model, optimizer, schedule, precision, "
                f"EMA or loader): {type(exc).__name__}: {detail}"
            ) from None
        log.info("resumed from %s", latest)
        return step


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the ranks agreed on at the end of a step."""

    stop: bool  # a rank got SIGTERM/SIGINT: checkpoint and stop after this step
    skipped: bool  # a rank ran out of memory: no rank trained on this step
    records: list[dict[str, Any]]  # one per out-of-memory error, for metrics.jsonl


def _enable_activation_checkpointing(model: torch.nn.Module, impl: str) -> None:
    if not hasattr(model, "set_activation_checkpointing"):
        raise UserError(
            f"config key train.activation_checkpointing = true, but {impl} has no "
            "set_activation_checkpointing method"
        )
    model.set_activation_checkpointing(True)


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
