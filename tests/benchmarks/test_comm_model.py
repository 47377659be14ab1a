"""benchmarks/train/comm_model.py: its byte counts equal the real hooks' on gloo, and its model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.train import comm_model

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_measured_bytes_equal_the_closed_form(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "benchmarks.train.comm_model", "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]  # exit 1 when a count differs
    measured = json.loads(out.read_text())["measured"]
    assert [r["strategy"] for r in measured] == list(comm_model.STRATEGIES)
    assert all(r["sent"] == r["closed_form"] and r["sent"] for r in measured)
    by = {r["strategy"]: r for r in measured}
    assert by["fsdp2"]["optim_bytes"] < 0.51 * by["ddp-fp32"]["optim_bytes"]  # sharded in two
    assert by["powersgd-r1"]["sent"]["all_reduce"] < by["ddp-bf16"]["sent"]["all_reduce"] / 10
    assert "| ddp-fp32 | AR " in done.stdout and "one 400 Gb NIC per node" in done.stdout


def test_model_favours_big_buckets_for_powersgd_and_nvlink_for_hsdp() -> None:
    model = comm_model.meta_model("1B")
    thin = comm_model.CLUSTERS[2]
    small, big = (
        comm_model.step_comm_s(f"powersgd-r4@{mb}", model, 1024, thin) for mb in (25, 200)
    )
    assert big < small < comm_model.step_comm_s("ddp-fp32", model, 1024, thin)
    assert comm_model.memory_gb("ddp-fp32", model, 8) == pytest.approx(16 * 1.012, rel=0.01)
    assert comm_model.memory_gb("hsdp", model, 1024) == comm_model.memory_gb("fsdp2", model, 8)


@pytest.mark.slow
def test_hook_overlap_times_both_hooks_on_several_buckets(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "benchmarks.train.hook_overlap", "--dim", "64", "--layers", "2"]
    cmd += ["--bucket-mb", "0.1", "--steps", "2", "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["hook"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == ["allreduce", "powersgd-r4"]
    assert all(
        r["buckets"] >= 2 and r["in_hook_ms"] > 0 and r["compute_ms"] > 0 for r in rows.values()
    )
    assert "| powersgd-r4 |" in done.stdout and "in the hook ms" in done.stdout
