"""The per-utterance table and random access: ``melcache.open``, ``CacheDataset``,
``preprocess index-table`` and ``inspect --key``, on the sample corpus built by the real build."""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import pickle
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import melcache
from melcache.access import UnknownKey
from melcache.codec import decode_mel
from melcache.dataset import CacheDataset
from melcache.errors import ShardError, UserError
from melcache.format import INDEX_NAME
from melcache.reader import ShardCheck, read_shard
from melcache.table import TABLE_NAME
from preprocess.check.verify import verify
from tests.support.helpers import REPO, SAMPLE_CORPUS, run_preprocess


def streamed(cache: Path) -> list[tuple[str, str, str | None, int, np.ndarray]]:
    """Every sample as the loader's reader streams the index's shards, in order."""
    index = json.loads((cache / INDEX_NAME).read_text())
    found = []
    for shard in index["shards"]:
        for raw in read_shard(str(cache / shard["name"]), shard, ShardCheck("sha256")):
            mel = decode_mel(raw.mel, raw.storage, 100, raw.key).copy()
            found.append((raw.key, raw.text, raw.speaker, raw.frames, mel))
    return found


def copied(sample_cache: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(sample_cache, tmp_path / "cache"))


def one_line(error: Exception) -> str:
    text = str(error)
    assert "\n" not in text and text
    return text


def test_lookups_by_key_and_row_equal_the_stream(sample_cache: Path) -> None:
    expected = streamed(sample_cache)
    with melcache.open(sample_cache) as cache:
        assert len(cache) == len(expected) == 30
        assert cache.keys() == [key for key, *_ in expected]
        assert cache.lengths.tolist() == [frames for _, _, _, frames, _ in expected]
        for row, (key, text, speaker, frames, mel) in enumerate(expected):
            for utterance in (cache[row], cache[key]):
                assert (utterance.key, utterance.text, utterance.speaker) == (key, text, speaker)
                assert utterance.frames == frames and utterance.row == row
                assert np.array_equal(utterance.mel, mel) and utterance.mel.dtype == np.float16
        assert cache[-1].key == expected[-1][0]
        keys = [key for key, *_ in expected][::-3]
        assert [u.key for u in cache.get_many(keys)] == keys


def test_unknown_key_and_row_are_clear_errors(sample_cache: Path) -> None:
    with melcache.open(sample_cache) as cache:
        with pytest.raises(UnknownKey) as error:
            cache["no_such_key"]
        assert "no utterance with key 'no_such_key'" in one_line(error.value)
        assert isinstance(error.value, KeyError) and isinstance(error.value, UserError)
        with pytest.raises(IndexError):
            cache[len(cache)]


def test_dataset_gives_lengths_without_reading_shards(sample_cache: Path) -> None:
    dataset = CacheDataset(sample_cache)
    expected = streamed(sample_cache)
    assert len(dataset) == 30
    assert dataset.lengths.tolist() == [frames for _, _, _, frames, _ in expected]
    assert [dataset.get_frame_len(i) for i in range(3)] == dataset.lengths[:3].tolist()
    assert np.all(dataset.durations() > 0.3)
    # A length-grouped batch sampler, as another trainer would build from the lengths alone.
    order = np.argsort(dataset.lengths, kind="stable")
    batches = [order[i : i + 4].tolist() for i in range(0, len(order), 4)]
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=list)
    seen = [item for batch in loader for item in batch]
    assert sorted(item["key"] for item in seen) == sorted(key for key, *_ in expected)
    item = pickle.loads(pickle.dumps(dataset))[5]  # as a spawned DataLoader worker gets it
    key, text, _, frames, mel = expected[5]
    assert (item["key"], item["text"], item["frames"]) == (key, text, frames)
    assert torch.equal(item["mel"], torch.from_numpy(mel))


def test_damaged_table_is_refused(sample_cache: Path, tmp_path: Path) -> None:
    cache = copied(sample_cache, tmp_path)
    table = bytearray((cache / TABLE_NAME).read_bytes())
    table[len(table) // 2] ^= 0x10
    (cache / TABLE_NAME).write_bytes(bytes(table))
    with pytest.raises(UserError) as error:
        melcache.open(cache)
    assert "xxh3_128 differs from index.json" in one_line(error.value)
    assert any(TABLE_NAME in p and "differs" in p for p in verify(cache))
    (cache / TABLE_NAME).write_bytes(bytes(table[:100]))  # cut short
    with pytest.raises(UserError, match=r"bytes, index\.json says"):
        melcache.open(cache)


def test_stale_table_is_refused(
    sample_cache: Path, tmp_path: Path, small_shards_config: Path
) -> None:
    """A table whose digest is right in index.json but that no longer matches the shards (a
    frame count changed, as a stale table would) is caught by verify and by the lookup; a
    table the index does not list is refused by both."""
    from melcache.table import encode_table, table_entry
    from preprocess.write.index_table import cache_rows

    cache = copied(sample_cache, tmp_path)
    index = json.loads((cache / INDEX_NAME).read_text())
    rows = cache_rows(cache, index)
    rows.columns["frames"][7] += 1
    data = encode_table(rows, index)
    (cache / TABLE_NAME).write_bytes(data)
    index["table"] = table_entry(data)
    (cache / INDEX_NAME).write_text(json.dumps(index))
    assert any("differs from what the shards make" in p for p in verify(cache))
    with melcache.open(cache) as opened, pytest.raises(ShardError) as error:
        opened[7]
    assert "utterances.table says" in one_line(error.value)
    del index["table"]
    (cache / INDEX_NAME).write_text(json.dumps(index))
    assert verify(cache) == [f"{TABLE_NAME}: not listed in index.json (stale?)"]
    with pytest.raises(UserError, match="index-table"):
        melcache.open(cache)


def test_shard_swapped_under_a_valid_table_is_caught(sample_cache: Path, tmp_path: Path) -> None:
    cache = copied(sample_cache, tmp_path)
    index = json.loads((cache / INDEX_NAME).read_text())
    first, second = (cache / s["name"] for s in index["shards"][:2])
    first.write_bytes(second.read_bytes())  # another shard under this one's name
    with melcache.open(cache) as opened, pytest.raises(ShardError) as error:
        opened[0]
    assert first.name in one_line(error.value)
    # The same size, one mel byte changed: that sample is refused, its neighbours still read.
    shutil.copy(sample_cache / first.name, first)
    with melcache.open(cache) as opened:
        offset, _ = opened.table.span(1)
        mel_at = int(opened.table.column("mel_at")[1])
        data = bytearray(first.read_bytes())
        data[offset + mel_at + 200] ^= 0x01
        first.write_bytes(bytes(data))
        with pytest.raises(ShardError, match=r"not the sample utterances\.table records"):
            opened[1]
        assert opened[0].key == streamed(sample_cache)[0][0]


def test_cache_without_a_table_still_verifies(sample_cache: Path, tmp_path: Path) -> None:
    cache = copied(sample_cache, tmp_path)
    index = json.loads((cache / INDEX_NAME).read_text())
    del index["table"]
    (cache / TABLE_NAME).unlink()
    (cache / INDEX_NAME).write_text(json.dumps(index))
    assert verify(cache) == []
    with pytest.raises(UserError) as error:
        melcache.open(cache)
    assert f"python -m preprocess index-table {cache}" in one_line(error.value)


@pytest.mark.slow  # subprocesses
def test_index_table_writes_the_builds_table(sample_cache: Path, tmp_path: Path) -> None:
    cache = copied(sample_cache, tmp_path)
    index = json.loads((cache / INDEX_NAME).read_text())
    del index["table"]
    (cache / TABLE_NAME).unlink()
    shutil.rmtree(cache / ".build")  # as a cache from before tables has no rows saved
    (cache / INDEX_NAME).write_text(json.dumps(index))
    done = run_preprocess("index-table", str(cache), "--workers", "2")
    assert "30 utterances" in done.stdout
    assert (cache / TABLE_NAME).read_bytes() == (sample_cache / TABLE_NAME).read_bytes()
    assert (
        json.loads((cache / INDEX_NAME).read_text())["table"]
        == json.loads((sample_cache / INDEX_NAME).read_text())["table"]
    )
    assert run_preprocess("verify", str(cache)).returncode == 0


@pytest.mark.slow  # subprocesses
def test_inspect_key_prints_and_draws_one_utterance(sample_cache: Path, tmp_path: Path) -> None:
    key, text, speaker, frames, _ = streamed(sample_cache)[12]
    done = run_preprocess("inspect", str(sample_cache), "--key", key, "--png", str(tmp_path))
    assert f"key {key}: row 12" in done.stdout and f"text: {text}" in done.stdout
    assert f"speaker: {speaker}" in done.stdout and f"{frames} frames × 100 mels" in done.stdout
    with Image.open(tmp_path / f"{key}.png") as image:
        assert image.format == "PNG" and len(image.convert("RGB").getcolors(1 << 20)) > 50
    missing = run_preprocess("inspect", str(sample_cache), "--key", "nope", check=False)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error: {sample_cache}: no utterance with key 'nope' (30 in the cache)"
    ]


@pytest.mark.slow  # two build processes
def test_parts_and_lz4_q5_builds_write_the_same_table(
    tmp_path: Path, small_shards_config: Path
) -> None:
    """A cache built by two parts has the table of the one-part build; an lz4-q5 cache's
    lookups decode its mel.q5 members."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    common = ["--src", str(SAMPLE_CORPUS), "--config", str(small_shards_config), "--workers", "1"]
    run_preprocess("build", *common, "--out", str(whole), "--storage", "lz4-q5")
    command = [sys.executable, "-m", "preprocess", "build", *common, "--out", str(parts)]
    builds = [  # parts meet in OUT: both run at once, as on two machines
        subprocess.Popen([*command, "--storage", "lz4-q5", "--part", part], cwd=REPO)
        for part in ("0/2", "1/2")
    ]
    assert [build.wait(timeout=600) for build in builds] == [0, 0]
    assert (parts / TABLE_NAME).read_bytes() == (whole / TABLE_NAME).read_bytes()
    expected = streamed(whole)
    with melcache.open(parts) as cache:
        for key, text, _, _, mel in expected:
            assert np.array_equal(cache[key].mel, mel) and cache[key].text == text


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """A static file server that answers ``Range: bytes=A-B`` with 206, as object stores do
    (Python's own handler ignores ranges)."""

    def send_head(self):  # type: ignore[no-untyped-def]
        wanted = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if wanted is None:
            return super().send_head()
        data = Path(self.translate_path(self.path)).read_bytes()
        start, stop = int(wanted[1]), int(wanted[2]) + 1
        self.send_response(206)
        self.send_header("Content-Length", str(len(data[start:stop])))
        self.end_headers()
        return io.BytesIO(data[start:stop])

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def served(folder: Path, handler: type) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


def test_http_cache_is_read_by_range_requests(sample_cache: Path) -> None:
    expected = streamed(sample_cache)
    with served(sample_cache, _RangeHandler) as url, melcache.open(url) as cache:
        for row in (0, 13, 29):
            key, text, _, _, mel = expected[row]
            assert cache[key].text == text and np.array_equal(cache[row].mel, mel)
    handler = http.server.SimpleHTTPRequestHandler
    with (
        served(sample_cache, handler) as url,
        melcache.open(url) as cache,
        pytest.raises(ShardError, match="ignores range requests"),
    ):
        cache[0]
    with pytest.raises(UserError, match="random access reads a local folder, an http"):
        melcache.open("pipe:cat " + str(sample_cache))


def test_fuzzed_table_gives_one_line_errors_or_true_utterances(
    sample_cache: Path, tmp_path: Path
) -> None:
    """A table damaged and then re-listed in index.json with matching digests (as a forger or
    a buggy tool would leave it): every lookup is the streamed utterance or a one-line error."""
    from melcache.table import table_entry

    cache = copied(sample_cache, tmp_path)
    honest = (sample_cache / TABLE_NAME).read_bytes()
    index = json.loads((sample_cache / INDEX_NAME).read_text())
    truth = {key: (text, mel) for key, text, _, _, mel in streamed(sample_cache)}
    rng = np.random.default_rng(0)
    outcomes = {"refused": 0, "read": 0}
    for _ in range(150):
        data = bytearray(honest)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        (cache / TABLE_NAME).write_bytes(bytes(data))
        (cache / INDEX_NAME).write_text(json.dumps({**index, "table": table_entry(bytes(data))}))
        try:
            with melcache.open(cache) as opened:
                for item in [*range(len(opened)), *truth]:
                    try:
                        got = opened[item]
                    except (UserError, ShardError) as exc:
                        one_line(exc)
                        outcomes["refused"] += 1
                        continue
                    text, mel = truth[got.key]
                    assert got.text == text and np.array_equal(got.mel, mel)
                    outcomes["read"] += 1
        except UserError as exc:
            one_line(exc)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 50 and outcomes["read"] > 50


def test_index_table_reads_shards_other_tools_wrote(sample_cache: Path, tmp_path: Path) -> None:
    """A shard rewritten with pax headers (another tar writer, a repacked download): the
    table is made through tarfile, and lookups parse the sample through the general reader."""
    from melcache.reader import DIGESTS
    from melcache.tar.reader import iter_members
    from preprocess.write.index_table import index_table

    cache = copied(sample_cache, tmp_path)
    index = json.loads((cache / INDEX_NAME).read_text())
    entry = index["shards"][3]
    shard = cache / entry["name"]
    with open(shard, "rb") as stream:
        members = list(iter_members(stream, shard.name))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for key, member, data in members:
            info = tarfile.TarInfo(f"{key}.{member}")
            info.size, info.pax_headers = len(data), {"comment": "repacked"}
            tar.addfile(info, io.BytesIO(data))
    shard.write_bytes(buffer.getvalue())
    entry["bytes"] = len(buffer.getvalue())
    entry.update({field: digest(buffer.getvalue()) for field, digest in DIGESTS.items()})
    (cache / INDEX_NAME).write_text(json.dumps(index))
    index_table(cache)
    assert verify(cache) == []
    with melcache.open(cache) as opened:
        for key, text, _, _, mel in streamed(sample_cache):
            assert opened[key].text == text and np.array_equal(opened[key].mel, mel)


def test_rows_saved_for_other_bytes_are_not_used(sample_cache: Path, tmp_path: Path) -> None:
    """The build's writers save each shard's rows for the table; rows saved for other bytes
    of a shard (its sha256 differs) or unreadable ones are scanned again, never trusted."""
    from preprocess.write.index_table import ROWS_FOLDER, index_table

    cache = copied(sample_cache, tmp_path)
    saved = sorted((cache / ".build" / ROWS_FOLDER).glob("*.json"))
    assert len(saved) == len(json.loads((cache / INDEX_NAME).read_text())["shards"])
    record = json.loads(saved[0].read_text())
    record["columns"]["frames"] = [f + 1 for f in record["columns"]["frames"]]
    record["sha256"] = "0" * 64
    saved[0].write_text(json.dumps(record))
    saved[1].write_text("{not json")
    index_table(cache)
    assert (cache / TABLE_NAME).read_bytes() == (sample_cache / TABLE_NAME).read_bytes()
