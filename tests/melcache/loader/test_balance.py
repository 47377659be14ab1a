"""Who is heard how often (#53): ``data.where`` and ``[data.balance]``, decided from each
cache's table and dealt inside the bucket schedule (``melcache/loader/balance.py``).

The shares are checked on a drawn table of 300 speakers (hours Zipf-like) and 3 languages
(70 / 25 / 5 %) through the same dealing the loader uses; the loader itself on a real cache
built from the sample corpus through a manifest with ``language`` and ``dnsmos`` extras."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from melcache.access import Cache
from melcache.errors import UserError
from melcache.loader import DataConfig, make_loader
from melcache.loader.balance import Rows, allocate, weigh
from melcache.table import TABLE_NAME
from tests.support.helpers import SAMPLE_CORPUS, run_preprocess

SPEAKERS, LANGUAGES = 300, ("en", "zh", "de")
BALANCE = {"speaker_temperature": 0.5, "language_temperature": 0.3}


def drawn_rows(count: int = 40_000, seed: int = 0) -> tuple[Rows, np.ndarray, np.ndarray]:
    """Rows of a drawn corpus sorted by length, as a build's shards hold them: speakers'
    hours Zipf-like (the largest over 20× the median), languages 70 / 25 / 5 % of speakers'
    draws; and the first row of each of 80 shards."""
    rng = np.random.default_rng(seed)
    share = 1 / np.arange(1, SPEAKERS + 1) ** 1.1
    speaker = rng.choice(SPEAKERS, count, p=share / share.sum()) + 1
    language_of = rng.choice(3, SPEAKERS + 1, p=[0.7, 0.25, 0.05])
    frames = rng.integers(100, 1500, count)
    order = np.argsort(frames, kind="stable")
    frames, speaker = frames[order], speaker[order]
    meta = [
        {"speaker": str(s), "frames": int(f), "language": LANGUAGES[language_of[s]]}
        for s, f in zip(speaker.tolist(), frames.tolist(), strict=True)
    ]
    rows = Rows(frames.astype(np.int64), speaker.astype(np.int64), meta)
    languages = np.array([LANGUAGES.index(m["language"]) for m in meta])
    return rows, np.linspace(0, count, 81).astype(np.int64), languages


def target_shares(rows: Rows, languages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per language ∝ hours^0.3, per speaker within its language ∝ hours^0.5."""
    frames = rows.frames.astype(float)
    hours = np.bincount(languages, frames)
    language = hours**0.3 / (hours**0.3).sum()
    speaker = np.zeros(SPEAKERS + 1)
    for code in range(len(LANGUAGES)):
        mine = np.bincount(
            rows.speakers[languages == code], frames[languages == code], SPEAKERS + 1
        )
        powered = np.where(mine > 0, mine, 0) ** 0.5
        speaker += language[code] * powered / powered.sum()
    return language, speaker


def heard(rows: Rows, picks, units, epoch: int) -> np.ndarray:
    """Copies of each row heard in one epoch."""
    copies = np.zeros(len(rows.frames))
    for unit, pick in zip(units, picks, strict=True):
        np.add.at(copies, pick.rows_of(0, 0, epoch, unit[0]), 1)
    return copies


def test_an_epoch_hears_speakers_and_languages_within_001_of_their_targets() -> None:
    rows, shard_rows, languages = drawn_rows()
    chosen = weigh(rows, shard_rows, "", BALANCE, "drawn")
    units = [[i, i + 1] for i in range(0, 80, 2)]
    picks = allocate(chosen, units)
    language, speaker = target_shares(rows, languages)
    hours = np.bincount(rows.speakers, rows.frames.astype(float))
    assert hours.max() > 20 * np.median(hours[hours > 0])
    for epoch in range(3):
        copies = heard(rows, picks, units, epoch)
        frames = copies * rows.frames
        got_language = np.bincount(languages, frames, 3) / frames.sum()
        got_speaker = np.bincount(rows.speakers, frames, SPEAKERS + 1) / frames.sum()
        assert 0.5 * np.abs(got_language - language).sum() < 0.01
        assert 0.5 * np.abs(got_speaker - speaker).sum() < 0.01
        assert [int(c) for c in (np.add.reduceat(copies, shard_rows[:-1:2]))] == [
            p.size for p in picks
        ]  # every unit holds its fixed count, epoch after epoch
    assert (heard(rows, picks, units, 0) != heard(rows, picks, units, 1)).any()
    assert abs(float(frames.sum()) / rows.frames.sum() - 1) < 0.01  # the epoch keeps its hours


def test_a_filter_alone_hears_each_utterance_it_keeps_once_an_epoch() -> None:
    rows, shard_rows, languages = drawn_rows(4_000)
    chosen = weigh(rows, shard_rows, 'language in ["en", "de"] and frames >= 300', {}, "x")
    units = [[i] for i in range(80)]
    copies = heard(rows, allocate(chosen, units), units, 5)
    kept = (languages != 1) & (rows.frames >= 300)
    assert (copies == kept).all()


def test_a_weight_expression_scales_what_is_heard() -> None:
    rows, shard_rows, _ = drawn_rows(8_000)
    for i, meta in enumerate(rows.meta):
        meta["dnsmos"] = 2.0 + i % 2  # every other row 3.0
    chosen = weigh(rows, shard_rows, "", {"weight": "3 if dnsmos >= 3 else 1"}, "x")
    good = np.arange(len(rows.frames)) % 2 == 1
    ratio = (chosen.weights[good] @ rows.frames[good]) / (
        chosen.weights[~good] @ rows.frames[~good]
    )
    natural = rows.frames[good].sum() / rows.frames[~good].sum()
    assert ratio / natural == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"where": "language =="}, "data.where 'language ==': not an expression"),
        (
            {"where": "__import__('os')"},
            "data.where \"__import__('os')\": \"__import__('os')\" is not allowed",
        ),
        ({"balance": {"speaker_temp": 0.5}}, "data.balance.speaker_temp is not a key"),
        (
            {"balance": {"speaker_temperature": -1}},
            "data.balance.speaker_temperature = -1 is invalid",
        ),
        ({"balance": {"weight": "dnsmos *"}}, "data.balance.weight 'dnsmos *': not an expression"),
        ({"where": "x", "sync_buckets": False}, "data.sync_buckets = False is invalid"),
    ],
)
def test_bad_settings_are_one_line_naming_the_key(data: dict, message: str) -> None:
    with pytest.raises(UserError) as error:
        DataConfig(**data)
    assert message in str(error.value) and "\n" not in str(error.value)


CONFIG = '[build]\nnum_buckets = 2\nmin_shards = 4\nextras = ["language", "dnsmos"]\n'


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample corpus through a manifest: its speakers, ``language`` (zh for the
    Mandarin speaker) and a ``dnsmos`` of 2.0 to 4.0 by turns."""
    root = tmp_path_factory.mktemp("balance_corpus")
    lines = []
    audio = sorted(p for p in SAMPLE_CORPUS.rglob("*") if p.suffix in (".wav", ".flac"))
    for i, path in enumerate(audio):
        (root / path.parent.name).mkdir(exist_ok=True)
        shutil.copy(path, root / path.parent.name / path.name)
        row = {
            "audio_filepath": f"{path.parent.name}/{path.name}",
            "text": path.with_suffix(".txt").read_text().strip(),
            "speaker": path.parent.name,
            "language": "zh" if path.parent.name == "zh" else "en",
            "dnsmos": 2.0 + (i % 5) * 0.5,
        }
        lines.append(json.dumps(row, ensure_ascii=False))
    (root / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    (root / "c.toml").write_text(CONFIG)
    out = root / "cache"
    run_preprocess(
        *("build", "--src", str(root / "manifest.jsonl"), "--out", str(out)),
        *("--config", str(root / "c.toml"), "--workers", "1"),
    )  # fmt: skip
    return out


def test_where_on_an_extra_streams_only_what_it_keeps_without_a_rebuild(cache: Path) -> None:
    data = DataConfig(batch_frames=1200, num_workers=0, where="dnsmos >= 3 and language == 'en'")
    loader = make_loader(cache, data)
    table = Cache(cache)
    kept = {
        key
        for key in table.table.strings("keys")
        if table[key].meta["extras"]["dnsmos"] >= 3
        and table[key].meta["extras"]["language"] == "en"
    }
    picked = [row for sub in loader.spec.subs for pick in sub.picks for row in pick.rows.tolist()]
    assert sorted(table.table.strings("keys")[r] for r in picked) == sorted(kept)
    seen = collections.Counter(k for b in itertools.islice(loader, 40) for k in b.keys)
    assert set(seen) == kept


def test_a_balanced_stream_resumes_batch_for_batch(cache: Path) -> None:
    data = DataConfig(batch_frames=1200, num_workers=0, balance={"speaker_temperature": 0.0})
    first = make_loader(cache, data, seed=3)
    stream = iter(first)
    for _ in range(7):
        next(stream)
    state = first.state_dict()
    after = [next(stream).keys for _ in range(12)]
    first.close()
    again = make_loader(cache, data, seed=3)
    again.load_state_dict(state)
    assert [b.keys for b in itertools.islice(again, 12)] == after


def test_another_where_at_a_resume_is_a_data_change_and_new_weights_are_not(cache: Path) -> None:
    base = DataConfig(batch_frames=1200, num_workers=0, balance={"speaker_temperature": 0.0})
    ranks = [make_loader(cache, base, rank=r, world_size=2) for r in range(2)]
    streams = [iter(loader) for loader in ranks]
    for _ in range(5):
        for stream in streams:
            next(stream)
    states = [loader.state_dict() for loader in ranks]
    for loader in ranks:
        loader.close()
    tempered = DataConfig(batch_frames=1200, num_workers=0, balance={"speaker_temperature": 1.0})
    moved = make_loader(cache, tempered)
    moved.load_state_dict(states)
    assert any("data.balance changed" in line for line in moved.resume_changes)
    filtered = DataConfig(
        batch_frames=1200, num_workers=0, where="language == 'en'", balance=base.balance
    )
    with pytest.raises(UserError, match=r"data\.where changed since the loader state was saved"):
        make_loader(cache, filtered).load_state_dict(states)
    allowed = make_loader(cache, dataclasses.replace(filtered, allow_data_change=True))
    allowed.load_state_dict(states)
    assert any("data.where changed" in line for line in allowed.resume_changes)


def test_nothing_left_and_a_table_without_extras_are_one_line(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"data\.where = 'dnsmos > 9' leaves no utterance"):
        make_loader(cache, DataConfig(num_workers=0, batch_frames=1200, where="dnsmos > 9"))
    unknown = DataConfig(num_workers=0, batch_frames=1200, balance={"weight": "snr"})
    with pytest.raises(UserError, match=r"data\.balance\.weight names 'snr', which its utterances"):
        make_loader(cache, unknown)
    bare = tmp_path / "bare"
    shutil.copytree(cache, bare)
    index = json.loads((bare / "index.json").read_text())
    del index["table"]
    (bare / "index.json").write_text(json.dumps(index))
    (bare / TABLE_NAME).unlink()
    with pytest.raises(UserError, match="python -m preprocess index-table"):
        make_loader(bare, DataConfig(num_workers=0, batch_frames=1200, where="dnsmos > 2"))


@pytest.mark.slow  # 60 steps of the tiny model
def test_a_run_reports_what_each_epoch_dealt_and_draws_it(cache: Path, tmp_path: Path) -> None:
    from tests.support.helpers import metrics, tiny_fit
    from train.plot import plot_run

    overrides = [
        "data.balance.language_temperature=0",
        'data.where="dnsmos >= 2.5"',
        "data.batch_frames=1200",
        "train.log_every=5",
    ]
    tiny_fit(cache, tmp_path / "run", 60, overrides)
    reports = [r for r in metrics(tmp_path / "run") if "heard_epoch" in r]
    assert [r["heard_epoch"] for r in reports][:2] == [0.0, 1.0]
    for report in reports:  # τ = 0: the two languages' hours half and half, within a copy
        assert report["target/language/en"] == pytest.approx(0.5)
        # (one utterance is ~5 % of the 16 kept: the deal is within one copy of the target)
        assert report["heard/language/zh"] == pytest.approx(0.5, abs=0.06)
        assert report["heard/language_tv"] < 0.06
    assert plot_run(tmp_path / "run").is_file()


def test_a_balanced_4_rank_state_resumes_at_2_ranks_reading_each_epoch_as_dealt(
    sample_cache: Path,
) -> None:
    data = DataConfig(
        batch_frames=3000, max_batch_size=3, num_workers=0, balance={"speaker_temperature": 0.0}
    )

    def job(world: int, steps: int, states=None) -> tuple[list, list]:
        loaders = [
            make_loader(sample_cache, data, rank=r, world_size=world, seed=1) for r in range(world)
        ]
        for loader in loaders:
            if states is not None:
                loader.load_state_dict(states)
        streams = [iter(loader) for loader in loaders]
        batches = [next(s) for _ in range(steps) for s in streams]
        saved = [loader.state_dict() for loader in loaders]
        for loader in loaders:
            loader.close()
        return batches, saved

    per_bucket = collections.Counter()
    for sub in make_loader(sample_cache, data).spec.subs:
        per_bucket[sub.bucket] += sub.per_epoch

    def first_epochs(batches: list) -> dict[int, collections.Counter]:
        out: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        taken = collections.Counter()
        for batch in batches:
            if taken[batch.bucket] < 2 * per_bucket[batch.bucket]:
                out[batch.bucket].update(batch.keys)
                taken[batch.bucket] += 1
        return out

    before, states = job(4, 3)
    after, _ = job(2, 30, states)
    whole, _ = job(1, 60)
    assert first_epochs(before + after) == first_epochs(whole)  # two epochs of every bucket
    # The check can fail: a new job started afresh repeats what the old one had read.
    afresh, _ = job(2, 30)
    assert first_epochs(before + afresh) != first_epochs(whole)


def test_spread_puts_an_utterances_copies_in_other_batches_within_the_budget() -> None:
    from melcache.batch_plans import even_batch_count, make_rng, plan_even_batches

    rng = np.random.default_rng(5)
    rows = np.repeat(np.arange(400), rng.integers(1, 5, 400))  # up to 4 copies each
    frames = rng.integers(200, 400, 400)[rows]
    count = even_batch_count(len(rows), int(frames.max()), batch_frames=6000,
                             max_batch_size=64, pad_multiple=8)  # fmt: skip
    cut = {"rng": make_rng(0, 4), "count": count, "max_batch_size": 64, "pad_multiple": 8}
    beside = {}
    for spread in (False, True):
        batches = plan_even_batches(frames.tolist(), rows=rows.tolist() if spread else None, **cut)
        assert sorted(i for b in batches for i in b) == list(range(len(rows)))
        assert all(len(b) * -(-int(frames[b].max()) // 8) * 8 <= 6000 for b in batches)
        beside[spread] = sum(len(b) - len(set(rows[b].tolist())) for b in batches)
    assert beside[True] * 3 < beside[False], beside


def test_spread_through_the_loader_keeps_what_is_heard(cache: Path) -> None:
    """An epoch deals the same copies with and without ``spread``; only their batches differ."""
    from melcache.loader.stream import planned_stream

    heard, beside = {}, {}
    for spread in (False, True):
        balance = {"speaker_temperature": 0.0, "spread": spread}
        loader = make_loader(cache, DataConfig(batch_frames=2400, num_workers=0, balance=balance))
        left = {unit[0]: sub.per_epoch for sub in loader.spec.subs for unit in sub.units[:1]}
        first_of = {unit[0]: sub.units[0][0] for sub in loader.spec.subs for unit in sub.units}
        heard[spread], beside[spread] = collections.Counter(), 0
        for (epoch, first), _, samples, _, _ in planned_stream(loader.spec, 0):
            stream = first_of[first]
            if epoch == 0 and left.get(stream):
                heard[spread].update(s.key for s in samples)
                beside[spread] += len(samples) - len({s.key for s in samples})
                left[stream] -= 1
            if not any(left.values()):
                break
        loader.close()
    assert heard[True] == heard[False] and max(heard[True].values()) > 1
    assert beside[True] < beside[False], beside
