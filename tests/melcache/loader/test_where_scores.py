"""``data.where`` and ``data.balance.weight`` on a score derived beside the mels (#53): the
SNR example (``examples/quality_score``) derived by the real ``preprocess derive`` into a copy of
the sample cache, then read by the real loader, ``verify`` and ``inspect``; no mel shard is
rewritten."""

from __future__ import annotations

import collections
import hashlib
import io
import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from examples.quality_score.encoder import SnrEstimate
from melcache.access import Cache
from melcache.errors import ShardError, UserError
from melcache.loader import DataConfig, make_loader
from tests.support.helpers import cache_digests, run_preprocess

SNR = "examples.quality_score.encoder:encoder"
pytestmark = pytest.mark.slow  # real derives in subprocesses


def derive(cache: Path, encoder: str, field: str = "snr", *extra: str) -> None:
    run_preprocess("derive", str(cache), "--field", field, "--encoder", encoder,
                   "--workers", "1", *extra)  # fmt: skip


def values(cache: Path, field: str = "snr") -> np.ndarray:
    entry = json.loads((cache / "index.json").read_text())["fields"][field]
    return np.load(cache / entry["folder"] / entry["values"]["name"], allow_pickle=False)


@pytest.fixture
def scored(cache_copy: Path) -> Path:
    """A private copy of the sample cache with ``snr`` derived."""
    derive(cache_copy, SNR)
    return cache_copy


def test_values_are_the_encoders_own_and_the_mels_stay_untouched(
    sample_cache: Path, scored: Path
) -> None:
    snr = values(scored)
    with Cache(scored) as cache:
        assert snr.dtype == np.float32 and snr.shape == (len(cache),)
        for utterance in cache:
            mel = torch.from_numpy(utterance.mel.astype(np.float32))[None]
            own = SnrEstimate()(mel).numpy()
            assert snr[utterance.row] == own[0] == utterance.fields["snr"][0]
    assert len(set(snr.tolist())) > len(snr) // 2  # a score, not a constant
    mels = {k: v for k, v in cache_digests(scored).items() if k.endswith(".tar")}
    assert mels == {k: v for k, v in cache_digests(sample_cache).items() if k.endswith(".tar")}
    shown = run_preprocess("inspect", str(scored)).stdout
    assert "snr: float32 [] per utterance" in shown and "values p5 / p50 / p95:" in shown


def test_where_on_a_score_streams_only_what_it_keeps_and_a_weight_repeats_it(
    scored: Path,
) -> None:
    snr = values(scored)
    cut = float(np.median(snr))
    with Cache(scored) as cache:
        keys = cache.keys()
    kept = {keys[row] for row in np.flatnonzero(snr >= cut)}
    loader = make_loader(
        scored, DataConfig(batch_frames=1500, num_workers=0, where=f"snr >= {cut}")
    )
    seen = collections.Counter(k for b in itertools.islice(loader, 60) for k in b.keys)
    assert set(seen) == kept and 0 < len(kept) < len(keys)
    weight = {"weight": f"3 if snr >= {cut} else 1"}
    loader = make_loader(scored, DataConfig(batch_frames=1500, num_workers=0, balance=weight))
    picked = [r for sub in loader.spec.subs for p in sub.picks for r in p.rows_of(0, 0, 0, 0)]
    high = sum(1 for r in picked if snr[r] >= cut) / max(1, sum(1 for r in picked if snr[r] < cut))
    assert high > 2, high  # ~3 copies a high-SNR utterance to 1 a low one, by frames


def test_a_score_derived_again_is_a_data_change_at_a_resume(scored: Path) -> None:
    data = DataConfig(
        batch_frames=1500, num_workers=0, where="snr > 0.5"
    )  # every utterance, under either score
    first = make_loader(scored, data, seed=2)
    stream = iter(first)
    for _ in range(3):
        next(stream)
    state = first.state_dict()
    after = [next(stream).keys for _ in range(5)]
    first.close()
    again = make_loader(scored, data, seed=2)
    again.load_state_dict(state)
    assert [b.keys for b in itertools.islice(again, 5)] == after
    derive(scored, "tests.support.plugin_encoders:seconds_score", "snr", "--replace")
    changed = make_loader(scored, data, seed=2)
    with pytest.raises(UserError, match=r"data\.where"):
        changed.load_state_dict(state)


def test_a_damaged_or_unusable_score_is_one_line(scored: Path) -> None:
    derive(scored, "tests.support.plugin_encoders:frame_ones", "ones")
    with pytest.raises(UserError, match=r"field 'ones' holds \[T, 1\], not one number per utt"):
        make_loader(scored, DataConfig(batch_frames=1500, num_workers=0, where="ones > 0"))
    entry = json.loads((scored / "index.json").read_text())["fields"]["snr"]
    path = scored / entry["folder"] / "values.npy"
    good = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    done = run_preprocess("verify", str(scored), check=False)
    assert (
        done.returncode != 0
        and "values.npy: sha256 differs from the index" in done.stdout + done.stderr
    )
    with pytest.raises(ShardError, match=r"values.npy: sha256 differs from the index"):
        make_loader(scored, DataConfig(batch_frames=1500, num_workers=0, where="snr > 0"))
    # Forged whole (its sha256 put into the index too): verify still names the row.
    index = json.loads((scored / "index.json").read_text())
    forged = np.load(io.BytesIO(good), allow_pickle=False).copy()
    forged[2] += 1
    buffer = io.BytesIO()
    np.save(buffer, forged, allow_pickle=False)
    path.write_bytes(buffer.getvalue())
    index["fields"]["snr"]["values"]["sha256"] = hashlib.sha256(buffer.getvalue()).hexdigest()
    (scored / "index.json").chmod(0o644)
    (scored / "index.json").write_text(json.dumps(index))
    done = run_preprocess("verify", str(scored), check=False)
    assert re.search(r"values.npy: row 2 \(\S+\) holds", done.stdout + done.stderr), (
        done.stdout + done.stderr
    )


def test_a_run_trains_on_a_score_without_a_rebuild(scored: Path, tmp_path: Path) -> None:
    from tests.support.helpers import metrics, tiny_fit

    cut = float(np.median(values(scored)))
    overrides = [f'data.where="snr >= {cut}"', "data.batch_frames=1500", "train.log_every=1"]
    tiny_fit(scored, tmp_path / "run", 6, overrides)
    steps = [r["step"] for r in metrics(tmp_path / "run") if "loss" in r]
    assert steps[-1] == 6
