"""An exported ChatTTS folder (``python -m train export``, ``examples/chattts/home.py``) in
ChatTTS's own ``Chat``, through its public ``load``, and speech from it.

``Chat.load(source="custom")`` checks every file against the sha256 of ChatTTS's release and
refuses anything else; its map is an instance attribute (``chat.sha256_map``) read before the
check, so :func:`load_chat` sets it to the folder's own hashes. Embed, DVAE and Decoder sizes
come from ChatTTS's hard-coded ``Config``: :func:`load_chat` sets them from ``chattts.json``.
Never point ``source="local"`` at an export: it renames mismatching files to ``.bak`` and
downloads the release over them.

    python -m examples.chattts.chat OUT --text "Hello." --wav OUT/sample.wav
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

from examples.chattts import asset
from melcache.errors import UserError

SAMPLE_RATE = 24_000  # ChatTTS's Vocos


def load_chat(folder: str | Path, device: str | None = None) -> Any:
    """ChatTTS's ``Chat`` holding the export in ``folder`` (the folder with ``asset/`` and
    ``chattts.json``), on ``device`` (ChatTTS's own choice, CUDA where there is one, by
    default)."""
    import ChatTTS
    import torch

    folder = Path(folder)
    sizes = read_sizes(folder)
    chat = ChatTTS.Chat(logging.getLogger("chattts"))
    # Config's fields default to instances shared by every Config (dataclass defaults, not
    # factories): set sizes on a copy, or every later Chat of this process would get them.
    chat.config = copy.deepcopy(chat.config)
    _set_sizes(chat.config, sizes)
    chat.sha256_map = asset.sha256_map(folder)
    loaded = chat.load(
        source="custom",
        custom_path=str(folder),
        device=None if device is None else torch.device(device),
    )
    if not loaded:
        raise UserError(f"{folder}: ChatTTS's Chat.load refused it (its log above says why)")
    return chat


def read_sizes(folder: str | Path) -> dict[str, Any]:
    """``chattts.json``: the sizes ``Chat``'s config needs and the inference settings."""
    path = Path(folder) / asset.SIZES
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not an export's sizes file ({exc})") from None


def speak(
    chat: Any, text: str, infer: dict[str, Any], *, seed: int = 0, max_frames: int = 400
) -> np.ndarray:
    """``text`` spoken by ``chat.infer`` with the inference settings ``infer`` (an export's
    ``chattts.json`` ``"infer"``): float32 samples at 24 kHz, sampled from ``seed``."""
    import ChatTTS

    params = ChatTTS.Chat.InferCodeParams(
        prompt=infer["prompt"],
        manual_seed=seed,
        max_new_token=max_frames,
        min_new_token=8,  # an undertrained GPT may end at once; say at least a few frames
        show_tqdm=False,
    )
    wavs = chat.infer(
        [text],
        skip_refine_text=infer["skip_refine_text"],
        use_decoder=infer["use_decoder"],
        do_text_normalization=infer["do_text_normalization"],
        do_homophone_replacement=infer["do_homophone_replacement"],
        split_text=False,  # one text, one wav: no reference pass of ChatTTS's own
        params_infer_code=params,
    )
    return np.asarray(wavs[0], dtype=np.float32)


def _set_sizes(config: Any, sizes: dict[str, Any]) -> None:
    """Set ChatTTS's ``Config`` (an instance's) to an export's sizes."""
    gpt = sizes["gpt"]
    for key, value in gpt.items():
        setattr(config.gpt, key, value)
    for key in ("hidden_size", "num_audio_tokens", "num_text_tokens", "num_vq"):
        setattr(config.embed, key, gpt[key])
    for part in ("encoder", "decoder", "vq"):
        for key, value in sizes["dvae"][part].items():
            setattr(getattr(config.dvae, part), key, value)
    for key, value in sizes["decoder"].items():
        setattr(config.decoder, key, value)


def main(argv: list[str] | None = None) -> int:
    """Speak a text with an exported folder into a wav."""
    import soundfile

    p = argparse.ArgumentParser(
        prog="python -m examples.chattts.chat",
        description="Load an export (python -m train export) into ChatTTS's own Chat and write "
        "a text spoken by Chat.infer, with the inference settings the training implies.",
    )
    p.add_argument("folder", type=Path, help="the export: the folder holding asset/")
    p.add_argument("--text", required=True, help="what to say")
    p.add_argument("--wav", type=Path, required=True, help="wav file to write (24 kHz)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", help="torch device (default: ChatTTS's choice)")
    args = p.parse_args(argv)
    try:
        chat = load_chat(args.folder, args.device)
        wav = speak(chat, args.text, read_sizes(args.folder)["infer"], seed=args.seed)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if wav.size == 0 or not np.isfinite(wav).all():
        print(f"error: Chat.infer gave {wav.size} samples, finite: {np.isfinite(wav).all()}")
        return 1
    args.wav.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(args.wav, wav, SAMPLE_RATE)
    print(f"{args.wav}: {wav.size / SAMPLE_RATE:.2f} s spoken by ChatTTS's Chat from {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
