"""A batch that grows (``train/adapt/batch_ramp.py``): accumulation rises in integer factors,
by a fixed ramp or a closed loop on the noise scale, the learning rate with it, resumed bitwise."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.support.helpers import (
    checkpoint,
    load,
    metrics,
    run_ok,
    same_weights,
    train_cmd,
)
from tests.train.test_adapt import fit
from train.config.tables import OptimConfig


def test_accumulation_rises_in_integer_factors_where_the_gain_is_worth_it() -> None:
    from train.adapt.batch_ramp import chain, gain

    assert chain(8) == [1, 2, 4, 8] and chain(6) == [1, 2, 6] and chain(1) == [1]
    assert chain(12) == [1, 2, 4, 12] and chain(3) == [1, 3]
    assert gain(100.0, 100.0) < 1 < gain(150.0, 100.0)  # doubling pays once B_noise > √2 B
    assert gain(1e6, 1.0) == pytest.approx(2.0, rel=1e-3)  # at most the factor


def batch_events(out: Path) -> list[dict]:
    return [r for r in metrics(out) if r.get("event") == "batch_size"]


def test_a_ramped_batch_raises_accumulation_and_lr_and_resumes_bitwise(
    train_cache: Path, tmp_path: Path
) -> None:
    extra = ["train.grad_accum=4", "train.adapt.batch_ramp_steps=6"]
    t = fit(train_cache, tmp_path / "straight", 12, *extra)
    events = batch_events(tmp_path / "straight")
    # The line 1 + 3·s/6 crosses 2 at step 2 and 4 at step 6: the chain 1, 2, 4.
    assert [(e["step"], e["accum_before"], e["accum"]) for e in events] == [(3, 1, 2), (7, 2, 4)]
    assert t.parts.scheduler.base_lrs == pytest.approx([2e-3, 2e-3])  # √(1/4) · √2 · √2 = 1
    local = load(checkpoint(tmp_path / "straight", 12), "rank-00000.pt")
    assert local["loader"]["batches"] == 2 * 1 + 4 * 2 + 6 * 4  # micro-batches drawn
    fit(train_cache, tmp_path / "halves", 6, *extra)
    resumed = fit(train_cache, tmp_path / "halves", 12, *extra)
    assert resumed.parts.batch.accum == 4
    assert batch_events(tmp_path / "halves") == events
    same_weights(checkpoint(tmp_path / "straight", 12), checkpoint(tmp_path / "halves", 12))


def test_the_closed_loop_doubles_only_upwards_after_its_cool_down() -> None:
    from train.adapt.batch_ramp import BatchSchedule
    from train.config.train_table import AdaptConfig, TrainConfig
    from train.optim.optimizer import build_optimizer, build_scheduler

    model = torch.nn.Linear(2, 2)
    optim_cfg = OptimConfig(lr=1e-3)
    optimizer = build_optimizer(model, optim_cfg)
    scheduler = build_scheduler(optimizer, optim_cfg)
    cfg = TrainConfig(
        adapt=AdaptConfig(
            noise_scale=True, batch_adaptive=True, batch_cooldown=10, batch_max_accum=4
        ),
        log_every=5,
    )
    batch = BatchSchedule(cfg, optimizer, scheduler)
    noisy = {"noise_scale": 1e5, "noise_batch": 1e3}  # x = 100: doubling pays
    quiet = {"noise_scale": 1e3, "noise_batch": 1e3}  # x = 1 < √2: it does not
    assert batch.observe(5, quiet) == [] and batch.accum == 1
    assert batch.observe(7, noisy) == []  # not a logging step
    (rise,) = batch.observe(10, noisy)
    assert (rise["accum_before"], rise["accum"], batch.accum) == (1, 2, 2)
    assert rise["gain"] == pytest.approx(2 * 101**2 / 102**2)
    assert scheduler.base_lrs[0] == pytest.approx(1e-3 * math.sqrt(2))
    assert batch.observe(15, noisy) == []  # cooling down
    assert batch.observe(20, noisy)[0]["accum"] == 4
    assert batch.observe(30, noisy) == [] and batch.accum == 4  # at batch_max_accum
    assert batch.observe(40, {"noise_scale": math.nan, "noise_batch": 1e3}) == []
    assert scheduler.base_lrs[0] == pytest.approx(2e-3)  # √4
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * scheduler.lr_lambdas[0](0))


def accum_by_step(rises: list[dict], steps: int) -> list[int]:
    """The accumulation of each step: a rise logged at step s holds from step s + 1."""
    accum, out = 1, []
    for step in range(1, steps + 1):
        out.append(accum)
        accum = next((r["accum"] for r in rises if r["step"] == step), accum)
    return out


@pytest.mark.slow
def test_ddp_closed_loop_resumes_bitwise(train_cache: Path, tmp_path: Path) -> None:
    """The noise-scale closed loop on 2 gloo ranks, on a model with loud gradient noise: it
    raises the batch; 12 steps straight equal 6 + resume + 6, the same rises at the same steps
    (the decision reads only checkpointed EMAs)."""
    extra = ["model.impl=tests.support.spike_model:NoisyGradient", "model.args.noise=1.0"]
    extra += ["train.adapt.noise_scale=true", "train.adapt.batch_adaptive=true"]
    extra += ["train.adapt.batch_cooldown=0", "train.log_every=2", "train.checkpoint.every=6"]
    extra += ["train.adapt.noise_scale_ema=0.5", "train.adapt.batch_max_accum=4"]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    run_ok(train_cmd(train_cache, straight, *extra, max_steps=12), timeout=600)
    run_ok(train_cmd(train_cache, halves, *extra, max_steps=6), timeout=600)
    run_ok(train_cmd(train_cache, halves, *extra, max_steps=12), timeout=600)
    assert batch_events(straight) == batch_events(halves)
    a, b = load(checkpoint(straight, 12)), load(checkpoint(halves, 12))
    assert a["batch"] == b["batch"] and a["scheduler"]["base_lrs"] == b["scheduler"]["base_lrs"]
    same_weights(checkpoint(straight, 12), checkpoint(halves, 12))
    rises = batch_events(straight)
    assert rises and a["batch"]["accum"] == 2 ** len(rises) <= 4
    assert all(r["gain"] > 1.05 and r["noise_scale"] > r["frames_per_step"] for r in rises)
    assert [r["step"] for r in rises] == sorted({r["step"] for r in rises})  # one per step
    drawn = load(checkpoint(straight, 12), "rank-00001.pt")["loader"]["batches"]
    assert drawn == sum(accum_by_step(rises, 12))
    assert a["scheduler"]["base_lrs"][0] == pytest.approx(2e-3 * 2 ** (len(rises) / 2))
