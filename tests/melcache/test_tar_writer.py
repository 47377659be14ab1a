"""The shard writer writes what the libraries it replaced wrote, byte for byte (webdataset's
TarWriter, np.save), so caches built before and after it are the same files. In-process and
quick."""

from __future__ import annotations

import io
import random
import tarfile

import numpy as np
import pytest
import webdataset as wds

from melcache.format import encode_npy, encode_sample
from melcache.tar.reader import tar_members
from melcache.tar.writer import TAR_MTIME, TAR_OWNER, open_tar_writer, tar_header
from tests.support.tars import shard_bytes


def _samples(seed: int, count: int) -> list[dict]:
    """Samples of every shape a shard holds: sizes on and off the 512-byte blocks, empty
    members, keys that need a pax header (long, non-ASCII), audio and extra members."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        key = ["utt", "spk-ü_é", "x" * 130, "é" * 60][i % 4] + f"{i:05d}"
        frames = int(rng.integers(0, 700))
        meta = {"text": "héllo " * int(rng.integers(0, 90)), "frames": frames, "bucket": i}
        sample = encode_sample(key, rng.normal(size=(frames, 100)).astype(np.float16), meta)
        if i % 3 == 0:
            sample["flac"] = rng.bytes(int(rng.choice([0, 511, 512, 513, 1024, 10240, 99_999])))
        if i % 5 == 0:
            sample["_ignored"] = b"metadata both writers leave out"
        samples.append(sample)
    return samples


def _webdataset_writer(buffer: io.BytesIO) -> wds.TarWriter:
    return wds.TarWriter(buffer, user=TAR_OWNER, group=TAR_OWNER, encoder=False, mtime=TAR_MTIME)


@pytest.mark.parametrize(("seed", "count"), [(0, 0), (1, 1), (2, 7), (3, 40)])
def test_shards_are_the_bytes_webdataset_wrote(seed: int, count: int) -> None:
    samples = _samples(seed, count)
    ours = shard_bytes(samples)
    assert ours == shard_bytes(samples, _webdataset_writer)
    assert len(ours) % 10240 == 0  # whole tar records, as tarfile ends an archive
    if count:
        keys = {key for key, _, _ in tar_members(ours, "written")}
        assert keys == {s["__key__"] for s in samples}


@pytest.mark.parametrize("seed", [4, 5])
def test_write_says_where_each_member_went(seed: int) -> None:
    """What write() returns is where tarfile finds each member (pax headers included), and
    the sample's bytes from its first header to its last member's data."""
    samples = _samples(seed, 12)
    buffer = io.BytesIO()
    with open_tar_writer(buffer) as writer:
        written = [writer.write(sample) for sample in samples]
    data = buffer.getvalue()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        found = {m.name: (m.offset, m.offset_data, m.size) for m in tar}
    for sample, where in zip(samples, written, strict=True):
        members = sorted(m for m in sample if not m.startswith("_"))
        assert where.spans == {m: found[f"{sample['__key__']}.{m}"] for m in members}
        first, (_, at, size) = where.spans[members[0]][0], where.spans[members[-1]]
        assert first == where.offset
        assert bytes(where.data) == data[first : at + size]


def test_each_header_is_the_one_tarfile_writes() -> None:
    """The header patched into tarfile's template equals tarfile's own for names of every
    length around the field's 100 bytes (empty too), ASCII or not (a pax header), control
    characters among them, and sizes on and off the blocks up to and past the largest the
    size field holds (a pax header again)."""
    rng = random.Random(0)
    alphabet = "abcXYZ019._-/ é\0\t\n\x7f" + "".join(map(chr, range(1, 32)))
    largest = 8**11 - 1
    sizes = [0, 1, 511, 512, 513, 10**6, largest, largest + 1, 2**40]
    for _ in range(5000):
        length = rng.choice([0, 1, 60, 99, 100, 101, 150])
        name = "".join(rng.choice(alphabet) for _ in range(length))
        size = rng.choice([*sizes, rng.randrange(largest)])
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = size, TAR_MTIME, 0o444
        info.uname = info.gname = TAR_OWNER
        assert tar_header(name, size) == info.tobuf(tarfile.PAX_FORMAT), (name, size)


def test_mel_npy_is_what_np_save_writes() -> None:
    rng = np.random.default_rng(0)
    shapes = [
        (0, 100),
        (1, 100),
        (7, 80),
        (3, 1),
        *((int(n), 100) for n in rng.integers(0, 3000, 50)),
    ]
    for shape in shapes:
        for mel in (rng.normal(size=shape), np.asfortranarray(rng.normal(size=shape))):
            saved = io.BytesIO()
            np.save(saved, np.ascontiguousarray(mel, dtype="<f2"), allow_pickle=False)
            assert encode_npy(mel) == saved.getvalue()
