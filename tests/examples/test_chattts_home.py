"""ChatTTS in and out (issue #50), with the real chattts, transformers and vocos packages: a
release (fabricated from ChatTTS's own modules at random init, saved in its layout) starts the
GPT and DVAE examples, strictly; ``python -m train export`` gives back an ``asset/`` folder that
ChatTTS's own ``Chat.load(source="custom")`` accepts; what ChatTTS computes from it equals what
the training adapters compute from the checkpoints."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.helpers import (
    REPO,
    checkpoint,
    derive_args,
    load,
    run_ok,
    run_preprocess,
    torchrun,
)

pytest.importorskip("ChatTTS", reason="needs the 'chattts' extra: pip install -e '.[chattts]'")
pytest.importorskip("vocos", reason="needs the 'chattts' extra: pip install -e '.[chattts]'")

from safetensors.torch import load_file

import melcache
from examples.chattts.chat import load_chat, read_sizes, speak
from examples.chattts.random_release import TINY_DVAE, TINY_GPT, fabricate
from examples.chattts_dvae.adapter import DVAE
from examples.chattts_gpt.adapter import GPT
from melcache.errors import UserError
from preprocess.write.field_shard import log_floor_value
from train.export import export as train_export

GPT_CONFIG = REPO / "examples" / "chattts_gpt" / "config.toml"
DVAE_CONFIG = REPO / "examples" / "chattts_dvae" / "config.toml"
SPEC = "examples.chattts_gpt.tokenizer:ChatTTSTokenizer"
TINY_ARGS = {"hidden": 64, "layers": 2, "heads": 4, "intermediate": 128}
TINY_DVAE_ARGS = {"dim": 64, "hidden": 32, "layers": 2, "bn_dim": 16, "vq_dim": 128}


@pytest.fixture(scope="module")
def tiny_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A release at the examples' tiny sizes (300 text tokens)."""
    return fabricate(tmp_path_factory.mktemp("tiny_release"), tiny=True, text_tokens=300)


def export(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``python -m train export ...`` in a subprocess."""
    command = [sys.executable, "-m", "train", "export", *map(str, args)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_release_goes_into_the_gpt_and_dvae_examples_tensor_for_tensor(tiny_release: Path):
    gpt = GPT(vocab_size=300, release=str(tiny_release), **TINY_ARGS)
    folder = tiny_release / "asset"
    embed, llama = (
        load_file(folder / "Embed.safetensors"),
        load_file(folder / "gpt/model.safetensors"),
    )
    state = gpt.state_dict()
    assert {f"embed.{k}" for k in embed} | {f"chattts.gpt.{k}" for k in llama} == set(state) | {
        "chattts.gpt.embed_tokens.weight"  # ChatTTS deletes the Llama's own table too
    }
    for key, value in embed.items():
        assert torch.equal(state[f"embed.{key}"], value), key
    for key, value in llama.items():
        if key != "embed_tokens.weight":
            assert torch.equal(state[f"chattts.gpt.{key}"], value), key
    dvae = DVAE(n_mels=100, release=str(folder), **TINY_DVAE_ARGS)  # asset/ itself works too
    released = load_file(folder / "DVAE.safetensors")
    assert set(released) == {k.removeprefix("dvae.") for k in dvae.state_dict()}
    for key, value in dvae.state_dict().items():
        assert torch.equal(value, released[key.removeprefix("dvae.")]), key
    dvae.set_mel_stats(torch.zeros(100), torch.full((100,), 7.0))  # keeps the release's scale
    assert torch.equal(dvae.dvae.coef, released["coef"])


def test_a_release_of_other_sizes_or_damaged_is_one_line_naming_what(
    tiny_release: Path, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match=r"config\.json: hidden_size is 64, .* give 32$"):
        GPT(vocab_size=300, release=str(tiny_release), **{**TINY_ARGS, "hidden": 32})
    with pytest.raises(UserError, match=r"holds 300 tokens, \[data\] tokenizer gives 257: .*vocab"):
        GPT(vocab_size=257, release=str(tiny_release), **TINY_ARGS)
    with pytest.raises(UserError, match=r"DVAE\.safetensors: downsample_conv\.0\.weight is "
                       r"\[64, 100, 3\] in the file but \[32, 100, 3\] with these \[model\.args\]"):  # fmt: skip
        DVAE(n_mels=100, release=str(tiny_release), **{**TINY_DVAE_ARGS, "dim": 32})
    damaged = fabricate(tmp_path / "damaged", tiny=True, text_tokens=300)
    embed = load_file(damaged / "asset/Embed.safetensors")
    del embed["head_code.1.parametrizations.weight.original0"]
    asset_file = damaged / "asset/Embed.safetensors"
    from safetensors.torch import save_file

    save_file(embed, asset_file)
    with pytest.raises(UserError, match=r"Embed\.safetensors: missing \['head_code\.1\.param"):
        GPT(vocab_size=300, release=str(damaged), **TINY_ARGS)
    asset_file.write_bytes(b"not safetensors")
    with pytest.raises(UserError, match=r"Embed\.safetensors: not a readable safetensors file"):
        GPT(vocab_size=300, release=str(damaged), **TINY_ARGS)
    with pytest.raises(UserError, match=r"not a ChatTTS release \(no Embed\.safetensors"):
        GPT(vocab_size=300, release=str(tmp_path), **TINY_ARGS)


def gpt_run(
    cache: Path, out: Path, vocab: Path, steps: int, *overrides: str, ranks: int = 1,
    config: Path = GPT_CONFIG,
) -> Path:  # fmt: skip
    """The GPT example trained ``steps`` on ``cache`` with the tokenizer in ``vocab``."""
    args = ["-m", "train", "--shards", str(cache), "--config", str(config), "--out", str(out),
            "--max-steps", str(steps), f"train.checkpoint.every={steps}",
            f"data.vocab={json.dumps(str(vocab))}", "data.max_batch_size=4", *overrides]  # fmt: skip
    run_ok(torchrun(*args) if ranks == 2 else [sys.executable, *args], timeout=900)
    return out


RELEASE_CONFIG = """[model]
impl = "examples.chattts_gpt.adapter:GPT"
[model.args]
release = {release}
[data]
tokenizer = "examples.chattts_gpt.tokenizer:ChatTTSTokenizer"
fields = ["codes"]
batch_frames = 400
num_workers = 1
[optim]
lr = 1e-4
warmup_steps = 1
[train]
precision = "fp32"
log_every = 1
"""


def teacher_forced_logits(model: GPT, chat, text: list[int], codes: torch.Tensor):
    """Every position's code logits ``[S, num_vq, num_audio_tokens]`` over the text then the
    code frames: through the training adapter, and through ChatTTS's inference modules
    (``Embed`` → its Llama → ``head_code``) as ``Chat`` loaded them."""
    n_text, n_codes = torch.tensor([len(text)]), torch.tensor([len(codes)])
    with torch.no_grad():
        hidden = model._decode(torch.tensor([text]), n_text, codes[None], n_codes)[0]
        ours = torch.stack([head(hidden) for head in model.embed.head_code], 1)
    ids = torch.cat([torch.tensor(text)[:, None].expand(-1, codes.shape[1]), codes])[None]
    text_mask = torch.arange(ids.shape[1])[None] < len(text)
    with torch.inference_mode():
        emb = chat.embed(ids, text_mask)
        states = chat.gpt.gpt(inputs_embeds=emb, attention_mask=torch.ones_like(text_mask).long())
        hidden = states.last_hidden_state[0]
        theirs = torch.stack([head(hidden) for head in chat.gpt.head_code], 1)
    return ours, theirs


def check_round_trip(exported: Path, run: Path, cache: Path, vocab_size: int) -> None:
    """What ChatTTS's ``Chat`` loads from ``exported`` is ``run``'s newest checkpoint: every
    tensor, the same logits on a teacher-forced input, and its DVAE's codes of every cached mel
    are the ones ``derive`` stored."""
    chat = load_chat(exported, device="cpu")  # Chat.load(source="custom") returned True
    saved = load(max((run / "checkpoints").glob("step-*")))
    weights, args = saved["model"], dict(saved["config"]["model"]["args"])
    files = {
        "embed.": load_file(exported / "asset/Embed.safetensors"),
        "chattts.gpt.": load_file(exported / "asset/gpt/model.safetensors"),
    }
    for key, value in weights.items():
        prefix = "embed." if key.startswith("embed.") else "chattts.gpt."
        assert torch.equal(files[prefix][key.removeprefix(prefix)], value), key
    model = GPT(vocab_size=vocab_size, **{k: v for k, v in args.items() if k != "release"})
    model.load_state_dict(weights)
    model.eval()
    with melcache.open(cache) as opened:
        first = opened[0]
        text = [int(i) for i in np.arange(1, 12) % (vocab_size - 1) + 1]
        ours, theirs = teacher_forced_logits(model, chat, text, torch.from_numpy(
            first.fields["codes"].astype(np.int64)))  # fmt: skip
        difference = (ours - theirs).abs().max().item()
        print(f"largest logit difference, adapter against ChatTTS: {difference:.2e}")
        assert difference <= 1e-4
        floor = log_floor_value(json.loads((cache / "index.json").read_text())["features"])
        for utterance in opened:
            assert np.array_equal(
                chatts_codes(chat, utterance.mel, floor), utterance.fields["codes"]
            )


def chatts_codes(chat, mel: np.ndarray, floor: float) -> np.ndarray:
    """ChatTTS's own DVAE encode (``DVAE.forward(mode="encode")`` past its wav → mel front end)
    of a cached mel, padded to an even length with the log floor as ``derive`` pads it."""
    even = np.full((len(mel) + len(mel) % 2, mel.shape[1]), floor, np.float32)
    even[: len(mel)] = mel
    dvae = chat.dvae
    with torch.inference_mode():
        x = torch.from_numpy(even).T[None]
        h = dvae.encoder(dvae.downsample_conv(x / dvae.coef.view(100, 1)))
        return dvae.vq_layer(h)[0].T.numpy()  # [T / 2, 4], ChatTTS's order


@pytest.mark.slow
def test_a_run_from_scratch_goes_back_to_chattts_at_the_examples_sizes(
    derived: Path, dvae_run: Path, chattts_tokenizer: Path, tmp_path: Path
) -> None:
    """DVAE and GPT at the examples' tiny sizes from random init, the tokenizer trained on the
    cache's texts: the export states the sizes, Chat loads them and speaks."""
    run = gpt_run(derived, tmp_path / "gpt", chattts_tokenizer, 4)
    done = export(run, dvae_run, "--out", tmp_path / "export")
    assert "RANDOM INIT" in done.stdout  # Decoder and Vocos: no release given
    sizes = read_sizes(tmp_path / "export")
    assert sizes["gpt"]["hidden_size"] == TINY_GPT["hidden_size"]
    assert sizes["dvae"]["vq"] == {"dim": TINY_DVAE["vq_dim"]}
    assert sizes["random_init"] == ["Decoder.safetensors", "Vocos.safetensors"]
    vocab_size = sizes["gpt"]["num_text_tokens"]
    check_round_trip(tmp_path / "export", run, derived, vocab_size)
    dvae = load(max((dvae_run / "checkpoints").glob("step-*")))["model"]
    exported = load_file(tmp_path / "export/asset/DVAE.safetensors")
    assert all(torch.equal(exported[k.removeprefix("dvae.")], v) for k, v in dvae.items())
    wav = speak(load_chat(tmp_path / "export", "cpu"), "hello", sizes["infer"])
    assert wav.size > 0 and np.isfinite(wav).all()
    from ChatTTS.config.config import Config

    assert Config().gpt.hidden_size == 768  # loading tiny sizes left ChatTTS's defaults alone
    again = export(run, "--out", tmp_path / "export", check=False)
    assert again.returncode == 2 and "is not empty" in again.stderr
    assert again.stderr.strip().count("\n") == 0, again.stderr


@pytest.mark.slow
def test_a_run_from_the_release_at_its_sizes_goes_back_to_chattts(
    train_cache: Path, tmp_path: Path
) -> None:
    """ChatTTS's released sizes: derive with the release's DVAE.safetensors, the GPT started
    from the release and trained 2 steps, exported with the release's Decoder and Vocos."""
    release = fabricate(tmp_path / "release")
    cache = tmp_path / "cache"
    shutil.copytree(train_cache, cache)
    run_preprocess(*derive_args(cache, release / "asset/DVAE.safetensors"))
    config = tmp_path / "gpt.toml"
    config.write_text(RELEASE_CONFIG.format(release=json.dumps(str(release))))
    run = gpt_run(cache, tmp_path / "gpt", release / "asset/tokenizer", 2, config=config)
    done = export(run, "--out", tmp_path / "export", "--release", release)
    print(done.stdout)
    assert "RANDOM INIT" not in done.stdout
    for name in ("Decoder.safetensors", "Vocos.safetensors", "DVAE.safetensors"):
        assert (tmp_path / "export/asset" / name).read_bytes() == (
            release / "asset" / name
        ).read_bytes()
    check_round_trip(tmp_path / "export", run, cache, 21178)


@pytest.mark.slow
def test_an_fsdp2_run_exports_the_bytes_of_a_ddp_run_of_the_same_weights(
    tiny_release: Path, derived: Path, dvae_run: Path, tmp_path: Path
) -> None:
    """Two 2-rank jobs from the same release whose steps change no weight (lr 1e-30): DDP's
    full state and FSDP2's DCP shards, consolidated, export byte for byte alike."""
    vocab = tiny_release / "asset/tokenizer"
    release = f"model.args.release={json.dumps(str(tiny_release))}"
    for strategy in ("ddp", "fsdp2"):
        run = gpt_run(derived, tmp_path / strategy, vocab, 2, release, "optim.lr=1e-30",
                      "optim.min_lr=0", f"train.parallel.strategy={strategy}", ranks=2)  # fmt: skip
        export(run, dvae_run, "--out", tmp_path / f"export-{strategy}", "--release", tiny_release)
    assert (checkpoint(tmp_path / "fsdp2", 2) / "weights").is_dir()  # DCP shards, no full state
    ddp, fsdp2 = tmp_path / "export-ddp", tmp_path / "export-fsdp2"
    files = sorted(str(p.relative_to(ddp)) for p in ddp.rglob("*.safetensors"))
    assert len(files) == 7, (
        files
    )  # the two runs' weights; asset/'s gpt, Embed, DVAE, Decoder, Vocos
    for name in files:
        other = name.replace("weights/ddp/", "weights/fsdp2/")
        assert (fsdp2 / other).read_bytes() == (ddp / name).read_bytes(), name
    initial = load_file(tiny_release / "asset/Embed.safetensors")
    exported = load_file(fsdp2 / "asset/Embed.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in initial.items())  # lr 1e-30: unchanged


def saved_run(
    folder: Path, model: torch.nn.Module, impl: str, args: dict, data: dict, ema: dict | None = None
) -> Path:
    """A run folder in the trainer's layout (``train/run/checkpoint.py``) holding ``model``'s
    weights (and an EMA's) at step 1, as a one-process DDP run writes it."""
    step = checkpoint(folder, 1)
    step.mkdir(parents=True)
    config = {"model": {"impl": impl, "args": args}, "data": data}
    state = {"step": 1, "config": config, "model": model.state_dict(), "ema": ema}
    torch.save(state, step / "shared.pt")
    (step / "COMPLETE.json").write_text(json.dumps({"step": 1, "world_size": 1}))
    return folder


def test_what_cannot_go_into_chattts_is_refused_in_one_line(
    tiny_release: Path, tmp_path: Path
) -> None:
    gpt_impl, dvae_impl = "examples.chattts_gpt.adapter:GPT", "examples.chattts_dvae.adapter:DVAE"
    on_bytes = saved_run(tmp_path / "bytes", GPT(vocab_size=257, **TINY_ARGS), gpt_impl,
                         TINY_ARGS, {"tokenizer": "bytes"})  # fmt: skip
    wide = {**TINY_DVAE_ARGS, "vq_dim": 64}  # Chat builds a DVAE only with dim = vq_dim / 2
    narrow = saved_run(tmp_path / "dvae", DVAE(n_mels=100, **wide), dvae_impl, wide, {})
    tokenizer = {"tokenizer": SPEC, "vocab": str(tiny_release / "asset/tokenizer")}
    gpt = saved_run(tmp_path / "gpt", GPT(vocab_size=300, **TINY_ARGS), gpt_impl, TINY_ARGS,
                    tokenizer)  # fmt: skip
    cases = {  # runs, release, what the one line says
        "bytes": ([on_bytes], tiny_release, r"trained with \[data\] tokenizer = 'bytes', which "
                  r"cannot go into ChatTTS .*python -m examples\.chattts_gpt\.tokenizer"),
        "dim": ([gpt, narrow], None, r"a DVAE with dim 64 and vq_dim 64: .*train it with vq_dim = 128"),
        "no dvae": ([gpt], None, r"needs the DVAE whose codes the GPT learnt: give its run"),
        "no run": ([tmp_path / "missing"], None, r"missing: no complete checkpoint in"),
        "twice": ([gpt, gpt], None, r"share a folder name"),
    }  # fmt: skip
    for name, (runs, release, message) in cases.items():
        with pytest.raises(UserError) as refused:
            train_export(runs, tmp_path / f"out-{name.replace(' ', '-')}", release=release)
        assert re.search(message, str(refused.value)) and "\n" not in str(refused.value), name
    done = export(on_bytes, "--out", tmp_path / "cli", check=False)  # the command: one line
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "which cannot go into ChatTTS" in done.stderr
    lines = train_export([gpt], tmp_path / "ok", release=tiny_release)  # the release's DVAE
    assert any(line.startswith("DVAE: copied from") for line in lines)
    assert load_chat(tmp_path / "ok", "cpu").has_loaded()


@pytest.mark.slow
def test_the_export_benchmark_prints_every_row() -> None:
    done = run_ok(
        [sys.executable, "-m", "benchmarks.train.chattts_export", "--tiny", "--repeats", "1"]
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["row"].split(" (")[0] for r in rows] == [
        "GPT from the release", "GPT at random init", "DVAE from the release",
        "DVAE at random init", "export of a GPT run", "ChatTTS's Chat.load of the export",
    ]  # fmt: skip
    assert all(r["median_s"] > 0 for r in rows)


def test_export_with_ema_takes_the_averaged_parameters_and_the_model_s_buffers(
    tiny_release: Path, tmp_path: Path
) -> None:
    model = DVAE(n_mels=100, **TINY_DVAE_ARGS)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    shadow = {n: torch.full_like(p, 0.5) for n, p in trained.items()}
    impl = "examples.chattts_dvae.adapter:DVAE"
    run = saved_run(
        tmp_path / "dvae", model, impl, TINY_DVAE_ARGS, {}, {"updates": 1, "shadow": shadow}
    )
    train_export([run], tmp_path / "out", release=tiny_release, ema=True)
    exported = load_file(tmp_path / "out/weights/dvae/model.safetensors")
    assert exported.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(exported[name], shadow.get(name, value)), name
    assert torch.equal(load_file(tmp_path / "out/asset/DVAE.safetensors")["coef"], model.dvae.coef)
    without = saved_run(tmp_path / "plain", model, impl, TINY_DVAE_ARGS, {})
    with pytest.raises(UserError, match=r"the run kept no EMA .*export without --ema"):
        train_export([without], tmp_path / "out2", ema=True)
