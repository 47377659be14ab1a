"""Corpora shipped as Parquet (the Hugging Face ``datasets`` convention), read a row group at
a time, never a whole file.

A row holds encoded audio in one column (``datasets``' Audio feature, a struct ``{"bytes",
"path"}``, or plain binary), its transcript in another, optionally a speaker, and any other
fields: ``duration`` or ``num_samples`` + ``sampling_rate`` spare probing the audio, and
``--where`` selects on them. The column names are configurable (``--columns``).

A shard gathers utterances of one length from every row group, and Parquet cannot hand out one
row without decoding its row group's whole column chunk. So the scan, while it reads each row
group, appends its audio and text to a plain tar, the file's *spool* in ``OUT/.build/spool/``;
from then on the file is read exactly as a WebDataset tar is
(:mod:`preprocess.inputs.archives`): the writer reads one member at its offset. The spool holds
the corpus's audio once over while the build runs and is deleted when the cache is complete.
Sources are ``FILE:ROW.EXT``.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from typing import Any

from melcache.bounded import open_regular
from melcache.errors import UserError
from melcache.extras import value_problem
from preprocess.inputs.archives import TAR_AUDIO
from preprocess.inputs.records import (
    FILTERED,
    Corpus,
    Found,
    Rejection,
    found,
    listed_samples,
    listed_speaker,
    short,
)
from preprocess.inputs.where import Where

DEFAULT_COLUMNS = ("audio", "text", "speaker")
SPOOL = "spool"  # under OUT/.build


def pyarrow_parquet() -> Any:
    """``pyarrow.parquet``, or a :class:`UserError` saying how to install it."""
    try:
        import pyarrow.parquet
    except ImportError:
        raise UserError(
            "Parquet input needs pyarrow: pip install 'melcache[parquet]' (or pip install pyarrow)"
        ) from None
    return pyarrow.parquet


def parse_columns(text: str | None) -> tuple[str, str, str]:
    """``(audio, text, speaker)`` column names from ``--columns AUDIO,TEXT[,SPEAKER]``."""
    if text is None:
        return DEFAULT_COLUMNS
    names = [name.strip() for name in text.split(",")]
    if len(names) not in (2, 3) or not all(names):
        raise UserError(f"--columns {text!r}: expected AUDIO,TEXT or AUDIO,TEXT,SPEAKER")
    return names[0], names[1], names[2] if len(names) == 3 else DEFAULT_COLUMNS[2]


def check_columns(root: str, archives: tuple[str, ...], columns: tuple[str, str, str]) -> None:
    """:class:`UserError` when the first readable Parquet file lacks the audio or text column:
    the columns are misnamed, not every row bad. (Unreadable files, and later ones lacking the
    columns, are rejected whole when scanned.)"""
    for archive in archives:
        path = os.path.join(root, archive)
        try:
            with open_regular(path) as file:
                names = pyarrow_parquet().read_schema(file).names
        except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
            continue
        missing = [name for name in columns[:2] if name not in names]
        if missing:
            raise UserError(
                f"{path} has no column {', '.join(map(repr, missing))} (it has "
                f"{', '.join(names)}); name the audio and text columns with --columns AUDIO,TEXT"
            )
        return


def parquet_rows(
    corpus: Corpus, number: int, rel: str, sample_rate: int, where: Where | None
) -> Iterator[Found | Rejection]:
    """The rows of Parquet file ``number`` (``rel``), in order, a row group at a time, each
    utterance's audio and text appended to the file's spool before it is yielded."""
    assert corpus.columns is not None  # internal invariant: open_corpus sets them
    audio_column, text_column, _ = corpus.columns
    spool = corpus.archive_path(rel)
    os.makedirs(os.path.dirname(spool), exist_ok=True)
    if os.path.exists(spool):  # a new file, so that a reader of the old one keeps reading it
        os.unlink(spool)
    row = 0
    try:
        with open_regular(os.path.join(corpus.root, rel)) as source:
            table_file = pyarrow_parquet().ParquetFile(source)
            names = table_file.schema_arrow.names
            missing = [name for name in (audio_column, text_column) if name not in names]
            if missing:
                yield Rejection(rel, f"no column {', '.join(map(repr, missing))} in this file")
                return
            with open(spool, "wb") as out, tarfile.open(fileobj=out, mode="w") as tar:
                for group in range(table_file.num_row_groups):
                    rows = table_file.read_row_group(group).to_pylist()
                    items = [
                        _row(corpus, tar, number, rel, row + i, record, sample_rate, where)
                        for i, record in enumerate(rows)
                    ]
                    out.flush()  # the scan probes these rows' audio in the spool next
                    row += len(rows)
                    yield from items
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        yield Rejection(rel, f"damaged Parquet file after {row} rows: {short(exc)}")


def _row(
    corpus: Corpus,
    tar: tarfile.TarFile,
    number: int,
    rel: str,
    row: int,
    record: dict[str, Any],
    sample_rate: int,
    where: Where | None,
) -> Found | Rejection:
    """One row as an utterance, its audio and text appended to the spool, or why not."""
    assert corpus.columns is not None
    audio_column, text_column, speaker_column = corpus.columns
    audio = record.pop(audio_column)
    data, name = (
        (audio.get("bytes"), audio.get("path")) if isinstance(audio, dict) else (audio, None)
    )
    name = name if isinstance(name, str) else ""  # a name only: decoding sniffs the format
    extension = os.path.splitext(name)[1][1:].lower()
    extension = extension if extension in TAR_AUDIO else "audio"
    source = f"{rel}:{row}.{extension}"
    if not isinstance(data, bytes) or not data:
        return Rejection(source, f"row has no audio bytes in column {audio_column!r}")
    if isinstance(audio, dict) and audio.get("path") is not None and not name:
        kind = type(audio["path"]).__name__
        return Rejection(source, f"row's audio path in column {audio_column!r} is {kind}")
    text = record.get(text_column)
    if not isinstance(text, str):
        return Rejection(source, f"row has no text string in column {text_column!r}")
    if where is not None and not where(record):
        return Rejection(source, where.text, stage=FILTERED)
    samples = listed_samples(record, sample_rate)
    if isinstance(samples, str):
        return Rejection(source, samples.replace("manifest", "row"))
    try:
        speaker = listed_speaker(
            {"speaker": record.get(speaker_column)}, f"row column {speaker_column!r}"
        )
    except ValueError as exc:
        return Rejection(source, str(exc))
    # The row's other scalar columns too: what [build] extras may ask the writer to carry.
    meta = {
        k: v
        for k, v in record.items()
        if k not in (text_column, speaker_column, "speaker")
        if value_problem(v) is None
    }
    meta.update({"text": text} if speaker is None else {"text": text, "speaker": speaker})
    audio_at = _append(tar, f"{row}.{extension}", data)
    text_at = _append(tar, f"{row}.json", json.dumps(meta).encode())
    return found(number << 32 | row, source, text_at, text, speaker, samples, audio_at)


def _append(tar: tarfile.TarFile, name: str, payload: bytes) -> int:
    """Add a member to the spool; return where its header starts (as a tar's locators)."""
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    at = tar.offset
    tar.addfile(info, io.BytesIO(payload))
    return at
