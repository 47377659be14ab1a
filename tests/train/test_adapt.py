"""Training that adapts to what it measures: spike skips (``train/adapt/spikes.py``) and adaptive
clipping (``train/optim/clipping.py``), in one process and on 2-process gloo jobs, resumed bitwise."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.helpers import (
    REPO,
    checkpoint,
    load,
    metrics,
    needs_extra,
    run_ok,
    same_ddp_run,
    same_weights,
    tiny_fit,
    tiny_trainer,
    train_cmd,
)
from train.config.tables import OptimConfig, load_config
from train.optim.clipping import GradClip
from train.trainer import Trainer

SPIKE_AT = 9
# A window of 8 steps, judged from the 4th: the spike at step 9 needs the state of steps 1-6.
SPIKES = [
    "model.impl=tests.support.spike_model:SpikeAt",
    f"model.args.at={SPIKE_AT}",
    "train.adapt.skip_spikes=true",
    "train.adapt.spike_window=8",
    "train.adapt.spike_min_history=4",
]
ONE = [
    "data.batch_frames=800",
    "data.num_workers=0",
    "model.args.dim=32",
    "model.args.layers=1",
    "train.precision=fp32",
    "train.log_every=3",
    "train.checkpoint.every=6",
    "train.ema_decay=0.99",
]


def trainer(cache: Path, out: Path, *extra: str) -> Trainer:
    return tiny_trainer(cache, out, [*ONE, *extra])


def fit(cache: Path, out: Path, steps: int, *extra: str) -> Trainer:
    return tiny_fit(cache, out, steps, [*ONE, *extra])


def spikes(out: Path) -> list[dict]:
    return [r for r in metrics(out) if r.get("event") == "spike"]


def test_a_loss_spike_is_skipped_and_a_resume_is_bitwise(train_cache: Path, tmp_path: Path) -> None:
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    t = fit(train_cache, straight, 12, *SPIKES)
    (event,) = spikes(straight)
    assert event["step"] == SPIKE_AT and t.parts.measures.spikes.skipped == 1
    assert event["step_loss"] > event["loss_mean"] + 6 * event["loss_std"]
    final = load(checkpoint(straight, 12))
    # 12 steps, 11 updates: the fused AdamW skipped one on the device.
    assert {int(s["step"]) for s in final["optimizer"]["state"].values()} == {11}
    assert final["spikes"]["skipped"] == 1 and final["spikes"]["count"] == 11
    windows = [r for r in metrics(straight) if "loss" in r]
    assert [r["skipped_steps"] for r in windows] == [0, 0, 1, 0]  # steps 7-9 hold it
    assert all(r["loss"] < 3 for r in windows)  # the spike's loss is not in its window

    fit(train_cache, halves, 6, *SPIKES)
    fit(train_cache, halves, 12, *SPIKES)
    assert [e["step"] for e in spikes(halves)] == [SPIKE_AT]
    same_weights(checkpoint(straight, 12), checkpoint(halves, 12))


def test_without_a_spike_nothing_is_skipped(train_cache: Path, tmp_path: Path) -> None:
    t = fit(train_cache, tmp_path, 10, *SPIKES, "model.args.factor=1.0")
    assert t.parts.measures.spikes.skipped == 0 and not spikes(tmp_path)
    state = load(checkpoint(tmp_path, 10))["optimizer"]["state"]
    assert {int(s["step"]) for s in state.values()} == {10}


def rewind_args(keys: Path, at: int, count: int, after: int) -> list[str]:
    """A SpikeRun model spiking at ``count`` forwards from ``at``; a rewind after ``after``."""
    return [
        "model.impl=tests.support.spike_model:SpikeRun",
        f"model.args.at={at}",
        f"model.args.count={count}",
        f"model.args.keys_log={str(keys)!r}",
        "train.adapt.skip_spikes=true",
        "train.adapt.spike_window=8",
        "train.adapt.spike_min_history=4",
        f"train.adapt.spike_rewind_after={after}",
    ]


def forward_keys(keys: Path, rank: int = 0) -> list[list[str]]:
    """The batch keys of each training forward a SpikeRun model logged, in order."""
    rows = [json.loads(line) for line in (keys / f"rank-{rank}.jsonl").read_text().splitlines()]
    return [row["keys"] for row in rows]


def test_spikes_in_a_row_rewind_to_the_start_and_skip_their_batches(
    train_cache: Path, tmp_path: Path
) -> None:
    """No checkpoint yet: 2 spikes in a row (steps 5, 6, voted by step 7) send the run back
    to step 0, saved at the start; steps 1-8 then train on batches 8-15, not 1-7 again, and
    12 steps straight equal 8 + resume + 4, bitwise."""
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    extra = ["train.checkpoint.every=100"]
    t = fit(train_cache, straight, 12, *extra, *rewind_args(tmp_path / "k1", 5, 2, 2))
    (rewound,) = [r for r in metrics(straight) if r.get("event") == "rewind"]
    assert rewound == {
        "step": 7, "event": "rewind", "to_step": 0, "spikes": 2, "batches_skipped": 7
    }  # fmt: skip
    assert [e["step"] for e in spikes(straight)] == [5, 6]
    assert (
        t.parts.measures.spikes.rewinds,
        t.parts.measures.spikes.skipped,
        t.parts.measures.spikes.streak,
    ) == (
        1,
        2,
        0,
    )
    assert [r["rewinds"] for r in metrics(straight) if "loss" in r][-1] == 1
    seen = forward_keys(tmp_path / "k1")
    assert len(seen) == 12 + 7  # every batch drawn once: the 7 before the rewind are skipped
    assert seen[7:14] != seen[:7]  # a replay would have trained on batches 1-7 again
    final = load(checkpoint(straight, 12))
    assert {int(s["step"]) for s in final["optimizer"]["state"].values()} == {12}
    assert load(checkpoint(straight, 12), "rank-00000.pt")["loader"]["batches"] == 19
    assert checkpoint(straight, 0).is_dir()

    fit(train_cache, halves, 8, *extra, *rewind_args(tmp_path / "k2", 5, 2, 2))
    fit(train_cache, halves, 12, *extra, *rewind_args(tmp_path / "k2", 5, 2, 2))
    assert forward_keys(tmp_path / "k2") == seen  # a fresh process counts from 1: no spike
    assert [r["step"] for r in metrics(halves) if r.get("event") == "rewind"] == [7]
    same_weights(checkpoint(straight, 12), checkpoint(halves, 12))


@pytest.mark.parametrize("rule", ["zclip", "autoclip"])
def test_adaptive_clipping_resumes_exactly(train_cache: Path, tmp_path: Path, rule: str) -> None:
    extra = [f"optim.clip={rule}", "optim.zclip_warmup=3", "optim.autoclip_window=5"]
    fit(train_cache, tmp_path / "straight", 12, *extra)
    fit(train_cache, tmp_path / "halves", 6, *extra)
    fit(train_cache, tmp_path / "halves", 12, *extra)
    same_weights(checkpoint(tmp_path / "straight", 12), checkpoint(tmp_path / "halves", 12))
    state = load(checkpoint(tmp_path / "straight", 12))["clip"]
    assert int(state["steps"]) == 12


def clipped_norms(cfg: OptimConfig, norms: list[float]) -> list[float]:
    """The norm after clipping of a one-parameter model whose gradient has each norm."""
    param = torch.nn.Parameter(torch.zeros(1))
    model = torch.nn.ParameterList([param])
    clip, out = GradClip(cfg, torch.device("cpu"), sharded=False), []
    for norm in norms:
        param.grad = torch.tensor([norm])
        clip.clip(model, clip.total_norm(model), None)
        out.append(float(param.grad.abs()))
    return out


def test_zclip_follows_the_papers_rule() -> None:
    cfg = OptimConfig(clip="zclip", grad_clip=0, zclip_warmup=4, zclip_alpha=0.9, zclip_z=2.0)
    norms = [1.0, 1.2, 0.8, 1.0, 1.1, 9.0, 1.0, 30.0]
    got = clipped_norms(cfg, norms)
    mean, var = np.mean(norms[:4]), np.var(norms[:4])  # the warm-up's, unclipped
    want = list(norms[:4])
    for g in norms[4:]:  # reference: ZClip's z-score with reciprocal clipping, EMA of the result
        std = math.sqrt(var)
        z = (g - mean) / (std + 1e-6)
        c = mean + (2.0**2 / z) * std if z > 2.0 else g
        want.append(c)
        mean = 0.9 * mean + 0.1 * c
        var = 0.9 * var + 0.1 * (c - mean) ** 2
    assert got == pytest.approx(want, rel=1e-5)
    assert got[5] < 2.0 and got[7] < 2.0  # the two outliers were cut, the rest kept


def test_autoclip_clips_at_a_percentile_of_past_norms() -> None:
    cfg = OptimConfig(clip="autoclip", grad_clip=5.0, autoclip_percentile=50, autoclip_window=4)
    norms = [1.0, 3.0, 2.0, 10.0, 4.0, 0.5]
    got = clipped_norms(cfg, norms)
    want = []
    for i, g in enumerate(norms):
        limit = min(np.percentile(norms[max(0, i - 3) : i + 1], 50), 5.0)
        want.append(min(g, limit))
    assert got == pytest.approx(want, rel=1e-5)


def test_the_plot_draws_the_noise_scale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    needs_extra("matplotlib", "plot")
    from train.plot import plot_run

    rows = [
        {
            "step": s,
            "loss": 1.0 / s,
            "frames_per_s": 1e3,
            "frames_per_step": 500,
            "data_wait_pct": 1,
        }
        | {"noise_scale": 900.0 + s, "noise_scale_lo": 800.0, "noise_scale_hi": 1e3 + s}
        for s in (5, 10, 15)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import matplotlib.pyplot as plt

    drawn, real_subplots = [], plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: drawn.append(a) or real_subplots(*a, **k))
    png = plot_run(tmp_path)
    assert png.read_bytes()[:4] == b"\x89PNG" and drawn == [(3, 1)]


# ---- a 2-process gloo job -----------------------------------------------------------------
@pytest.mark.slow
def test_ddp_a_spike_on_one_rank_is_skipped_on_every_rank_and_resumes_bitwise(
    train_cache: Path, tmp_path: Path
) -> None:
    """Rank 1's loss spikes at step 9: both ranks see it in the global loss and skip that step,
    no other; 12 steps straight equal 6 + resume + 6, bit for bit (the noise scale's EMAs too)."""
    extra = [*SPIKES, "model.args.rank=1", "train.checkpoint.every=6", "train.log_every=3"]
    extra.append("train.adapt.noise_scale=true")
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    run_ok(train_cmd(train_cache, straight, *extra, max_steps=12), timeout=600)
    (event,) = spikes(straight)
    assert event["step"] == SPIKE_AT
    final = load(checkpoint(straight, 12))
    assert {int(s["step"]) for s in final["optimizer"]["state"].values()} == {11}
    windows = [r for r in metrics(straight) if "loss" in r]
    assert all(r["noise_scale_lo"] <= r["noise_scale"] <= r["noise_scale_hi"] for r in windows)
    assert all(r["noise_trace"] > 0 for r in windows)
    run_ok(train_cmd(train_cache, halves, *extra, max_steps=6), timeout=600)
    done = run_ok(train_cmd(train_cache, halves, *extra, max_steps=12), timeout=600)
    assert "resumed from" in done.stderr and f"step {SPIKE_AT} skipped: loss" in done.stderr
    assert [e["step"] for e in spikes(halves)] == [SPIKE_AT]
    same_ddp_run(checkpoint(straight, 12), checkpoint(halves, 12))


@pytest.mark.slow
def test_ddp_noise_scale_under_fp16_equals_fp32s(train_cache: Path, tmp_path: Path) -> None:
    """The comm hook sees fp16's gradients times the loss scale (2^16 here): divided out, the
    monitor's tr(Σ) and |G|² match an fp32 run of the same steps (×2^32 if it were not). fp16's
    first step overflows and is left out: a short EMA makes the last steps count."""
    extra = ["train.adapt.noise_scale=true", "train.adapt.noise_scale_ema=0.5", "train.log_every=4"]
    windows = {}
    for precision in ("fp32", "fp16"):
        out = tmp_path / precision
        run_ok(train_cmd(train_cache, out, *extra, f"train.precision={precision}", max_steps=8))
        windows[precision] = [r for r in metrics(out) if "noise_trace" in r][-1]
    assert windows["fp16"]["amp_skip_rate"] == 0  # steps 5-8: no overflow
    fp16, fp32 = windows["fp16"], windows["fp32"]
    assert fp16["noise_trace"] == pytest.approx(fp32["noise_trace"], rel=0.1)
    # |G|² = |Ḡ|² − Ŝ/N, a difference of near-equal terms: fp16's rounding moves it more.
    assert fp16["noise_grad_sq"] == pytest.approx(fp32["noise_grad_sq"], rel=0.3)


@pytest.mark.slow
def test_ddp_spikes_in_a_row_rewind_once_skip_their_batches_and_resume_bitwise(
    train_cache: Path, tmp_path: Path
) -> None:
    """Rank 1's loss spikes at steps 9-11: both ranks skip them, and with 3 in a row (voted
    by step 12) go back to the checkpoint of step 8, once; the loaders go on, so steps 9-16
    train on batches 13-20 and batches 9-12 are never trained on. 16 steps straight equal
    12 (the rewind included) + resume + 4, bit for bit."""
    extra = ["train.checkpoint.every=4", "train.log_every=2", "model.args.rank=1"]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    done = run_ok(
        train_cmd(
            train_cache, straight, *extra, *rewind_args(tmp_path / "k1", 9, 3, 3), max_steps=16
        ),
        timeout=600,
    )
    assert "3 loss spikes in a row; back to step 8" in done.stderr
    (rewound,) = [r for r in metrics(straight) if r.get("event") == "rewind"]
    assert rewound == {
        "step": 12, "event": "rewind", "to_step": 8, "spikes": 3, "batches_skipped": 4
    }  # fmt: skip
    assert [e["step"] for e in spikes(straight)] == [9, 10, 11]
    assert [r["rewinds"] for r in metrics(straight) if "loss" in r][-1] == 1
    final = load(checkpoint(straight, 16))
    assert {int(s["step"]) for s in final["optimizer"]["state"].values()} == {16}
    assert final["spikes"]["rewinds"] == 1 and final["spikes"]["skipped"] == 3
    seen = [forward_keys(tmp_path / "k1", rank) for rank in (0, 1)]
    for rank in (0, 1):
        assert len(seen[rank]) == 20  # every batch drawn, each forwarded once
        assert seen[rank][12:16] != seen[rank][8:12]  # a replay would train 9-12 again
        local = load(checkpoint(straight, 16), f"rank-{rank:05d}.pt")
        assert local["loader"]["batches"] == 20

    for steps in (12, 16):
        cmd = train_cmd(
            train_cache, halves, *extra, *rewind_args(tmp_path / "k2", 9, 3, 3), max_steps=steps
        )
        run_ok(cmd, timeout=600)
    assert [r["to_step"] for r in metrics(halves) if r.get("event") == "rewind"] == [8]
    assert [forward_keys(tmp_path / "k2", rank) for rank in (0, 1)] == seen
    same_ddp_run(checkpoint(straight, 16), checkpoint(halves, 16))


@pytest.mark.slow
def test_noise_scale_matches_brute_force_on_unequal_ranks() -> None:
    """benchmarks/train/noise_scale_bench.py, shortened: exact per-example gradients of a linear
    regression on 2 gloo ranks of 16 and 48 examples a step."""
    from benchmarks.train import noise_scale_bench

    row = noise_scale_bench.measure(2, steps=1500)
    assert 0.9 < row["ratio"] < 1.1, row
    assert 0.95 < row["trace_ratio"] < 1.05, row


def test_the_fp16_scaler_backs_off_after_its_hysteresis_and_not_below_its_floor() -> None:
    from train.optim.scaler import HysteresisScaler

    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = HysteresisScaler(
        "cpu", enabled=True, hysteresis=2, min_scale=2.0, init_scale=16.0, growth_interval=3
    )
    overflows = [1, 0, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    scale, left, clean, want, got = 16.0, 2, 0, [], []
    for inf in overflows:  # reference: Megatron-LM's DynamicGradScaler.update
        if inf:
            clean, left = 0, left - 1
            if left <= 0:
                scale = max(scale * 0.5, 2.0)
        else:
            clean += 1
            if clean == 3:
                clean, left, scale = 0, 2, scale * 2
        want.append(scale)
        scaler.scale(torch.ones(()))  # starts the scale on the first call
        param.grad = torch.tensor([math.inf if inf else 1.0, 0.0])
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        got.append(scaler.get_scale())
        assert float(scaler.overflow) == inf
    assert got == want and min(got) == 2.0
    resumed = HysteresisScaler("cpu", enabled=True, hysteresis=2, min_scale=2.0)
    resumed.load_state_dict(scaler.state_dict())
    assert resumed.state_dict() == scaler.state_dict()


def test_an_fp16_spike_skips_the_update_but_is_no_overflow() -> None:
    from train.optim.scaler import HysteresisScaler

    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    scaler = HysteresisScaler("cpu", enabled=True, hysteresis=1, min_scale=1.0, init_scale=8.0)
    for spike, moved in ((True, False), (False, True)):
        before = param.detach().clone()
        scaler.scale(param.sum()).backward()
        scaler.unscale_(opt)
        scaler.step(opt, skip=torch.tensor(spike))
        scaler.update()
        opt.zero_grad()
        assert (not torch.equal(param, before)) == moved
        assert float(scaler.overflow) == 0 and scaler.get_scale() == 8.0  # no backoff
    assert int(opt.state[param]["step"]) == 1


def test_a_loss_spike_is_skipped_under_fp16(train_cache: Path, tmp_path: Path) -> None:
    """× 3, not × 100: a loss that large overflows fp16, which the scaler skips itself."""
    t = fit(train_cache, tmp_path, 12, *SPIKES, "train.precision=fp16", "model.args.factor=3.0")
    assert [e["step"] for e in spikes(tmp_path)] == [
        SPIKE_AT
    ] and t.parts.measures.spikes.skipped == 1
    assert all(r["amp_skip_rate"] == 0 for r in metrics(tmp_path) if "loss" in r)
    final = load(checkpoint(tmp_path, 12))
    assert {int(s["step"]) for s in final["optimizer"]["state"].values()} == {11}
    assert final["scaler"]["scale"] == 2.0**16  # the spike was no overflow: no backoff


def test_fp16_on_cpu_logs_its_skip_rate(train_cache: Path, tmp_path: Path) -> None:
    t = fit(train_cache, tmp_path, 6, "train.precision=fp16")
    windows = [r for r in metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in windows] == [3, 6]
    assert all(0 <= r["amp_skip_rate"] <= 1 for r in windows)
    assert load(checkpoint(tmp_path, 6))["scaler"]["hysteresis_left"] <= 2
    assert t.parts.scaler.get_scale() >= 1.0


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["train.adapt.noise_scale=true", "train.parallel.comm_hook=powersgd"],
            "train.parallel.comm_hook",
        ),
        (["train.adapt.batch_adaptive=true"], "train.adapt.noise_scale"),
        (["train.adapt.spike_min_history=200"], "train.adapt.spike_min_history"),
        (["train.adapt.spike_rewind_after=3"], "train.adapt.skip_spikes"),
        (["optim.clip=zclip2"], "optim.clip"),
        (["train.grad_accum=8", "train.adapt.batch_max_accum=4"], "train.adapt.batch_max_accum"),
    ],
)
def test_adaptive_keys_that_cannot_work_are_refused_by_name(
    overrides: list[str], named: str
) -> None:
    from melcache.errors import UserError

    with pytest.raises(UserError, match=re.escape(named)) as refused:
        load_config(REPO / "configs" / "tiny.toml", overrides)
    assert "\n" not in str(refused.value)


def test_adaptive_clipping_is_refused_with_sharded_gradients() -> None:
    from melcache.errors import UserError

    with pytest.raises(UserError, match=re.escape('optim.clip = "zclip" is not available with')):
        GradClip(OptimConfig(clip="zclip"), torch.device("cpu"), sharded=True)
