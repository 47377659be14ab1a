"""ChatTTS's home format for ``python -m train export``: runs of the GPT and DVAE adapters →
``OUT/asset/`` (``examples/chattts/asset.py``) and ``OUT/chattts.json``, the folder that
``examples/chattts/chat.py`` loads into ChatTTS's own ``Chat``.

- GPT run → ``asset/gpt/`` (the Llama; a one-row ``embed_tokens``, which ChatTTS deletes on
  load, so ``from_pretrained`` finds every weight), ``asset/Embed.safetensors`` and
  ``asset/tokenizer/`` (the run's ``[data] vocab`` folder: a GPT trained on the bytes tokenizer
  cannot go into ChatTTS and is refused).
- DVAE run → ``asset/DVAE.safetensors``, its sizes ones ``Chat`` can build (``dim`` = ``vq_dim /
  2``).
- Whatever no run gives comes from ``--release``; ``Decoder`` and ``Vocos``, which no example
  trains, without a release are written at random init, and the export says so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from examples.chattts import asset
from melcache.errors import UserError
from train.export import save_weights

if TYPE_CHECKING:
    from train.export import ExportedRun

GPT_IMPL = "examples.chattts_gpt.adapter:GPT"
DVAE_IMPL = "examples.chattts_dvae.adapter:DVAE"
TOKENIZER_IMPL = "examples.chattts_gpt.tokenizer:ChatTTSTokenizer"
# How a GPT trained on code cross entropy from [Stts][empty_spk]TEXT[Ptts] must be run.
INFER = {
    "use_decoder": False,  # codes → DVAE decoder → mel → Vocos; the Decoder is not trained
    "skip_refine_text": True,  # head_text is not trained
    "prompt": "",  # no [speed_5]: the training framing (examples/chattts_gpt/tokenizer.py)
    "do_text_normalization": False,  # the cache's texts were not normalised by ChatTTS
    "do_homophone_replacement": False,
}


def write(runs: list[ExportedRun], out: Path, release: Path | None) -> list[str]:
    """Write ``out/asset/`` and ``out/chattts.json`` from ``runs`` (and ``release``); the lines
    saying where each part came from."""
    by_impl = {GPT_IMPL: [], DVAE_IMPL: []}
    for run in runs:
        by_impl.setdefault(run.impl, []).append(run)
    for impl, found in by_impl.items():
        if len(found) > 1:
            raise UserError(f"runs {[str(r.run) for r in found]} are all {impl}: export one")
    gpt, dvae = (next(iter(by_impl[k]), None) for k in (GPT_IMPL, DVAE_IMPL))
    source = None if release is None else asset.asset_folder(release)
    target = out / asset.ASSET
    target.mkdir(parents=True, exist_ok=True)  # train.export refused a non-empty out unless --force
    sizes: dict[str, Any] = {"infer": INFER, "random_init": []}
    lines = [_write_gpt(gpt, source, target, sizes), _write_dvae(dvae, source, target, sizes)]
    lines += _write_untrained(source, target, sizes)
    (out / asset.SIZES).write_text(json.dumps(sizes, indent=1) + "\n", encoding="utf-8")
    lines.append(f"ChatTTS's asset/ in {out}: load it with examples.chattts.chat.load_chat")
    return lines


def _write_gpt(
    gpt: ExportedRun | None, source: Path | None, target: Path, sizes: dict[str, Any]
) -> str:
    from examples.chattts_gpt.adapter import chattts_config, llama_config

    if gpt is None:
        if source is None:
            raise UserError(f"ChatTTS's asset/ needs a GPT: give a run of {GPT_IMPL}, or --release")
        shutil.copytree(source / asset.GPT, target / asset.GPT, dirs_exist_ok=True)
        shutil.copyfile(source / asset.EMBED, target / asset.EMBED)
        asset.copy_tokenizer(source / asset.TOKENIZER, target / asset.TOKENIZER)
        sizes["gpt"] = _release_gpt_sizes(source)
        return f"gpt/, Embed, tokenizer/: copied from {source}"
    args = dict(gpt.config["model"]["args"])
    vocab_size = gpt.weights["embed.emb_text.weight"].shape[0]
    _copy_run_tokenizer(gpt, vocab_size, target / asset.TOKENIZER)
    release = args.pop("release", None)
    config = chattts_config(vocab_size, **{k: v for k, v in args.items() if k != "n_mels"})
    llama = llama_config(config, release)
    # ChatTTS deletes the Llama's own token table on load: a one-row one, so from_pretrained
    # finds every weight it expects and nobody mistakes it for a vocabulary.
    llama.vocab_size = 1
    llama.bos_token_id = llama.eos_token_id = llama.pad_token_id = None
    state = under(gpt.weights, "chattts.gpt.")
    state["embed_tokens.weight"] = torch.zeros(
        1, config["hidden_size"], dtype=state["norm.weight"].dtype
    )
    (target / asset.GPT).mkdir(exist_ok=True)
    llama.to_json_file(str(target / asset.GPT / "config.json"))
    save_weights(state, target / asset.GPT / "model.safetensors")
    embed = under(gpt.weights, "embed.")
    save_weights(embed, target / asset.EMBED)
    sizes["gpt"] = config
    return f"gpt/, Embed, tokenizer/: {gpt.run} at step {gpt.step}"


def under(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of the submodule at ``prefix``, keyed as that submodule's own state."""
    return {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}


def _release_gpt_sizes(source: Path) -> dict[str, Any]:
    """ChatTTS's GPT config for a release's own files (their shapes, its config.json)."""
    from examples.chattts_gpt.adapter import chattts_config

    embed = asset.read_tensors(source / asset.EMBED)
    llama = json.loads((source / asset.GPT / "config.json").read_text(encoding="utf-8"))
    vocab, hidden = embed["emb_text.weight"].shape
    codes = sorted(k for k in embed if k.startswith("emb_code."))
    return chattts_config(
        vocab, hidden, llama["num_hidden_layers"], llama["num_attention_heads"],
        llama["intermediate_size"], embed[codes[0]].shape[0], len(codes),
        llama.get("max_position_embeddings", 4096),
    )  # fmt: skip


def _copy_run_tokenizer(gpt: ExportedRun, vocab_size: int, target: Path) -> None:
    """The GPT run's own tokenizer files, which must be ChatTTS's kind and size."""
    data = gpt.config["data"]
    if data.get("tokenizer") != TOKENIZER_IMPL or not data.get("vocab"):
        raise UserError(
            f"{gpt.run}: trained with [data] tokenizer = {data.get('tokenizer')!r}, which cannot "
            "go into ChatTTS (its Chat reads a BertTokenizerFast): train a tokenizer with "
            "`python -m examples.chattts_gpt.tokenizer CACHE --out DIR` and the GPT with "
            f'[data] tokenizer = "{TOKENIZER_IMPL}", vocab = "DIR" (examples/chattts_gpt/config.toml)'
        )
    from transformers import BertTokenizerFast

    folder = Path(data["vocab"])
    if len(BertTokenizerFast.from_pretrained(str(folder))) != vocab_size:
        raise UserError(
            f"{folder}: not the tokenizer {gpt.run} was trained with ({vocab_size} ids)"
        )
    asset.copy_tokenizer(folder, target)


def _write_dvae(
    dvae: ExportedRun | None, source: Path | None, target: Path, sizes: dict[str, Any]
) -> str:
    if dvae is None:
        if source is None:
            raise UserError(
                f"ChatTTS's asset/ needs the DVAE whose codes the GPT learnt: give its run "
                f"({DVAE_IMPL}) or --release"
            )
        shutil.copyfile(source / asset.DVAE, target / asset.DVAE)
        sizes["dvae"] = _dvae_sizes(asset.read_tensors(source / asset.DVAE))
        return f"DVAE: copied from {source}"
    state = under(dvae.weights, "dvae.")
    sizes["dvae"] = _dvae_sizes(state)
    save_weights(state, target / asset.DVAE)
    return f"DVAE: {dvae.run} at step {dvae.step}"


def _dvae_sizes(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """ChatTTS's ``Config.dvae`` for DVAE weights ``state``; refused where ``Chat`` cannot
    build them (it makes the DVAE's width its decoder's input width)."""
    from examples.chattts_dvae.adapter import dvae_sizes

    s = dvae_sizes(state)
    dim, vq_dim = s["dim"], s["vq_dim"]
    if dim != vq_dim // 2:
        raise UserError(
            f"a DVAE with dim {dim} and vq_dim {vq_dim}: ChatTTS's Chat builds it only with "
            f"dim = vq_dim / 2 (train it with vq_dim = {2 * dim})"
        )
    block = {"hidden": s["hidden"], "n_layer": s["layers"], "bn_dim": s["bn_dim"]}
    return {
        "encoder": {"idim": dim, "odim": vq_dim, **block},
        "decoder": {"idim": dim, "odim": dim, **block},
        "vq": {"dim": vq_dim},
    }


def _write_untrained(source: Path | None, target: Path, sizes: dict[str, Any]) -> list[str]:
    """``Decoder`` and ``Vocos``: the release's, else random init (said, and recorded)."""
    hidden = sizes["gpt"]["hidden_size"]
    if source is not None:
        for name in (asset.DECODER, asset.VOCOS):
            shutil.copyfile(source / name, target / name)
        sizes["decoder"] = _decoder_sizes(asset.read_tensors(source / asset.DECODER))
        return [f"Decoder, Vocos: copied from {source}"]
    sizes["decoder"] = asset.decoder_sizes(hidden)
    coef = asset.read_tensors(target / asset.DVAE)["coef"]
    save_weights(asset.random_decoder(sizes["decoder"], coef), target / asset.DECODER)
    save_weights(asset.random_vocos(), target / asset.VOCOS)
    sizes["random_init"] = [asset.DECODER, asset.VOCOS]
    return [
        "Decoder, Vocos: written at RANDOM INIT (no --release given; no example trains them): "
        "speech comes through the DVAE's decoder (use_decoder=False) and an untrained vocoder"
    ]


def _decoder_sizes(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """ChatTTS's ``Config.decoder`` read off a ``Decoder.safetensors``'s shapes."""
    blocks = {k.split(".")[2] for k in state if k.startswith("decoder.decoder_block.")}
    return {
        "idim": int(state["decoder.conv_in.0.weight"].shape[1]),
        "odim": int(state["decoder.conv_out.weight"].shape[0]),
        "hidden": int(state["decoder.conv_in.2.weight"].shape[0]),
        "n_layer": len(blocks),
        "bn_dim": int(state["decoder.conv_in.0.weight"].shape[0]),
    }
