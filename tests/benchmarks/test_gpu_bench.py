"""benchmarks/train/gpu_bench.py on CPU: the whole command on a tiny corpus, and its baseline collate."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import results
from benchmarks.train.gpu_bench import DEFAULT_ROWS, PadToBatch, parse_args
from benchmarks.train.gpu_util import UtilSampler

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_run_prints_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows_file = tmp_path / "rows.jsonl"
    command = [sys.executable, "-m", "benchmarks.train.gpu_bench", "--device", "cpu"]
    command += ["--model", "tiny", "--steps", "2", "--warmup", "1", "--minutes", "0.3"]
    command += ["--accum", "2", "--workers", "1", "--data", str(tmp_path / "data")]
    command += ["--json", str(rows_file), "--memory-limit-mib", "64"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    lines = done.stdout.splitlines()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    assert [r["row"] for r in rows] == DEFAULT_ROWS
    assert [json.loads(line) for line in rows_file.read_text().splitlines()] == rows
    for row in rows:
        assert row["samples_per_s"] > 0 and row["frames_per_s"] > 0, row
        assert 0 <= row["data_wait_pct"] <= 100, row
        assert 0 <= row["padding_pct"] < 100, row
        assert row["gpu_util_pct"] is None and row["peak_allocated_mib"] is None, row
        assert row["peak_rss_mib"] > 0 and math.isfinite(row["loss"]), row
        assert row["micro_batches"] == 2 and row["model"] == "tiny", row
    by_name = {r["row"]: r for r in rows}
    assert [r["precision"] for r in rows[:3]] == ["fp32", "fp32", "bf16"]
    assert [r["grad_accum"] for r in rows] == [1, 1, 1, 1, 2, 2, 2, 1, 1]
    # The budget rows: train tune's table, and its smallest entry as the one global budget.
    tuned, one = by_name["budget-tuned"]["batch_frames"], by_name["budget-global"]["batch_frames"]
    assert isinstance(tuned, dict) and len(tuned) >= 2 and one == min(tuned.values())
    assert by_name["budget-tuned"]["mean_batch"] >= by_name["budget-global"]["mean_batch"]
    # Copies on the compute stream or a side stream: on CPU both are plain, the same steps.
    assert by_name["copy-compute"]["loss"] == pytest.approx(by_name["cache-bf16"]["loss"])
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].startswith("| row | what | samples/s | frames/s")
    assert [line.split(" | ")[0].removeprefix("| ") for line in table[1:]] == DEFAULT_ROWS
    # One rank: skipping the all-reduce of the first micro-batches (no_sync) and recomputing
    # activations change the cost, never the result (same batches, seeds and dropout masks).
    nosync = by_name["accum-nosync"]["loss"]
    assert by_name["accum-sync"]["loss"] == pytest.approx(nosync, rel=1e-3)
    assert by_name["ckpt"]["loss"] == pytest.approx(nosync, rel=1e-3)
    # docs/results.md's GPU section is rendered from the rows file, the same table.
    monkeypatch.setattr(results, "GPU_RESULTS", rows_file)
    rendered = results.gpu_table(quick=False).splitlines()
    assert "tiny model on cpu" in rendered[0]
    assert [line for line in rendered if line.startswith("| ")] == table


def test_baseline_batch_matches_the_cache_layout() -> None:
    mels = [torch.randn(5, 3), torch.randn(9, 3)]
    tokens = [torch.tensor([1, 2]), torch.tensor([3, 4, 5])]
    batch = PadToBatch(pad_multiple=8, pad_value=-11.5)(list(zip(mels, tokens, strict=True)))
    assert batch.mel.dtype == torch.float16 and batch.mel.shape == (2, 16, 3)
    assert batch.mel_lengths.tolist() == [5, 9] and batch.text_lengths.tolist() == [2, 3]
    assert torch.equal(batch.mel[1, :9], mels[1].half())
    assert (batch.mel[0, 5:] == -11.5).all() and (batch.mel[1, 9:] == -11.5).all()
    assert batch.text.tolist() == [[1, 2, *[0] * 6], [3, 4, 5, *[0] * 5]]  # padded like the loader
    assert len(batch) == 2 and batch.speaker == [None, None]


def test_rows_and_sampler_options() -> None:
    assert "compile" in parse_args(["--rows", "all"]).rows
    assert parse_args([]).rows == DEFAULT_ROWS
    with pytest.raises(SystemExit):
        parse_args(["--rows", "cache-fp32,nope"])
    sampler = UtilSampler(torch.device("cpu"))  # no GPU: no thread, no samples
    assert sampler.mean(0.0, 1e9) is None
    sampler.close()
