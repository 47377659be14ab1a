"""Scan and plan in process (quick): the plan is the same however many parts and pieces
scanned the corpus, keys stay unique, and lengths decide rejections and buckets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import SAMPLE_CORPUS

from melcache.errors import UserError
from melcache.features import FeatureConfig
from preprocess.config import BuildConfig
from preprocess.inputs.corpus import open_corpus
from preprocess.inputs.where import Where
from preprocess.plan.scan import Scan, part_folder, scan_folder, scan_part
from preprocess.plan.shard_plan import make_plan, planned_shard


def in_process(fn, items, chunksize=1):  # the Runner of one worker
    return map(fn, items)


def manifest(tmp_path: Path) -> Path:
    """A manifest whose sources clash once sanitised (``a.b`` / ``a_b``), list one file
    twice, and whose lengths span the duration filter."""
    root = tmp_path / "corpus"
    shutil.copytree(SAMPLE_CORPUS / "zh", root / "zh")
    rows = [
        {"audio_filepath": "zh/zh_01.wav", "text": "one", "duration": 2.0},
        {"audio_filepath": "a.b.wav", "text": "two", "duration": 3.0},
        {"audio_filepath": "a_b.wav", "text": "three", "duration": 4.0},
        {"audio_filepath": "zh/zh_01.wav", "text": "again", "duration": 2.0},
        {"audio_filepath": "a_b_2.wav", "text": "plain", "duration": 5.0},
        {"audio_filepath": "short.wav", "text": "short", "duration": 0.1},
        {
            "audio_filepath": "long.wav",
            "text": "long",
            "num_samples": 48000 * 40,
            "sampling_rate": 48000,
        },
        {"audio_filepath": "bad.wav", "text": "bad", "duration": "soon"},
    ] + [
        {"audio_filepath": f"x/{n:03d}.wav", "text": f"utterance {n}", "duration": 0.5 + n / 10}
        for n in range(40)
    ]
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def plan_of(src: Path, out: Path, parts: int, pieces: int):
    corpus = open_corpus(src, out)
    state = out / ".build"
    for part in range(parts):
        scan_part(corpus, part_folder(state, part, parts), part, parts, 24000, in_process, pieces)
    scan = Scan(scan_folder(state, parts), parts)
    return make_plan(scan, FeatureConfig(), BuildConfig(min_shards=4), False), scan


@pytest.mark.parametrize(("parts", "pieces"), [(2, 1), (3, 2)])
def test_plan_does_not_depend_on_parts_or_pieces(tmp_path: Path, parts: int, pieces: int) -> None:
    src = manifest(tmp_path)
    one, _ = plan_of(src, tmp_path / "one", 1, 1)
    many, _ = plan_of(src, tmp_path / "many", parts, pieces)
    assert one.digest == many.digest
    assert one.members.tolist() == many.members.tolist()
    assert one.shards.tolist() == many.shards.tolist()
    assert one.rejected.tolist() == many.rejected.tolist()


def test_keys_are_unique_and_lengths_filter(tmp_path: Path) -> None:
    plan, scan = plan_of(manifest(tmp_path), tmp_path / "out", 2, 2)
    items = [item for n in range(len(plan)) for item in planned_shard(plan, scan, n).items]
    keys = {item.source + f"#{item.locator}": item.key for item in items}
    assert len(set(keys.values())) == len(items) == 45  # 48 rows: short, long, bad rejected
    assert keys["a.b.wav#" + str(offset(scan, "a.b.wav"))] == "a_b"
    assert sorted(k for k in keys.values() if k.startswith("a_b")) == ["a_b", "a_b_2", "a_b_3"]
    assert sorted(k for k in keys.values() if k.startswith("zh_")) == ["zh_zh_01", "zh_zh_01_2"]
    rejected = {r.source: r.reason for r in scan.rejections()}
    assert rejected == {"bad.wav": "manifest duration is not a finite number of seconds ≥ 0"}
    assert len(plan.rejected) == 2  # short.wav and long.wav, judged by length alone
    for number in range(len(plan)):  # every shard within one bucket, sorted by length
        shard = planned_shard(plan, scan, number)
        bucket = plan.buckets[shard.bucket]
        lengths = [FeatureConfig().num_frames(item.samples) for item in shard.items]
        assert lengths == sorted(lengths)
        assert all(bucket.min_frames <= n <= bucket.max_frames for n in lengths)


def offset(scan: Scan, source: str) -> int:
    """The locator (line offset) the scan recorded for ``source``'s first row."""
    for piece in scan.pieces:
        for local in range(len(piece)):
            if piece.source(local) == source:
                return int(piece.columns["locator"][local])
    raise AssertionError(source)


def test_where_selects_on_metadata_and_runs_no_code() -> None:
    where = Where('language == "en" and dnsmos >= 3.2')
    assert where.fields == ["dnsmos", "language"]
    assert where({"language": "en", "dnsmos": 3.5})
    assert not where({"language": "en", "dnsmos": 3.1})
    assert not where({"language": "zh", "dnsmos": 3.5})
    assert not where({"language": "en"})  # a missing field compares false
    assert not Where("dnsmos > 3")({"dnsmos": "high"})  # unorderable: false, not a crash
    assert Where('speaker in ["a", "b"] or not clean')({"speaker": "c"})
    assert not Where("clean")({}) and Where("clean == true")({"clean": True})
    assert Where("-1 < score")({"score": 0})
    for code in ('__import__("os").system("true")', "a.b == 1", "x[0] == 1", "f(x)", "x +"):
        with pytest.raises(UserError, match="--where"):
            Where(code)


def test_where_leaves_rows_out_counted(tmp_path: Path) -> None:
    src = manifest(tmp_path)
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    for number, row in enumerate(rows):
        row["language"] = "en" if number % 3 else "zh"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = open_corpus(src, tmp_path / "out", where='language == "en"')
    state = tmp_path / "out" / ".build"
    scan_part(corpus, part_folder(state, 0, 2), 0, 2, 24000, in_process, 2)
    scan_part(corpus, part_folder(state, 1, 2), 1, 2, 24000, in_process, 1)
    scan = Scan(scan_folder(state, 2), 2)
    assert scan.filtered == sum(1 for r in rows if r["language"] == "zh") == 16
    sources = [piece.source(i) for piece in scan.pieces for i in range(len(piece))]
    language = {r["audio_filepath"]: r["language"] for r in rows}
    assert {language[s] for s in sources} == {"en"}
    with pytest.raises(UserError, match="which a JSONL manifest, tars or Parquet have"):
        open_corpus(SAMPLE_CORPUS, tmp_path / "out", where='language == "en"')
