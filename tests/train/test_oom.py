"""Out-of-memory errors cost a step, not the run (``train/memory/oom.py``): a plug-in model that raises
``torch.OutOfMemoryError`` above a size limit, in one process and on one rank of 2-process gloo
jobs; a step that hits the limit is skipped on every rank, its bucket's budget lowered, logged,
checkpointed and resumed."""

from __future__ import annotations

import gc
import json
import math
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from melcache.errors import UserError
from melcache.loader import Batch
from tests.support.helpers import REPO, checkpoint, load, metrics, run_ok, train_cmd
from train.config.tables import load_config
from train.memory.oom import Budgets, release_interrupted_backward
from train.memory.probes import MemoryCap
from train.parallel.env import Env
from train.trainer import Trainer

STAND_IN = 8  # frames (pad_multiple): shorter than any utterance of the cache
CPU = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
MODEL = "model.impl=tests.support.oom_model:OutOfMemoryAbove"
# One process: the batches of the 3-bucket train cache are at most 800 padded frames.
SMALL = [
    "data.batch_frames=800",
    "data.num_workers=0",
    "model.args.dim=64",
    "model.args.layers=2",
    "train.precision=fp32",
    "train.log_every=4",
    "train.checkpoint.every=4",
]


def oom_trainer(cache: Path, out: Path, limit: int, *extra: str) -> Trainer:
    overrides = [*SMALL, MODEL, f"model.args.limit_frames={limit}", *extra]
    overrides.append(f"model.args.record={out / 'record.jsonl'!s}")
    return Trainer(load_config(REPO / "configs" / "tiny.toml", overrides), str(cache), out, CPU)


def bucket_of(cache: Path) -> callable:
    """The length bucket of an utterance of ``frames`` frames, from the cache's index."""
    buckets = json.loads((cache / "index.json").read_text())["buckets"]
    return lambda frames: next(
        b["bucket"] for b in buckets if b["min_frames"] <= frames <= b["max_frames"]
    )


def events(out: Path) -> list[dict]:
    return [r for r in metrics(out) if r.get("event") == "out_of_memory"]


def replay(record: Path, logged: list[dict], caps: dict[int, int], bucket: callable) -> int:
    """Walk one rank's passes in order: each that raised is the next logged error and lowers its
    bucket's cap as logged; every other pass kept its bucket's cap at the time. Returns the
    number of passes that raised."""
    logged = iter(logged)
    raised = 0
    for line in map(json.loads, record.read_text().splitlines()):
        if line["longest"] == STAND_IN:  # the pass DDP needs after an error: no utterance
            continue
        b, size = bucket(line["longest"]), line["rows"] * line["frames"]
        if line["raised"]:
            event = next(logged)
            assert (event["bucket"], event["rows"], event["frames"]) == (
                b,
                line["rows"],
                line["frames"],
            )
            assert event["budget"] == min(caps.get(b, math.inf), int(0.9 * size))
            caps[b] = event["budget"]
            raised += 1
        else:
            assert size <= caps.get(b, math.inf), (line, caps)
    assert next(logged, None) is None  # every logged error was a pass that raised
    return raised


# ---- one process -----------------------------------------------------------------------------
def test_forward_oom_skips_the_step_lowers_the_budget_and_resumes(
    train_cache: Path, tmp_path: Path
) -> None:
    trainer = oom_trainer(train_cache, tmp_path, 600)
    try:
        assert trainer.fit(max_steps=12) == "max_steps"
    finally:
        trainer.close()
    assert trainer.step == 12
    logged = events(tmp_path)
    assert logged and all(e["rows"] * e["frames"] > 600 for e in logged)
    caps: dict[int, int] = {}
    raised = replay(tmp_path / "record.jsonl", logged, caps, bucket_of(train_cache))
    assert raised == len(logged) == trainer.parts.budgets.skipped_steps
    assert trainer.parts.budgets.caps == caps
    saved = load(checkpoint(tmp_path, 12))["budgets"]
    assert saved["caps"] == {str(b): c for b, c in caps.items()}
    assert saved["skipped_steps"] == raised
    # The logged windows count the skipped steps and average the loss over the trained ones.
    windows = [r for r in metrics(tmp_path) if "loss" in r]
    assert sum(r["skipped_steps"] for r in windows) == raised
    assert all(math.isfinite(r["loss"]) for r in windows)

    (tmp_path / "record.jsonl").unlink()
    resumed = oom_trainer(train_cache, tmp_path, 600)
    try:
        assert resumed.parts.budgets.caps == caps
        resumed.fit(max_steps=20)
    finally:
        resumed.close()
    later = [e for e in events(tmp_path) if e["step"] > 12]
    replay(tmp_path / "record.jsonl", later, dict(caps), bucket_of(train_cache))


def test_a_single_utterance_out_of_memory_twice_ends_the_run(
    train_cache: Path, tmp_path: Path
) -> None:
    trainer = oom_trainer(train_cache, tmp_path, 40)
    try:
        with pytest.raises(UserError, match=r"2 times on a single utterance of bucket \d") as end:
            trainer.fit(max_steps=30)
    finally:
        trainer.close()
    message, last = str(end.value), events(tmp_path)[-1]  # the error that ended it is logged
    assert f"bucket {last['bucket']} ({last['frames']} padded frames" in message
    assert last["rows"] == 1 and "\n" not in message
    singles = [e for e in events(tmp_path) if e["rows"] == 1 and e["bucket"] == last["bucket"]]
    assert len(singles) == 2


def test_backward_oom_without_ddp_is_a_skipped_step_too(train_cache: Path, tmp_path: Path) -> None:
    trainer = oom_trainer(train_cache, tmp_path, 600, "model.args.stage=backward")
    try:
        trainer.fit(max_steps=12)
    finally:
        trainer.close()
    logged = events(tmp_path)
    assert logged and {e["stage"] for e in logged} == {"backward"}
    raised = replay(tmp_path / "record.jsonl", logged, {}, bucket_of(train_cache))
    assert raised == trainer.parts.budgets.skipped_steps == len(logged)


def test_an_interrupted_backward_keeps_its_graph_until_released() -> None:
    """An out-of-memory error mid-backward leaves the graph's saved tensors queued in the
    autograd engine even with every reference dropped (pytorch/pytorch#82218); the trainer
    releases them when it drops the step (as ChatTTS's GPT needed in ``train tune``)."""
    n = 1 << 18
    live = MemoryCap(math.inf)  # bytes of the tensors made inside it that are still alive
    with live:
        x = torch.randn(n, requires_grad=True)
        branches = [(x * (i + 2)).exp() for i in range(4)]  # each saves its n floats
        loss = sum(b.sum() for b in branches)
    del branches
    live.limit = live.current + 2 * n  # half of one gradient: the backward's first runs out
    with pytest.raises(torch.OutOfMemoryError), live:
        loss.backward()
    del loss
    gc.collect()
    assert live.current >= 3 * 4 * n  # three branches' saved tensors still alive
    release_interrupted_backward(torch.device("cpu"))
    assert live.current == 4 * n  # x alone


def test_batches_over_a_lowered_budget_are_cut_into_pieces() -> None:
    rows, frames = 7, 40
    batch = Batch(
        mel=torch.randn(rows, frames, 4).half(),
        mel_lengths=torch.arange(40, 33, -1),
        text=torch.ones(rows, 8, dtype=torch.int64),
        text_lengths=torch.full((rows,), 8),
        keys=[f"k{i}" for i in range(rows)],
        speaker=[None] * rows,
        bucket=3,
    )
    budgets = Budgets(CPU, pad_multiple=8, out=Path("unused"))
    assert budgets.split([batch]) == [batch]  # no cap yet
    budgets.caps[3] = 100  # two rows of 40 frames per pass: 7 rows in 4 near-equal pieces
    pieces = budgets.split([batch])
    assert [len(p) for p in pieces] == [2, 2, 2, 1]
    assert [k for p in pieces for k in p.keys] == batch.keys
    assert torch.equal(torch.cat([p.mel for p in pieces]), batch.mel)
    assert all(p.mel.is_contiguous() and p.bucket == 3 for p in pieces)
    budgets.caps[3] = 10  # below one utterance: one per pass
    assert [len(p) for p in budgets.split([batch])] == [1] * rows


# ---- one rank of a 2-process gloo job ----------------------------------------------------------
def on_rank_1(record: Path) -> list[str]:
    """Overrides: the plug-in model runs out of memory above 600 padded frames, on rank 1."""
    return [
        MODEL,
        "model.args.limit_frames=600",
        "model.args.rank=1",
        f"model.args.record={record}",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])  # 2: errors in no_sync passes and backwards too
def test_ddp_forward_oom_on_one_rank_skips_exactly_those_steps_and_resumes(
    train_cache: Path, tmp_path: Path, accum: int
) -> None:
    out, record = tmp_path / "run", tmp_path / "rank1.jsonl"
    # The whole-cache stream of seed 0 (greedy batches, some over the limit, first in their
    # steps); bucket sub-streams (the default) cut and order them otherwise.
    extra = [*on_rank_1(record), f"train.grad_accum={accum}", "data.sync_buckets=false"]
    if accum == 2:
        extra.append("model.args.stage=backward")  # the first pass's backward: no_sync
    run_ok(train_cmd(train_cache, out, *extra), timeout=600)
    logged = events(out)
    assert logged and {e["rank"] for e in logged} == {1}
    # With 2 micro-batches, the batches over the limit come first in their steps: their
    # backward is a no_sync one, recoverable like a forward.
    assert {e["stage"] for e in logged} == {"forward" if accum == 1 else "backward"}
    caps: dict[int, int] = {}
    raised = replay(record, logged, caps, bucket_of(train_cache))
    final = checkpoint(out, 20)
    shared = load(final)
    assert raised == len(logged) == shared["budgets"]["skipped_steps"]
    assert shared["budgets"]["caps"] == {str(b): c for b, c in caps.items()}
    for rank in (0, 1):  # every rank ran every step, the skipped ones included
        local = load(final, f"rank-{rank:05d}.pt")
        assert local["step"] == 20 and local["loader"]["batches"] == 20 * accum
    windows = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in windows] == [5, 10, 15, 20]
    assert sum(r["skipped_steps"] for r in windows) == raised

    again = tmp_path / "rank1-resumed.jsonl"
    extra[: len(on_rank_1(again))] = on_rank_1(again)
    done = run_ok(train_cmd(train_cache, out, *extra, max_steps=30), timeout=600)
    assert "resumed from" in done.stderr
    replay(again, [e for e in events(out) if e["step"] > 20], dict(caps), bucket_of(train_cache))
    later = load(checkpoint(out, 30))["budgets"]["caps"]
    assert all(later[str(b)] <= c for b, c in caps.items())  # budgets only ever go down


@pytest.mark.slow
def test_ddp_oom_in_the_synchronised_backward_stops_cleanly_and_restarts_with_the_cut(
    train_cache: Path, tmp_path: Path
) -> None:
    """The hard case: rank 1 runs out of memory inside DDP's backward. The attempt ends with a
    message (never a hang) and leaves the cut; torchrun restarts it, and the restarted ranks
    resume from the last checkpoint with the budget lowered, until the job is done."""
    out, record = tmp_path / "run", tmp_path / "rank1.jsonl"
    entry = ("--max-restarts", "3", "-m", "train")
    # The whole-cache stream of seed 0: an oversize batch before the first checkpoint, another after.
    pinned = ("model.args.stage=backward", "data.sync_buckets=false")
    cmd = train_cmd(train_cache, out, *on_rank_1(record), *pinned, entry=entry)
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    stops = output.count("in the synchronised backward of bucket")
    # The first stop comes before any checkpoint, the second resumes from one.
    assert "it resumes from the start with that bucket's budget lowered to" in output
    assert re.search(r"resumes from checkpoint \S+/step-\d{8} with that bucket", output)
    logged = events(out)
    assert stops == len(logged) >= 1, output[-4000:]
    assert {e["stage"] for e in logged} == {"synchronised backward"}
    assert not list(out.glob("oom-rank-*.json"))  # applied, checkpointed, removed
    shared = load(checkpoint(out, 20))
    caps = shared["budgets"]["caps"]
    assert {int(b) for b in caps} == {e["bucket"] for e in logged}
    for e in logged:
        assert caps[str(e["bucket"])] <= int(0.9 * e["rows"] * e["frames"])
    print(f"{stops} stops, job done in {time.monotonic() - start:.0f} s")


def test_lowered_budgets_grow_back_after_clean_steps(train_cache: Path, tmp_path: Path) -> None:
    trainer = oom_trainer(train_cache, tmp_path, 600, "train.memory.budget_regrow_steps=3")
    try:
        trainer.fit(max_steps=16)
    finally:
        trainer.close()
    records = [
        r for r in metrics(tmp_path) if r.get("event") in ("out_of_memory", "budget_regrown")
    ]
    regrown = [r for r in records if r["event"] == "budget_regrown"]
    assert regrown and any(r["event"] == "out_of_memory" for r in records)
    caps: dict[int, int] = {}
    last_change = regrown_at = 0
    for r in records:  # each regrowth: 3 clean steps after the last change, every cap ÷ 0.9
        if r["event"] == "out_of_memory":
            caps[r["bucket"]], last_change = r["budget"], r["step"]
            continue
        assert r["budget_before"] == caps[r["bucket"]]
        assert r["budget"] == int(caps[r["bucket"]] / 0.9)
        assert r["step"] - last_change >= 3 or r["step"] == regrown_at  # every cap at once
        caps[r["bucket"]] = r["budget"]
        last_change = regrown_at = r["step"]
    assert trainer.parts.budgets.caps == caps
    saved = load(checkpoint(tmp_path, 16))["budgets"]
    assert saved["caps"] == {str(b): c for b, c in caps.items()}
    assert saved["clean_steps"] == trainer.parts.budgets.clean_steps
