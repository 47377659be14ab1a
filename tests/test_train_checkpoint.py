"""Checkpointer: complete-or-invisible folders, keep-K, stale temp cleanup, weights_only loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from melcache.errors import UserError
from train import checkpoint
from train.checkpoint import MARKER, Checkpointer
from train.distributed import Env

CPU = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


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


def test_world_size_change_is_refused(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, CPU, keep=2, async_save=False)
    ckpt.save(1, *state(1))
    marker = tmp_path / "step-00000001" / MARKER
    marker.write_text(marker.read_text().replace('"world_size": 1', '"world_size": 4'))
    with pytest.raises(UserError, match="written by 4 ranks"):
        ckpt.load(ckpt.latest())


def test_loading_refuses_pickled_code(tmp_path: Path) -> None:
    """weights_only=True: a checkpoint cannot run code when loaded."""
    ckpt = Checkpointer(tmp_path, CPU, keep=2, async_save=False)
    ckpt.save(1, {"evil": Path("/")}, {})
    with pytest.raises(Exception, match=r"(?i)weights_only|unsupported global"):
        ckpt.load(ckpt.latest())
