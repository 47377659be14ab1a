"""ChatTTS's GPT (``examples/chattts_gpt``, issue #38) with the real chattts and transformers
packages, from random init: the sequence it trains on is ChatTTS's (text, then code frames,
then the end of audio), each frame predicted from what comes before it only, and its text goes
through ChatTTS's own tokenizer class (here one trained on the cache's texts)."""

from __future__ import annotations

import itertools
import json
import math
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import torch

from tests.support.helpers import REPO, checkpoint, dcp_weights, load, metrics, run_ok, torchrun

# pytest.importorskip itself, not helpers.needs_extra: ruff lets only it precede imports (E402)
pytest.importorskip("ChatTTS", reason="needs the 'chattts' extra: pip install -e '.[chattts]'")
pytest.importorskip("transformers", reason="needs the 'chattts' extra: pip install -e '.[chattts]'")

from examples.chattts_gpt.adapter import GPT
from melcache.errors import UserError
from train.config.tables import load_config
from train.memory.probes import MemoryCap, tensor_bytes
from train.parallel.env import Env
from train.trainer import Trainer
from train.tune import WorstBatch, trainer_tensors

CPU = Env(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
CONFIG = REPO / "examples" / "chattts_gpt" / "config.toml"
SPEC = "examples.chattts_gpt.tokenizer:ChatTTSTokenizer"
TINY = {"hidden": 32, "layers": 2, "heads": 2, "intermediate": 64}


def batch(codes: torch.Tensor, n_codes: list[int], text: torch.Tensor, n_text: list[int]):
    """What the loader hands a fields-only model: text, and the codes with their lengths."""
    return types.SimpleNamespace(
        fields={"codes": codes}, field_lengths={"codes": torch.tensor(n_codes)},
        text=text, text_lengths=torch.tensor(n_text),
    )  # fmt: skip


def predictions(model: GPT, b: types.SimpleNamespace) -> torch.Tensor:
    """Each row's logits for frames 0 .. T (the end of audio last) ``[B, T + 1, num_vq,
    num_audio_tokens]``, NaN where a frame is not counted, from the adapter's own predicting
    positions."""
    codes, n_codes = b.fields["codes"], b.field_lengths["codes"]
    hidden = model._decode(b.text, b.text_lengths, codes, n_codes)
    _, valid, before = model._targets(codes, n_codes, b.text_lengths, hidden.shape[1])
    h = hidden.gather(1, before[..., None].expand(-1, -1, hidden.shape[-1]))
    logits = torch.stack([head(h) for head in model.embed.head_code], 2)
    return torch.where(valid[..., None, None], logits, float("nan"))


def test_each_frame_is_predicted_from_the_text_and_the_frames_before_it_only() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=257, **TINY).eval()
    codes = torch.randint(0, 625, (2, 12, 4))
    text = torch.randint(1, 257, (2, 6))
    with torch.no_grad():
        base = predictions(model, batch(codes, [12, 7], text, [6, 3]))
        assert base[1, 8:].isnan().all() and not base[1, :8].isnan().any()  # 7 frames + end
        changed = codes.clone()
        changed[:, 5:] = (changed[:, 5:] + 1) % 625  # frames 5 on, of both rows
        after = predictions(model, batch(changed, [12, 7], text, [6, 3]))
        torch.testing.assert_close(after[:, :6], base[:, :6])  # frame 5 from frames 0..4
        assert not torch.allclose(after[0, 6:], base[0, 6:])
        other = text.clone()
        other[1, 2] = other[1, 2] % 256 + 1
        assert not torch.allclose(
            predictions(model, batch(codes, [12, 7], other, [6, 3]))[1, 0], base[1, 0]
        )
        # padding past a row's text changes nothing
        longer = torch.cat([text, torch.zeros(2, 4, dtype=text.dtype)], 1)
        again = predictions(model, batch(codes, [12, 7], longer, [6, 3]))
        torch.testing.assert_close(again, base, equal_nan=True)


def test_the_loss_counts_every_frame_and_the_end_and_falls_from_chattts_s_level() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=257, **TINY)
    codes = torch.randint(0, 625, (3, 20, 4))
    b = batch(codes, [20, 9, 4], torch.randint(1, 257, (3, 8)), [8, 2, 0])
    out = model(b)
    # (20 + 1) + (9 + 1) + 4: a row without text has nothing to predict its first frame from
    assert int(out["loss_count"]) == 35
    first = (out["loss_sum"] / out["loss_count"]).item()
    assert abs(first - 4 * torch.log(torch.tensor(626.0))) < 2  # 4 codebooks, near uniform
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(25):
        out = model(b)
        optimizer.zero_grad()
        (out["loss_sum"] / out["loss_count"]).backward()
        optimizer.step()
    assert (out["loss_sum"] / out["loss_count"]).item() < 0.7 * first


def test_chattts_s_tokenizer_class_frames_the_text_as_chattts_does(tmp_path: Path) -> None:
    """A real BertTokenizerFast folder with ChatTTS's special tokens (its released vocabulary
    cannot be downloaded here), given as ``[data] vocab`` through the trainer's builder."""
    from transformers import BertTokenizerFast

    from train.model.tokenizers import build_tokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]
    bert = BertTokenizerFast(vocab={word: i for i, word in enumerate(words)})
    bert.add_special_tokens({"additional_special_tokens": ["[Stts]", "[empty_spk]", "[Ptts]"]})
    folder = tmp_path / "asset" / "tokenizer"
    bert.save_pretrained(str(folder))
    tokenizer = build_tokenizer(SPEC, str(folder))
    assert tokenizer.vocab_size == 10
    assert list(tokenizer("hello world")) == [
        7,
        8,
        5,
        6,
        9,
    ]  # [Stts] [empty_spk] hello world [Ptts]
    with pytest.raises(UserError, match=r"missing/tokenizer\.json not found .*\[data\] vocab"):
        build_tokenizer(SPEC, str(tmp_path / "missing"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_chattts_s_gpt_trains_on_two_ranks_from_the_codes_and_resumes_bitwise(
    strategy: str, derived: Path, chattts_tokenizer: Path, tmp_path: Path
) -> None:
    """``torchrun --nproc-per-node 2 -m train --config examples/chattts_gpt/config.toml`` on a
    cache whose codes the DVAE example's encoder derived: the loss and the validation loss
    fall, and a run stopped halfway resumes to the same weights, bit for bit."""

    def train(out: Path, steps: int) -> None:
        run_ok(
            torchrun(
                "-m", "train", "--shards", str(derived), "--config", str(CONFIG), "--out",
                str(out), "--max-steps", str(steps), "train.checkpoint.every=10",
                f"train.parallel.strategy={strategy}", f"data.val_shards={derived}",
                "train.validation.every=10", f"data.vocab={json.dumps(str(chattts_tokenizer))}",
            ),
            timeout=600,
        )  # fmt: skip

    train(tmp_path / "whole", 20)
    losses = [r["loss"] for r in metrics(tmp_path / "whole") if "loss" in r]
    print(f"{strategy}: loss per window {losses}")
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
    validated = [(r["step"], r["val_loss"]) for r in metrics(tmp_path / "whole") if "val_loss" in r]
    assert [step for step, _ in validated] == [10, 20] and validated[1][1] < validated[0][1]
    train(tmp_path / "split", 10)
    train(tmp_path / "split", 20)
    whole, split = (model_weights(tmp_path / name, 20) for name in ("whole", "split"))
    assert whole.keys() == split.keys() and len(whole) > 10
    for key, value in whole.items():
        assert torch.equal(value, split[key]), key


def model_weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    """The model's weights at checkpoint ``step``: DDP's full state, or FSDP2's DCP shards."""
    if (checkpoint(out, step) / "shared.pt").is_file() and "model" in load(checkpoint(out, step)):
        return load(checkpoint(out, step))["model"]
    return {k: v for k, v in dcp_weights(out, step).items() if k.startswith("model.")}


def step_peak(model: GPT, b: Any) -> int:
    """Bytes of the tensors a forward and backward on ``b`` hold at their peak, beyond what
    was live before."""
    cap = MemoryCap(math.inf)
    with cap:
        model(b)["loss_sum"].backward()
    model.zero_grad(set_to_none=True)
    return cap.peak


def test_the_tunes_worst_batch_is_padded_as_the_batches_it_bounds_are() -> None:
    """``transformers``' Llama drops its attention mask where no row is padded, and the causal
    kernel then holds no ``S × S`` weights: a worst batch without padding peaks below real
    batches of shorter rows, and budgets tuned on it ran 14 % over their target on #52's
    50 h cache. ``train tune``'s worst batch is padded: a real batch, its rows no longer than
    the worst batch's, peaks no higher."""
    torch.manual_seed(0)
    model = GPT(vocab_size=257, hidden=32, layers=2, heads=8, intermediate=64)
    frames, tokens, size = 200, 20, 6
    worst = WorstBatch(0, frames, tokens, 8, 0, fields={"codes": (frames, (4,), "int16")})
    codes, text = torch.zeros(size, frames, 4, dtype=torch.long), torch.ones(size, 24).long()
    real = batch(codes, [200, 196, 190, 199, 185, 200], text, [20, 18, 20, 12, 19, 17])
    unpadded = batch(codes, [frames] * size, text, [tokens] * size)
    peaks = {name: step_peak(model, b) for name, b in
             (("worst", worst.batch(size)), ("real", real), ("unpadded", unpadded))}  # fmt: skip
    assert peaks["unpadded"] < peaks["real"] <= peaks["worst"], peaks


@pytest.mark.slow
def test_train_tune_sizes_a_model_of_codes_alone_in_code_frames_and_training_stays_under_it(
    derived: Path, chattts_tokenizer: Path, tmp_path: Path
) -> None:
    """``train tune`` builds its worst batches from the field shards' longest code frames, and
    training on its budgets, where memory and not the cap on rows binds, stays under its
    target (the sample's rows are too short for the unpadded worst batch of the test above
    to show here)."""
    out, limit_mib = tmp_path / "budgets.toml", 60
    overrides = [f"data.vocab={json.dumps(str(chattts_tokenizer))}", "data.max_batch_size=64"]
    command = [sys.executable, "-m", "train", "tune", "--shards", str(derived), "--config",
               str(CONFIG), "--output", str(out), "--memory-limit-mib", str(limit_mib), *overrides]  # fmt: skip
    run_ok(command, timeout=600)
    budgets = tomllib.loads(out.read_text())["data"]["batch_frames"]
    codes = json.loads((derived / "index.json").read_text())["fields"]["codes"]["shards"]
    longest = {
        s["bucket"]: max(c["max_frames"] for c in codes if c["bucket"] == s["bucket"])
        for s in codes
    }
    assert sorted(int(b) for b in budgets) == sorted(longest)
    for bucket, budget in budgets.items():  # at least one utterance of the bucket's longest
        assert budget >= longest[int(bucket)], (bucket, budget)
    mel = json.loads((derived / "index.json").read_text())["shards"]
    assert max(longest.values()) < max(s["max_frames"] for s in mel)  # codes: half the mel rate

    cfg = load_config([CONFIG, out], [*overrides, "data.num_workers=0"])
    trainer = Trainer(cfg, str(derived), tmp_path / "run", CPU)
    cap = MemoryCap(math.inf, tensor_bytes(trainer_tensors(trainer)))
    peaks, rows = {}, {}
    for batch in itertools.islice(iter(trainer.parts.loader), 24):
        cap.reset_peak()
        with cap:
            trainer.train_step([batch])
        peaks[batch.bucket] = max(peaks.get(batch.bucket, 0), cap.peak / 2**20)
        rows[batch.bucket] = max(rows.get(batch.bucket, 0), len(batch))
    trainer.close()
    print(f"budgets {budgets}; rows {rows}; peaks {peaks}")
    assert max(rows.values()) < 64  # memory binds, not the cap on rows
    assert max(peaks.values()) <= cfg.train.memory.target * limit_mib, peaks


@pytest.mark.slow
def test_chattts_pretrain_sh_runs_build_dvae_derive_and_gpt_and_resumes(tmp_path: Path) -> None:
    """The README's ChatTTS commands, as ``examples/chattts_pretrain.sh OUT`` chains them on the
    sample corpus; run again, every step resumes instead of redoing its work (the build, which
    ends with the same mel shards, keeps the field derive listed)."""
    script = [str(REPO / "examples" / "chattts_pretrain.sh"), str(tmp_path / "out")]
    run_ok(["bash", *script], timeout=900)
    out = tmp_path / "out"
    index = json.loads((out / "shards" / "index.json").read_text())
    assert (
        index["fields"]["codes"]["provenance"]["encoder"] == "examples.chattts_dvae.adapter:encoder"
    )
    assert [r["step"] for r in metrics(out / "gpt") if "loss" in r] == [5, 10, 15, 20]
    wav, rate = soundfile.read(out / "sample.wav", dtype="float32")  # spoken by ChatTTS's Chat
    assert rate == 24_000 and wav.size > 0 and np.isfinite(wav).all()
    assert (out / "asset" / "gpt" / "model.safetensors").is_file()
    again = run_ok(["bash", *script], timeout=900)
    assert again.stderr.count("resumed from") == 2, again.stderr[-3000:]  # the DVAE's and GPT's
    assert "field 'codes' is already derived with this provenance" in again.stderr
    assert f"{out}/sample.wav" in again.stdout  # it says what it made, and where
