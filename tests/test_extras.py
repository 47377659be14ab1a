"""Per-utterance extras (``melcache/extras.py``): ``[build] extras`` carries a manifest's fields
into each sample, the index and ``verify``; the loader and a plug-in asking for them in its
``melcache_contract`` get them (and ``"reference"``, a same-speaker row) in ``batch.extras``; a
field a cache lacks is refused at start by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import SAMPLE_CORPUS, run_preprocess
from test_train_contract import fit, plugin, trainer

from melcache.errors import UserError
from melcache.format import REJECTED_NAME
from melcache.loader import make_loader
from melcache.loader import stream as train_stream
from melcache.loader.batch import extras_rows, stand_in_extras
from melcache.loader.data_config import DataConfig
from melcache.loader.units import ranged_unit
from melcache.reader import ShardCheck, read_shard
from preprocess.inputs.records import key_base

CONFIG = """
[build]
num_buckets = 2
min_shards = 2
max_seconds = 4.5
extras = ["language"]
"""
# (audio under examples/wavs, each ≤ 4.5 s, language); en_m3_03 has no language, en_m3_07 a list: rejected
ROWS = [
    *((f"en_f1/en_f1_{n:02d}", "en") for n in (1, 2, 3, 4, 6)),
    *((f"en_m3/en_m3_{n:02d}", "en") for n in (1, 2, 4)),
    ("en_m3/en_m3_03", None),
    ("en_m3/en_m3_07", ["en", "fr"]),
    *((f"zh/zh_{n:02d}", "zh") for n in range(1, 4)),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A manifest corpus of sample-corpus audio with a ``language`` field per row."""
    root = tmp_path_factory.mktemp("extras_corpus")
    lines = []
    for stem, language in ROWS:
        audio = next(SAMPLE_CORPUS.glob(f"{stem}.*[!t]"))  # .wav or .flac, not the .txt
        (root / audio.parent.name).mkdir(exist_ok=True)
        shutil.copy(audio, root / audio.parent.name / audio.name)
        row = {
            "audio_filepath": f"{audio.parent.name}/{audio.name}",
            "text": (SAMPLE_CORPUS / f"{stem}.txt").read_text().strip(),
            "speaker": audio.parent.name,
        }
        if language is not None:
            row["language"] = language
        lines.append(json.dumps(row, ensure_ascii=False))
    (root / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    (root / "extras.toml").write_text(CONFIG)
    return root


@pytest.fixture(scope="module")
def cache(corpus: Path) -> Path:
    out = corpus / "cache"
    run_preprocess(
        *("build", "--src", str(corpus / "manifest.jsonl"), "--out", str(out)),
        *("--config", str(corpus / "extras.toml"), "--workers", "1"),
    )  # fmt: skip
    return out


def expected_languages() -> dict[str, str | None]:
    """Each written utterance's key and its manifest language."""
    return {
        key_base(f"{Path(stem).parent}/{Path(stem).name}.x"): lang
        for stem, lang in ROWS
        if not isinstance(lang, list)
    }


@pytest.mark.slow
def test_the_build_carries_a_manifests_field_into_every_sample(cache: Path, tmp_path: Path) -> None:
    index = json.loads((cache / "index.json").read_text())
    assert index["build"]["extras"] == ["language"]
    stored = {
        s.key: s.extras
        for entry in index["shards"]
        for s in read_shard(str(cache / entry["name"]), entry, ShardCheck())
    }
    assert stored == {key: {"language": lang} for key, lang in expected_languages().items()}
    [rejected] = [json.loads(line) for line in (cache / REJECTED_NAME).read_text().splitlines()]
    assert rejected["source"] == "en_m3/en_m3_07.flac"
    assert "'language' (build.extras) is list" in rejected["reason"]
    assert run_preprocess("verify", str(cache), check=False).returncode == 0
    # an index claiming a field its samples lack: verify names each sample
    claimed = tmp_path / "claimed"
    shutil.copytree(cache, claimed)
    index["build"]["extras"] = ["language", "dnsmos"]
    (claimed / "index.json").write_text(json.dumps(index))
    done = run_preprocess("verify", str(claimed), check=False)
    assert done.returncode == 1
    assert "json extras ['language'] != the index's build.extras ['dnsmos', 'language']" in (
        done.stdout + done.stderr
    )


@pytest.mark.slow
def test_a_folder_corpus_with_extras_is_refused_in_one_line(corpus: Path) -> None:
    args = ("build", "--src", str(SAMPLE_CORPUS), "--out", str(corpus / "refused"))
    done = run_preprocess(*args, "--config", str(corpus / "extras.toml"), check=False)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: build.extras = ['language']: {SAMPLE_CORPUS} is a folder corpus, which has "
        "no per-utterance fields to carry; list them in a JSONL manifest"
    ]


@pytest.mark.parametrize("world_size, workers", [(1, 1), (8, 0)])
def test_the_loader_hands_out_the_fields_asked_for(
    cache: Path, world_size: int, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also where 8 ranks share each unit, each reading only its batches' rows by range."""
    ranged = []
    monkeypatch.setattr(train_stream, "ranged_unit", lambda *a: ranged.append(1) or ranged_unit(*a))
    data = DataConfig(batch_frames=1200, num_workers=workers, extras=("language", "reference"))
    loader = make_loader(cache, data, rank=world_size - 1, world_size=world_size)
    languages, references = expected_languages(), 0
    try:
        stream = iter(loader)
        for _ in range(12):
            batch = next(stream)
            assert batch.extras["language"] == [languages[k] for k in batch.keys]
            rows = batch.extras["reference"].tolist()
            for row, ref in enumerate(rows):
                others = [r for r, s in enumerate(batch.speaker) if s == batch.speaker[row]]
                assert (ref == -1) == (len(others) == 1)
                assert ref == -1 or (ref != row and batch.speaker[ref] == batch.speaker[row])
            references += sum(ref >= 0 for ref in rows)
    finally:
        loader.close()
    assert references > 0
    assert bool(ranged) == (world_size > 1)
    with pytest.raises(UserError, match=r"cache .* has no per-utterance field 'dnsmos'"):
        make_loader(cache, dataclasses.replace(data, extras=("dnsmos",)))


def test_a_plugin_asking_for_extras_gets_them(cache: Path, train_cache: Path, tmp_path) -> None:
    t = fit(cache, tmp_path / "run", 3, plugin("LanguagePrompted"))
    assert t.parts.raw_model.references_seen > 0
    assert t.parts.loader.spec.data.extras == ("language", "reference")
    with pytest.raises(UserError, match=r"has no per-utterance field 'language'.*carries none"):
        trainer(train_cache, tmp_path / "lacking", plugin("LanguagePrompted"))


def test_batches_cut_after_out_of_memory_keep_their_extras(cache: Path, tmp_path: Path) -> None:
    t = fit(cache, tmp_path, 6, plugin("LanguagePrompted"), "model.args.limit_frames=300")
    assert (
        t.parts.budgets.skipped_steps > 0 and t.parts.budgets.caps
    )  # it failed, then trained in pieces
    assert (
        t.step == 6
        and t.parts.raw_model.references_seen > 0
        and min(t.parts.raw_model.rows_seen) == 1
    )


def test_made_up_batches_carry_the_fields_asked_for() -> None:
    """``train tune``'s worst batches and the out-of-memory stand-in pass."""
    extras = stand_in_extras(["language", "reference"], 3)
    assert extras["language"] == [None] * 3
    assert extras["reference"].tolist() == [1, 2, 0]
    assert stand_in_extras(["reference"], 1)["reference"].tolist() == [-1]
    cut = extras_rows(extras, 1, 3)
    assert cut["language"] == [None] * 2 and cut["reference"].tolist() == [1, -1]


def test_extras_need_the_whole_batch() -> None:
    from train.model.contract import declared

    class Tensors(torch.nn.Module):
        melcache_contract = {"extras": ["language"]}  # noqa: RUF012

    with pytest.raises(UserError, match='only reach a model given the whole batch: add "inputs"'):
        declared(Tensors, "pkg:Tensors")
