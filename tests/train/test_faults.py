"""Fault injection for training (issue #6): real 2-rank torchrun jobs on CPU.

- A shard damaged after the build (truncated, or bytes flipped inside a mel): ``verify``
  names it; ``data.on_error=skip`` logs it once per rank and every rank still runs every
  step; ``data.on_error=raise`` stops the whole job with an error naming the shard, within a
  bounded time, leaving no rank hung in a collective and no process behind.
- ``kill -9`` of one rank under ``torchrun --max-restarts 1``: the job restarts from the
  last complete checkpoint and ends at the same final step.

The restart works with torchrun's default shared rendezvous store (each attempt's keys are
prefixed, ``train/parallel/env.py``). Bytes flipped inside a mel, behind intact tar and .npy
headers, are caught by the loader's default shard check (xxh3_128) before the shard is used;
the same damage met in a later epoch is tested in test_shard_check.py.
- A checkpoint carrying a pickled payload is refused (``weights_only=True``), and the payload
  never runs, whether the file is loaded by the checkpointer or by a resuming ``python -m
  train``.

Cases covered elsewhere are not repeated: kill -9 during a checkpoint write and SIGTERM
(tests/train/parallel/test_ddp.py), truncated/flipped shards in ``verify``
(tests/preprocess/test_verify.py) and in a single-process loader
(tests/melcache/loader/test_faults.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from melcache.errors import UserError
from melcache.format import MEL_MEMBER
from melcache.loader import DataConfig, make_loader
from melcache.loader.stream import planned_stream
from tests.support.helpers import (
    REPO,
    SMALL,
    checkpoint,
    child_pids,
    load,
    metrics,
    processes_naming,
    run_preprocess,
    train_cmd,
    wait_for,
)
from train.config.tables import load_config
from train.parallel.env import Env
from train.run.checkpoint import SHARED, Checkpointer, rank_file

pytestmark = pytest.mark.slow  # torchrun jobs, kills and damaged caches: the full tier

CPU = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
# A job whose ranks wait on a dead peer must end well within this (torchrun's own grace
# period before SIGKILL is 30 s).
BOUND_S = 120
STEPS = 20


# ---- helpers -------------------------------------------------------------------------------
def trainer_data(*extra: str) -> DataConfig:
    """The ``[data]`` the tests' trainer runs with (tiny, SMALL, ``extra``)."""
    return load_config(REPO / "configs" / "tiny.toml", [*SMALL, *extra]).data


def first_of_rank_1(cache: Path, *extra: str) -> tuple[str, str]:
    """The shard and key of the first utterance rank 1 (of 2) trains on under the trainer's
    config: its first step needs it, so damage there is met at once, on rank 1, whether it
    reads whole shards or only its own rows."""
    loader = make_loader(cache, trainer_data(*extra), rank=1, world_size=2)
    try:
        _, _, samples, _, entries = next(planned_stream(loader.spec, 0))
    finally:
        loader.close()
    key = samples[0].key
    for entry in entries:
        with tarfile.open(cache / entry["name"]) as tar:
            if f"{key}.{MEL_MEMBER}" in tar.getnames():
                return entry["name"], key
    raise AssertionError(f"{key} is in none of {[e['name'] for e in entries]}")


def load_index(cache: Path) -> dict:
    return json.loads((cache / "index.json").read_text())


def truncate(shard: Path, key: str) -> None:
    """Cut the shard in half (its size no longer the index's: met at its first read)."""
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def flip_mel_bytes(shard: Path, key: str) -> None:
    """Flip 16 bytes in the middle of utterance ``key``'s mel data: the tar and the .npy header
    stay intact, so only a digest can tell."""
    with tarfile.open(shard) as tar:
        member = tar.getmember(f"{key}.{MEL_MEMBER}")
    middle = member.offset_data + member.size // 2
    data = bytearray(shard.read_bytes())
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    shard.write_bytes(bytes(data))


DAMAGE = {"truncated": truncate, "flipped": flip_mel_bytes}


def damaged_copy(cache: Path, dest: Path, how: str, *extra: str) -> str:
    """Copy ``cache`` to ``dest`` and damage what rank 1 reads first; return its shard's name."""
    shutil.copytree(cache, dest)
    name, key = first_of_rank_1(dest, *extra)
    DAMAGE[how](dest / name, key)
    return name


def gone_within(tag: str, timeout: float) -> list[int]:
    """Wait until no process names ``tag``; return the ones still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while (left := processes_naming(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@contextlib.contextmanager
def job(
    cmd: list[str], tag: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """Start ``cmd``; on the way out SIGKILL, by pid, whatever still names ``tag``."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in processes_naming(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def rank_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of global rank ``rank`` among torchrun's children (from its environment)."""
    for pid in child_pids(torchrun_pid):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return pid
    raise AssertionError(f"no rank {rank} among the children of torchrun {torchrun_pid}")


def skip_log_ranks(output: str, name: str) -> list[int]:
    """The rank of every "skipping shard NAME" log line, one entry per line."""
    pattern = rf"\[rank (\d)\] melcache\.loader\.stream_loader: skipping shard {re.escape(name)}: .*{re.escape(name)}"
    return [int(rank) for rank in re.findall(pattern, output)]


# ---- corrupt data at training time -----------------------------------------------------------
@pytest.mark.parametrize("how", ["truncated", "flipped"])
def test_damaged_shard_is_skipped_once_and_every_rank_runs_every_step(
    train_cache: Path, tmp_path: Path, how: str
) -> None:
    cache, out = tmp_path / "cache", tmp_path / "run"
    name = damaged_copy(train_cache, cache, how)
    verdict = run_preprocess("verify", str(cache), "--workers", "1", check=False)
    assert verdict.returncode == 1 and f"{name}: sha256 differs" in verdict.stdout

    with job(train_cmd(cache, out, "data.on_error=skip", max_steps=STEPS), str(out)) as p:
        output, _ = p.communicate(timeout=4 * BOUND_S)
    assert p.returncode == 0, output[-4000:]
    final = checkpoint(out, STEPS)
    logged = skip_log_ranks(output, name)
    # Rank 1 meets the shard at its first step and again in later epochs: one line per rank.
    assert 1 in logged and len(logged) == len(set(logged)), output[-4000:]
    for rank in (0, 1):
        local = load(final, rank_file(rank))
        assert local["step"] == STEPS and local["loader"]["batches"] == STEPS
        assert (name in local["loader"]["skipped_shards"]) == (rank in logged)
    assert [r["step"] for r in metrics(out)] == [5, 10, 15, 20]


@pytest.mark.parametrize(
    ("how", "extra", "error"),
    [
        # Met in rank 1's loader worker process, re-raised in the rank by DataLoader.
        pytest.param(
            "truncated",
            ("data.num_workers=1",),
            r"\d+ bytes, the index says",
            id="truncated-workers1",
        ),
        # Met in rank 1's own process (no loader workers).
        pytest.param(
            "flipped",
            ("data.num_workers=0",),
            # Whole-shard digest, or the table's digest of the one utterance where rank 1
            # reads only its own rows (it shares the unit with rank 0).
            r"(xxh3_128 differs from the index|the \d+ bytes at \d+ are not the sample utterances"
            r"\.table records)",
            id="flipped-workers0",
        ),
    ],
)
def test_damaged_shard_with_on_error_raise_stops_every_rank_in_bounded_time(
    train_cache: Path, tmp_path: Path, how: str, extra: tuple[str, ...], error: str
) -> None:
    cache, out = tmp_path / "cache", tmp_path / "run"
    name = damaged_copy(train_cache, cache, how, *extra)
    # Rank 1 fails on its first batch while rank 0 waits for it in the step's all-reduce.
    start = time.monotonic()
    with job(train_cmd(cache, out, "data.on_error=raise", *extra, max_steps=STEPS), str(out)) as p:
        try:
            output, _ = p.communicate(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"job still running after {BOUND_S} s: a rank hangs in a collective")
        elapsed = time.monotonic() - start
        left = gone_within(str(out), 30)
    assert p.returncode != 0
    assert re.search(rf"\[rank 1\] train: \S*{re.escape(name)}: {error}", output) or re.search(
        rf"ShardError: \S*{re.escape(name)}: {error}", output
    ), output[-4000:]
    assert re.search(r"exitcode\s*:\s*2\b", output), output[-4000:]  # the CLI's error exit
    assert not left, f"processes left behind: {left}"
    assert not list((out / "checkpoints").glob("step-*"))
    print(f"on_error=raise ({how}): job ended {elapsed:.1f} s after start")


def test_flipped_mel_bytes_are_caught_under_the_default_config(
    train_cache: Path, tmp_path: Path
) -> None:
    """Neither the trainer's config nor ``make_loader`` needs to be told to check."""
    assert DataConfig().shard_check == "fast"
    extra = ("data.num_workers=0", "data.on_error=skip")
    name = damaged_copy(train_cache, tmp_path / "cache", "flipped", *extra)
    data = trainer_data(*extra)
    assert data.shard_check == "fast"
    stream = make_loader(tmp_path / "cache", data, rank=1, world_size=2)
    try:
        batches = iter(stream)
        for _ in range(4):  # rank 1 reads the damaged shard first
            next(batches)
    finally:
        stream.close()
    assert name in stream.skipped_shards


# ---- kill -9 of one rank ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "store_env",
    [
        pytest.param({}, id="torchrun-default"),
        pytest.param({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, id="private-store"),
    ],
)
def test_kill_9_one_rank_restarts_from_last_checkpoint(
    train_cache: Path, tmp_path: Path, store_env: dict[str, str]
) -> None:
    steps = 40
    out = tmp_path / "run"
    entry = ("--max-restarts", "1", "-m", "train")
    cmd = train_cmd(train_cache, out, max_steps=steps, entry=entry)
    with job(cmd, str(out), env={**os.environ, **store_env}) as p:
        assert wait_for(checkpoint(out, 5).is_dir, p, BOUND_S), "no first checkpoint"
        os.kill(rank_pid(p.pid, 1), signal.SIGKILL)
        killed_at = time.monotonic()
        saved = sorted(c.name for c in (out / "checkpoints").glob("step-*"))
        try:
            output, _ = p.communicate(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not finish within {BOUND_S} s of the kill")
        recovered_s = time.monotonic() - killed_at
    assert saved[-1] != checkpoint(out, steps).name, "the job finished before the kill"
    assert p.returncode == 0, output[-4000:]
    resumed = re.findall(r"resumed from \S*step-(\d{8})", output)
    assert len(resumed) == 1 and 5 <= int(resumed[0]) < steps, output[-4000:]
    final = checkpoint(out, steps)
    assert load(final)["step"] == steps
    for rank in (0, 1):
        local = load(final, rank_file(rank))
        assert local["step"] == steps and local["loader"]["batches"] == steps
    # The restarted run rewrote the records past its checkpoint: one per log step, in order.
    assert [r["step"] for r in metrics(out)] == list(range(5, steps + 1, 5))
    print(f"kill -9 rank 1: job done {recovered_s:.1f} s later, resumed at step {resumed[0]}")


# ---- untrusted checkpoints ---------------------------------------------------------------------
class Payload:
    """Unpickling this runs ``os.mkdir(marker)``: the trace a real exploit would leave."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def plant(folder: Path, target: str, marker: Path) -> Path:
    """A complete single-rank checkpoint whose ``target`` file carries a :class:`Payload`."""
    ckpt = Checkpointer(folder, CPU, keep=2, async_save=False)
    shared = {"step": 1, "model": {"w": torch.zeros(2)}}
    local = {"step": 1, "rank": 0}
    (shared if target == SHARED else local)["extra"] = Payload(marker)
    ckpt.save(1, shared, local)
    return folder / "step-00000001"


@pytest.mark.parametrize("target", [SHARED, rank_file(0)])
def test_checkpointer_refuses_a_pickled_payload(tmp_path: Path, target: str) -> None:
    live, marker = tmp_path / "payload-ran-unsafe-load", tmp_path / "payload-ran"
    path = plant(tmp_path / "proof", target, live)
    torch.load(path / target, weights_only=False)  # the payload is real: a plain load runs it
    assert live.is_dir()

    path = plant(tmp_path / "checkpoints", target, marker)
    ckpt = Checkpointer(tmp_path / "checkpoints", CPU, keep=2, async_save=False)
    with pytest.raises(UserError, match=r"refused \(weights_only\)"):
        ckpt.load(ckpt.latest())
    assert not marker.exists()


def test_resuming_run_refuses_a_pickled_payload(train_cache: Path, tmp_path: Path) -> None:
    out, marker = tmp_path / "run", tmp_path / "payload-ran"
    plant(out / "checkpoints", SHARED, marker)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "train", "--shards", str(train_cache), "--out", str(out)),
            *("--config", str(REPO / "configs" / "tiny.toml"), "--max-steps", "2"),
            *("data.num_workers=0", "data.batch_frames=800", "train.precision=fp32"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    assert done.returncode != 0
    assert re.search(r"(?i)weights.only", done.stderr), done.stderr[-3000:]
    assert not marker.exists()
    assert not checkpoint(out, 2).exists()
