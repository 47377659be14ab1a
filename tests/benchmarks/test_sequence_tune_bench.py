"""``benchmarks.train.sequence_tune_bench``: budgets on the declared sequence against today's,
run end to end on small caches, and the work and bound it counts per step."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.train.sequence_tune_bench import MODELS, WORK, Step, bound, measured_step
from melcache.loader.batch import Batch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sequence_tune_bench_runs_the_encoder_decoder_on_both_axes(train_cache: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.train.sequence_tune_bench"]
    command += ["--cache", str(train_cache), "--model", "encoder-decoder", "--rounds", "2"]
    command += ["--turn", "2", "--peak-steps", "2", "--memory-limit-mib", "64"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    today, tuned, *trained, ratio, most, whole = lines
    assert (today["sequence"], tuned["sequence"]) == ("frames", "text,frames")
    assert "text_budgets" in tuned and "text_budgets" not in today  # a table per axis
    assert "EncoderDecoder" in tuned["where"] and "PlannedOnFrames" in today["where"]
    assert [r["sequence"] for r in trained] == ["frames", "text,frames"]
    assert all(r["positions_per_s_median"] > 0 and r["peak_mib"] > 0 for r in trained)
    assert ratio["model"] == "encoder-decoder" and ratio["median_within_round"] > 0
    assert (most["measure"], most["sequence"]) == ("bound", "text,frames")
    assert most["most_on_any_device"] > 0 and set(most["today_work_over_declared"]) == set(WORK)
    assert (most["batches"], whole["measure"], whole["sequence"]) == (
        "timed",
        "bound",
        "text,frames",
    )
    assert whole["batches"].startswith("one epoch (") and whole["most_on_any_device"] > 0


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
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    today, tuned, *trained, ratio, most, whole = lines
    assert "GPTPlannedOnFrames" in today["where"] and "adapter:GPT" in tuned["where"]
    assert [r["sequence"] for r in trained] == ["frames", "text+frames"]
    assert all(r["positions_per_step"] > 0 and 0 <= r["padded_share"] < 1 for r in trained)
    assert ratio["median_within_round"] > 0 and most["most_on_any_device"] > 0
    assert whole["batches"].startswith("one epoch (") and whole["most_on_any_device"] > 0


def test_a_step_counts_the_work_its_model_lays_out() -> None:
    """Padded apart (the prefix LM: text to the longest text, frames to the longest frames) or
    packed (ChatTTS's GPT: each row its text then its code frames, to the longest row)."""
    text, frames = torch.tensor([3, 1]), torch.tensor([4, 9])
    batch = Batch(
        mel=torch.zeros(2, 16, 4), mel_lengths=frames, text=torch.zeros(2, 3), text_lengths=text,
        keys=["a", "b"], speaker=[None, None], bucket=0,
        fields={"codes": torch.zeros(2, 9, 4)}, field_lengths={"codes": frames},
    )  # fmt: skip
    apart = measured_step(MODELS["prefix"], batch, 0.5)  # step, rows, positions, frames, pairs
    assert (apart.positions, apart.work) == (17, (1, 2, 2 * (3 + 16), 2 * 16, 2 * 19**2))
    packed = measured_step(MODELS["chattts-gpt"], batch, 0.5)
    assert (packed.positions, packed.work) == (17, (1, 2, 2 * 10, 2 * 9, 2 * 10**2))
    two = measured_step(MODELS["encoder-decoder"], batch, 0.5)
    assert two.work[-1] == 2 * (3 * 3 + 16 * 16 + 3 * 16)


def test_the_bound_holds_for_every_mix_of_costs_and_is_reached_by_one() -> None:
    """The most a declared arm gains on any device whose step time is a nonnegative mix of
    its work: no mix of costs beats it, and the mix of the one item it comes from reaches it."""
    rng = random.Random(0)

    def steps(count: int) -> list[Step]:  # one step each, rows, positions, frames, pairs
        def work() -> tuple[int, ...]:
            return (1, *(rng.randint(1, 100) * k for k in (8, 1000, 900, 10**5)))

        return [Step(0.0, rng.randint(500, 900), work()) for _ in range(count)]

    arms = {"frames": steps(30), "text+frames": steps(20)}
    (line,) = bound("prefix", arms)
    most = line["most_on_any_device"]

    def gain(costs: tuple[float, ...]) -> float:  # positions per second, declared over today
        def rate(arm: list[Step]) -> float:
            seconds = sum(c * w for s in arm for c, w in zip(costs, s.work, strict=True))
            return sum(s.positions for s in arm) / seconds

        return rate(arms["text+frames"]) / rate(arms["frames"])

    assert all(gain(tuple(rng.random() for _ in WORK)) <= most + 1e-3 for _ in range(2000))
    item = max(line["today_work_over_declared"], key=line["today_work_over_declared"].get)
    alone = tuple(float(name == item) for name in WORK)
    assert math.isclose(gain(alone), most, abs_tol=1e-3)
