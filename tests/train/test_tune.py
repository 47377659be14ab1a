"""``python -m train tune`` on CPU, against a memory limit (``train.memory.probes.MemoryCap``): the search
finds each bucket's largest batch within one step of the true limit, and a training run with the
tuned table stays under it."""

from __future__ import annotations

import gc
import itertools
import json
import math
import subprocess
import tomllib
from pathlib import Path

import pytest
import torch

from melcache.access import Cache
from melcache.batch_plans import round_up
from melcache.loader import Batch, make_loader
from melcache.loader.batch import utf8_tokens
from melcache.loader.stream import planned_stream
from tests.support.helpers import PROBE, REPO, SAMPLE_CORPUS, build_cache, run_ok, torchrun
from tests.support.train_probe import worst_batch
from train.config.tables import load_config
from train.memory.probes import MemoryCap, tensor_bytes
from train.parallel.env import Env
from train.trainer import Trainer
from train.tune import largest_fitting, render, tune

CPU = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
TINY = REPO / "configs" / "tiny.toml"
OVERRIDES = [
    "model.args.dim=64",
    "model.args.layers=2",
    "train.precision=fp32",
    "data.max_batch_size=64",
    "data.num_workers=0",
    # Greedy batches (the whole-cache stream): with one shard per bucket, even cuts would
    # halve a shard just over a budget, and no batch would show how much a budget holds.
    "data.sync_buckets=false",
]
LIMIT_MIB = 28
# One shard per bucket (3 buckets, short utterances): batches as large as a budget allows.
TUNE_CACHE_TOML = "[build]\nnum_buckets = 3\nmin_shards = 1\nmax_seconds = 4.5\n"


@pytest.fixture(scope="module")
def tune_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tune_cache")
    (root / "build.toml").write_text(TUNE_CACHE_TOML)
    assert SAMPLE_CORPUS.is_dir()
    return build_cache(root / "cache", root / "build.toml")


def test_the_search_is_exact_for_every_limit() -> None:
    for limit in range(70):
        for start in (1, 5, 64):
            tried: list[int] = []

            def fits(n: int, limit: int = limit, tried: list[int] = tried) -> bool:
                tried.append(n)
                return n <= limit

            assert largest_fitting(fits, start=start, most=64) == min(limit, 64), (limit, start)
            assert len(tried) <= 2 * math.ceil(math.log2(64)) + 2, tried


def test_an_agreed_cap_raises_only_where_every_rank_is_at_the_same_point() -> None:
    """Under torchrun (``agree``: the largest of every rank's flag) the cap does not raise at
    the op that passes it, but before the next collective or at ``settle()``, and also when
    only another rank is over."""
    flags: list[float] = []
    mine = MemoryCap(1000, agree=lambda flag: flags.append(flag) or flag)
    with mine:
        tensor = torch.zeros(1000)  # 4,000 bytes: past the cap, no error yet
        assert mine.over and not mine.raised
        with pytest.raises(torch.OutOfMemoryError, match="on some rank"):
            torch.ops._c10d_functional.wait_tensor(tensor)
    assert mine.raised and flags == [1.0]

    others_over = MemoryCap(2**30, agree=lambda flag: 1.0)
    with others_over:
        torch.zeros(10)
    with pytest.raises(torch.OutOfMemoryError):
        others_over.settle()
    assert others_over.raised and not others_over.over

    nobody_over = MemoryCap(2**30, agree=lambda flag: flag)
    with nobody_over:
        torch.ops._c10d_functional.wait_tensor(torch.zeros(10))
    nobody_over.settle()
    assert not nobody_over.raised


@pytest.mark.slow
def test_tune_is_within_one_step_of_the_limit_and_a_tuned_run_stays_under_it(
    tune_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from train.__main__ import main

    output = tmp_path / "budgets.toml"
    command = ["tune", "--shards", str(tune_cache), "--config", str(TINY)]
    command += ["--memory-limit-mib", str(LIMIT_MIB), "--output", str(output), *OVERRIDES]
    assert main(command) == 0
    printed = capsys.readouterr().out
    assert "| bucket | max length (frames) | budget (frames) | samples per batch | peak MiB |" in (
        printed
    )
    table = tomllib.loads(output.read_text())["data"]["batch_frames"]
    cfg = load_config([TINY, output], OVERRIDES)
    assert cfg.data.batch_frames == table

    rows, _ = tune(cfg, str(tune_cache), memory_limit_mib=LIMIT_MIB)  # the same answer again
    assert {str(r.bucket): r.budget for r in rows} == table
    # The true limit, found independently: a real training step on the bucket's worst batch
    # of B utterances fits 90 % of the limit, one of B + 1 runs out of memory.
    trainer = Trainer(cfg, str(tune_cache), tmp_path / "check", CPU)
    cap = MemoryCap(
        0.9 * LIMIT_MIB * 2**20, tensor_bytes(trainer.parts.raw_model.state_dict().values())
    )
    with cap:
        assert not trainer.train_step([worst_batch(1, 29, 8, 0)]).skipped  # optimizer state
    for row in rows:
        assert row.samples < cfg.data.max_batch_size  # the limit binds, not the cap on rows
        for size, fits in ((row.samples, True), (row.samples + 1, False)):
            gc.collect()  # as tune's probe does: a failed step's cycles are garbage (3.12+ keep them longer)
            with cap:
                verdict = trainer.train_step(
                    [worst_batch(size, row.max_frames, row.text_tokens, 0)]
                )
            assert verdict.skipped != fits, (row, size)
            trainer.parts.budgets.caps.clear()
    trainer.close()
    samples = {r.bucket: r.samples for r in rows}
    assert samples[0] > samples[max(samples)]  # shorter utterances: more per batch

    # Training with the tuned table under the whole limit never runs out of memory.
    trainer = Trainer(cfg, str(tune_cache), tmp_path / "run", CPU)
    run_cap = MemoryCap(
        LIMIT_MIB * 2**20, tensor_bytes(trainer.parts.raw_model.state_dict().values())
    )
    step, largest = trainer.train_step, {}

    def capped_step(micro: list[Batch]):
        for batch in micro:
            largest[batch.bucket] = max(largest.get(batch.bucket, 0), batch.mel.numel() // 100)
        with run_cap:
            return step(micro)

    trainer.train_step = capped_step
    try:
        trainer.fit(max_steps=24)
    finally:
        trainer.close()
    assert trainer.parts.budgets.skipped_steps == 0 and not trainer.parts.budgets.caps
    assert run_cap.peak <= LIMIT_MIB * 2**20
    longest_budget = table[str(max(samples))]
    assert largest[0] > longest_budget  # more frames than one budget safe for every bucket
    print(f"tuned {table}; largest batches {largest}; peak {run_cap.peak / 2**20:.1f} MiB")


def test_tune_on_cpu_needs_a_memory_limit(
    train_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from train.__main__ import main

    output = tmp_path / "budgets.toml"
    command = ["tune", "--shards", str(train_cache), "--config", str(TINY), "--output", str(output)]
    assert main(command) == 2 and not output.exists()
    assert "--memory-limit-mib" in caplog.text


@pytest.mark.slow
def test_tune_under_fsdp2_searches_with_every_rank_in_step(
    tune_cache: Path, tmp_path: Path
) -> None:
    """2 gloo ranks: every rank tries the same batch at the same time and a memory error is
    raised on every rank at once (``MemoryCap(agree=...)``), so no rank hangs (run_ok's
    timeout is the watchdog); each row is the largest batch that fits on every rank."""
    output, fsdp2 = tmp_path / "budgets.toml", [*OVERRIDES, "train.parallel.strategy=fsdp2"]
    command = ["-m", "train", "tune", "--shards", str(tune_cache), "--config", str(TINY)]
    command += ["--memory-limit-mib", str(LIMIT_MIB), "--output", str(output), *fsdp2]
    done = run_ok(torchrun(*command), timeout=180)
    assert done.stdout.count("| bucket | max length (frames) |") == 1  # rank 0 prints
    assert "fsdp2 on 2 ranks" in output.read_text()
    table = tomllib.loads(output.read_text())["data"]["batch_frames"]
    assert load_config([TINY, output], fsdp2).data.batch_frames == table

    check = [str(PROBE), "tune-check", str(tune_cache), str(output), str(LIMIT_MIB)]
    run_ok(torchrun(*check, str(tmp_path), *fsdp2), timeout=180)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"tune-check-rank{rank}.json").read_text())
        assert found["budgets"] == table  # the same answer again
        assert found["verdicts"] == {bucket: [True, False] for bucket in table}, found
        assert found["uneven"] is False  # rank 1 ran out alone: both ranks raised
    print(f"fsdp2 budgets {table}")


@pytest.mark.slow
def test_tune_under_torchrun_with_ddp_is_refused_in_one_line(train_cache: Path, tmp_path: Path):
    output = tmp_path / "budgets.toml"
    command = ["-m", "train", "tune", "--shards", str(train_cache), "--config", str(TINY)]
    command += ["--memory-limit-mib", "64", "--output", str(output), *OVERRIDES]
    done = subprocess.run(torchrun(*command), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and not output.exists()  # each rank exits 2 (torchrun: 1)
    lines = [x for x in done.stderr.splitlines() if "train tune under torchrun" in x]
    assert len(lines) == 2 and all(
        'searches train.parallel.strategy = "fsdp2" or "hsdp"' in x for x in lines
    )
    assert "[rank0]: Traceback" not in done.stderr and "[rank1]: Traceback" not in done.stderr


@pytest.mark.slow
def test_tune_sizes_an_encoder_decoder_on_both_axes_with_its_longest_real_text(
    sample_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``data.sequence = "text,frames"``: each bucket's worst batch holds its longest frames
    and its longest real text (of all its shards, not the longest frames' shard's), and the
    answer is two tables. The sample cache: several shards a bucket."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the text lengths' sidecar
    overrides = [*OVERRIDES[:-1], 'data.sequence="text,frames"']  # sync_buckets: the default
    rows, where = tune(load_config(TINY, overrides), str(sample_cache), memory_limit_mib=LIMIT_MIB)
    longest: dict[int, int] = {}
    with Cache(sample_cache) as cache:
        for shard, entry in enumerate(cache.index["shards"]):
            top = max(len(utf8_tokens(text)) for text in cache.texts(shard))
            longest[entry["bucket"]] = max(longest.get(entry["bucket"], 0), top)
    assert {r.bucket: r.text_tokens for r in rows} == longest
    for row in rows:
        assert row.text_budget == row.samples * round_up(row.text_tokens, 8)
        assert row.budget == row.samples * round_up(row.max_frames, 8)
    output = tmp_path / "budgets.toml"
    output.write_text(render(rows, where)[1])
    tuned = tomllib.loads(output.read_text())["data"]
    assert tuned["batch_text"] == {str(r.bucket): r.text_budget for r in rows}
    data = load_config([TINY, output], overrides).data
    spec = make_loader(sample_cache, data, tokenizer=utf8_tokens).spec  # both tables accepted
    for _, _, samples, _, entries in itertools.islice(planned_stream(spec, 0), 20):
        text = max(len(utf8_tokens(s.text)) for s in samples)
        assert len(samples) * round_up(text, 8) <= tuned["batch_text"][str(entries[0]["bucket"])]
