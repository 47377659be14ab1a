"""Hostile build inputs, third round (issue #24), in process (quick): long and crafted tar
headers, repeated tar keys, lengths no recording has, JSON nested past the parser's stack,
Parquet columns of the wrong type, ``--where`` text the parser cannot hold, and listings that
are FIFOs. Each ends in a per-input rejection or a one-line :class:`UserError`, in seconds."""

from __future__ import annotations

import io
import json
import os
import resource
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from helpers import REPO, build_command, run_preprocess

from melcache.errors import UserError
from melcache.index import read_index
from preprocess.inputs.archives import TEXT_MEMBER_LIMIT, read_member, tar_samples
from preprocess.inputs.audio import AudioError, probe
from preprocess.inputs.corpus import open_corpus, read_transcript, read_transcript_file, share
from preprocess.inputs.parquet import parquet_rows
from preprocess.inputs.records import Corpus, Found, Rejection, Slice
from preprocess.inputs.where import Where
from preprocess.plan.scan import scan_meta

RATE = 24000
LONG_KEY = "speaker_" + "x" * 110 + "/EN_B00000_" + "y" * 40  # folder and name both > 100


def wav(seconds: float = 0.5) -> bytes:
    """A real (non-silent) 16 kHz wav of ``seconds``."""
    buffer = io.BytesIO()
    t = np.arange(int(16000 * seconds)) / 16000
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000, format="WAV")
    return buffer.getvalue()


def member(
    name: str, payload: bytes, fmt: int = tarfile.PAX_FORMAT, pax_size: bool = False
) -> bytes:
    """One tar member (headers and padded data) as ``fmt`` writes it, with its size in its pax
    header too if ``pax_size``."""
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    if pax_size:
        info.pax_headers = {"size": str(len(payload))}
    padding = -len(payload) % tarfile.BLOCKSIZE
    return info.tobuf(fmt, "utf-8", "surrogateescape") + payload + bytes(padding)


def scan_tar(folder: Path, name: str, data: bytes) -> tuple[Corpus, list[Found | Rejection]]:
    (folder / name).write_bytes(data + bytes(2 * tarfile.BLOCKSIZE))
    corpus = Corpus("tars", str(folder), archives=(name,))
    return corpus, list(tar_samples(corpus, 0, name, RATE, None))


def meta(text: str, **fields: Any) -> bytes:
    return json.dumps({"text": text, **fields}).encode()


def set_ustar_size(header: bytearray, size: int) -> None:
    """Write ``size`` into a ustar header's size field as base-256 and fix its checksum."""
    header[124:136] = bytes([0x80]) + size.to_bytes(11, "big")
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header[:512])


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_long_tar_names_are_read_by_their_real_name(tmp_path: Path, fmt: int) -> None:
    audio = wav()
    data = member(f"{LONG_KEY}.wav", audio, fmt) + member(f"{LONG_KEY}.json", meta("long"), fmt)
    corpus, items = scan_tar(tmp_path, "long.tar", data)
    [item] = items
    assert isinstance(item, Found), item
    assert item.source == f"long.tar:{LONG_KEY}.wav"
    assert read_member(corpus, item.source, item.audio_at) == (audio, False)
    assert read_member(corpus, item.source, item.locator) == (meta("long"), True)
    assert read_transcript(corpus, item.source, item.locator) == ("long", None, {"text": "long"})


def test_a_repeated_tar_key_is_a_rejection_not_a_lost_sample(tmp_path: Path) -> None:
    one, two = member("k.wav", wav()) + member("k.json", meta("first")), member("k.wav", wav())
    _, items = scan_tar(tmp_path, "dup.tar", one + two + member("k.json", meta("second")))
    assert [type(i) for i in items] == [Found, Rejection]
    assert items[1].reason.startswith("duplicate key")  # type: ignore[union-attr]
    _, items = scan_tar(tmp_path, "dup2.tar", one + member("k.json", meta("again")))
    assert [type(i) for i in items] == [Found, Rejection]  # discovered = written + rejected


def test_crafted_tar_sizes_are_bounded_by_the_file(tmp_path: Path) -> None:
    audio = wav()
    # 1. A real pax size, a ustar size field of 2**62: the pax size is the member's size.
    head = bytearray(member(f"{LONG_KEY}.wav", audio, pax_size=True))
    ustar = len(head) - len(audio) - (-len(audio) % 512) - 512  # the header after the pax one
    block = bytearray(head[ustar : ustar + 512])
    set_ustar_size(block, 2**62)
    head[ustar : ustar + 512] = block
    started = time.monotonic()
    corpus, items = scan_tar(tmp_path, "a.tar", bytes(head) + member(f"{LONG_KEY}.json", meta("a")))
    [item] = items
    assert isinstance(item, Found), item
    assert read_member(corpus, item.source, item.audio_at) == (audio, False)
    # 2. A pax header whose own size is 2**62, and a member claiming 2**62 bytes (plain ustar).
    for crafted in (0, 1):
        block = bytearray(member("k.wav" if crafted else LONG_KEY + ".wav", audio)[:512])
        set_ustar_size(block, 2**62)
        _, items = scan_tar(tmp_path, f"b{crafted}.tar", bytes(block) + audio)
        [rejection] = items
        assert isinstance(rejection, Rejection) and "damaged tar" in rejection.reason
        assert (
            "past the end" in rejection.reason or "claims 4611686018427387904" in rejection.reason
        )
        assert "\n" not in rejection.reason
    # 3. A transcript member over the cap is a rejection before it is read.
    big = member("t.wav", audio) + member("t.json", b" " * (TEXT_MEMBER_LIMIT + 1))
    _, items = scan_tar(tmp_path, "c.tar", big)
    assert isinstance(items[0], Rejection) and "over 16 MiB" in items[0].reason
    # 4. A member cut off by a shorter tar than its header claims, at write time.
    (tmp_path / "a.tar").write_bytes((tmp_path / "a.tar").read_bytes()[: item.audio_at + 2048])
    with pytest.raises(ValueError, match="past the end"):
        read_member(corpus, item.source, item.audio_at)
    assert time.monotonic() - started < 10


HOSTILE_LENGTHS = [
    {"duration": 1e308},
    {"duration": 1e30},
    {"duration": float("inf")},
    {"duration": -1.0},
    {"duration": 2**64 - 1},
    {"num_samples": 2**64 - 1, "sampling_rate": 16000},
    {"num_samples": 10**30, "sampling_rate": 1},
    {"num_samples": 16000, "sampling_rate": 10**400},  # 0 samples: rejected as empty later
]
DEEP = "[" * 100_000 + "]" * 100_000


def test_hostile_manifest_lines_are_rejections(tmp_path: Path) -> None:
    lines = [json.dumps({"audio_filepath": "a.wav", "text": "t", **e}) for e in HOSTILE_LENGTHS]
    lines += [
        '{"audio_filepath": "a.wav", "text": "t", "extra": ' + DEEP + "}",
        '{"audio_filepath": "a.wav", "text": "t", "speaker": [[["s"]]]}',
        '{"audio_filepath": "a.wav", "text": "t", "duration": 1' + "0" * 5000 + "}",
        json.dumps({"audio_filepath": "a.wav", "text": "good", "duration": 1.0}),
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    corpus = open_corpus(tmp_path / "m.jsonl", tmp_path / "out")
    items = list(share(corpus, Slice(0, 1), RATE, []))
    assert len(items) == len(lines)
    reasons = [i.reason for i in items if isinstance(i, Rejection)]
    assert len(reasons) == len(lines) - 2, reasons  # the good row and the 0-sample one
    assert sum("no recording is that long" in r for r in reasons) == 5
    assert "manifest line is not UTF-8 JSON: JSON nested too deeply" in reasons
    assert "manifest speaker is list, not a string or a number" in reasons
    assert all("\n" not in r for r in reasons)


def test_hostile_tar_json_is_a_rejection(tmp_path: Path) -> None:
    samples = [(meta("t", **length), "huge") for length in HOSTILE_LENGTHS[:2]]
    samples += [(b'{"text": "t", "a": ' + DEEP.encode() + b"}", "nested too deeply")]
    samples += [(meta("t", speaker={"id": 1}), "speaker is dict")]
    data = b"".join(
        member(f"k{n}.wav", wav()) + member(f"k{n}.json", payload)
        for n, (payload, _) in enumerate(samples)
    )
    _, items = scan_tar(tmp_path, "h.tar", data)
    assert all(isinstance(i, Rejection) for i in items) and len(items) == len(samples)
    assert "no recording is that long" in items[0].reason  # type: ignore[union-attr]
    assert "nested too deeply" in items[2].reason  # type: ignore[union-attr]
    assert "speaker is dict" in items[3].reason  # type: ignore[union-attr]


def test_parquet_columns_of_the_wrong_type_are_row_rejections(tmp_path: Path) -> None:
    audio = pa.struct([("bytes", pa.binary()), ("path", pa.int64())])
    speaker = pa.struct([("id", pa.int64())])
    table = pa.table(
        {
            "audio": pa.array([{"bytes": wav(), "path": p} for p in (7, None, None, 8)], audio),
            "text": ["a", "b", "c", "d"],
            "speaker": pa.array([None, {"id": 1}, None, None], speaker),
            "duration": pa.array([1, 1, 2**64 - 1, 1], pa.uint64()),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    corpus = open_corpus(tmp_path / "t.parquet", tmp_path / "out")
    items = list(parquet_rows(corpus, 0, "t.parquet", RATE, None))
    reasons = [i.reason if isinstance(i, Rejection) else "" for i in items]
    assert reasons[0] == "row's audio path in column 'audio' is int"
    assert reasons[1] == "row column 'speaker' is dict, not a string or a number"
    assert "no recording is that long" in reasons[2]
    assert reasons[3] == "row's audio path in column 'audio' is int"
    texts = pa.table({"audio": [wav(), wav()], "text": pa.array([3, 4], pa.int64())})
    pq.write_table(texts, tmp_path / "u.parquet")
    corpus = open_corpus(tmp_path / "u.parquet", tmp_path / "out2")
    for item in parquet_rows(corpus, 0, "u.parquet", RATE, None):
        assert isinstance(item, Rejection) and "no text string" in item.reason


def test_the_builds_own_json_is_bounded(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_text(DEEP)
    assert scan_meta(tmp_path) is None  # rescanned, not a RecursionError
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "index.json").write_text(DEEP)
    with pytest.raises(UserError, match="nested too deeply"):
        read_index(cache)


@pytest.mark.parametrize(
    "text",
    [
        "not " * 2000 + "x",
        "-" * 3000 + "1",
        "-" * 20000 + "1",
        "x in " + "[" * 150 + "1" + "]" * 150,
        'lang == "\udcff"',  # a command-line byte that is not UTF-8
        "x in [" + ",".join(["1"] * 60_000) + "]",
        "a\0",
    ],
    ids=["2000 not", "3000 minus", "20000 minus", "150 lists", "not UTF-8", "long", "NUL"],
)
def test_where_text_the_parser_cannot_hold_is_one_line(text: str) -> None:
    started = time.monotonic()
    with pytest.raises(UserError) as caught:
        Where(text)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400
    assert time.monotonic() - started < 2


def test_where_refuses_names_python_would_fold() -> None:
    with pytest.raises(UserError, match="would be read as 'lang'"):
        Where('ｌａｎｇ == "fw"')
    assert Where('语言 == "zh"')({"语言": "zh"})  # a name NFKC leaves alone is kept
    assert Where('lang == "ｆｗ"')({"lang": "ｆｗ"})  # in a string, characters are data
    assert not Where("not " * 51 + "x")({"x": 1})  # deep but within bounds still works


def test_listings_that_are_not_regular_files_are_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "m.jsonl")
    with pytest.raises(UserError, match="is a FIFO"):
        open_corpus(tmp_path / "m.jsonl", tmp_path / "out")
    lj = tmp_path / "lj"
    (lj / "wavs").mkdir(parents=True)
    os.mkfifo(lj / "metadata.csv")
    with pytest.raises(UserError, match="is a FIFO"):
        open_corpus(lj, tmp_path / "out")
    os.mkfifo(tmp_path / "a.wav")  # a manifest's audio_filepath may name one
    with pytest.raises(AudioError, match="is a FIFO"):
        probe(str(tmp_path / "a.wav"))
    os.mkfifo(tmp_path / "a.txt")
    with pytest.raises(ValueError, match=r"transcript unreadable: a\.txt: .* FIFO"):
        read_transcript_file(str(tmp_path / "a.txt"))
    os.mkfifo(tmp_path / "x.tar")
    corpus = open_corpus(Path(str(tmp_path / "x*.tar")), tmp_path / "out")
    [item] = tar_samples(corpus, 0, "x.tar", RATE, None)
    assert isinstance(item, Rejection) and "FIFO" in item.reason
    os.mkfifo(tmp_path / "p.parquet")
    corpus = Corpus(
        "parquet",
        str(tmp_path),
        archives=("p.parquet",),
        columns=("audio", "text", "s"),
        spool=str(tmp_path / "spool"),
    )
    [item] = parquet_rows(corpus, 0, "p.parquet", RATE, None)
    assert isinstance(item, Rejection) and "FIFO" in item.reason


# ---- whole builds, as a user runs them (subprocesses) ----------------------------------------
def build(src: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``python -m preprocess build`` with one worker, its address space capped at 6 GiB
    (torch maps ~4 GiB): a header that made it allocate what it claims would fail."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))

    command = build_command(src, out, "--workers", "1", *extra)
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=cap
    )


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.slow
def test_a_build_that_plans_no_shard_is_an_empty_cache_and_one_line(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.mkdir()
    for n in range(3):
        (short / f"a{n}.wav").write_bytes(wav(0.1))
        (short / f"a{n}.txt").write_text("too short")
    out = tmp_path / "out"
    for _ in range(2):  # a rerun ends the same way
        done = build(short, out)
        assert done.returncode == 2
        assert "nothing left to build" in error_line(done) and "3 too short" in error_line(done)
    assert len((out / "rejected.jsonl").read_text().splitlines()) == 3
    index = read_index(out)
    assert index["shards"] == [] and index["totals"]["discovered"] == 3
    assert run_preprocess("verify", str(out)).returncode == 0  # empty, and sound
    summary = run_preprocess("inspect", str(out), "--png", str(tmp_path / "png")).stdout
    assert "0 utterances" in summary and "3  too short" in summary
    assert len(list((tmp_path / "png").glob("*.png"))) == 3
    assert build(short, out, "--dry-run").returncode == 0  # a dry run reports, it does not fail
    # --where keeping nothing of a manifest: counted as left out, rejected.jsonl written empty.
    rows = [{"audio_filepath": "a0.wav", "text": "t", "lang": "en"}] * 2
    (short / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = build(short / "m.jsonl", tmp_path / "out2", "--where", 'lang == "xx"')
    assert done.returncode == 2 and "2 left out by --where" in error_line(done)
    assert (tmp_path / "out2" / "rejected.jsonl").read_text() == ""


@pytest.mark.slow
def test_hostile_tars_build_every_good_sample_and_count_the_rest(tmp_path: Path) -> None:
    tars = tmp_path / "tars"
    tars.mkdir()
    crafted = bytearray(member("c/" + LONG_KEY + ".wav", wav(1.0), pax_size=True))
    ustar = len(crafted) - len(wav(1.0)) - (-len(wav(1.0)) % 512) - 512
    block = bytearray(crafted[ustar : ustar + 512])
    set_ustar_size(block, 2**62)
    crafted[ustar : ustar + 512] = block
    pax = member(f"{LONG_KEY}.flac", wav(1.0)) + member(f"{LONG_KEY}.json", meta("pax name"))
    pax += bytes(crafted) + member(f"c/{LONG_KEY}.json", meta("crafted size"))
    pax += member("d.wav", wav(1.0)) + member("d.json", meta("first d"))
    pax += member("d.wav", wav(1.0)) + member("d.json", meta("second d"))  # rejected
    pax += member("h.wav", wav(1.0)) + member("h.json", meta("huge", duration=1e308))
    pax += member("n.wav", wav(1.0)) + member("n.json", b'{"text": ' + DEEP.encode() + b"}")
    (tars / "a.tar").write_bytes(pax + bytes(1024))
    gnu = member(f"g/{LONG_KEY}.wav", wav(1.0), tarfile.GNU_FORMAT)
    gnu += member(f"g/{LONG_KEY}.json", meta("gnu name"), tarfile.GNU_FORMAT)
    header = bytearray(member("z.wav", b"", tarfile.GNU_FORMAT)[:512])
    set_ustar_size(header, 2**33)  # claims 8 GiB: the rest of this tar is one rejection
    (tars / "b.tar").write_bytes(gnu + bytes(header) + bytes(1024))
    config = tmp_path / "edges.toml"
    config.write_text("[build]\nbucket_edges_seconds = [5.0, 10.0]\nmin_shards = 1\n")
    out = tmp_path / "out"
    done = build(tars, out, "--config", str(config))
    assert done.returncode == 0, done.stderr
    index = read_index(out)
    totals = index["totals"]
    assert totals["utterances"] == 4  # the pax, GNU and crafted-size long names, first d
    assert totals["rejected"] == 4  # second d, huge, nested, the 8 GiB claim
    assert totals["discovered"] == totals["utterances"] + totals["rejected"]
    assert len(index["buckets"]) == 3 and {s["bucket"] for s in index["shards"]} == {0}
    assert run_preprocess("verify", str(out)).returncode == 0
    assert (
        "     1   5.00–10.01     469–937        0       0"
        in run_preprocess("inspect", str(out)).stdout
    )  # an empty bucket
