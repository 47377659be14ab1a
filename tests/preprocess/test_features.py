"""Cached mels equal the upstream extractors' output on the same resampled audio."""

from __future__ import annotations

import io
import json
from pathlib import Path

import librosa
import numpy as np
import pytest
import soundfile as sf
import soxr
import torch
import torchaudio

from melcache.features import FeatureConfig
from melcache.format import INDEX_NAME
from melcache.tar.reader import group_samples, iter_members
from preprocess.config import load_config
from preprocess.inputs.audio import _INTEGER_READS, read_float32
from tests.support.helpers import REPO, SAMPLE_CORPUS, run_preprocess


def resampled(path: Path, rate: int) -> torch.Tensor:
    """The corpus file as mono float32 at ``rate``, decoded and resampled independently."""
    audio, source_rate = sf.read(path, dtype="float32", always_2d=True)
    return torch.from_numpy(soxr.resample(audio.mean(axis=1), source_rate, rate, quality="HQ"))


def chattts_reference(audio: torch.Tensor) -> np.ndarray:
    """ChatTTS dvae.py MelSpectrogramFeatures / F5-TTS get_vocos_mel_spectrogram."""
    mel = torchaudio.transforms.MelSpectrogram(
        sample_rate=24000,
        n_fft=1024,
        win_length=1024,
        hop_length=256,
        n_mels=100,
        power=1,
        center=True,
    )(audio)
    return torch.log(torch.clamp(mel, min=1e-5)).T.numpy()


def hifigan_reference(audio: torch.Tensor) -> np.ndarray:
    """jik876/hifi-gan meldataset.py mel_spectrogram (librosa Slaney filters, manual padding)."""
    basis = torch.from_numpy(
        librosa.filters.mel(sr=22050, n_fft=1024, n_mels=80, fmin=0, fmax=8000)
    ).float()
    padded = torch.nn.functional.pad(audio[None, None], (384, 384), mode="reflect")[0, 0]
    spec = torch.stft(
        padded, 1024, 256, 1024, torch.hann_window(1024), center=False, return_complex=True
    )
    magnitude = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    return torch.log(torch.clamp(basis @ magnitude, min=1e-5)).T.numpy()


def cached_mels(cache: Path) -> dict[str, tuple[str, np.ndarray]]:
    out = {}
    for shard in json.loads((cache / INDEX_NAME).read_text())["shards"]:
        with open(cache / shard["name"], "rb") as stream:
            for sample in group_samples(iter_members(stream, shard["name"]), shard["name"]):
                source = json.loads(sample["json"])["source"]
                out[source] = np.load(io.BytesIO(sample["mel.npy"]), allow_pickle=False)
    return out


def assert_fp16_close(cached: np.ndarray, reference: np.ndarray) -> None:
    assert cached.dtype == np.float16 and cached.shape == reference.shape
    # fp16 keeps 11 significant bits: half an ulp is |x| * 2^-11; allow a little float noise.
    error = np.abs(cached.astype(np.float32) - reference)
    assert (error <= np.abs(reference) * 2.0**-10 + 1e-3).all(), float(error.max())


@pytest.mark.parametrize(
    ("preset", "reference"), [("chattts", chattts_reference), ("hifigan", hifigan_reference)]
)
@pytest.mark.slow  # builds in a subprocess
def test_cached_mel_matches_upstream(tmp_path: Path, preset: str, reference) -> None:
    src = tmp_path / "src"
    src.mkdir()
    files = [
        SAMPLE_CORPUS / "en_f1" / "en_f1_11.wav",
        SAMPLE_CORPUS / "en_m3" / "en_m3_04.wav",
        SAMPLE_CORPUS / "zh" / "zh_03.flac",
    ]
    for f in files:  # float32, stereo, and a FLAC: the awkward ones
        (src / f.name).write_bytes(f.read_bytes())
        (src / f.with_suffix(".txt").name).write_bytes(f.with_suffix(".txt").read_bytes())
    config = REPO / "configs" / f"{preset}.toml"
    run_preprocess(
        "build",
        "--src",
        str(src),
        "--out",
        str(tmp_path / "out"),
        "--config",
        str(config),
        "--workers",
        "1",
    )
    features, _ = load_config(config)
    mels = cached_mels(tmp_path / "out")
    assert sorted(mels) == sorted(f.name for f in files)
    for f in files:
        assert_fp16_close(mels[f.name], reference(resampled(f, features.sample_rate)))


def test_presets_match_upstream_parameters() -> None:
    chattts, _ = load_config(REPO / "configs" / "chattts.toml")
    assert chattts == FeatureConfig()  # the defaults are the ChatTTS/vocos mel
    assert chattts.num_frames(24000) == 94
    hifigan, _ = load_config(REPO / "configs" / "hifigan.toml")
    assert (hifigan.sample_rate, hifigan.n_mels, hifigan.f_max, hifigan.center) == (
        22050,
        80,
        8000.0,
        False,
    )
    assert hifigan.num_frames(22050) == 22050 // 256


@pytest.mark.parametrize(
    ("container", "subtype", "fast"),
    [
        ("WAV", "PCM_16", True),
        ("FLAC", "PCM_16", True),
        ("WAV", "PCM_24", True),
        ("FLAC", "PCM_24", True),
        ("WAV", "PCM_32", True),
        ("AIFF", "PCM_16", True),
        ("WAV", "PCM_U8", False),
        ("WAV", "FLOAT", False),
    ],
)
def test_fast_decode_equals_libsndfile_float(
    tmp_path: Path, container: str, subtype: str, fast: bool
) -> None:
    """Integer PCM is read as integers and scaled by melcache: libsndfile's float32, bit for bit."""
    signal = np.random.default_rng(7).uniform(-1.0, 1.0, (4000, 2))
    signal[:2] = [[-1.0, 1.0], [1.0, -1.0]]  # full scale both ways
    path = tmp_path / f"clip.{container.lower()}"
    sf.write(path, signal, 16000, format=container, subtype=subtype)
    assert (sf.info(path).subtype in _INTEGER_READS) == fast  # the path under test is taken
    decoded, rate = read_float32(str(path))
    expected, _ = sf.read(path, dtype="float32", always_2d=True)
    assert rate == 16000 and decoded.dtype == np.float32
    np.testing.assert_array_equal(decoded, expected)
