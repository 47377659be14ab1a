"""Fault injection for the build stage (issue #6): nothing lost, nothing hangs.

Bad inputs end as counted rejections with a reason (``written + rejected == discovered``);
killed builds, killed workers and full disks end in a rerun that is byte-identical to an
uninterrupted build; hostile tar member names never reach the filesystem. Cases already
covered by ``test_build.py`` (silence, 0.05 s, Latin-1 ``.txt``, orphan audio, text as
``.wav``, LJSpeech missing audio and malformed row, JSONL not JSON, absolute manifest path)
are not repeated here.
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
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
from helpers import (
    REPO,
    SAMPLE_CORPUS,
    build_args,
    build_command,
    cache_digests,
    group_gone,
    pool_workers,
    receipts,
    recorded,
    resize_tmpfs,
    run_preprocess,
    small_tmpfs,
    started,
    tree,
    unprivileged_prefix,
    wait_for,
)

from melcache.errors import ShardError
from melcache.format import (
    HOST_TAG,
    INDEX_NAME,
    REJECTED_NAME,
    decode_mel_npy,
    decode_meta,
    group_samples,
    iter_members,
)
from melcache.lock import process_stat
from preprocess.check.verify import verify
from preprocess.inputs.audio import resampled_length
from preprocess.inputs.corpus import open_corpus, share
from preprocess.inputs.records import Found, Slice
from preprocess.job.owners import sweep_temps

pytestmark = pytest.mark.slow  # builds in subprocesses, kills, a tiny disk: the full tier
SPEECH = SAMPLE_CORPUS / "en_m3" / "en_m3_02.wav"  # 1.5 s, 16 kHz mono
FLAC = SAMPLE_CORPUS / "zh" / "zh_02.flac"  # 3 s, 22.05 kHz


def write_utterance(path: Path, audio: np.ndarray, rate: int, **kw: str) -> None:
    sf.write(path, audio, rate, **kw)
    path.with_suffix(".txt").write_text("some words", encoding="utf-8")


def rejected_by_source(out: Path) -> dict[str, dict[str, str]]:
    lines = (out / REJECTED_NAME).read_text(encoding="utf-8").splitlines()
    return {r["source"]: r for r in map(json.loads, lines)}


def read_samples(shard: Path) -> list[dict]:
    with open(shard, "rb") as stream:
        return list(group_samples(iter_members(stream, shard.name), shard.name))


def written_samples(out: Path) -> dict[str, tuple[dict, np.ndarray]]:
    """``source → (json meta, mel)`` of every sample in a built cache."""
    found = {}
    for entry in json.loads((out / INDEX_NAME).read_text())["shards"]:
        for sample in read_samples(out / entry["name"]):
            meta = decode_meta(sample["json"], entry["name"])
            found[meta["source"]] = (meta, decode_mel_npy(sample["mel.npy"], 100, entry["name"]))
    return found


def assert_counted(out: Path, written: set[str], rejected: dict[str, str]) -> None:
    """The cache holds exactly ``written``; each of ``rejected`` (source → reason kind) is listed
    once in rejected.jsonl, counted by kind in the index, and the sums add up."""
    index = json.loads((out / INDEX_NAME).read_text())
    records = rejected_by_source(out)
    assert {s: r["reason"].split(":")[0] for s, r in records.items()} == rejected
    assert all(r["reason"].strip() for r in records.values())
    assert set(written_samples(out)) == written
    totals = index["totals"]
    assert totals["discovered"] == len(written) + len(rejected)
    assert totals["utterances"] + totals["rejected"] == totals["discovered"]
    assert totals["rejected_by_reason"] == dict(Counter(rejected.values()))
    assert verify(out) == []


# ---- bad input: each a counted rejection, the rest built, exit 0 --------------------------------
def test_bad_folder_inputs_are_counted_rejections(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(6)
    speech, rate = sf.read(SPEECH, dtype="float32")
    write_utterance(src / "good.wav", speech, rate)
    raw = SPEECH.read_bytes()
    (src / "trunc_header.wav").write_bytes(raw[:30])  # cut inside the fmt chunk
    (src / "zero.wav").write_bytes(b"")
    (src / "text.mp3").write_text("a text file with an audio extension\n" * 20)
    (src / "trunc.flac").write_bytes(FLAC.read_bytes()[: FLAC.stat().st_size // 2])
    for name in ("trunc_header", "zero", "text", "trunc"):
        (src / f"{name}.txt").write_text("some words")
    write_utterance(src / "long70.wav", 0.1 * rng.standard_normal(8000 * 70), 8000)
    stereo = soxr.resample(np.stack([speech, 0.5 * speech], axis=1), rate, 8000)
    write_utterance(src / "u8.wav", stereo, 8000, subtype="PCM_U8")
    write_utterance(src / "clipped.wav", np.clip(4 * rng.standard_normal(16000), -1, 1), 16000)
    os.symlink(".", src / "loop")  # the corpus inside itself
    (src / "sub").mkdir()
    os.symlink("..", src / "sub" / "up")

    out = tmp_path / "out"
    done = run_preprocess(*build_args(src, out, "--workers", "2"))
    assert "Traceback" not in done.stderr
    assert_counted(
        out,
        written={"good.wav", "u8.wav", "clipped.wav"},
        rejected={
            "trunc_header.wav": "unreadable audio",
            "zero.wav": "unreadable audio",
            "text.mp3": "unreadable audio",
            "trunc.flac": "undecodable audio",  # its header is intact: fails while decoding
            "long70.wav": "too long",
            "loop": "symlink loop",
            "sub/up": "symlink loop",
        },
    )
    records = rejected_by_source(out)
    assert records["long70.wav"]["stage"] == "discover"  # judged by its header, never decoded
    assert records["trunc.flac"]["stage"] == "decode"
    # 8-bit unsigned stereo at 8 kHz is mixed down and resampled, with exact header framing.
    samples = written_samples(out)
    meta, mel = samples["u8.wav"]
    n = resampled_length(len(stereo), 8000, 24000)
    assert meta["sample_rate"] == 24000 and meta["frames"] == 1 + n // 256 == mel.shape[0]
    assert float(mel.max() - mel.min()) > 5  # speech, not a flat line of zeros
    _, clipped = samples["clipped.wav"]
    assert np.isfinite(clipped.astype(np.float32)).all()


def test_non_finite_audio_is_a_counted_rejection(tmp_path: Path) -> None:
    """NaN or inf samples, and finite float samples so large the spectrum overflows, never
    reach a shard: each is a rejection with its reason, the rest is built."""
    src = tmp_path / "src"
    src.mkdir()
    speech, rate = sf.read(SPEECH, dtype="float32")
    write_utterance(src / "good.wav", speech, rate, subtype="FLOAT")
    for name, value in (("nan", np.nan), ("inf", np.inf), ("neginf", -np.inf)):
        damaged = speech.copy()
        damaged[len(damaged) // 2] = value
        write_utterance(src / f"{name}.wav", damaged, rate, subtype="FLOAT")
    write_utterance(src / "huge.wav", speech * np.float32(1e30), rate, subtype="FLOAT")
    out = tmp_path / "out"
    done = run_preprocess(*build_args(src, out, "--workers", "1"))
    assert "Traceback" not in done.stderr
    assert_counted(
        out,
        written={"good.wav"},
        rejected={
            "nan.wav": "non-finite audio",
            "inf.wav": "non-finite audio",
            "neginf.wav": "non-finite audio",
            "huge.wav": "non-finite mel",
        },
    )


def test_non_unicode_names_and_text_cost_only_themselves(tmp_path: Path) -> None:
    """A file name byte that is not UTF-8, a lone surrogate in JSONL text or speaker: each a
    rejection with a printable source, the rest built, no temporary file left."""
    speech, rate = sf.read(SPEECH, dtype="float32")
    folder = tmp_path / "folder"
    folder.mkdir()
    write_utterance(folder / "good.wav", speech, rate)
    latin1 = os.fsencode(folder) + b"/caf\xe9"  # legal on Linux, not UTF-8
    shutil.copy(folder / "good.wav", latin1 + b".wav")
    shutil.copy(folder / "good.txt", latin1 + b".txt")
    out = tmp_path / "out-folder"
    done = run_preprocess(*build_args(folder, out, "--workers", "2"))
    assert "Traceback" not in done.stderr
    assert_counted(
        out, written={"good.wav"}, rejected={"caf\\xe9.wav": "file name is not valid UTF-8"}
    )

    manifest = folder / "list.jsonl"
    rows = [
        {"audio_filepath": "good.wav", "text": "fine words"},
        {"audio_filepath": "good.wav", "text": "broken \ud800 text"},
        {"audio_filepath": "good.wav", "text": "fine", "speaker": "\udc80"},
    ]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))  # ASCII escapes
    out = tmp_path / "out-manifest"
    done = run_preprocess(*build_args(manifest, out, "--workers", "1"))
    assert "Traceback" not in done.stderr
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["totals"]["rejected_by_reason"] == {
        "transcript is not valid Unicode (a lone surrogate)": 1,
        "speaker is not valid Unicode (a lone surrogate)": 1,
    }
    assert index["totals"]["utterances"] == 1 and verify(out) == []
    assert not list(out.glob("*.tmp"))


def test_two_builds_into_one_out_both_finish_and_say_so(tmp_path: Path) -> None:
    """A retry started while the first attempt still runs (here: stopped mid-shard) names it
    (pid and host), never sweeps the temporary file it is writing, and both exit 0."""
    corpus = tmp_path / "corpus"  # ten copies: shards of several utterances, slow to write
    for copy in range(10):
        shutil.copytree(SAMPLE_CORPUS, corpus / f"copy{copy}")
    out = tmp_path / "out"
    command = build_command(corpus, out, "--workers", "1")
    with started(command, tmp_path / "first.log") as first:
        assert wait_for(lambda: any(out.glob("*.tmp")), first, 120), "no shard was being written"
        os.killpg(first.pid, signal.SIGSTOP)  # the first attempt, mid-shard, still alive
        writing = list(out.glob("*.tmp"))
        second = run_preprocess(*build_args(corpus, out, "--workers", "1"), check=False)
        assert all(temp.exists() for temp in writing)  # its live temporary file survived
        os.killpg(first.pid, signal.SIGCONT)
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()
    assert second.returncode == 0, second.stderr
    assert f"another build is writing {out}: pid {first.pid} on host " in second.stderr
    assert verify(out) == [] and not list(out.glob("*.tmp"))
    assert not list((out / ".build").glob("running.*"))


def test_bad_ljspeech_rows_are_counted_rejections(tmp_path: Path) -> None:
    lj = tmp_path / "lj"
    (lj / "wavs").mkdir(parents=True)
    for uid in ("LJ-1", "LJ-2", "LJ-3", "LJ-4"):
        shutil.copy(SPEECH, lj / "wavs" / f"{uid}.wav")
    rows = [
        "\ufeffLJ-1|Hello there|hello there".encode(),  # BOM, as Windows editors save it
        "LJ-2|caf\xe9 au lait".encode("latin-1"),  # the rule: rows must be UTF-8
        b"LJ-3|   |  ",  # no text in either column
        b"",  # blank lines are not rows
        b"LJ-4|Fine words",
    ]
    (lj / "metadata.csv").write_bytes(b"\r\n".join(rows) + b"\r\n")  # CRLF line ends
    out = tmp_path / "out"
    run_preprocess(*build_args(lj, out, "--workers", "1"))
    assert_counted(
        out,
        written={"wavs/LJ-1.wav", "wavs/LJ-4.wav"},
        rejected={
            "metadata.csv:2": "metadata.csv row is not valid UTF-8",
            "wavs/LJ-3.wav": "empty transcript",
        },
    )
    texts = {s: m["text"] for s, (m, _) in written_samples(out).items()}
    assert texts == {"wavs/LJ-1.wav": "hello there", "wavs/LJ-4.wav": "Fine words"}


def test_bad_manifest_lines_are_counted_rejections(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "audio").mkdir(parents=True)
    for name in ("a", "b", "c"):
        shutil.copy(SPEECH, corpus / "audio" / f"{name}.wav")
    shutil.copy(SPEECH, tmp_path / "outside.wav")
    lines = [
        json.dumps({"audio_filepath": "audio/a.wav", "text": "caf\u00e9"}).encode(),
        # absolute paths are fine inside the manifest's folder; only escaping is refused
        json.dumps({"audio_filepath": str(corpus / "audio" / "b.wav"), "text": "x"}).encode(),
        json.dumps({"audio_filepath": "../outside.wav", "text": "x"}).encode(),
        '{"audio_filepath": "audio/c.wav", "text": "caf\xe9"}'.encode("latin-1"),
        b"[1, 2]",
        b'{"audio_filepath": 5, "text": "x"}',
        b'{"audio_filepath": "audio/c.wav"}',
        b"",
        b'{"audio_filepath": "audio/missing.wav", "text": "x"}',
    ]
    manifest = corpus / "train.jsonl"
    manifest.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    run_preprocess(*build_args(manifest, out, "--workers", "1"))
    assert_counted(
        out,
        written={"audio/a.wav", "audio/b.wav"},
        rejected={
            "../outside.wav": "audio path is outside the manifest's folder",
            "train.jsonl:4": "manifest line is not UTF-8 JSON",
            "train.jsonl:5": "manifest line has no audio_filepath string",
            "train.jsonl:6": "manifest line has no audio_filepath string",
            "audio/c.wav": "manifest text is missing or not a string",
            "audio/missing.wav": "audio file not found",
        },
    )


def test_ljspeech_id_cannot_reach_outside_the_corpus(tmp_path: Path) -> None:
    lj = tmp_path / "lj"
    (lj / "wavs").mkdir(parents=True)
    shutil.copy(SPEECH, lj / "wavs" / "LJ-1.wav")
    shutil.copy(SPEECH, tmp_path / "secret.wav")
    (lj / "metadata.csv").write_text("LJ-1|inside\n../../secret|outside\n")
    found = list(share(open_corpus(lj, tmp_path / "out"), Slice(0, 1), 24000, []))
    assert [f.source for f in found if isinstance(f, Found)] == ["wavs/LJ-1.wav"]
    rejections = [f for f in found if not isinstance(f, Found)]
    assert len(rejections) == 1 and rejections[0].reason  # the row, with a plain reason


def test_special_files_neither_crash_nor_hang(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(SPEECH, src / "good.wav")
    for name in ("good", "self", "pipe", "dangling"):
        (src / f"{name}.txt").write_text("some words")
    os.symlink("self.wav", src / "self.wav")  # a symlink loop of one
    os.symlink("nowhere.wav", src / "dangling.wav")
    fifo = src / "pipe.wav"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    opened = False
    with started(build_command(src, out, "--workers", "1"), tmp_path / "log") as proc:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            try:  # succeeds only while the build has the FIFO open for reading
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.02)
                continue
            opened = True
            os.close(fd)  # end of stream: the blocked reader goes on, so the test never hangs
        returncode = proc.poll()
    log = (tmp_path / "log").read_text()
    assert not opened, "the build opened the FIFO pipe.wav: without a writer it blocks forever"
    assert returncode == 0, log
    records = rejected_by_source(out)
    assert set(records) == {"self.wav", "pipe.wav", "dangling.wav"}
    kinds = {s: r["reason"].split(":")[0] for s, r in records.items()}  # any plain reason
    assert_counted(out, written={"good.wav"}, rejected=kinds)


# ---- unreadable files (permissions; root runs without its read override) --------------------------
def locked(path: Path) -> Path:
    path.chmod(0)
    return path


def test_unreadable_files_are_counted_rejections(tmp_path: Path) -> None:
    prefix = unprivileged_prefix()
    src = tmp_path / "src"
    src.mkdir()
    for name in ("good", "locked", "lockedtext"):
        shutil.copy(SPEECH, src / f"{name}.wav")
        (src / f"{name}.txt").write_text("some words")
    locked(src / "locked.wav")
    locked(src / "lockedtext.txt")
    out = tmp_path / "out"
    done = subprocess.run(
        [*prefix, *build_command(src, out, "--workers", "1")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert_counted(
        out,
        written={"good.wav"},
        rejected={"locked.wav": "unreadable audio", "lockedtext.wav": "transcript unreadable"},
    )


UNPRIVILEGED_PROBE = """
import json, sys
from pathlib import Path
from preprocess.inputs.audio import AudioError, probe
from preprocess.inputs.records import Slice
from preprocess.inputs.corpus import open_corpus, share
from melcache.errors import UserError
found = {}
for path in sys.argv[1:3]:
    try:
        found[path] = repr(probe(path))
    except AudioError as exc:
        found[path] = str(exc)
try:
    list(share(open_corpus(Path(sys.argv[3]), Path("out")), Slice(0, 1), 24000, []))
    found["discover"] = "no error"
except UserError as exc:
    found["discover"] = f"UserError: {exc}"
except OSError as exc:
    found["discover"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(found))
"""


def unprivileged_findings(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """probe() of a chmod 000 and a dangling audio file, a scan of an LJSpeech folder whose
    metadata.csv is chmod 000, all run without root's read override."""
    prefix = unprivileged_prefix()
    secret = locked(Path(shutil.copy(SPEECH, tmp_path / "secret.wav")))
    dangling = tmp_path / "dangling.wav"
    os.symlink("nowhere.wav", dangling)
    lj = tmp_path / "lj"
    (lj / "wavs").mkdir(parents=True)
    shutil.copy(SPEECH, lj / "wavs" / "LJ-1.wav")
    (lj / "metadata.csv").write_text("LJ-1|words\n")
    locked(lj / "metadata.csv")
    done = subprocess.run(
        [*prefix, sys.executable, "-c", UNPRIVILEGED_PROBE, str(secret), str(dangling), str(lj)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), secret, dangling


def test_unreadable_audio_reason_names_the_cause(tmp_path: Path) -> None:
    found, secret, dangling = unprivileged_findings(tmp_path)
    assert "Permission denied" in found[str(secret)]
    assert "audio file not found" in found[str(dangling)]


def test_unreadable_metadata_csv_is_a_user_error(tmp_path: Path) -> None:
    found, _, _ = unprivileged_findings(tmp_path)
    assert found["discover"].startswith("UserError: ") and "metadata.csv" in found["discover"]


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
