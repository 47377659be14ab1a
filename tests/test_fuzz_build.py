"""Fuzzing what a build reads: tar headers and member names, manifest and sample JSON of any
depth and value, Parquet columns of any type, and ``--where`` text.

Every case must end in a result, a per-input rejection or a one-line error (``UserError``,
or the ``ValueError`` / ``AudioError`` a caller turns into a rejection), never a traceback
from inside a library, a hang or an allocation of what a header claims. All in process: the
inputs are written here, thousands of cases run in seconds.
"""

from __future__ import annotations

import io
import json
import math
import random
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

from melcache.errors import UserError
from preprocess.inputs.archives import audio_input, parse_text_member, read_member, tar_samples
from preprocess.inputs.audio import AudioError, probe
from preprocess.inputs.corpus import open_corpus, parse_manifest_line, read_transcript
from preprocess.inputs.parquet import parquet_rows
from preprocess.inputs.records import Corpus, Found, Rejection
from preprocess.inputs.where import Where

RATE = 24000
INT64 = 2**63 - 1
ODD_VALUES: list[Any] = [
    None, -1, 0, 1, 16000, 2**62, 2**64 - 1, 10**30, 1.5, -0.0, 1e308, math.nan, math.inf,
    -math.inf, True, "", "12", "\ud800", [], [1], {}, {"a": 1}, [[["deep"]]],
]  # fmt: skip
ODD_NAMES = ["", "/", "a/", "../x.wav", "/abs.wav", "a..json", "k.JSON", "k.wav.json", "é.wav",
             "x" * 300 + ".wav", "k" * 99 + ".json", "\udcff.wav", ".json", "k.", "k.txt"]  # fmt: skip


def wav(seconds: float = 0.4) -> bytes:
    buffer = io.BytesIO()
    t = np.arange(int(8000 * seconds)) / 8000
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), 8000, format="WAV")
    return buffer.getvalue()


def member(name: str, payload: bytes, fmt: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    return info.tobuf(fmt, "utf-8", "surrogateescape") + payload + bytes(-len(payload) % 512)


def honest_tar() -> bytes:
    """Samples under ustar, pax (a long key) and GNU (a long key) headers."""
    long = "d" * 60 + "/" + "k" * 80
    data = member("a.wav", wav(), tarfile.USTAR_FORMAT) + member(
        "a.json", b'{"text": "a", "duration": 0.4}', tarfile.USTAR_FORMAT
    )
    data += member(f"{long}.wav", wav(), tarfile.PAX_FORMAT)
    data += member(f"{long}.json", b'{"text": "pax"}', tarfile.PAX_FORMAT)
    data += member(f"g{long}.flac", wav(), tarfile.GNU_FORMAT)
    data += member(f"g{long}.txt", b"gnu", tarfile.GNU_FORMAT)
    return data + bytes(1024)


def header_offsets(data: bytes) -> list[int]:
    """Where each 512-byte block that looks like a tar header starts."""
    return [i for i in range(0, len(data) - 511, 512) if data[i + 257 : i + 262] == b"ustar"]


def refit_checksum(block: bytearray) -> None:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block[:512])


def mutate_tar(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A header's size or name set to an odd value (checksum refitted, so tarfile believes
    it), a flipped header byte, a cut, or a member of an odd name appended."""
    out = bytearray(data)
    at = rng.choice(header_offsets(data))
    block = out[at : at + 512]
    kind = rng.choice(["size", "name", "flip", "cut", "append", "pax"])
    if kind == "size":
        size = rng.choice([0, 1, 511, 10**6, 2**33, 2**62, 2**88 - 1, rng.randrange(2**40)])
        if size < 8**11 and rng.random() < 0.5:
            block[124:136] = b"%011o\0" % size
        else:
            block[124:136] = bytes([0x80]) + size.to_bytes(11, "big")
        refit_checksum(block)
    elif kind == "name":
        name = rng.choice(ODD_NAMES).encode("utf-8", "surrogateescape")[:100]
        block[0:100] = name + bytes(100 - len(name))
        refit_checksum(block)
    elif kind == "flip":
        block[rng.randrange(512)] ^= 1 << rng.randrange(8)
        if rng.random() < 0.5:
            refit_checksum(block)
    elif kind == "cut":
        end = rng.randrange(len(data))
        return data[:end], f"cut at {end}"
    elif kind == "append":
        fmt = rng.choice([tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
        name = rng.choice(ODD_NAMES)
        try:
            extra = member(name, rng.choice([wav(), b"{}", b"[" * 5000, b""]), fmt)
        except (ValueError, UnicodeError):  # a name this format cannot hold
            return data, f"append {name!r}: not writable"
        return data[:-1024] + extra + bytes(1024), f"append {name!r} in format {fmt}"
    else:  # a pax record of an odd value
        record_value = rng.choice(["-1", "1e9", "99999999999999999999", "x", ""])
        record = f"size={record_value}\n"
        record = f"{len(record) + 3} {record}"
        info = tarfile.TarInfo("././@PaxHeader")
        info.type, info.size = tarfile.XHDTYPE, len(record)
        pax = info.tobuf(tarfile.USTAR_FORMAT) + record.encode() + bytes(-len(record) % 512)
        return bytes(out[:at]) + pax + bytes(out[at:]), f"pax size={record_value} at {at}"
    out[at : at + 512] = block
    return bytes(out), f"{kind} of header at {at}"


def test_fuzzed_tars_give_rejections_or_readable_members(tmp_path: Path) -> None:
    honest = honest_tar()
    corpus = Corpus("tars", str(tmp_path), archives=("f.tar",))
    rng = random.Random(24)
    found = rejected = 0
    started = time.monotonic()
    for number in range(600):
        data, case = mutate_tar(honest, rng)
        (tmp_path / "f.tar").write_bytes(data)
        items = list(tar_samples(corpus, 0, "f.tar", RATE, None))
        assert all(isinstance(i, Found | Rejection) for i in items), case
        for item in items:
            if isinstance(item, Rejection):
                rejected += 1
                assert item.reason and "\n" not in item.reason, f"{number} {case}: {item}"
                continue
            found += 1
            try:  # what the writer does with it
                read_transcript(corpus, item.source, item.locator)
                probe(audio_input(corpus, item.source, item.audio_at))
                read_member(corpus, item.source, item.audio_at)
            except (ValueError, AudioError) as exc:
                assert "\n" not in str(exc), f"{number} {case}: {exc}"
    assert found > 300 and rejected > 100  # both outcomes were exercised
    assert time.monotonic() - started < 60


def odd_json(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value: odd scalars, and now and then containers nested thousands deep."""
    if rng.random() < 0.05:
        nesting = rng.choice([10, 500, 990, 5000, 100_000])
        return json.loads("[" * min(nesting, 900) + "]" * min(nesting, 900)) if nesting < 900 \
            else RAW_DEEP[nesting]  # fmt: skip
    if depth < 3 and rng.random() < 0.3:
        return {f"k{i}": odd_json(rng, depth + 1) for i in range(rng.randint(0, 3))}
    return rng.choice(ODD_VALUES)


class _Raw(str):
    """JSON text spliced in as is (deeper than ``json.dumps`` can write)."""


RAW_DEEP = {n: _Raw("[" * n + "]" * n) for n in (990, 5000, 100_000)}


def dumps(value: Any) -> str:
    if isinstance(value, _Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {dumps(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def odd_row(rng: random.Random) -> str:
    fields = ["audio_filepath", "text", "speaker", "duration", "num_samples", "sampling_rate"]
    row = {"audio_filepath": "a.wav", "text": "t"}
    for field in rng.sample(fields, rng.randint(1, len(fields))):
        row[field] = odd_json(rng)
    return dumps(row)


def test_fuzzed_json_lines_give_rows_or_reasons(tmp_path: Path) -> None:
    rng = random.Random(7)
    rows = reasons = 0
    for _ in range(3000):
        line = odd_row(rng).encode("utf-8", "surrogatepass")
        if rng.random() < 0.05:
            line = line[: rng.randrange(len(line) + 1)] + bytes([rng.randrange(256)])
        try:
            _, _, speaker, samples, _ = parse_manifest_line(line, str(tmp_path), RATE)
            rows += 1
            assert samples is None or 0 <= samples <= INT64
            assert speaker is None or isinstance(speaker, str)
        except (ValueError, LookupError) as exc:
            reasons += 1
            assert "\n" not in str(exc.args[-1])
        try:
            _, text, speaker = parse_text_member(line, json_member=True)
            assert isinstance(text, str) and (speaker is None or isinstance(speaker, str))
        except ValueError as exc:
            assert "\n" not in str(exc)
    assert rows > 100 and reasons > 1000


PARQUET_COLUMNS: dict[str, list[tuple[pa.DataType, Any]]] = {
    "audio": [
        (pa.struct([("bytes", pa.binary()), ("path", pa.int64())]), lambda: {"bytes": wav(), "path": 3}),
        (pa.struct([("bytes", pa.binary()), ("path", pa.string())]), lambda: {"bytes": wav(), "path": "a.mp3"}),
        (pa.struct([("bytes", pa.string()), ("path", pa.string())]), lambda: {"bytes": "x", "path": None}),
        (pa.struct([("path", pa.list_(pa.int8()))]), lambda: {"path": [1]}),
        (pa.binary(), wav),
        (pa.int64(), lambda: 5),
        (pa.list_(pa.binary()), lambda: [wav()]),
    ],
    "text": [(pa.string(), lambda: "t"), (pa.int64(), lambda: 1), (pa.binary(), lambda: b"t"),
             (pa.list_(pa.string()), lambda: ["t"])],
    "speaker": [(pa.string(), lambda: "s"), (pa.int32(), lambda: 4), (pa.float64(), lambda: math.nan),
                (pa.struct([("id", pa.int8())]), lambda: {"id": 1}), (pa.list_(pa.int8()), lambda: [1]),
                (pa.bool_(), lambda: True)],
    "duration": [(pa.float64(), lambda: 1e308), (pa.float64(), lambda: 0.4), (pa.uint64(), lambda: 2**64 - 1),
                 (pa.int64(), lambda: -5), (pa.string(), lambda: "1.0"), (pa.float32(), lambda: math.inf)],
    "num_samples": [(pa.uint64(), lambda: 2**64 - 1), (pa.int64(), lambda: 6400), (pa.float64(), lambda: 1.0)],
    "sampling_rate": [(pa.uint64(), lambda: 2**64 - 1), (pa.int32(), lambda: 16000), (pa.int32(), lambda: 0)],
}  # fmt: skip


def test_fuzzed_parquet_types_give_row_rejections(tmp_path: Path) -> None:
    rng = random.Random(13)
    found = rejected = 0
    for number in range(40):
        columns = {"audio": None, "text": None} | {
            name: None for name in rng.sample(sorted(PARQUET_COLUMNS)[2:], rng.randint(0, 4))
        }
        arrays, case = {}, []
        for name in columns:
            kind, value = rng.choice(PARQUET_COLUMNS[name])
            values = [value() if rng.random() < 0.8 else None for _ in range(3)]
            arrays[name] = pa.array(values, kind)
            case.append(f"{name}: {kind}")
        rel = f"f{number}.parquet"
        pq.write_table(pa.table(arrays), tmp_path / rel)
        corpus = open_corpus(tmp_path / rel, tmp_path / f"out{number}")
        for item in parquet_rows(corpus, 0, rel, RATE, None):
            assert isinstance(item, Found | Rejection), case
            if isinstance(item, Rejection):
                rejected += 1
                assert item.reason and "\n" not in item.reason, f"{case}: {item}"
            else:
                found += 1
                assert item.samples is None or 0 <= item.samples <= INT64
    assert found > 5 and rejected > 20


WHERE_TOKENS = ["lang", "dnsmos", "ｌａｎｇ", "语言", "x", "true", "null", "1", "-2.5", "1e400",
                '"en"', "'ｆｗ'", "==", "!=", "<", ">=", "in", "not in", "and", "or", "not", "-",
                "+", "~", "(", ")", "[", "]", ",", "f(x)", "x.y", "x[0]", "lambda: 1", "\0",
                "\udcff", "\\", ":=", "*", "if", "await", "#"]  # fmt: skip


def test_fuzzed_where_text_gives_a_selection_or_one_line(tmp_path: Path) -> None:
    rng = random.Random(3)
    parsed = refused = 0
    rows = [{}, {"lang": "en", "dnsmos": 3.5, "x": [1, 2]}, {"lang": None, "x": "s"}]
    for _ in range(3000):
        tokens = [rng.choice(WHERE_TOKENS) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.05:  # a prefix operator repeated past the parser's stack
            tokens = [rng.choice(["not", "-", "~", "(", "["])] * rng.choice(
                [99, 2000, 30000]
            ) + tokens
        text = " ".join(tokens)
        try:
            where = Where(text)
        except UserError as exc:
            refused += 1
            assert "\n" not in str(exc) and len(str(exc)) < 1000
            continue
        parsed += 1
        for row in rows:
            assert where(row) in (True, False)
    assert parsed > 50 and refused > 1000
