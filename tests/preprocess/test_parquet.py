"""Corpora packed as Parquet (the Hugging Face datasets convention, issue #14): read a row
group at a time, the audio spooled for the writers, the cache equal to the same audio given
as loose files."""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from melcache.errors import UserError
from melcache.format import decode_meta
from melcache.tar.reader import group_samples, iter_members
from preprocess.inputs.corpus import open_corpus
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

FORMATS = ("mp3", "flac", "wav")
AUDIO = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets' Audio feature
BAD_ROWS = 4  # per file: no bytes, no text, undecodable, an invalid duration


def hugging_face(tmp_path: Path) -> tuple[Path, Path, int]:
    """Two Parquet files of the sample corpus's audio (mp3/flac/wav bytes with their file
    name, a ``sentence`` and a ``client_id`` column, a duration on every other row, row groups
    of 3 rows), the same audio as loose files, and how many rows are good."""
    folder, loose = tmp_path / "parquet", tmp_path / "loose"
    folder.mkdir()
    loose.mkdir()
    audio = sorted(p for p in SAMPLE_CORPUS.rglob("*") if p.suffix in (".wav", ".flac"))
    for number in range(2):
        rows = []
        for index, path in enumerate(audio[number::2]):
            extension = FORMATS[index % 3]
            name = f"clip_{number}_{index}.{extension}"
            data = encoded(path, extension)
            text = path.with_suffix(".txt").read_text()
            (loose / name).write_bytes(data)
            (loose / name).with_suffix(".txt").write_text(text)
            rows.append(
                {
                    "audio": {"bytes": data, "path": name},
                    "sentence": text,
                    "client_id": path.parent.name,
                    "locale": "zh" if path.parent.name == "zh" else "en",
                    "duration": None if index % 2 else seconds(data),  # else probed
                }
            )
        rows += [
            {"audio": {"bytes": None, "path": "gone.mp3"}, "sentence": "no bytes"},
            {"audio": {"bytes": encoded(audio[0], "mp3"), "path": "x.mp3"}, "sentence": None},
            {"audio": {"bytes": b"\xff\xfb" + bytes(4000), "path": "y.mp3"}, "sentence": "broken"},
            {"audio": {"bytes": encoded(audio[0], "wav"), "path": "z.wav"}, "sentence": "short"}
            | {"duration": -1.0},
        ]
        schema = pa.schema(
            [
                ("audio", AUDIO),
                ("sentence", pa.string()),
                ("client_id", pa.string()),
                ("locale", pa.string()),
                ("duration", pa.float64()),
            ]
        )
        table = pa.Table.from_pylist(rows, schema=schema)
        pq.write_table(table, folder / f"train-{number:05d}-of-00002.parquet", row_group_size=3)
    return folder, loose, len(audio)


def seconds(data: bytes) -> float:
    info = sf.info(io.BytesIO(data))
    return info.frames / info.samplerate


COLUMNS = ("--columns", "audio,sentence,client_id")


@pytest.mark.slow
def test_parquet_builds_the_cache_of_the_same_loose_files(tmp_path: Path) -> None:
    folder, loose, good = hugging_face(tmp_path)
    out = tmp_path / "out"
    done = run_preprocess(*build_args(folder, out, "--workers", "2", *COLUMNS))
    index = json.loads((out / "index.json").read_text())
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert index["totals"]["utterances"] == good and "Traceback" not in done.stderr
    assert len(rejected) == 2 * BAD_ROWS
    reasons = {r["source"]: r["reason"] for r in rejected}
    first = "train-00000-of-00002.parquet"
    bad = good // 2 + good % 2  # the first bad row of the first file
    assert reasons[f"{first}:{bad}.mp3"].startswith("row has no audio bytes in column 'audio'")
    assert reasons[f"{first}:{bad + 1}.mp3"].startswith("row has no text string")
    assert (
        reasons[f"{first}:{bad + 2}.mp3"]
        == "unreadable audio: bytes in no known audio format (wav, flac, ogg/opus, mp3)"
    )
    assert reasons[f"{first}:{bad + 3}.wav"].startswith("row duration is not a finite number")
    assert run_preprocess("verify", str(out)).returncode == 0
    assert not (out / ".build" / "spool").exists()  # the copy of the audio is gone
    reference = tmp_path / "reference"
    run_preprocess(*build_args(loose, reference, "--workers", "2"))
    ours, theirs = mels_by_text(out), mels_by_text(reference)
    assert len(ours) == good and ours.keys() == theirs.keys()
    for text, mel in ours.items():
        assert np.array_equal(mel, theirs[text]), text
    expected = json.loads((reference / "index.json").read_text())["totals"]
    for total in ("utterances", "frames", "seconds"):
        assert index["totals"][total] == expected[total], total
    assert speakers(out) == {p.name for p in SAMPLE_CORPUS.iterdir() if p.is_dir()}


@pytest.mark.slow
def test_a_parquet_column_is_carried_as_an_extra(tmp_path: Path) -> None:
    folder, _, good = hugging_face(tmp_path)
    (tmp_path / "extras.toml").write_text('[build]\nextras = ["locale"]\n')
    out = tmp_path / "out"
    run_preprocess(*build_args(folder, out, *COLUMNS, "--config", str(tmp_path / "extras.toml")))
    carried = []
    for shard in sorted(out.glob("*.tar")):
        with open(shard, "rb") as stream:
            for sample in group_samples(iter_members(stream, shard.name), shard.name):
                meta = decode_meta(sample["json"], shard.name)
                carried.append((meta["speaker"], meta["extras"]))
    assert len(carried) == good
    assert all(extras == {"locale": "zh" if who == "zh" else "en"} for who, extras in carried)
    assert run_preprocess("verify", str(out)).returncode == 0


def speakers(cache: Path) -> set[str]:
    """The speakers a cache's samples record."""
    found = set()
    for shard in sorted(cache.glob("*.tar")):
        with open(shard, "rb") as stream:
            for sample in group_samples(iter_members(stream, shard.name), shard.name):
                found.add(decode_meta(sample["json"], shard.name)["speaker"])
    return found


@pytest.mark.slow
def test_parquet_parts_take_whole_files_and_where_selects_rows(tmp_path: Path) -> None:
    folder, _, _ = hugging_face(tmp_path)
    out = tmp_path / "out"
    run_preprocess(*build_args(folder, out, "--part", "0/2", "--dry-run", *COLUMNS))
    piece = out / ".build" / "scan-2" / "part-0" / "piece-0"
    sources = bytes(np.load(piece / "source.npy")).decode()
    assert "train-00000-of-00002.parquet:" in sources
    assert "train-00001-of-00002.parquet:" not in sources
    pattern = f"{folder}/train-*.parquet"
    done = run_preprocess(*build_args(pattern, out, "--where", 'locale == "en"', *COLUMNS))
    index = json.loads((out / "index.json").read_text())
    assert index["totals"]["filtered_out"] > 0
    assert f"{index['totals']['filtered_out']} left out by --where" in done.stdout
    mandarin = {p.read_text() for p in (SAMPLE_CORPUS / "zh").glob("*.txt")}
    assert mandarin and not mandarin & set(mels_by_text(out))


@pytest.mark.slow
def test_a_killed_parquet_build_resumes_byte_identical(tmp_path: Path) -> None:
    folder, _, _ = hugging_face(tmp_path)
    reference = tmp_path / "reference"
    run_preprocess(*build_args(folder, reference, "--workers", "1", *COLUMNS))
    out = tmp_path / "out"
    with started(build_command(folder, out, "--workers", "1", *COLUMNS), tmp_path / "log") as proc:
        assert wait_for(lambda: out.exists() and receipts(out) > 0, proc, 120)
        os.killpg(proc.pid, signal.SIGKILL)  # mid-build: the spool made, some shards written
        proc.wait()
    assert not (out / "index.json").exists()
    run_preprocess(*build_args(folder, out, "--workers", "1", *COLUMNS))
    assert cache_digests(out) == cache_digests(reference)
    rerun = run_preprocess(*build_args(folder, out, "--workers", "1", *COLUMNS))
    assert "Traceback" not in rerun.stderr and cache_digests(out) == cache_digests(reference)


def test_misnamed_columns_and_mixed_archives_are_refused(tmp_path: Path) -> None:
    table = pa.table({"audio": [{"bytes": b"x", "path": "a.wav"}], "text": ["hi"]})
    pq.write_table(table, tmp_path / "a.parquet")
    with pytest.raises(UserError, match=r"has no column 'sentence' \(it has audio, text\)"):
        open_corpus(tmp_path, tmp_path / "out", columns="audio,sentence")
    with pytest.raises(UserError, match="expected AUDIO,TEXT"):
        open_corpus(tmp_path, tmp_path / "out", columns="audio")
    corpus = open_corpus(tmp_path, tmp_path / "out")
    assert corpus.kind == "parquet" and corpus.columns == ("audio", "text", "speaker")
    (tmp_path / "b.tar").write_bytes(bytes(1024))
    with pytest.raises(UserError, match=r"one kind; it has \.parquet, \.tar"):
        open_corpus(tmp_path, tmp_path / "out")
    with pytest.raises(UserError, match="--columns names Parquet columns"):
        open_corpus(SAMPLE_CORPUS, tmp_path / "out", columns="audio,text")


@pytest.mark.slow
def test_a_cut_parquet_file_is_one_rejection_and_the_rest_builds(tmp_path: Path) -> None:
    folder, _, good = hugging_face(tmp_path)
    whole = (folder / "train-00001-of-00002.parquet").read_bytes()
    (folder / "train-00001-of-00002.parquet").write_bytes(whole[: len(whole) // 2])  # no footer
    out = tmp_path / "out"
    run_preprocess(*build_args(folder, out, *COLUMNS))
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    (damaged,) = [r for r in rejected if r["source"] == "train-00001-of-00002.parquet"]
    assert damaged["reason"].startswith("damaged Parquet file after 0 rows:")
    index = json.loads((out / "index.json").read_text())
    assert index["totals"]["utterances"] == good // 2 + good % 2  # the whole first file
    assert run_preprocess("verify", str(out)).returncode == 0
