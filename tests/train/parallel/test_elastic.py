"""A run folder written by a job of 4 ranks resumed by one of 2 with the same command (#39):
real torchrun gloo jobs, DDP and FSDP2 (its weights resharded by DCP)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.helpers import metrics, run_ok, train_cmd

STRATEGIES = {"ddp": (), "fsdp2": ("train.parallel.strategy=fsdp2",)}


def on_ranks(command: list[str], count: int) -> list[str]:
    """``command`` (a torchrun line) with ``count`` processes."""
    at = command.index("--nproc-per-node") + 1
    return [*command[:at], str(count), *command[at + 1 :]]


@pytest.mark.slow  # two torchrun jobs, of 4 and 2 processes
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_a_run_of_4_ranks_trains_on_with_2(
    train_cache: Path, tmp_path: Path, strategy: str
) -> None:
    out, extra = tmp_path / "run", STRATEGIES[strategy]
    run_ok(on_ranks(train_cmd(train_cache, out, *extra, max_steps=10), 4), timeout=400)
    done = run_ok(on_ranks(train_cmd(train_cache, out, *extra, max_steps=20), 2), timeout=400)
    assert "resumed from" in done.stderr and "world_size 4 -> 2" in done.stderr
    records = metrics(out)
    changed = [r for r in records if r.get("event") == "resumed_changed"]
    assert [r["step"] for r in changed] == [10] and "world_size 4 -> 2" in changed[0]["changes"]
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert [s for s, _ in losses] == sorted({s for s, _ in losses})  # one record per step
    after = [loss for step, loss in losses if step > 10]
    assert after and all(math.isfinite(loss) for loss in after)
    assert max(after) < losses[0][1]  # it goes on from the trained weights, not afresh


@pytest.mark.slow  # two torchrun jobs of 2 processes
def test_a_run_resumed_with_new_mix_weights_follows_them(
    train_cache: Path, sample_cache: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    entry = ("-m", "train", "--shards", str(sample_cache))  # options before the overrides

    def weights(a: float, b: float) -> str:
        return f'data.mix={{"{train_cache}" = {a}, "{sample_cache}" = {b}}}'

    budget = "data.batch_frames=3000"  # the sample cache's longest utterance: 871 frames
    run_ok(train_cmd(train_cache, out, weights(0.7, 0.3), budget, entry=entry, max_steps=10))
    done = run_ok(train_cmd(train_cache, out, weights(0.3, 0.7), budget, entry=entry, max_steps=20))
    assert "resumed with changes: mix shares" in done.stderr
    changed = [r for r in metrics(out) if r.get("event") == "resumed_changed"]
    assert (
        len(changed) == 1 and "[0.3, 0.7] -> [0.7, 0.3]" in changed[0]["changes"][0]
    )  # sample first
