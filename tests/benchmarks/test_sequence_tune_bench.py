"""``benchmarks.train.sequence_tune_bench``: budgets on the declared sequence against today's,
run end to end on small caches, and the work and ceiling it counts per step."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.train.sequence_tune_bench import MODELS, Step, ceiling, measured_step
from melcache.loader.batch import Batch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sequence_tune_bench_runs_the_encoder_decoder_on_both_axes(
    train_cache: Path, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "benchmarks.train.sequence_tune_bench"]
    command += ["--cache", str(train_cache), "--model", "encoder-decoder", "--rounds", "2"]
    command += ["--turn", "2", "--peak-steps", "2", "--memory-limit-mib", "64"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}  # the text lengths' sidecar
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    today, tuned, *trained, ratio, most = (json.loads(line) for line in done.stdout.splitlines())
    assert (today["sequence"], tuned["sequence"]) == ("frames", "text,frames")
    assert "text_budgets" in tuned and "text_budgets" not in today  # a table per axis
    assert "EncoderDecoder" in tuned["where"] and "PlannedOnFrames" in today["where"]
    assert [r["sequence"] for r in trained] == ["frames", "text,frames"]
    assert all(r["positions_per_s_median"] > 0 and r["peak_mib"] > 0 for r in trained)
    assert ratio["model"] == "encoder-decoder" and ratio["median_within_round"] > 0
    assert most["measure"] == "ceiling" and most["steps"] == 2 * 2 * 2  # arms × rounds × turn
    assert set(most["shares"]) == {"frames", "text,frames"} and most["most_any_plan_gains"] > 0


@pytest.mark.slow
def test_sequence_tune_bench_runs_chattts_gpt_on_its_code_frames(
    derived: Path, chattts_tokenizer: Path
) -> None:
    command = [sys.executable, "-m", "benchmarks.train.sequence_tune_bench", "--cache", str(derived),
               "--model", "chattts-gpt", "--config", str(REPO / "examples/chattts_gpt/config.toml"),
               "--set", f"data.vocab={json.dumps(str(chattts_tokenizer))}", "--rounds", "2",
               "--turn", "2", "--peak-steps", "2", "--memory-limit-mib", "200"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    today, tuned, *trained, ratio, most = (json.loads(line) for line in done.stdout.splitlines())
    assert "GPTPlannedOnFrames" in today["where"] and "adapter:GPT" in tuned["where"]
    assert [r["sequence"] for r in trained] == ["frames", "text+frames"]
    assert all(r["positions_per_step"] > 0 and 0 <= r["padded_share"] < 1 for r in trained)
    assert ratio["median_within_round"] > 0 and most["steps"] == 2 * 2 * 2


def test_a_step_counts_the_work_its_model_lays_out() -> None:
    """Padded apart (the prefix LM: text to the longest text, frames to the longest frames) or
    packed (ChatTTS's GPT: each row its text then its code frames, to the longest row)."""
    text, frames = torch.tensor([3, 1]), torch.tensor([4, 9])
    batch = Batch(
        mel=torch.zeros(2, 16, 4), mel_lengths=frames, text=torch.zeros(2, 3), text_lengths=text,
        keys=["a", "b"], speaker=[None, None], bucket=0,
        fields={"codes": torch.zeros(2, 9, 4)}, field_lengths={"codes": frames},
    )  # fmt: skip
    apart = measured_step(MODELS["prefix"], batch, 0.5)
    assert (apart.positions, apart.padded_positions) == (17, 2 * (3 + 16))
    assert (apart.pairs, apart.padded_pairs) == (7**2 + 10**2, 2 * 19**2)
    packed = measured_step(MODELS["chattts-gpt"], batch, 0.5)
    assert (packed.positions, packed.padded_positions) == (17, 2 * 10)
    assert (packed.pairs, packed.padded_pairs) == (7**2 + 10**2, 2 * 10**2)
    two = measured_step(MODELS["encoder-decoder"], batch, 0.5)
    assert (two.pairs, two.padded_pairs) == (9 + 16 + 12 + 1 + 81 + 9, 2 * (9 + 256 + 48))


def test_the_ceiling_is_today_fitted_over_its_work_bare() -> None:
    """Steps timed exactly ``0.5 + 1e-3·positions + 1e-6·pairs`` (padded): the fit finds the three
    costs, and the most any plan gains is today's time over its utterances' bare work."""

    def step(rows: int, padded: int, real: list[int]) -> Step:
        seconds = 0.5 + 1e-3 * rows * padded + 1e-6 * rows * padded**2
        return Step(seconds, sum(real), rows * padded, sum(r * r for r in real), rows * padded**2)

    today = [step(4, 100, [100, 90, 80, 70]), step(2, 300, [300, 250]), step(8, 50, [50] * 8)]
    declared = [step(3, 200, [200, 199, 150]), step(1, 400, [400])]
    out = ceiling("prefix", {"frames": today, "text+frames": declared})
    costs = out["coefficients"]
    assert math.isclose(costs["per_step_s"], 0.5, rel_tol=1e-6)
    assert math.isclose(costs["per_position_s"], 1e-3, rel_tol=1e-6)
    assert math.isclose(costs["per_pair_s"], 1e-6, rel_tol=1e-6)
    assert math.isclose(out["r2"], 1.0)
    bare = sum(1e-3 * s.positions + 1e-6 * s.pairs for s in today)
    assert out["most_any_plan_gains"] == round(sum(s.seconds for s in today) / bare, 3)
    shares = out["shares"]["frames"]
    assert math.isclose(shares["overhead"], round(1.5 / sum(s.seconds for s in today), 4))
    assert math.isclose(
        shares["overhead"] + shares["padding"] + 1 / shares["fitted_over_bare"], 1, abs_tol=1e-3
    )
