"""Fault injection for the build stage (issue #6): nothing lost, nothing hangs.

Killed builds, killed workers and full disks end in a rerun that is byte-identical to an
uninterrupted build; hostile tar member names never reach the filesystem. Bad inputs, each a
counted rejection: ``test_rejections.py``.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from melcache.errors import ShardError
from melcache.format import HOST_TAG, INDEX_NAME
from melcache.host.lock import process_stat
from melcache.tar.reader import group_samples, iter_members
from preprocess.check.verify import verify
from preprocess.job.owners import sweep_temps
from tests.support.helpers import (
    SAMPLE_CORPUS,
    build_args,
    cache_digests,
    group_gone,
    pool_workers,
    read_samples,
    receipts,
    recorded,
    resize_tmpfs,
    run_preprocess,
    small_tmpfs,
    started,
    tree,
    wait_for,
)

pytestmark = pytest.mark.slow  # builds in subprocesses, kills, a tiny disk: the full tier


# ---- killed processes ---------------------------------------------------------------------------
def test_kill9_at_random_moments_then_rerun_is_byte_identical(
    tmp_path: Path, sample_cache: Path, small_shards_config: Path
) -> None:
    """Three SIGKILLs at seeded progress points with --workers 2 (the whole process group once,
    the main process alone twice, leaving its pool workers orphaned), then the same command."""
    rng = random.Random(1234)
    out = tmp_path / "out"
    args = build_args(SAMPLE_CORPUS, out, "--config", str(small_shards_config), "--workers", "2")
    planned = len(json.loads((sample_cache / INDEX_NAME).read_text())["shards"])
    for round_, whole_group in enumerate((True, False, False)):
        with started([sys.executable, "-m", "preprocess", *args], tmp_path / "kill.log") as proc:
            # 0 to 2 more shards, then up to 50 ms; never in the last four shards, so the
            # kill lands before the index phase (its own test below).
            target = min(receipts(out) + rng.randint(0, 2), planned - 4)
            progressed = wait_for(
                lambda t=target: (out / ".build").is_dir() and receipts(out) >= t, proc, 300
            )
            assert progressed, f"round {round_}: the build never reached {target} receipts"
            time.sleep(rng.uniform(0.0, 0.05))
            assert proc.poll() is None, f"round {round_}: the build ended before its kill"
            if whole_group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()  # the main process alone, as `kill -9 PID` does
            proc.wait()
            at_kill = receipts(out)
            assert group_gone(proc.pid, 60), "orphaned pool workers did not exit"
        assert receipts(out) <= at_kill + 2, "orphaned workers went on to start new shards"
        assert not (out / INDEX_NAME).exists()
    run_preprocess(*args)
    assert cache_digests(out) == cache_digests(sample_cache)
    assert verify(out) == []
    assert not list(out.glob("*.tmp"))


def wait_unless_stalled(proc: subprocess.Popen[bytes], out: Path, stall_s: float) -> int | None:
    """Wait for ``proc``; give up (``None``) once no shard has been acknowledged for ``stall_s``."""
    seen, since = receipts(out), time.monotonic()
    while proc.poll() is None and time.monotonic() - since < stall_s:
        time.sleep(0.05)
        if receipts(out) != seen:
            seen, since = receipts(out), time.monotonic()
    return proc.poll()


def test_killed_worker_neither_hangs_nor_corrupts(
    tmp_path: Path, sample_cache: Path, small_shards_config: Path
) -> None:
    out = tmp_path / "out"
    args = build_args(SAMPLE_CORPUS, out, "--config", str(small_shards_config), "--workers", "2")
    log = tmp_path / "killed_worker.log"
    with started([sys.executable, "-m", "preprocess", *args], log) as proc:
        assert wait_for(lambda: receipts(out) >= 1, proc, 300) and proc.poll() is None
        os.kill(pool_workers(proc.pid)[0], signal.SIGKILL)
        returncode = wait_unless_stalled(proc, out, stall_s=10)
    assert returncode is not None, "the build hung after one of its workers was killed"
    if returncode != 0:  # failing is fine when it is clear and claims nothing
        assert "Traceback" not in log.read_text() and not (out / INDEX_NAME).exists()
    run_preprocess(*args)
    assert cache_digests(out) == cache_digests(sample_cache)


def test_rerun_after_a_kill_while_writing_stats(
    tmp_path: Path, sample_cache: Path, small_shards_config: Path
) -> None:
    """Every shard done, killed inside zarr.save_group: what SIGKILL (or ENOSPC) leaves there."""
    out = Path(shutil.copytree(sample_cache, tmp_path / "out", symlinks=True))
    (out / INDEX_NAME).unlink()
    shutil.rmtree(out / "stats.zarr")
    killed = subprocess.Popen(["true"])  # the writer, gone: its pid names the temp folder
    killed.wait()
    half = out / f"stats.zarr.{HOST_TAG}-{killed.pid}.tmp"
    half.mkdir()
    (half / "zarr.json").write_text('{"zarr_format": 3, "node_ty')
    run_preprocess(
        *build_args(SAMPLE_CORPUS, out, "--config", str(small_shards_config), "--workers", "1")
    )
    assert cache_digests(out) == cache_digests(sample_cache)
    assert verify(out) == [] and not list(out.glob("*.tmp"))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_zombie_writers_temporary_file_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    """A killed build's orphaned pool workers may stay zombies (a container's PID 1 that never
    reaps them): a zombie writes nothing, so its temporary files are stale (CI once kept two)."""
    zombie = subprocess.Popen(["true"])  # exits, and stays a zombie until this test reaps it
    deadline = time.monotonic() + 30
    while process_stat(zombie.pid)[0] != "Z":
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    stale = tmp_path / f"b00-000001.tar.{HOST_TAG}-{zombie.pid}.tmp"
    live = tmp_path / f"b00-000002.tar.{HOST_TAG}-{os.getpid()}.tmp"
    for temp in (stale, live):
        temp.write_bytes(b"half a shard")
    sweep_temps(tmp_path)
    zombie.wait()
    assert not stale.exists() and live.exists()


# ---- a full disk --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def disk_full(
    tmp_path_factory: pytest.TempPathFactory, sample_cache: Path, small_shards_config: Path
) -> dict:
    """Build the sample corpus onto a tmpfs half the size of its shards, grow the tmpfs, rerun.

    Returns the first run (``failed``, with ``out`` and whether it left an index) and the
    rerun's digests and verify problems, all taken before the tmpfs is unmounted.
    """
    shard_bytes = sum(p.stat().st_size for p in sample_cache.glob("*.tar"))
    disk = tmp_path_factory.mktemp("disk") / "mnt"
    out = disk / "out"
    args = build_args(SAMPLE_CORPUS, out, "--config", str(small_shards_config), "--workers", "1")
    with small_tmpfs(disk, f"{shard_bytes // 2 // 1024}k"):
        failed = run_preprocess(*args, check=False)
        claimed = (out / INDEX_NAME).exists()
        resize_tmpfs(disk, "64m")
        rerun = run_preprocess(*args, check=False)
        return {
            "out": out,
            "failed": failed,
            "claimed": claimed,
            "rerun": rerun,
            "digests": cache_digests(out) if rerun.returncode == 0 else {},
            "problems": verify(out) if rerun.returncode == 0 else ["no rerun"],
        }


def test_disk_full_claims_nothing_and_rerun_completes(disk_full: dict, sample_cache: Path) -> None:
    assert disk_full["failed"].returncode != 0
    assert not disk_full["claimed"], "index.json written by a build that ran out of space"
    assert disk_full["rerun"].returncode == 0, disk_full["rerun"].stderr
    assert disk_full["digests"] == cache_digests(sample_cache)
    assert disk_full["problems"] == []


def test_disk_full_is_one_clear_error_line(disk_full: dict) -> None:
    stderr = disk_full["failed"].stderr
    assert disk_full["failed"].returncode in (1, 2)
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "No space left" in errors[0] or "disk full" in errors[0]
    assert str(disk_full["out"]) in errors[0]


# ---- untrusted shard content --------------------------------------------------------------------
HOSTILE_NAMES = ("../escape.json", "../../escape.mel.npy", "sub/../../escape2.json")


def hostile_shard(path: Path, honest: Path, absolute: Path | None) -> None:
    """``honest``'s samples plus members named to escape; links too; ``absolute`` if given."""
    with tarfile.open(honest) as source, tarfile.open(path, "w") as tar:
        for member in source.getmembers():
            tar.addfile(member, source.extractfile(member))
        names = [*HOSTILE_NAMES, *([f"{absolute}.json"] if absolute else [])]
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
        for kind, name, target in [
            (tarfile.SYMTYPE, "link.json", "/etc/passwd"),
            (tarfile.LNKTYPE, "hard.json", "../escape.json"),
        ]:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info)


def test_hostile_member_names_are_skipped_or_refused(
    tmp_path: Path, sample_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "a" / "b"  # ../ and ../../ from here still land inside tmp_path
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    honest = sorted(sample_cache.glob("*.tar"))[0]
    keys = [s["__key__"] for s in read_samples(honest)]
    relative, absolute = tmp_path / "b00-000000.tar", tmp_path / "outside" / "abs"
    hostile_shard(relative, honest, absolute=None)
    hostile_shard(tmp_path / "b00-000001.tar", honest, absolute=absolute)
    before = tree(tmp_path)

    unknown: list[str] = []
    with open(relative, "rb") as stream:
        members = iter_members(stream, relative.name, unknown.append)
        samples = list(group_samples(members, relative.name))
    assert [s["__key__"] for s in samples] == keys  # the honest samples, nothing else
    assert sorted(unknown) == sorted(HOSTILE_NAMES)
    with open(tmp_path / "b00-000001.tar", "rb") as stream, pytest.raises(ShardError) as caught:
        list(iter_members(stream, "b00-000001.tar"))
    assert str(caught.value).startswith("b00-000001.tar: unsafe member name")
    assert tree(tmp_path) == before  # ../, ../../ and the absolute name all fall inside it


def test_verify_reports_hostile_members_without_writing(
    tmp_path: Path, sample_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = Path(shutil.copytree(sample_cache, tmp_path / "cache", symlinks=True))
    cwd = cache / "x" / "y"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    index = json.loads((cache / INDEX_NAME).read_text())
    absolute = tmp_path / "outside" / "abs"
    for entry, target in zip(index["shards"][:2], (None, absolute), strict=True):
        shard = cache / entry["name"]
        hostile_shard(tmp_path / "hostile.tar", shard, absolute=target)
        os.replace(tmp_path / "hostile.tar", shard)
        entry.update(recorded(shard.read_bytes()))
    (cache / INDEX_NAME).write_text(json.dumps(index))
    before = tree(tmp_path)

    report = "\n".join(verify(cache))
    first, second = index["shards"][0]["name"], index["shards"][1]["name"]
    for name in HOSTILE_NAMES:
        assert f"{first}: foreign member {name!r} (never read)" in report
    assert f"{second}: unsafe member name '{absolute}.json'" in report
    assert tree(tmp_path) == before  # ../, ../../ and the absolute name all fall inside it
