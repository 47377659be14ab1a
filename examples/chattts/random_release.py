"""A ChatTTS release made from the chattts package's own modules at random init, saved in its
own layout (``asset/``), at ChatTTS's released sizes (``ChatTTS/config/config.py``) or at the
GPT and DVAE examples' tiny ones: what the tests and ``benchmarks/train/chattts_export.py`` start
from, since the released weights cannot be downloaded here, and a way to try the import and
export path offline::

    python -m examples.chattts.random_release DIR [--tiny]
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from ChatTTS.config.config import Config
from ChatTTS.model.dvae import DVAE
from ChatTTS.model.embed import Embed
from transformers import BertTokenizerFast, LlamaConfig, LlamaModel

from examples.chattts import asset
from examples.chattts_gpt.tokenizer import BERT_TOKENS, CHATTTS_TOKENS
from train.export import save_weights

# The GPT and DVAE examples' sizes (examples/chattts_*/config.toml), as ChatTTS's Config keys.
TINY_GPT = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_hidden_layers": 2}  # fmt: skip
TINY_DVAE = {"dim": 64, "hidden": 32, "n_layer": 2, "bn_dim": 16, "vq_dim": 128}


def fabricate(root: Path, *, tiny: bool = False, text_tokens: int = 21178, seed: int = 0) -> Path:
    """Write ``root/asset/`` as ChatTTS's release lays it out, at random init; return ``root``."""
    torch.manual_seed(seed)
    config = Config()
    folder = root / asset.ASSET
    gpt = {**asdict(config.gpt), **(TINY_GPT if tiny else {}), "num_text_tokens": text_tokens}
    _tokenizer(folder / asset.TOKENIZER, text_tokens)
    embed = Embed(gpt["hidden_size"], gpt["num_audio_tokens"], text_tokens, gpt["num_vq"])
    save_weights(embed.state_dict(), folder / asset.EMBED)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
            "max_position_embeddings")  # fmt: skip
    LlamaModel(LlamaConfig(**{k: gpt[k] for k in keys})).save_pretrained(str(folder / asset.GPT))
    dvae = DVAE(**_dvae_config(config, tiny))
    with torch.no_grad():
        dvae.coef.uniform_(0.5, 2.0)  # ChatTTS's learnt per-channel scale: positive
    save_weights(dvae.state_dict(), folder / asset.DVAE)
    decoder = asdict(config.decoder) if not tiny else asset.decoder_sizes(gpt["hidden_size"])
    save_weights(asset.random_decoder(decoder, dvae.coef), folder / asset.DECODER)
    save_weights(asset.random_vocos(), folder / asset.VOCOS)
    return root


def _dvae_config(config: Config, tiny: bool) -> dict[str, Any]:
    """ChatTTS's ``DVAE`` arguments as ``Chat._load`` gives them (released or tiny sizes)."""
    dvae = asdict(config.dvae)
    if tiny:
        d = TINY_DVAE
        block = {"hidden": d["hidden"], "n_layer": d["n_layer"], "bn_dim": d["bn_dim"]}
        dvae["encoder"] = {"idim": d["dim"], "odim": d["vq_dim"], **block}
        dvae["decoder"] = {"idim": d["dim"], "odim": d["dim"], **block}
        dvae["vq"]["dim"] = d["vq_dim"]
    return {
        "decoder_config": dvae["decoder"],
        "encoder_config": dvae["encoder"],
        "vq_config": dvae["vq"],
        "dim": dvae["decoder"]["idim"],
    }


def _tokenizer(folder: Path, size: int) -> None:
    """A ``BertTokenizerFast`` of exactly ``size`` ids: BERT's tokens, letters and CJK
    characters, fillers, and ChatTTS's control tokens last (as ChatTTS's release adds them)."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(",.!?'")
    words = [*BERT_TOKENS, *letters, *(f"##{c}" for c in letters)]
    room = size - len(CHATTTS_TOKENS) - len(words)
    words += [chr(0x4E00 + i) for i in range(room)]  # CJK characters, one token each
    bert = BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}, do_lower_case=True)
    bert.add_special_tokens({"additional_special_tokens": list(CHATTTS_TOKENS)})
    if len(bert) != size:  # fewer than ChatTTS's tokens plus the letters
        raise ValueError(f"a tokenizer of {size} ids cannot hold ChatTTS's {len(bert)} fixed ones")
    bert.save_pretrained(str(folder))
    asset.write_special_tokens_map(folder)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m examples.chattts.random_release")
    parser.add_argument("root", type=Path, help="folder to write asset/ into")
    parser.add_argument("--tiny", action="store_true", help="the examples' sizes")
    args = parser.parse_args()
    print(fabricate(args.root, tiny=args.tiny) / asset.ASSET)
