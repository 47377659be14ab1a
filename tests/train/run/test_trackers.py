"""Trackers (``train/run/trackers.py``, issue #41): what TensorBoard's own reader and W&B's
offline run folder hold equals metrics.jsonl; a resumed run continues its W&B run; a tracker
that hangs or fails costs the run one warning and a bounded wait at the end."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from benchmarks.train.tracker_bench import Hanging  # the double the benchmark times
from melcache.errors import UserError
from tests.support.helpers import SMALL, checkpoint, load, metrics, tiny_fit
from tests.support.wandb_log import offline_runs
from train.parallel.env import Env
from train.run import tracker_backends, trackers
from train.run.tracker_backends import Opening
from train.run.trackers import Tracked, TrackerState, open_trackers, scalars

RUN = [*SMALL, "train.log_every=1", "train.checkpoint.every=3", "data.num_workers=0"]


class Failing:
    """A tracker double that fails at its second record."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.seen:
            raise ConnectionError("the server went away")
        self.seen.append(step)

    def picture(self, step: int, tag: str, path: Path) -> None:
        raise AssertionError("not called here")

    def close(self) -> None:
        self.seen.append(-1)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_records_become_scalars_and_events_are_prefixed() -> None:
    assert scalars({"step": 4, "loss": 1.5, "skipped_steps": 0}) == {
        "loss": 1.5,
        "skipped_steps": 0.0,
    }
    event = {"step": 5, "event": "out_of_memory", "rank": 1, "stage": "forward", "ok": True}
    assert scalars(event) == {"event/out_of_memory": 1.0, "out_of_memory/rank": 1.0}


def test_a_hanging_tracker_costs_a_put_and_a_bounded_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tracked = Tracked("hanging", Hanging, close_seconds=0.5)
    started = time.perf_counter()
    for step in range(1000):
        tracked.put("scalars", step, {"loss": 1.0})
    assert time.perf_counter() - started < 0.5  # ~µs each: the loop never waits
    started = time.perf_counter()
    tracked.close()
    assert time.perf_counter() - started < 2.0
    (warning,) = warnings_of(caplog)
    assert "tracker hanging did not finish within 0.5 s" in warning


def test_a_full_queue_drops_counts_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    tracked = Tracked("slow", Hanging, capacity=3, close_seconds=0.2)
    for step in range(10):
        tracked.put("scalars", step, {"loss": 1.0})
    assert tracked.dropped == 7
    tracked.close()
    (warning,) = warnings_of(caplog)
    assert "tracker slow is not keeping up (3 records queued)" in warning


def test_a_failing_tracker_warns_once_and_is_closed(caplog: pytest.LogCaptureFixture) -> None:
    backend = Failing()
    tracked = Tracked("failing", lambda: backend)
    for step in range(5):
        tracked.put("scalars", step, {"loss": 1.0})
        time.sleep(0.05)  # let the thread deliver
    tracked.close()
    assert backend.seen == [0, -1]  # its first record, then closed after the failure
    assert tracked.dropped == 4
    (warning,) = warnings_of(caplog)
    assert warning.startswith("tracker failing failed (ConnectionError: the server went away)")


def test_a_tracker_whose_package_is_missing_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(tracker_backends.MODULES, "wandb", "no_such_package_41")
    env = Env(0, 1, 0, __import__("torch").device("cpu"))
    with pytest.raises(UserError, match=r"no_such_package_41 is not installed: pip install"):
        open_trackers(("wandb",), env, Opening(tmp_path, 0, "x", {}))
    other = Env(1, 2, 1, env.device)  # other ranks open nothing, so check nothing
    assert open_trackers(("wandb",), other, Opening(tmp_path, 0, "x", {})).tracked == []


def test_the_wandb_run_id_is_w_and_b_s_own_or_new_and_resumes_from_the_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    assert TrackerState(()).state_dict() == {}
    fresh = TrackerState(("wandb",))
    assert isinstance(fresh.wandb_run_id, str) and len(fresh.wandb_run_id) == 8
    monkeypatch.setenv("WANDB_RUN_ID", "given123")
    assert TrackerState(("wandb",)).wandb_run_id == "given123"
    resumed = TrackerState(("tensorboard", "wandb"))
    resumed.load_state_dict({"wandb_run_id": "saved456"})
    assert resumed.state_dict() == {"wandb_run_id": "saved456"}


def test_tensorboard_reads_back_every_logged_loss_and_the_validation_pictures(
    train_cache: Path, tmp_path: Path
) -> None:
    """TensorBoard's own EventAccumulator: each step's loss equal to metrics.jsonl's (float64
    scalars), and a picture at each validation."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    val = [f"data.val_shards={train_cache}", "train.validation.every=3"]
    tiny_fit(train_cache, tmp_path, 6, [*RUN, *val, 'train.trackers=["tensorboard"]'])
    logged = {r["step"]: r["loss"] for r in metrics(tmp_path) if "loss" in r}
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    read = {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors("loss")}
    assert read == logged
    val_read = [e.step for e in events.Tensors("val_loss")]
    assert val_read == [3, 6]
    assert [e.step for e in events.Images("val/mel")] == [3, 6]


def test_a_hanging_tracker_leaves_the_run_to_end_normally_with_one_warning(
    train_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its every call sleeps 60 s: the run trains, checkpoints and ends; the close waits the
    bounded time, once, with one warning (the step times: benchmarks/train/tracker_bench.py)."""
    monkeypatch.setitem(tracker_backends.OPENERS, "tensorboard", Hanging)
    monkeypatch.setattr(trackers, "CLOSE_SECONDS", 1.0)
    started = time.perf_counter()
    trainer = tiny_fit(train_cache, tmp_path, 6, [*RUN, 'train.trackers=["tensorboard"]'])
    assert time.perf_counter() - started < 40  # a wait on the tracker would be 60 s or more
    assert trainer.step == 6 and checkpoint(tmp_path, 6).is_dir()
    assert len([r for r in metrics(tmp_path) if "loss" in r]) == 6
    (warning,) = warnings_of(caplog)
    assert "tracker tensorboard did not finish within 1 s" in warning


@pytest.mark.slow  # wandb.init starts W&B's own service process
def test_wandb_offline_holds_the_history_and_a_resume_continues_its_run(
    train_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes' worth of one run (6 steps, then resumed from step 6 to 9): two offline
    run folders with the checkpoint's run id, whose histories together are metrics.jsonl's,
    with each validation's picture as an image W&B stored in the run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_RUN_ID", "WANDB_DIR", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    val = [f"data.val_shards={train_cache}", "train.validation.every=3"]
    run = [*RUN, *val, 'train.trackers=["wandb"]']
    tiny_fit(train_cache, tmp_path, 6, run)
    run_id = load(checkpoint(tmp_path, 6))["trackers"]["wandb_run_id"]
    tiny_fit(train_cache, tmp_path, 9, run)  # a new Trainer: resumes from step 6
    assert load(checkpoint(tmp_path, 9))["trackers"]["wandb_run_id"] == run_id
    runs = offline_runs(tmp_path)
    assert [r[0] for r in runs] == [run_id, run_id]
    histories = [[(row["step"], row["loss"]) for row in rows if "loss" in row] for _, rows in runs]
    assert [step for step, _ in histories[0]] == [1, 2, 3, 4, 5, 6]
    assert [step for step, _ in histories[1]] == [7, 8, 9]
    logged = [(r["step"], r["loss"]) for r in metrics(tmp_path) if "loss" in r]
    assert histories[0] + histories[1] == logged
    # W&B's own record of an image (its keys flattened under the tag) and the PNG it copied in
    pictures = [row for _, rows in runs for row in rows if "val/mel/_type" in row]
    assert [row["step"] for row in pictures] == [3, 6, 9]
    for row in pictures:
        assert row["val/mel/_type"] == "image-file" and row["val/mel/format"] == "png"
        assert list(tmp_path.glob(f"wandb/offline-run-*/files/{row['val/mel/path']}"))


def test_a_tracker_that_cannot_write_is_refused_before_the_first_step(tmp_path: Path) -> None:
    """``OUT/tensorboard`` a file lost every record, said only at the run's end."""
    env = Env(0, 1, 0, __import__("torch").device("cpu"))
    (tmp_path / "tensorboard").write_text("not a folder")
    with pytest.raises(UserError, match=r"^tracker tensorboard writes into \S+/tensorboard, which "
                       r"is a file, not a folder$"):  # fmt: skip
        open_trackers(("tensorboard",), env, Opening(tmp_path, 0, None, {}))
