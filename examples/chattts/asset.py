"""ChatTTS 0.2.5's ``asset/`` folder, the one its ``Chat`` loads, read and written strictly.

What ``Chat._load`` reads (``ChatTTS/config/config.py`` ``Path``), each load strict::

    asset/gpt/config.json, model.safetensors   a Hugging Face Llama (LlamaModel.from_pretrained;
                                               then embed_tokens is deleted: Embed embeds)
    asset/Embed.safetensors                    emb_code.{i}, emb_text, head_text, head_code.{i}
                                               (weight norm: parametrizations.weight.original0/1)
    asset/DVAE.safetensors                     coef, the mel front end, encoder, GFSQ, decoder
    asset/Decoder.safetensors                  the GPT's hidden states -> mel (use_decoder=True)
    asset/Vocos.safetensors                    mel -> waveform
    asset/tokenizer/                           a BertTokenizerFast; Chat.load also checks its
                                               special_tokens_map.json

Embed, DVAE and Decoder sizes come from ChatTTS's hard-coded ``Config``, not from the files:
an export writes the sizes it used into ``chattts.json`` beside ``asset/``, and
``examples/chattts/chat.py`` sets them on ``Chat.config`` before loading.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from melcache.errors import UserError

ASSET = "asset"
GPT, EMBED, DVAE, DECODER, VOCOS, TOKENIZER = (
    "gpt", "Embed.safetensors", "DVAE.safetensors", "Decoder.safetensors", "Vocos.safetensors",
    "tokenizer",
)  # fmt: skip
SIZES = "chattts.json"  # beside asset/: Chat's config sizes and the inference settings
# Every file Chat.load(source="custom") checks, by its key in ChatTTS/res/sha256_map.json.
CHECKED = {
    f"sha256_asset_{path.replace('/', '_').replace('.', '_')}": f"{ASSET}/{path}"
    for path in (
        DECODER, DVAE, EMBED, VOCOS, f"{GPT}/config.json", f"{GPT}/model.safetensors",
        f"{TOKENIZER}/special_tokens_map.json", f"{TOKENIZER}/tokenizer_config.json",
        f"{TOKENIZER}/tokenizer.json",
    )
}  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def asset_folder(path: str | Path) -> Path:
    """The ``asset/`` folder of a ChatTTS release: ``path`` itself or its ``asset/``."""
    path = Path(path)
    for folder in (path / ASSET, path):
        if (folder / EMBED).is_file():
            return folder
    raise UserError(f"{path}: not a ChatTTS release (no {EMBED} in it or in its {ASSET}/)")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; one line naming the file when it is missing or damaged."""
    if not path.is_file():
        raise UserError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{path}: not a readable safetensors file ({exc})") from None


def load_strict(
    module: nn.Module, tensors: Mapping[str, torch.Tensor], where: Path, unused: Iterable[str] = ()
) -> None:
    """Load ``tensors`` into ``module``, every tensor mapped: a missing or unexpected one, or a
    shape other than the module's (its ``[model.args]``), is one line naming it. ``unused``:
    tensors the file may hold that ChatTTS itself drops."""
    expected = module.state_dict()
    unused = set(unused)
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected and k not in unused]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise UserError(f"{where}: {what} (of {len(missing) or len(unexpected)}) for this model")
    for key, value in expected.items():
        if tensors[key].shape != value.shape:
            raise UserError(
                f"{where}: {key} is {list(tensors[key].shape)} in the file but "
                f"{list(value.shape)} with these [model.args]"
            )
    module.load_state_dict({k: tensors[k] for k in expected}, strict=True)


def check_llama_sizes(folder: Path, sizes: Mapping[str, int]) -> dict[str, Any]:
    """The release's ``gpt/config.json``, refused in one line where a size differs from
    ``sizes`` (Hugging Face config keys)."""
    path = folder / GPT / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not a readable config ({exc})") from None
    for key, value in sizes.items():
        if config.get(key, value) != value:
            raise UserError(f"{path}: {key} is {config[key]}, these [model.args] give {value}")
    return config


def decoder_sizes(hidden: int) -> dict[str, int]:
    """ChatTTS's ``Decoder`` (GPT hidden states, two frames per state, to mel) for a GPT of
    width ``hidden``: its released sizes at 768, a small one otherwise."""
    from ChatTTS.config.config import Decoder

    if hidden == 768:
        return asdict(Decoder())
    return {"idim": hidden // 2, "odim": hidden // 2, "hidden": hidden, "n_layer": 2, "bn_dim": 16}


def random_decoder(sizes: Mapping[str, int], coef: torch.Tensor) -> dict[str, torch.Tensor]:
    """ChatTTS's ``Decoder`` at random init, its mel scale ``coef`` the DVAE's."""
    from ChatTTS.model.dvae import DVAE as ChatTTSDVAE

    decoder = ChatTTSDVAE(decoder_config=dict(sizes), dim=sizes["idim"])
    with torch.no_grad():
        decoder.coef.copy_(coef.view_as(decoder.coef))
    return decoder.state_dict()


def random_vocos() -> dict[str, torch.Tensor]:
    """ChatTTS's ``Vocos`` (its config: 100 mels at 24 kHz) at random init."""
    from ChatTTS.config.config import Vocos as VocosConfig
    from vocos import Vocos
    from vocos.pretrained import instantiate_class

    config = asdict(VocosConfig())
    parts = {k: instantiate_class(args=(), init=config[k]) for k in ("backbone", "head")}
    extractor = instantiate_class(args=(), init=config["feature_extractor"])
    return Vocos(feature_extractor=extractor, **parts).state_dict()


def copy_tokenizer(source: Path, target: Path) -> None:
    """ChatTTS's tokenizer files from ``source`` (a ``BertTokenizerFast`` folder) into
    ``target``, with the ``special_tokens_map.json`` that ``Chat.load`` checks."""
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
        elif name != "special_tokens_map.json":
            raise UserError(f"{source}: {name} missing: not a saved BertTokenizerFast")
    write_special_tokens_map(target)


def write_special_tokens_map(folder: Path) -> None:
    """``special_tokens_map.json`` from ``tokenizer_config.json`` where it is missing: ChatTTS's
    ``Chat.load`` checks it, and transformers 5's ``save_pretrained`` no longer writes it."""
    path = folder / "special_tokens_map.json"
    if path.is_file():
        return
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    names = ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token")
    special = {k: config[k] for k in names if isinstance(config.get(k), str)}
    path.write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")


def sha256_map(root: Path) -> dict[str, str]:
    """The sha256 of each file ``Chat.load`` checks under ``root/asset``, keyed as ChatTTS's
    own map (``chat.sha256_map``): what lets it load files other than the release's."""
    digests = {}
    for key, relative in CHECKED.items():
        with open(root / relative, "rb") as f:
            digests[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return digests
