"""ChatTTS's DVAE (``chattts`` 0.2.5: its mel encoder, grouped residual FSQ and decoder) trained
as a mel autoencoder on a melcache cache: ``[model] impl = "examples.chattts_dvae.adapter:DVAE"``
(``pip install 'melcache[chattts]'``).

What the adapter bridges (``train/model/contract.py`` for the keys):

- ChatTTS's ``DVAE.forward`` runs under ``torch.inference_mode``; the adapter runs its parts
  (``downsample_conv`` → ``encoder`` → ``vq_layer.quantizer`` → ``decoder`` → ``out_conv``) with
  gradients, the FSQ passing them straight through.
- Its mel is the ``"chattts"`` preset (every feature key checked at start); it computes in
  float32; the encoder halves the frame rate, so the padded length must be even (``[data]
  pad_multiple`` ≥ 2, 8 by default).
- ChatTTS divides the log-mel by a per-channel ``coef`` learnt with the released weights; from
  random init the adapter sets it to the cache's per-channel std (``set_mel_stats``).
- vector_quantize_pytorch's ``GroupedResidualFSQ.forward`` all-reduces a quantize-dropout seed
  in every training forward (and reads it on the host), even with that dropout off: the trainer
  refuses it at start, naming ``dvae.vq_layer.quantizer`` (``train/model/guards.py``). The adapter
  calls its residual FSQ groups itself, with the (unused) seed given, so no collective runs.

``encoder`` is the factory for ``python -m preprocess derive CACHE --field codes --encoder
examples.chattts_dvae.adapter:encoder --checkpoint RUN_OR_FILE`` (docs/fields.md): the DVAE's
encoder, mel ``[B, T, 100]`` → codes ``[B, T / 2, 4]``, the grouped residual FSQ's indices
(G = 2, R = 2, levels (5, 5, 5, 5): values 0..624) in ChatTTS's order (group-major, as
``GFSQ.forward`` lays them out): the audio tokens ChatTTS's GPT reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from ChatTTS.model.dvae import DVAE as ChatTTSDVAE
from torch import nn

from examples.chattts import asset
from melcache.errors import UserError
from melcache.features import feature_presets
from melcache.fields.format import FieldEncoder

# What the released ChatTTS DVAE.safetensors holds: ChatTTS/config/config.py's sizes, the
# adapter's defaults. The encoder needs these parts of it; the decoder is left out.
_ENCODER_PARTS = ("coef", "downsample_conv.", "encoder.", "vq_layer.")


class DVAE(nn.Module):
    """ChatTTS's DVAE at ChatTTS's sizes (``ChatTTS/config/config.py``) unless args say less."""

    melcache_contract: ClassVar[dict] = {
        "mel_dtype": "float32",
        "features": "chattts",
        "home": "examples.chattts.home:write",  # python -m train export: ChatTTS's asset/
    }

    def __init__(
        self,
        *,
        n_mels: int,
        dim: int = 512,
        hidden: int = 256,
        layers: int = 12,
        bn_dim: int = 128,
        vq_dim: int = 1024,
        release: str | None = None,
    ) -> None:
        super().__init__()
        self.dvae = ChatTTSDVAE(
            decoder_config={
                "idim": vq_dim // 2, "odim": dim, "hidden": hidden, "n_layer": layers, "bn_dim": bn_dim,
            },
            encoder_config={
                "idim": dim, "odim": vq_dim, "hidden": hidden, "n_layer": layers, "bn_dim": bn_dim,
            },
            vq_config={"dim": vq_dim, "levels": (5, 5, 5, 5), "G": 2, "R": 2},
            dim=dim,
        )  # fmt: skip
        with torch.no_grad():
            self.dvae.coef.fill_(1.0)
        self.from_release = release is not None
        if release is not None:
            folder = asset.asset_folder(release)
            asset.load_strict(
                self.dvae, asset.read_tensors(folder / asset.DVAE), folder / asset.DVAE
            )

    def set_mel_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """ChatTTS's per-channel divisor, from the cache's statistics instead of its weights
        (a run from a release keeps the release's, which its encoder was trained with)."""
        if not self.from_release:
            self.dvae.coef.copy_(std.clamp_min(1e-3).view_as(self.dvae.coef))

    def forward(self, mel, mel_lengths, text, text_lengths) -> dict[str, torch.Tensor]:
        """L1 reconstruction of the log-mel, summed over valid frames (mean over channels)."""
        x = mel.transpose(1, 2)  # [B, n_mels, T]
        pred = self._reconstruct(x)
        valid = torch.arange(x.shape[2], device=x.device) < mel_lengths[:, None]
        err = (pred - x).abs().mean(1)  # [B, T]
        return {"loss_sum": torch.where(valid, err, 0.0).sum()}

    def predict_mel(self, batch) -> torch.Tensor:
        """The reconstruction ``[B, T, n_mels]`` (the trainer's validation picture)."""
        return self._reconstruct(batch.mel.transpose(1, 2)).transpose(1, 2)

    def _reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        """Encode, quantize and decode ``x`` ``[B, n_mels, T]`` (T even)."""
        coef = self.dvae.coef
        h = self.dvae.encoder(self.dvae.downsample_conv(x / coef))  # [B, vq_dim, T / 2]
        quantized = self._quantize(h.transpose(1, 2))  # [B, T / 2, vq_dim]
        B, half, vq_dim = quantized.shape
        # ChatTTS's layout: each half of a code vector is one of two consecutive frames.
        feats = quantized.transpose(1, 2).reshape(B, 2, vq_dim // 2, half)
        feats = feats.permute(0, 2, 3, 1).flatten(2)  # [B, vq_dim / 2, T]
        return self.dvae.out_conv(self.dvae.decoder(x=feats)) * coef

    def _quantize(self, h: torch.Tensor) -> torch.Tensor:
        """``GroupedResidualFSQ`` without its forward's seed all-reduce (quantize dropout is off
        in ChatTTS's config, so the seed is never used)."""
        grouped = self.dvae.vq_layer.quantizer
        chunks = h.chunk(grouped.groups, dim=grouped.split_dim)
        parts = [
            rvq(c, rand_quantize_dropout_fixed_seed=0)[0]
            for rvq, c in zip(grouped.rvqs, chunks, strict=True)
        ]
        return torch.cat(parts, dim=grouped.split_dim)


class Codes(nn.Module):
    """ChatTTS's DVAE encoder as ``derive`` runs it: mel ``[B, T, 100]`` (T even) → int64
    codes ``[B, T / 2, 4]``."""

    def __init__(self, dvae: ChatTTSDVAE) -> None:
        super().__init__()
        self.dvae = dvae

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = mel.transpose(1, 2).float() / self.dvae.coef
        h = self.dvae.encoder(self.dvae.downsample_conv(x)).transpose(1, 2)  # [B, T / 2, vq]
        grouped = self.dvae.vq_layer.quantizer
        chunks = h.float().chunk(grouped.groups, dim=grouped.split_dim)
        # rvq → (quantized, indices [B, T / 2, R]); stacked as GFSQ.forward does: [B, T/2, G, R]
        indices = [
            rvq(c, rand_quantize_dropout_fixed_seed=0)[1]
            for rvq, c in zip(grouped.rvqs, chunks, strict=True)
        ]
        return torch.stack(indices, dim=2).flatten(2).long()


def encoder(checkpoint: str | None = None, device: str = "cpu", **kwargs: Any) -> FieldEncoder:
    """The DVAE encoder for ``derive``, from ``checkpoint``: a trainer run folder of this
    adapter (its newest complete checkpoint: its ``[model.args]`` and weights) or a weights
    file (``.safetensors``, ChatTTS's released ``DVAE.safetensors`` included, or a ``.pt``
    state dict), at the sizes ``kwargs`` give (ChatTTS's own by default). Read with
    safetensors or ``torch.load(weights_only=True)``: never unpickled."""
    if checkpoint is None:
        raise UserError("--encoder examples.chattts_dvae.adapter:encoder needs --checkpoint")
    path = Path(checkpoint)
    if path.is_dir():
        weights, args, state = _from_run(path)
    else:
        weights, state = path, _weights_file(path)
        args = {**dvae_sizes(state), **kwargs}
    model = DVAE(n_mels=100, **args).dvae
    state = {k.removeprefix("dvae."): v for k, v in state.items()}
    missing = [k for k in model.state_dict() if k.startswith(_ENCODER_PARTS) and k not in state]
    unknown = [k for k in state if k not in model.state_dict()]
    if missing or unknown:
        raise UserError(
            f"{weights}: not weights of a ChatTTS DVAE with args {args} (missing "
            f"{missing[:2]}, unexpected {unknown[:2]}): pass the run's sizes"
        )
    model.load_state_dict(state, strict=False)
    chattts = feature_presets()["chattts"].to_dict()
    return FieldEncoder(
        module=Codes(model).eval().to(device),
        config={"impl": "chattts DVAE encoder", "levels": [5, 5, 5, 5], "G": 2, "R": 2, **args},
        dtype="int16",
        shape=(4,),
        frame_rate=0.5,
        mel_multiple=2,
        weights=weights,
        features=chattts,
        bf16=False,  # FSQ rounds each value to one of 5 levels: bf16 would move indices
    )


def _from_run(run: Path) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """The newest complete checkpoint of a run folder, DDP or FSDP2 (``train/export.py``):
    the file that names it, its ``[model.args]`` and its weights."""
    from train.export import read_run

    read = read_run(run)
    if read.impl != "examples.chattts_dvae.adapter:DVAE":
        raise UserError(
            f"{read.checkpoint}: a run of {read.impl}, not examples.chattts_dvae.adapter:DVAE"
        )
    args = {k: v for k, v in read.config["model"]["args"].items() if k != "release"}
    # shared.pt names the checkpoint in the field's provenance (FSDP2's shards sit beside it)
    return read.checkpoint / "shared.pt", args, read.weights


def dvae_sizes(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """A weights file's DVAE sizes, read off its tensors (ChatTTS's own where one is absent):
    ``dim`` → ``downsample_conv``, ``bn_dim`` and ``hidden`` → the encoder's ``conv_in``,
    ``vq_dim`` → its ``conv_out``, ``layers`` → its blocks."""
    state = {k.removeprefix("dvae."): v for k, v in state.items()}
    shapes = {
        "dim": ("downsample_conv.0.weight", 0),
        "bn_dim": ("encoder.conv_in.0.weight", 0),
        "hidden": ("encoder.conv_in.2.weight", 0),
        "vq_dim": ("encoder.conv_out.weight", 0),
    }
    sizes = {k: int(state[key].shape[axis]) for k, (key, axis) in shapes.items() if key in state}
    blocks = {k.split(".")[2] for k in state if k.startswith("encoder.decoder_block.")}
    return {**sizes, **({"layers": len(blocks)} if blocks else {})}


def _weights_file(path: Path) -> dict[str, torch.Tensor]:
    """A weights file's tensors: safetensors (ChatTTS's own), else a ``weights_only`` state
    dict; one line, whatever a damaged or foreign file raises."""
    if path.suffix == ".safetensors":
        return asset.read_tensors(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UserError(
            f"{path}: not a readable weights file ({type(exc).__name__}: {exc})"
        ) from None
