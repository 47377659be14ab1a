"""Real 2-process jobs: ``torchrun --standalone --nproc-per-node 2`` on CPU with gloo.

One uninterrupted 20-step run (module fixture) is the reference for every resume test:
stopping, killing or signalling a job and starting it again must end on the same bits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.support.helpers import (
    PROBE,
    REPO,
    SMALL,
    STEPS,
    checkpoint,
    child_pids,
    load,
    metrics,
    run_ok,
    torchrun,
    train_cmd,
)

pytestmark = pytest.mark.slow  # 2-process torchrun jobs: the full tier


def assert_bitwise_equal(a: Path, b: Path) -> None:
    """Same weights, same optimizer moments, same loader positions and RNG on every rank."""
    sa, sb = load(a), load(b)
    assert sa["step"] == sb["step"]
    for key, tensor in sa["model"].items():
        assert torch.equal(tensor, sb["model"][key]), f"model {key} differs"
    for pid, moments in sa["optimizer"]["state"].items():
        for key, tensor in moments.items():
            assert torch.equal(tensor, sb["optimizer"]["state"][pid][key]), f"optimizer {pid}.{key}"
    for name, tensor in sa["ema"]["shadow"].items():
        assert torch.equal(tensor, sb["ema"]["shadow"][name]), f"EMA {name} differs"
    for rank in (0, 1):
        ra, rb = load(a, f"rank-{rank:05d}.pt"), load(b, f"rank-{rank:05d}.pt")
        assert ra["loader"] == rb["loader"]
        assert torch.equal(ra["rng"]["torch"], rb["rng"]["torch"])


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def straight(train_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 steps without interruption: the reference run."""
    out = tmp_path_factory.mktemp("straight")
    run_ok(train_cmd(train_cache, out))
    return out


def test_loss_goes_down(straight: Path) -> None:
    losses = [r["loss"] for r in metrics(straight)]
    assert [r["step"] for r in metrics(straight)] == [5, 10, 15, 20]
    assert losses[-1] < 0.75 * losses[0], losses


def test_every_rank_runs_the_same_steps_on_uneven_shards(straight: Path, train_cache: Path) -> None:
    index = json.loads((train_cache / "index.json").read_text())
    sizes = {s["samples"] for s in index["shards"]}
    assert len(index["shards"]) % 2 == 1 and len(sizes) > 1  # ranks get unequal data
    final = checkpoint(straight, STEPS)
    for rank in (0, 1):
        local = load(final, f"rank-{rank:05d}.pt")
        assert local["step"] == STEPS and local["loader"]["batches"] == STEPS


def test_ddp_accumulation_allreduce_rounds_and_precisions(
    train_cache: Path, tmp_path: Path
) -> None:
    run_ok(torchrun(str(PROBE), "ddp", str(train_cache), str(tmp_path), *SMALL[:4]))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"probe-rank{rank}.json").read_text())
        # Gradient all-reduce rounds: with 3 micro-batches per step exactly the same calls,
        # at the same steps, as without accumulation — none under no_sync.
        assert result["rounds_accum1"] and sorted(set(result["rounds_accum1"])) == [0, 1, 2]
        assert result["rounds_accum3"] == result["rounds_accum1"]
        # 3 micro-batches × 2 ranks == one plain step on their union (fp32).
        union = result["union"]
        assert union["micro_batches_per_rank"] == 3
        assert union["max_rel_grad_diff"] < 1e-4, union
        assert union["max_param_diff"] < 0.05 * union["lr"], union
        assert result["fp16"]["scaler_enabled"] and result["fp16"]["scale"] > 0
        assert not result["bf16"]["scaler_enabled"] and result["bf16"]["precision"] == "bf16"
    rank0 = json.loads((tmp_path / "probe-rank0.json").read_text())
    for precision in ("fp16", "bf16"):
        losses = rank0[precision]["losses"]
        assert len(losses) == 3 and all(0 < v < 100 for v in losses), losses


def test_stop_and_resume_equals_uninterrupted(
    straight: Path, train_cache: Path, tmp_path: Path
) -> None:
    run_ok(train_cmd(train_cache, tmp_path, max_steps=5))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000005"]
    # The second half writes its checkpoints from a background thread: same bits on disk.
    done = run_ok(train_cmd(train_cache, tmp_path, "train.checkpoint.async_write=true"))
    assert "resumed from" in done.stderr
    assert_bitwise_equal(checkpoint(straight, STEPS), checkpoint(tmp_path, STEPS))
    keys = ("step", "loss", "mel_loss", "stop_loss", "grad_norm", "lr")
    assert [{k: r[k] for k in keys} for r in metrics(tmp_path)] == [
        {k: r[k] for k in keys} for r in metrics(straight)
    ]


def test_kill_9_during_checkpoint_write(straight: Path, train_cache: Path, tmp_path: Path) -> None:
    marker = tmp_path / "writing"
    # The same job, but the write of checkpoint 4 stalls halfway: kill -9 the ranks there.
    entry = (str(PROBE), "slow-ckpt", "4", str(marker), "--")
    cmd = train_cmd(train_cache, tmp_path, "train.checkpoint.every=2", entry=entry)
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(marker.exists, 180, "checkpoint 4 to be half written")
        for pid in child_pids(job.pid):
            os.kill(pid, signal.SIGKILL)
        job.wait(timeout=60)
    finally:
        job.kill()
    assert job.returncode != 0
    folder = tmp_path / "checkpoints"
    assert (folder / ".tmp-step-00000004").is_dir()  # the torn write is there...
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-00000002"]  # ...not "latest"
    load(checkpoint(tmp_path, 2))  # the previous checkpoint still loads
    done = run_ok(train_cmd(train_cache, tmp_path))
    assert "resumed from" in done.stderr and "step-00000002" in done.stderr
    assert not (folder / ".tmp-step-00000004").exists()
    assert_bitwise_equal(checkpoint(straight, STEPS), checkpoint(tmp_path, STEPS))


@pytest.mark.parametrize(
    "workers",
    [
        0,
        1,
    ],
)
def test_sigterm_checkpoints_and_exits_cleanly(
    train_cache: Path, tmp_path: Path, workers: int
) -> None:
    cmd = train_cmd(
        train_cache,
        tmp_path,
        f"data.num_workers={workers}",
        "train.log_every=1",
        "train.checkpoint.every=1000",
        max_steps=1000,
    )
    job = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        log = tmp_path / "metrics.jsonl"
        wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 2, 180, "2 steps")
        # What torchrun (or a scheduler) does on SIGTERM: signal every rank's process group.
        for pid in child_pids(job.pid):
            os.killpg(pid, signal.SIGTERM)
        output, _ = job.communicate(timeout=90)
    finally:
        job.kill()
    assert job.returncode == 0, output[-3000:]
    assert "stopping at step" in output and "SIGTERM" in output
    done = sorted((tmp_path / "checkpoints").glob("step-*"))
    assert len(done) == 1 and (done[0] / "COMPLETE.json").is_file()
    step = int(done[0].name.split("-")[1])
    assert 2 <= step < 1000
    assert {load(done[0], f"rank-{r:05d}.pt")["step"] for r in (0, 1)} == {step}
