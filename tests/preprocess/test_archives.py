"""Corpora packed as WebDataset audio tars (the Emilia layout, issue #14): read in place,
damaged samples counted with reasons, mels equal to the same audio given as loose files."""

from __future__ import annotations

import io
import json
import os
import signal
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tests.support.helpers import (
    SAMPLE_CORPUS,
    build_args,
    build_command,
    cache_digests,
    encoded,
    mels_by_text,
    receipts,
    run_preprocess,
    started,
    wait_for,
)

pytestmark = pytest.mark.slow  # builds in subprocesses

FORMATS = ("mp3", "flac", "wav")


def add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


def emilia(tmp_path: Path) -> tuple[Path, Path, dict[str, int]]:
    """Two tars of the sample corpus's audio as mp3/flac/wav + json (Emilia's keys), the same
    audio as loose files with transcripts, and the count of each kind of bad sample."""
    tars, loose = tmp_path / "tars", tmp_path / "loose"
    tars.mkdir()
    loose.mkdir()
    audio = sorted(p for p in SAMPLE_CORPUS.rglob("*") if p.suffix in (".wav", ".flac"))
    for number in range(2):
        with tarfile.open(tars / f"EN-B{number:06d}.tar", "w") as tar:
            for index, path in enumerate(audio[number::2]):
                key = f"EN_B{number:05d}_S{index:05d}"
                extension = FORMATS[index % 3]
                data = encoded(path, extension)
                info = sf.info(io.BytesIO(data))
                text = path.with_suffix(".txt").read_text()
                meta = {
                    "text": text,
                    "speaker": path.parent.name,
                    "language": "zh" if path.parent.name == "zh" else "en",
                    "dnsmos": 2.8 + (index % 5) / 5,
                    "duration": info.frames / info.samplerate,
                }
                add(tar, f"{key}.{extension}", data)
                add(tar, f"{key}.json", json.dumps(meta, ensure_ascii=False).encode())
                (loose / f"{key}.{extension}").write_bytes(data)
                (loose / f"{key}.txt").write_text(text)
            add(tar, f"EN_B{number:05d}_X00000.mp3", encoded(audio[0], "mp3"))  # no text
            add(tar, f"EN_B{number:05d}_X00001.json", b'{"text": "no audio"}')  # no audio
            add(tar, f"EN_B{number:05d}_X00002.mp3", b"\xff\xfb" + bytes(4000))  # not mp3
            add(tar, f"EN_B{number:05d}_X00002.json", b'{"text": "broken", "duration": 1.0}')
    return tars, loose, {"written": len(audio), "bad": 6}


def test_emilia_tars_build_like_loose_files(tmp_path: Path) -> None:
    tars, loose, counts = emilia(tmp_path)
    out = tmp_path / "out"
    done = run_preprocess(*build_args(tars, out, "--workers", "2"))
    index = json.loads((out / "index.json").read_text())
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert index["totals"]["utterances"] == counts["written"]
    assert len(rejected) == counts["bad"] and "Traceback" not in done.stderr
    reasons = {r["source"].split(":")[1]: r["reason"] for r in rejected}
    assert reasons["EN_B00000_X00000.mp3"].startswith("sample has no text")
    assert reasons["EN_B00001_X00001"].startswith("sample has no audio member")
    assert reasons["EN_B00000_X00002.mp3"].startswith("undecodable audio")
    assert run_preprocess("verify", str(out)).returncode == 0
    reference = tmp_path / "reference"
    run_preprocess(*build_args(loose, reference, "--workers", "2"))
    ours, theirs = mels_by_text(out), mels_by_text(reference)
    assert len(ours) == counts["written"] and ours.keys() == theirs.keys()
    for text, mel in ours.items():
        assert np.array_equal(mel, theirs[text]), text


def test_where_on_tars_and_parts_take_whole_tars(tmp_path: Path) -> None:
    tars, _, _ = emilia(tmp_path)
    where = 'language == "en" and dnsmos >= 3.2'
    out = tmp_path / "out"
    done = run_preprocess(
        *build_args(tars, out, "--workers", "1", "--part", "0/2", "--where", where, "--dry-run")
    )
    pieces = out / ".build" / "scan-2" / "part-0" / "piece-0"
    sources = bytes(np.load(pieces / "source.npy")).decode()
    assert "EN-B000000.tar:" in sources and "EN-B000001.tar:" not in sources
    done = run_preprocess(*build_args(f"{tars}/EN-B{{000000..000001}}.tar", out, "--where", where))
    index = json.loads((out / "index.json").read_text())
    assert index["totals"]["filtered_out"] > 0
    assert f"{index['totals']['filtered_out']} left out by --where" in done.stdout
    mandarin = {p.read_text() for p in (SAMPLE_CORPUS / "zh").glob("*.txt")}
    assert mandarin and not mandarin & set(mels_by_text(out))  # all left out


def test_a_cut_tar_keeps_its_whole_samples_and_says_where_it_broke(tmp_path: Path) -> None:
    tars, _, _ = emilia(tmp_path)
    whole = (tars / "EN-B000000.tar").read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole[: len(whole) * 2 // 3])  # a download that stopped
    out = tmp_path / "out"
    run_preprocess(*build_args(cut, out, "--workers", "1"))
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    (damaged,) = [r for r in rejected if r["source"] == "cut.tar"]
    kept = int(damaged["reason"].split("after ")[1].split(" samples")[0])
    index = json.loads((out / "index.json").read_text())
    assert kept > 0 and damaged["reason"].startswith("damaged tar after")
    assert index["totals"]["utterances"] + len(rejected) - 1 == kept  # each whole sample counted
    assert run_preprocess("verify", str(out)).returncode == 0


def test_a_killed_tar_build_resumes_byte_identical(tmp_path: Path) -> None:
    tars, _, _ = emilia(tmp_path)
    reference = tmp_path / "reference"
    run_preprocess(*build_args(tars, reference, "--workers", "1"))
    out = tmp_path / "out"
    with started(build_command(tars, out, "--workers", "1"), tmp_path / "log") as proc:
        assert wait_for(lambda: out.exists() and receipts(out) > 0, proc, 120)
        os.killpg(proc.pid, signal.SIGKILL)  # mid-build: some shards done, one half written
        proc.wait()
    assert not (out / "index.json").exists()
    run_preprocess(*build_args(tars, out, "--workers", "1"))
    assert cache_digests(out) == cache_digests(reference)
