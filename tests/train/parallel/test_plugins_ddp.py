"""Plug-in models on 2 gloo ranks (torchrun): a collective in the forward is refused at start,
naming the module; accepted by its key, an out-of-memory error then ends the run cleanly (no
collective mismatch) and the same command resumes with the cut applied."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.helpers import REPO, metrics, run_ok, train_cmd

pytestmark = pytest.mark.slow


def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)


def test_a_forward_all_reduce_is_refused_naming_the_module(
    train_cache: Path, tmp_path: Path
) -> None:
    done = run(
        train_cmd(train_cache, tmp_path, "model.impl=tests.support.plugin_models:ForwardAllReduce")
    )
    assert done.returncode != 0
    assert "allreduce_ ×1 in module 'stats'" in done.stderr
    assert "train.parallel.allow_forward_collectives = true" in done.stderr
    assert not (tmp_path / "checkpoints" / "step-00000001").exists()


def test_ddps_unused_parameter_error_names_the_parameters(
    train_cache: Path, tmp_path: Path
) -> None:
    done = run(
        train_cmd(
            train_cache, tmp_path, "model.impl=tests.support.plugin_models:UnusedAfterFirstStep"
        )
    )
    assert done.returncode != 0
    line = next(x for x in done.stderr.splitlines() if "got no gradient" in x)
    assert "late_head.weight, late_head.bias" in line
    assert "train.parallel.find_unused_parameters = true" in line


def test_allowed_collectives_turn_oom_recovery_off(train_cache: Path, tmp_path: Path) -> None:
    """An out-of-memory error on one rank ends the run with one line saying why and what to do,
    not with gloo's collective mismatch abort (a cut pass or a stand-in would run the forward's
    collective a different number of times on each rank)."""
    cmd = train_cmd(
        train_cache,
        tmp_path,
        "model.impl=tests.support.plugin_models:ForwardAllReduceOutOfMemory",
        "model.args.limit_frames=600",
        "model.args.rank=1",
        "train.parallel.allow_forward_collectives=true",
        # Greedy batches of the whole-cache stream: some over the limit within 10 steps.
        "data.sync_buckets=false",
        max_steps=10,
    )
    done = run(cmd)
    assert done.returncode != 0
    line = next(x for x in done.stderr.splitlines() if "recovery is off" in x)
    assert "[rank 1]" in line and "lower data.batch_frames" in line
    assert "mismatch" not in done.stderr
    assert not list(tmp_path.glob("oom-rank-*.json"))
    # Without the out-of-memory errors the same model trains to the end.
    run_ok([*cmd, "model.args.limit_frames=100000"])
    assert max(r["step"] for r in metrics(tmp_path)) == 10
