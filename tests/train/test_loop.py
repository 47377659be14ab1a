"""The loop in one process on the real cache: metrics, graceful stop, resume, plot, checks."""

from __future__ import annotations

import json
import logging
import re
import signal
from pathlib import Path

import pytest
import torch

from melcache.errors import UserError
from tests.support.helpers import needs_extra
from train.config.tables import load_config
from train.optim.precision import resolve_precision
from train.parallel.env import Env
from train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
CPU = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
SMALL = [
    "data.batch_frames=800",
    "data.num_workers=0",
    "model.args.dim=64",
    "model.args.layers=2",
    "train.precision=fp32",
    "train.log_every=2",
    "train.checkpoint.every=100",
]
METRIC_KEYS = {
    "step",
    "loss",
    "mel_loss",
    "stop_loss",
    "lr",
    "grad_norm",
    "samples_per_s",
    "frames_per_s",
    "text_tokens_per_s",
    "padding_pct",
    "data_wait_pct",
    "step_time_s",
    "peak_rss_mib",
}


def make_trainer(cache: Path, out: Path, *extra: str) -> Trainer:
    return Trainer(
        load_config(REPO / "configs" / "tiny.toml", [*SMALL, *extra]), str(cache), out, CPU
    )


def test_feature_mismatch_is_a_clear_error(train_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="n_mels"):
        make_trainer(train_cache, tmp_path, "model.n_mels=80")
    with pytest.raises(UserError, match="hop_length"):
        make_trainer(train_cache, tmp_path, "model.hop_length=240")


def test_sigterm_checkpoints_and_resume_continues(train_cache: Path, tmp_path: Path) -> None:
    trainer = make_trainer(train_cache, tmp_path)
    step_once = trainer.train_step

    def step_then_signal(micro):
        if trainer.step == 2:
            signal.raise_signal(signal.SIGTERM)  # as a scheduler's SIGTERM would arrive
        return step_once(micro)

    trainer.train_step = step_then_signal
    try:
        assert trainer.fit(max_steps=50) == "signal"
    finally:
        trainer.close()
    # The signal comes during step 3; every rank alike stops after it (the step's host vote).
    assert trainer.step == 3
    assert (tmp_path / "checkpoints" / "step-00000003" / "COMPLETE.json").is_file()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3]
    assert set(records[0]) >= METRIC_KEYS
    assert 0 <= records[0]["padding_pct"] < 100 and 0 <= records[0]["data_wait_pct"] <= 100

    resumed = make_trainer(train_cache, tmp_path)
    try:
        assert resumed.step == 3
        assert resumed.parts.loader.state_dict() == trainer.parts.loader.state_dict()
        resumed.fit(max_steps=6)
    finally:
        resumed.close()
    assert resumed.step == 6


def test_rank_0_logs_one_line_per_window(
    train_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = make_trainer(train_cache, tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="train.run.metrics"):
            trainer.fit(max_steps=4)
    finally:
        trainer.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "train.run.metrics"]
    assert len(lines) == 2, lines  # log_every = 2
    for step, line in zip((2, 4), lines, strict=True):
        assert re.fullmatch(
            rf"step {step}/4 \| loss \d+\.\d{{4}} \| \d+\.\d samples/s \| "
            r"data wait \d+\.\d % \| \d+:\d\d:\d\d left",
            line,
        ), line
    assert lines[-1].endswith("| 0:00:00 left")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    needs_extra("matplotlib", "plot")
    from train.__main__ import main

    lines = [
        {
            "step": s,
            "loss": 1.0 / s,
            "mel_loss": 0.5 / s,
            "frames_per_s": 100.0 + s,
            "data_wait_pct": 2.0,
        }
        for s in (2, 4, 6)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# A metrics.jsonl edited by hand, cut by a crash or damaged: only lines 1, 6 and 8 are records.
HOSTILE_METRICS = [
    b'{"step": 2, "loss": 0.5, "frames_per_s": 100.0, "data_wait_pct": 1.0}',
    b"[" * 100_000,  # deeper than the JSON parser's stack
    b'{"step": 3, "loss": 0.4\xff}',  # not UTF-8
    b"[1, 2]",
    b'"a string"',
    b'{"step": 4, "loss": "low"}',  # lacks frames_per_s, and its loss is no number
    b'{"step": "5", "loss": 0.3}',
    b'{"step": 6, "loss": 0.2, "frames_per_s": 120.0, "data_wait_pct": 2.0}',
]


def test_a_hostile_metrics_file_is_plotted_and_resumed_past(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    needs_extra("matplotlib", "plot")
    from train.__main__ import main
    from train.run.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n".join(HOSTILE_METRICS) + b"\n")
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == f"{path}: skipped 5 lines that are not step records: line 2, 3, 4, 5, 7"

    MetricsLog(tmp_path, CPU, start_step=4, max_steps=10).close()  # what a resume at step 4 does
    assert path.read_bytes() == HOSTILE_METRICS[0] + b"\n" + HOSTILE_METRICS[5] + b"\n"


def test_cli_reports_bad_input_with_status_2(train_cache: Path, tmp_path: Path) -> None:
    from train.__main__ import main

    status = main(["--shards", str(train_cache), "--out", str(tmp_path), "train.grad_accum=0"])
    assert status == 2
    assert main(["--shards", str(tmp_path / "nothing"), "--out", str(tmp_path)]) == 2


def test_a_checkpoint_that_does_not_fit_is_one_clear_error(
    train_cache: Path, tmp_path: Path
) -> None:
    """The scaler, schedule and EMA state are checked like the model's: an fp32 run resumed
    as fp16 has no loss-scaler state to load."""
    trainer = make_trainer(train_cache, tmp_path)
    trainer.save()
    trainer.close()
    with pytest.raises(UserError, match="does not fit this config") as refused:
        make_trainer(train_cache, tmp_path, "train.precision=fp16")
    assert "\n" not in str(refused.value)


def test_rank_without_the_rest_of_torchrun_is_status_2(
    train_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from train.__main__ import _train_parser, main

    for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    assert main(["--shards", str(train_cache), "--out", str(tmp_path)]) == 2
    monkeypatch.setenv("RANK", "first")
    assert main(["--shards", str(train_cache), "--out", str(tmp_path)]) == 2
    assert "python -m train plot" in _train_parser().format_help()


def test_auto_precision_never_picks_emulated_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pre-Ampere GPU: bf16 only by emulation. "auto" gives fp32, "bf16" a clear error."""
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    cuda = torch.device("cuda", 0)
    assert resolve_precision("auto", cuda) == "fp32"
    with pytest.raises(UserError, match="not supported on Tesla V100"):
        resolve_precision("bf16", cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision("auto", cuda) == "bf16"


def test_deterministic_key_runs_on_cpu(train_cache: Path, tmp_path: Path) -> None:
    try:
        trainer = make_trainer(train_cache, tmp_path, "train.deterministic=true")
        assert torch.are_deterministic_algorithms_enabled()
        assert trainer.fit(max_steps=2) == "max_steps"
        trainer.close()
    finally:
        torch.use_deterministic_algorithms(False)  # global: leave the other tests as they were
