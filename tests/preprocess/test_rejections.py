"""Bad build inputs (issue #6): each a counted rejection with its reason, the rest built.

``written + rejected == discovered``, whatever a folder, LJSpeech or manifest input holds:
non-finite audio, names and text that are no Unicode, special and unreadable files. Cases
covered by ``test_build.py`` (silence, 0.05 s, Latin-1 ``.txt``, orphan audio, text as
``.wav``, LJSpeech missing audio and malformed row, JSONL not JSON, absolute manifest path)
are not repeated here; killed builds and full disks: ``test_faults.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from melcache.format import (
    INDEX_NAME,
    REJECTED_NAME,
    decode_mel_npy,
    decode_meta,
)
from preprocess.check.verify import verify
from preprocess.inputs.audio import resampled_length
from preprocess.inputs.corpus import open_corpus, share
from preprocess.inputs.records import Found, Slice
from tests.support.helpers import (
    REPO,
    SAMPLE_CORPUS,
    build_args,
    build_command,
    read_samples,
    run_preprocess,
    started,
    unprivileged_prefix,
    wait_for,
)

pytestmark = pytest.mark.slow  # builds in subprocesses: the full tier
SPEECH = SAMPLE_CORPUS / "en_m3" / "en_m3_02.wav"  # 1.5 s, 16 kHz mono
FLAC = SAMPLE_CORPUS / "zh" / "zh_02.flac"  # 3 s, 22.05 kHz


def write_utterance(path: Path, audio: np.ndarray, rate: int, **kw: str) -> None:
    sf.write(path, audio, rate, **kw)
    path.with_suffix(".txt").write_text("some words", encoding="utf-8")


def rejected_by_source(out: Path) -> dict[str, dict[str, str]]:
    lines = (out / REJECTED_NAME).read_text(encoding="utf-8").splitlines()
    return {r["source"]: r for r in map(json.loads, lines)}


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
