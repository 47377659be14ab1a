"""The reference model honours the contract; LR schedule and EMA behave."""

from __future__ import annotations

import math

import pytest
import torch

from train.config.tables import OptimConfig
from train.model import TextToMel
from train.optim.optimizer import EMA, WarmupCosine, build_optimizer

N_MELS = 20


def make_batch(lengths: list[int], text_lengths: list[int], pad_to: int | None = None) -> dict:
    """Random utterances padded with garbage (NaN/inf), which must never matter."""
    gen = torch.Generator().manual_seed(sum(lengths))
    T, L = pad_to or max(lengths), max(text_lengths)
    mel = torch.full((len(lengths), T, N_MELS), float("nan"), dtype=torch.float16)
    text = torch.zeros(len(lengths), L, dtype=torch.int64)
    for i, (n, m) in enumerate(zip(lengths, text_lengths, strict=True)):
        mel[i, :n] = torch.randn(n, N_MELS, generator=gen).half() - 5
        mel[i, n:] = float("inf") if i % 2 else float("nan")
        text[i, :m] = torch.randint(1, 257, (m,), generator=gen)
    return {
        "mel": mel,
        "mel_lengths": torch.tensor(lengths),
        "text": text,
        "text_lengths": torch.tensor(text_lengths),
    }


def tiny_model(**kw) -> TextToMel:
    torch.manual_seed(0)
    return TextToMel(n_mels=N_MELS, dim=32, layers=2, heads=2, **kw)


def test_every_parameter_gets_a_gradient() -> None:
    """DDP runs with find_unused_parameters=False: an unused parameter would hang it."""
    model = tiny_model()
    out = model(**make_batch([7, 12], [3, 5]))
    out["loss_sum"].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_loss_is_a_sum_over_valid_frames_and_ignores_padding() -> None:
    model = tiny_model(dropout=0.0, prenet_dropout=0.0).eval()
    a = make_batch([9], [4])
    b = make_batch([5], [6])
    alone = model(**a)["loss_sum"] + model(**b)["loss_sum"]
    # Same two utterances in one batch, padded further, with NaN/inf in the padding.
    both = make_batch([9, 5], [4, 6], pad_to=16)
    both["mel"][0, :9], both["text"][0, :4] = a["mel"][0], a["text"][0]
    both["mel"][1, :5], both["text"][1, :6] = b["mel"][0], b["text"][0]
    together = model(**both)
    assert torch.isfinite(together["loss_sum"])
    torch.testing.assert_close(together["loss_sum"], alone, rtol=1e-5, atol=1e-5)
    assert set(together) >= {"loss_sum", "mel_loss_sum", "stop_loss_sum"}


def test_prefix_mask_is_causal_over_mel() -> None:
    """Changing frame t must not change predictions for frames ≤ t (teacher forcing)."""
    model = tiny_model(dropout=0.0, prenet_dropout=0.0).eval()
    batch = make_batch([10], [4])
    mel_in = torch.randn(1, 10, N_MELS)
    h1 = model._decode(mel_in, batch["text"], batch["text_lengths"], batch["mel_lengths"])
    mel_in[0, 6] += 1.0
    h2 = model._decode(mel_in, batch["text"], batch["text_lengths"], batch["mel_lengths"])
    torch.testing.assert_close(h1[0, :6], h2[0, :6])
    assert not torch.allclose(h1[0, 6:], h2[0, 6:])


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    batch = make_batch([7, 12], [3, 5])
    grads = []
    for enabled in (False, True):
        model = tiny_model()
        model.set_activation_checkpointing(enabled)
        torch.manual_seed(1)  # same dropout masks; checkpoint replays the RNG state
        model(**batch)["loss_sum"].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g0, g1)


def test_generate_stops_and_denormalises() -> None:
    model = tiny_model()
    model.set_mel_stats(torch.full((N_MELS,), -5.0), torch.full((N_MELS,), 2.0))
    mel = model.generate(torch.tensor([72, 105]), max_frames=5)
    assert mel.shape[1] == N_MELS and 1 <= mel.shape[0] <= 5
    assert model.training  # restored


def test_warmup_then_cosine_to_min_lr() -> None:
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)
    f = WarmupCosine(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(110) == pytest.approx(0.1) and f(10_000) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 200))


def test_no_weight_decay_on_biases_and_norms() -> None:
    model = tiny_model()
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"])
    assert all(p.dim() < 2 for p in plain["params"])


def test_ema_tracks_weights_and_round_trips() -> None:
    model = torch.nn.Linear(3, 1)
    ema = EMA(model, decay=0.5)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update()  # warm-up decay min(0.5, 2/11) = 0.1818…
    decay = 2 / 11
    expected = decay * (model.weight - 1.0) + (1 - decay) * model.weight
    torch.testing.assert_close(ema.shadow[0], expected.detach())
    other = EMA(model, decay=0.5)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 1 and torch.equal(other.shadow[0], ema.shadow[0])
    assert math.isclose(ema.decay, 0.5)
