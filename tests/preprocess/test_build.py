"""The build stage end to end: integrity, layouts, rejections, resume, parts, errors."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from melcache.features import FeatureConfig
from melcache.format import INDEX_NAME, decode_meta
from melcache.loader import DataConfig, make_loader
from preprocess.config import BuildConfig
from preprocess.inputs.records import Corpus, utterance_hash
from preprocess.plan.shard_plan import PlannedShard, PlannedUtterance
from preprocess.write import mel_shard as writer
from tests.support.helpers import REPO, SAMPLE_CORPUS, read_samples, run_preprocess


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every shard and of the index."""
    paths = [*sorted(folder.glob("*.tar")), folder / INDEX_NAME]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def test_sample_cache_is_complete_and_consistent(sample_cache: Path) -> None:
    index = json.loads((sample_cache / INDEX_NAME).read_text())
    totals = index["totals"]
    assert totals["discovered"] == 30 == totals["utterances"] + totals["rejected"]
    assert len(index["shards"]) >= 8
    keys = []
    for entry in index["shards"]:
        samples = read_samples(sample_cache / entry["name"])
        assert len(samples) == entry["samples"]
        for sample in samples:
            meta = decode_meta(sample["json"], entry["name"])
            mel = np.load(io.BytesIO(sample["mel.npy"]), allow_pickle=False)
            assert mel.dtype == np.float16 and mel.shape == (meta["frames"], 100)
            # ChatTTS/vocos framing: 1 + samples // hop
            assert meta["frames"] == 1 + round(meta["seconds"] * 24000) // 256
            assert meta["bucket"] == entry["bucket"]
            assert meta["text"] and meta["source"].startswith(("en_", "zh/"))
            keys.append(sample["__key__"])
    assert len(keys) == len(set(keys)) == 30
    assert not any("." in k for k in keys)
    assert run_preprocess("verify", str(sample_cache)).stdout.strip().endswith("OK")


@pytest.mark.slow  # builds in a subprocess
def test_layouts_ljspeech_and_manifest(tmp_path: Path) -> None:
    sources = sorted(SAMPLE_CORPUS.glob("en_f1/*.wav"))[:3]
    lj = tmp_path / "lj"
    (lj / "wavs").mkdir(parents=True)
    rows = []
    for i, src in enumerate(sources):
        shutil.copy(src, lj / "wavs" / f"LJ001-{i:04d}.wav")
        text = src.with_suffix(".txt").read_text().strip()
        rows.append(f"LJ001-{i:04d}|{text}|{text.lower()}")
    rows += ["LJ009-0001|audio that does not exist", "this row has no separator", "|no id"]
    (lj / "metadata.csv").write_text("\n".join(rows) + "\n")

    manifest = tmp_path / "corpus" / "train.jsonl"
    (manifest.parent / "audio").mkdir(parents=True)
    lines = []
    for i, src in enumerate(sources):
        shutil.copy(src, manifest.parent / "audio" / f"m{i}.wav")
        entry = {"audio_filepath": f"audio/m{i}.wav", "text": "hello there", "speaker": "spk7"}
        lines.append(json.dumps(entry))
    lines += [
        "{not json",
        json.dumps({"audio_filepath": str(sources[0].resolve()), "text": "outside"}),
    ]
    manifest.write_text("\n".join(lines) + "\n")

    for src, written, reasons in [
        (lj, 3, {"audio file not found (listed in metadata.csv)", "malformed metadata.csv row"}),
        (
            manifest,
            3,
            {"manifest line is not UTF-8 JSON", "audio path is outside the manifest's folder"},
        ),
    ]:
        out = tmp_path / f"out_{src.name}"
        run_preprocess("build", "--src", str(src), "--out", str(out), "--workers", "1")
        index = json.loads((out / INDEX_NAME).read_text())
        assert index["totals"]["utterances"] == written
        rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
        assert {r["reason"].split(":")[0] for r in rejected} == reasons
        assert index["totals"]["discovered"] == written + len(rejected)
        assert run_preprocess("verify", str(out)).returncode == 0
    meta = decode_meta(
        read_samples(next((tmp_path / "out_train.jsonl").glob("*.tar")))[0]["json"], "x"
    )
    assert meta["speaker"] == "spk7" and meta["source"].startswith("audio/m")
    meta = decode_meta(read_samples(next((tmp_path / "out_lj").glob("*.tar")))[0]["json"], "x")
    assert meta["text"].islower()  # the normalized column wins


def write_wav(
    path: Path, audio: np.ndarray, rate: int, text: str | bytes | None = "words", **kw
) -> None:
    sf.write(path, audio, rate, **kw)
    if isinstance(text, str):
        path.with_suffix(".txt").write_text(text, encoding="utf-8")
    elif isinstance(text, bytes):
        path.with_suffix(".txt").write_bytes(text)


@pytest.mark.slow  # builds in a subprocess
def test_bad_inputs_are_rejected_with_reasons(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    speech, rate = sf.read(SAMPLE_CORPUS / "en_m3" / "en_m3_02.wav", dtype="float32")
    write_wav(src / "good.wav", speech, rate)
    write_wav(src / "silence.wav", np.zeros(16000, np.float32), 16000)
    write_wav(src / "tiny.wav", 0.1 * rng.standard_normal(800).astype(np.float32), 16000)
    write_wav(src / "long.wav", 0.1 * rng.standard_normal(8000 * 31).astype(np.float32), 8000)
    write_wav(src / "latin1.wav", speech, rate, text="café".encode("latin-1"))
    write_wav(src / "orphan.wav", speech, rate, text=None)
    write_wav(src / "blank.wav", speech, rate, text="  \n")
    (src / "notaudio.wav").write_text("this is text, not audio")
    (src / "notaudio.txt").write_text("words")
    stereo = np.stack([speech, speech], axis=1)[::2]  # 8-bit unsigned stereo is accepted
    write_wav(src / "u8.wav", stereo, rate // 2, subtype="PCM_U8")

    out = tmp_path / "out"
    done = run_preprocess("build", "--src", str(src), "--out", str(out), "--workers", "1")
    assert "2 utterances" in done.stdout
    rejected = {
        json.loads(x)["source"]: json.loads(x)["reason"]
        for x in (out / "rejected.jsonl").read_text().splitlines()
    }
    assert rejected["silence.wav"].startswith("all-silent audio")
    assert rejected["tiny.wav"].startswith("too short")
    assert rejected["long.wav"].startswith("too long")
    assert rejected["latin1.wav"].startswith("transcript not UTF-8")
    assert rejected["orphan.wav"].startswith("no transcript")
    assert rejected["blank.wav"] == "empty transcript"
    assert rejected["notaudio.wav"].startswith("unreadable audio")
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["totals"]["discovered"] == 9 == index["totals"]["utterances"] + len(rejected)
    assert sum(index["totals"]["rejected_by_reason"].values()) == 7


@pytest.mark.slow  # builds in a subprocess
def test_killed_build_resumes_byte_identical(
    tmp_path: Path, sample_cache: Path, small_shards_config: Path
) -> None:
    out = tmp_path / "out"
    args = [
        sys.executable,
        "-m",
        "preprocess",
        "build",
        "--src",
        str(SAMPLE_CORPUS),
        "--out",
        str(out),
    ]
    args += ["--config", str(small_shards_config), "--workers", "1"]
    for _ in range(2):  # kill twice, at different points
        proc = subprocess.Popen(
            args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 120
        receipts = len(list((out / ".build").glob("*.json"))) if out.exists() else 0
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and len(list((out / ".build").glob("*.json"))) > receipts:
                break
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert not (out / INDEX_NAME).exists()
    run_preprocess(*args[3:])
    assert digests(out) == digests(sample_cache)


@pytest.mark.slow  # builds in a subprocess
def test_a_resumed_build_of_the_previous_release_indexes_its_shards_by_sha256(
    tmp_path: Path, sample_cache: Path, small_shards_config: Path
) -> None:
    """Receipts the previous release wrote (a killed build) carry no xxh3_128: the finished
    index gives those shards sha256 alone, verify passes and the loader checks them by sha256."""
    out = Path(shutil.copytree(sample_cache, tmp_path / "out"))
    (out / INDEX_NAME).unlink()
    older = sorted((out / ".build").glob("b*.tar.json"))[:2]
    for path in older:
        receipt = json.loads(path.read_text())
        del receipt["xxh3_128"]
        path.write_text(json.dumps(receipt))
    run_preprocess(
        *("build", "--src", str(SAMPLE_CORPUS), "--out", str(out)),
        *("--config", str(small_shards_config), "--workers", "1"),
    )
    index = json.loads((out / INDEX_NAME).read_text())
    unfast = {entry["name"] for entry in index["shards"] if "xxh3_128" not in entry}
    assert unfast == {path.name.removesuffix(".json") for path in older}
    run_preprocess("verify", str(out), "--workers", "1")
    loader = make_loader(out, DataConfig(num_workers=0, batch_frames=3000))
    batches = iter(loader)
    while loader.epoch < 1:
        next(batches)
    loader.close()


@pytest.mark.slow  # builds in a subprocess
def test_keep_audio_stores_resampled_flac(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(SAMPLE_CORPUS / "zh", src)
    out = tmp_path / "out"
    run_preprocess("build", "--src", str(src), "--out", str(out), "--workers", "1", "--keep-audio")
    for shard in out.glob("*.tar"):
        for sample in read_samples(shard):
            audio, rate = sf.read(io.BytesIO(sample["flac"]))
            meta = decode_meta(sample["json"], shard.name)
            assert rate == 24000 and audio.ndim == 1
            assert meta["frames"] == 1 + len(audio) // 256
    assert run_preprocess("verify", str(out)).returncode == 0


@pytest.mark.slow  # builds in a subprocess
def test_user_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    bad = tmp_path / "bad.toml"
    bad.write_text("[features]\nn_mels = -3\n")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[build]\nmax_secs = 3\n")
    cases = [
        (["--src", str(tmp_path / "missing")], "does not exist"),
        (["--src", str(tmp_path / "empty")], "holds no audio files"),
        (["--src", str(SAMPLE_CORPUS), "--config", str(bad)], "features.n_mels = -3"),
        (["--src", str(SAMPLE_CORPUS), "--config", str(unknown)], "unknown key build.max_secs"),
    ]
    for args, message in cases:
        done = run_preprocess("build", *args, "--out", str(tmp_path / "out"), check=False)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr
    done = run_preprocess("verify", str(tmp_path / "empty"), check=False)
    assert done.returncode == 2 and "index.json not found" in done.stderr


def test_a_failed_shard_leaves_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    """Whatever goes wrong while a shard is written, its temporary file goes with it."""

    def explode(tar, *args) -> None:
        tar.write({"__key__": "half", "json": b"{}"})  # some bytes are on disk by now
        raise RuntimeError("a bug, not a full disk")

    monkeypatch.setattr(writer, "_write_utterance", explode)
    text = (SAMPLE_CORPUS / "zh" / "zh_01.txt").read_text()  # as scanned: the check passes
    utterance = PlannedUtterance(
        "k", "zh_01.wav", 1, 16000, utterance_hash("zh_01.wav", text, None)
    )
    shard = PlannedShard("b00-000000.tar", 0, 0, (utterance,))
    corpus = Corpus("folder", str(SAMPLE_CORPUS / "zh"))
    (tmp_path / writer.RECEIPTS).mkdir()
    with pytest.raises(RuntimeError, match="a bug"):
        writer.build_shard(shard, corpus, tmp_path, FeatureConfig(), BuildConfig(), False, "digest")
    assert sorted(p.name for p in tmp_path.iterdir()) == [writer.RECEIPTS]
