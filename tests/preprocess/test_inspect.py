"""``preprocess inspect``: the text summary and the pictures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

import melcache
from melcache.format import INDEX_NAME
from tests.support.helpers import needs_extra, run_preprocess

pytestmark = pytest.mark.slow  # `preprocess inspect` as a subprocess: the full tier


def test_summary_lists_buckets_and_totals(sample_cache: Path) -> None:
    index = json.loads((sample_cache / INDEX_NAME).read_text())
    text = run_preprocess("inspect", str(sample_cache)).stdout
    assert f"{index['totals']['utterances']} utterances" in text
    assert f"{len(index['shards'])} shards" in text
    bucket_rows = [line for line in text.splitlines() if line.strip()[:1].isdigit() and "–" in line]
    assert len(bucket_rows) == len(index["buckets"])
    assert "rejected: 0 of 30 discovered" in text
    # text × frames per bucket, from the table: the text's padding computed from the cache
    rows = text.split("(by the table)")[1].strip().splitlines()
    assert len(rows) == len(index["buckets"])
    with melcache.open(sample_cache) as cache:
        last = [u for u in cache if u.meta["bucket"] == index["buckets"][-1]["bucket"]]
    chars = [len(u.text) for u in last]
    padding = 1 - sum(chars) / (len(chars) * max(chars))
    assert rows[-1].split()[-2] == f"{padding:.1%}"


def test_pictures_are_real_images(sample_cache: Path, tmp_path: Path) -> None:
    done = run_preprocess(
        "inspect", str(sample_cache), "--png", str(tmp_path), "--batch-frames", "4000"
    )
    names = {"durations.png", "mels.png", "rejected.png"}
    assert {
        Path(line.split()[-1]).name for line in done.stdout.splitlines() if line.startswith("wrote")
    } == names
    for name in names:
        with Image.open(tmp_path / name) as image:
            image.verify()  # a complete, uncorrupted PNG
        with Image.open(tmp_path / name) as image:
            width, height = image.size
            assert image.format == "PNG" and width >= 600 and height >= 150
            # not a blank canvas: a real plot has many distinct colours
            assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 50


def test_the_durations_picture_says_what_it_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It reads up to 16 shards a bucket: a 30-utterance cache once showed '29 utterances'."""
    plt = needs_extra("matplotlib.pyplot", "plot")
    from preprocess.check.inspect import _plot_durations

    index = {"totals": {"utterances": 30},
             "buckets": [{"bucket": 0, "min_seconds": 0.0, "max_seconds": 9.0}]}  # fmt: skip
    samples = [{"seconds": 1.0 + i / 10, "bucket": 0, "shard": f"s{i}", "frames": 90 + i}
               for i in range(29)]  # fmt: skip
    titles: list[str] = []
    monkeypatch.setattr(plt, "close", lambda figure: titles.append(figure.axes[0].get_title()))
    _plot_durations(plt, index, samples, 2000, 16, tmp_path / "d.png")
    index["totals"]["utterances"] = 29
    _plot_durations(plt, index, samples, 2000, 16, tmp_path / "d.png")
    assert titles[0].startswith("29 of 30 utterances (up to 16 shards a bucket read)"), titles
    assert titles[1].startswith("29 utterances; red: bucket edges"), titles
