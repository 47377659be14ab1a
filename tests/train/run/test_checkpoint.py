"""Checkpointer: complete-or-invisible folders, keep-K, stale temp cleanup, weights_only loads."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path, PosixPath

import pytest
import torch

from melcache.errors import UserError
from tests.support.helpers import REPO, load, run_ok, same_weights, small_tmpfs, train_cmd
from tests.support.helpers import checkpoint as step_folder
from train.config.renamed import RENAMED
from train.parallel.env import Env
from train.run import checkpoint, dcp
from train.run.checkpoint import MARKER, SHARED, Checkpointer, rank_file
from train.run.dcp import WEIGHTS

CPU = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
# DCP warns that a process without a process group saves alone: that is what these tests do.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def weights(step: int) -> dict:
    """What a sharded run writes in DCP format (here from one process, so unsharded)."""
    return {"model": {"w": torch.full((64,), float(step))}, "optimizer": {"step": step}}


def state(step: int) -> tuple[dict, dict]:
    shared = {"step": step, "model": {"w": torch.full((3,), float(step))}, "config": {"a": [1, 2]}}
    local = {"rng": {"python": (3, tuple(range(5)), None)}, "loader": {"positions": [[0, step, 1]]}}
    return shared, local


@pytest.mark.parametrize("async_save", [False, True])
def test_save_load_round_trip_and_keep_last_k(tmp_path: Path, async_save: bool) -> None:
    ckpt = Checkpointer(tmp_path, CPU, keep=2, async_save=async_save)
    for step in (10, 20, 30):
        ckpt.save(step, *state(step))
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000030"]
    latest = ckpt.latest()
    assert latest is not None and latest.name == "step-00000030"
    shared, local = ckpt.load(latest)
    assert torch.equal(shared["model"]["w"], torch.full((3,), 30.0))
    assert local["loader"] == {"positions": [[0, 30, 1]]}


def test_async_save_is_a_snapshot(tmp_path: Path) -> None:
    """Training may change the live tensors right after save() returns."""
    live = torch.zeros(4)
    ckpt = Checkpointer(tmp_path, CPU, keep=2, async_save=True)
    ckpt.save(1, {"model": {"w": live}}, {})
    live.add_(1.0)
    ckpt.close()
    shared, _ = ckpt.load(ckpt.latest())
    assert torch.equal(shared["model"]["w"], torch.zeros(4))


def test_unfinished_writes_never_count_and_are_cleaned(tmp_path: Path, monkeypatch) -> None:
    ckpt = Checkpointer(tmp_path, CPU, keep=2, async_save=False)
    ckpt.save(2, *state(2))

    def dies_midway(obj, path: Path) -> None:
        path.write_bytes(b"half a pickle")
        raise KeyboardInterrupt  # the process is killed here

    monkeypatch.setattr(checkpoint, "_write", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(4, *state(4))
    # A final-looking folder without its marker (e.g. copied by hand) does not count either.
    (tmp_path / "step-00000009").mkdir()
    assert ckpt.latest().name == "step-00000002"
    assert (tmp_path / ".tmp-step-00000004").is_dir()
    monkeypatch.undo()
    fresh = Checkpointer(tmp_path, CPU, keep=2, async_save=False)  # a restart cleans up
    assert not (tmp_path / ".tmp-step-00000004").exists()
    assert fresh.latest().name == "step-00000002"
    fresh.load(fresh.latest())


def test_a_checkpoint_of_another_world_size_needs_every_old_rank_file(tmp_path: Path) -> None:
    """A job of another size reads every old rank's file (their loader states); one missing
    is named (the 4-rank → 2-rank resume itself: tests/train/parallel/test_elastic.py)."""
    ckpt = Checkpointer(tmp_path, CPU, keep=2, async_save=False)
    ckpt.save(1, *state(1))
    marker = tmp_path / "step-00000001" / MARKER
    marker.write_text(marker.read_text().replace('"world_size": 1', '"world_size": 4'))
    with pytest.raises(UserError, match=r"rank-00001\.pt is missing"):
        ckpt.load(ckpt.latest())


def test_loading_refuses_pickled_code(tmp_path: Path) -> None:
    """weights_only=True: a checkpoint cannot run code when loaded."""
    ckpt = Checkpointer(tmp_path, CPU, keep=2, async_save=False)
    ckpt.save(1, {"evil": Path("/")}, {})
    with pytest.raises(Exception, match=r"(?i)weights_only|unsupported global"):
        ckpt.load(ckpt.latest())


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def replace_with(make: Callable[[Path], None]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        path.unlink()
        make(path)

    return damage


SHARD = f"{WEIGHTS}/__0_0.distcp"  # the one DCP shard file one process writes
METADATA = f"{WEIGHTS}/.metadata"
# Each way a checkpoint file can be damaged: the file it hits, the damage, the reason named.
DAMAGE = {
    "empty shared.pt": (SHARED, lambda p: p.write_bytes(b""), "EOFError"),
    "truncated zip": (SHARED, cut_in_half, "RuntimeError"),
    "directory for shared.pt": (SHARED, replace_with(Path.mkdir), "is a directory"),
    "FIFO for shared.pt": (SHARED, replace_with(os.mkfifo), "is a FIFO"),
    "missing rank file": (rank_file(0), Path.unlink, "is missing"),
    "a list in shared.pt": (SHARED, lambda p: torch.save([1, 2], p), "holds a list"),
    "non-UTF-8 marker": (MARKER, lambda p: p.write_bytes(b'{"world_size": 1\xff}'), "utf-8"),
    "non-object marker": (MARKER, lambda p: p.write_text("[1]"), "no world_size"),
    "marker without world_size": (MARKER, lambda p: p.write_text("{}"), "no world_size"),
    "string world_size": (MARKER, lambda p: p.write_text('{"world_size": "1"}'), "no world_size"),
    "deep marker": (MARKER, lambda p: p.write_text("[" * 100_000), "nested too deeply"),
    "missing DCP folder": (WEIGHTS, shutil.rmtree, "is missing"),
    "missing DCP shard": (SHARD, Path.unlink, "is missing"),
    "truncated DCP shard": (SHARD, cut_in_half, "is cut short"),
    "FIFO for a DCP shard": (SHARD, replace_with(os.mkfifo), "is a FIFO"),
    "missing DCP metadata": (METADATA, Path.unlink, "is missing"),
    "truncated DCP metadata": (METADATA, cut_in_half, "not readable DCP metadata"),
    "garbage DCP metadata": (METADATA, lambda p: p.write_bytes(b"\x80\x05junk"), "DCP metadata"),
    "foreign DCP metadata": (METADATA, lambda p: p.write_bytes(pickle.dumps(print)), "refused"),
    "FIFO for DCP metadata": (METADATA, replace_with(os.mkfifo), "is a FIFO"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_named_and_the_previous_one_restored(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    target, damage, reason = DAMAGE[case]
    ckpt = Checkpointer(tmp_path, CPU, keep=3, async_save=False)
    for step in (1, 2):
        ckpt.save(step, *state(step), weights(step))
    damage(tmp_path / "step-00000002" / target)

    path, shared, _ = ckpt.restore()
    assert path.name == "step-00000001" and shared["step"] == 1
    assert torch.equal(dcp.read_full(path / WEIGHTS)["model"]["w"], weights(1)["model"]["w"])
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert str(tmp_path / "step-00000002" / target) in warning and reason in warning
    assert warning.endswith(f"falling back to {tmp_path / 'step-00000001'}")
    assert "\n" not in warning

    damage(tmp_path / "step-00000001" / target)  # now none is left
    with pytest.raises(UserError) as failure:
        ckpt.restore()
    message = str(failure.value)
    assert str(tmp_path / "step-00000001" / target) in message and reason in message
    assert "no earlier checkpoint is left" in message and "\n" not in message


def test_a_checkpoint_that_cannot_be_written_keeps_the_previous_one(tmp_path: Path) -> None:
    """A full disk mid-checkpoint (a real tmpfs that holds one checkpoint, not two)."""
    big = {"w": torch.zeros(64 * 1024)}  # 256 KiB
    with small_tmpfs(tmp_path / "disk", "400k") as disk:
        ckpt = Checkpointer(disk / "checkpoints", CPU, keep=2, async_save=False)
        ckpt.save(1, {"step": 1, "model": big}, {})
        with pytest.raises(UserError) as failure:
            ckpt.save(2, {"step": 2, "model": big}, {})
        message = str(failure.value)
        assert f"cannot write checkpoint step-00000002 in {disk / 'checkpoints'}" in message
        assert message.endswith("the previous checkpoint step-00000001 was kept")
        assert "\n" not in message
        assert [p.name for p in (disk / "checkpoints").iterdir()] == ["step-00000001"]
        _, shared, _ = ckpt.restore()
        assert shared["step"] == 1


@pytest.mark.parametrize("module", ["pathlib", "pathlib._local"])
def test_dcp_metadata_may_name_the_path_class_of_any_python(module: str) -> None:
    """DCP pickles the checkpoint's path: Python 3.13 names its class pathlib._local.PosixPath,
    3.11 and 3.12 pathlib.PosixPath; a checkpoint written by either reads under the other."""
    text = pickle.dumps(PosixPath("/runs/a"), protocol=0)  # text opcodes: names are plain bytes
    text = text.replace(PosixPath.__module__.encode() + b"\n", module.encode() + b"\n")
    assert module.encode() + b"\nPosixPath" in text
    assert dcp._MetadataUnpickler(io.BytesIO(text)).load() == PosixPath("/runs/a")


BEFORE_THE_MOVE = "2892e50"  # flat train/, the loader in train/: the commit before #36
RUN_KEYS = ("train.checkpoint.every=6", "train.log_every=3")


@pytest.mark.slow  # three 2-process torchrun jobs, two of them of the commit before the move
def test_a_run_saved_before_the_move_resumes_bitwise_after_it(train_cache: Path, tmp_path: Path):
    """A checkpoint and loader states written by the commit before the move (run from its own
    tree, ``git archive``) resume with today's code to the same step-12 weights, RNG and
    loader states as that commit's uninterrupted run."""
    old = tmp_path / "before"
    old.mkdir()
    tree = ["git", "-C", str(REPO), "archive", BEFORE_THE_MOVE, "melcache", "train"]
    archive = subprocess.run(tree, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    assert str(old / "train") in _imported_train(old), "the old tree's train/ would not run"
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out, steps in ((straight, 12), (resumed, 6)):
        command = [
            _old_name(arg) for arg in train_cmd(train_cache, out, *RUN_KEYS, max_steps=steps)
        ]
        command[command.index("--config") + 1] = str(old / "melcache" / "presets" / "tiny.toml")
        done = subprocess.run(command, cwd=old, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    done = run_ok(train_cmd(train_cache, resumed, *RUN_KEYS, max_steps=12), timeout=600)
    assert "resumed from" in done.stderr
    assert "changed config" not in done.stderr  # its flat [train] keys read as today's
    want, got = step_folder(straight, 12), step_folder(resumed, 12)
    same_weights(want, got)
    for rank in (0, 1):  # every generator, and the loader where it stands (today's state
        # holds more keys: its version's sub-stream names and deals)
        theirs_all, mine_all = (load(c, f"rank-{rank:05d}.pt") for c in (want, got))
        for key in ("batches", "next_worker", "positions", "skipped_shards"):
            assert mine_all["loader"][key] == theirs_all["loader"][key], (rank, key)
        assert torch.equal(mine_all["rng"]["torch"], theirs_all["rng"]["torch"]), rank
        theirs, mine = theirs_all["rng"], mine_all["rng"]
        assert mine["python"] == theirs["python"], f"rank {rank} Python RNG differs"
        assert torch.equal(mine["numpy"]["keys"], theirs["numpy"]["keys"]), rank
        assert mine["numpy"] == {**theirs["numpy"], "keys": mine["numpy"]["keys"]}, rank


def _old_name(arg: str) -> str:
    """An override in the flat ``[train]`` names of the commit before the move."""
    key, sep, value = arg.partition("=")
    old = {f"train.{g}.{n}": f"train.{o}" for o, (g, n) in RENAMED.items()}.get(key)
    return f"{old}{sep}{value}" if old and sep else arg


def _imported_train(tree: Path) -> str:
    """Where ``import train`` resolves when run from ``tree``, as its torchrun workers do."""
    code = "import train.trainer; print(train.trainer.__file__)"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=True
    ).stdout
