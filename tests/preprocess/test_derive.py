"""Derived fields (issue #38): ChatTTS's DVAE trained a few steps on the sample corpus, then
``python -m preprocess derive --field codes`` with its run folder. Parts at once, one killed
and rerun, give the bytes of one uninterrupted derive; no mel shard changes; the codes are
the encoder's own on each utterance; verify names a flipped byte; the loader, random access
and CacheDataset give the same codes; what cannot be derived or read is one line."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.helpers import (
    DVAE_ENCODER,
    REPO,
    derive_args,
    metrics,
    needs_extra,
    run_ok,
    run_preprocess,
    started,
    torchrun,
    train_cmd,
    wait_for,
)

pytestmark = pytest.mark.slow  # a DVAE run and several derives in subprocesses


def field_bytes(cache: Path) -> dict[str, str]:
    """sha256 of every file of the field, by its path inside its version folder."""
    entry = json.loads((cache / "index.json").read_text())["fields"]["codes"]
    folder = cache / entry["folder"]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def mel_shards(cache: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(cache.glob("*.tar"))}


def test_parts_at_once_one_killed_give_the_single_derive_and_leave_mels(
    train_cache: Path, dvae_run: Path, derived: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(train_cache, cache)
    before = mel_shards(cache)
    log0, log1 = tmp_path / "part0.log", tmp_path / "part1.log"
    command = [sys.executable, "-m", "preprocess"]
    with (
        started([*command, *derive_args(cache, dvae_run, "--part", "1/2")], log1) as part1,
        started([*command, *derive_args(cache, dvae_run, "--part", "0/2")], log0) as part0,
    ):
        # Part 1 killed as soon as it has written its first field shard's receipt.
        wrote = wait_for(lambda: any(cache.glob(".derive/*/b*.json")), part1, 120)
        part1.send_signal(signal.SIGKILL)
        part1.wait()
        assert part0.wait(timeout=300) == 0, log0.read_text()
    print(f"part 1 killed after a receipt: {wrote}; exit {part1.returncode}")
    assert "fields" not in json.loads((cache / "index.json").read_text())  # part 1 unfinished
    run_preprocess(*derive_args(cache, dvae_run, "--part", "1/2"))  # the rerun lists the field
    assert field_bytes(cache) == field_bytes(derived)
    assert mel_shards(cache) == before == mel_shards(train_cache)
    assert run_preprocess("verify", str(cache)).returncode == 0


def test_two_fields_derived_at_once_are_both_listed(
    train_cache: Path, dvae_run: Path, derived: Path, tmp_path: Path
) -> None:
    """Two derives of different fields into one cache, at once: each reads the index afresh
    under a lock when it lists its field, so neither drops the other's entry."""
    cache = tmp_path / "cache"
    shutil.copytree(train_cache, cache)
    command = [sys.executable, "-m", "preprocess"]
    runs = {
        name: [a if a != "codes" else name for a in derive_args(cache, dvae_run)]
        for name in ("a", "b")
    }
    with (
        started([*command, *runs["a"]], tmp_path / "a.log") as a,
        started([*command, *runs["b"]], tmp_path / "b.log") as b,
    ):
        assert a.wait(timeout=300) == 0 and b.wait(timeout=300) == 0, (
            tmp_path / "a.log"
        ).read_text()
    fields = json.loads((cache / "index.json").read_text())["fields"]
    assert sorted(fields) == ["a", "b"]
    codes = json.loads((derived / "index.json").read_text())["fields"]["codes"]
    assert (
        fields["a"]["totals"]["frames"]
        == fields["b"]["totals"]["frames"]
        == codes["totals"]["frames"]
    )
    assert run_preprocess("verify", str(cache)).returncode == 0


def test_torchrun_ranks_are_the_parts_and_give_the_same_bytes(
    train_cache: Path, dvae_run: Path, derived: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(train_cache, cache)
    done = run_ok(torchrun("-m", "preprocess", *derive_args(cache, dvae_run)), timeout=300)
    assert "torchrun's RANK=1 WORLD_SIZE=2" in done.stderr
    assert field_bytes(cache) == field_bytes(derived)


def test_codes_are_the_encoders_own_on_each_mel_and_every_reader_agrees(
    derived: Path, dvae_run: Path
) -> None:
    import melcache
    from examples.chattts_dvae.adapter import encoder
    from melcache.dataset import CacheDataset
    from melcache.loader import DataConfig, make_loader

    made = encoder(checkpoint=str(dvae_run))
    cache = melcache.open(derived)
    direct = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as derive's workers run it
    try:
        for u in cache:
            mel = torch.from_numpy(u.mel.astype(np.float32))
            if len(mel) % 2:  # padded to an even length with the log floor, as derive does
                mel = torch.cat([mel, torch.full((1, 100), float(np.log(1e-5)))])
            with torch.inference_mode():
                direct[u.key] = made.module(mel[None])[0].numpy()
            assert np.array_equal(u.fields["codes"], direct[u.key]), u.key
            assert (
                u.fields["codes"].dtype == np.int16
                and len(u.fields["codes"]) == (u.frames + 1) // 2
            )
    finally:
        torch.set_num_threads(threads)
    values = np.concatenate(list(direct.values()))
    assert values.min() >= 0 and values.max() <= 624 and len(np.unique(values)) > 20
    item = CacheDataset(derived)[3]
    assert torch.equal(item["fields"]["codes"].long(), torch.from_numpy(direct[item["key"]]).long())
    loader = make_loader(derived, DataConfig(batch_frames=2000, num_workers=1, fields=("codes",)))
    seen = 0
    try:
        for batch, _ in zip(loader, range(8), strict=False):
            assert batch.fields["codes"].dtype == torch.int64
            for row, key in enumerate(batch.keys):
                length = int(batch.field_lengths["codes"][row])
                assert np.array_equal(batch.fields["codes"][row, :length].numpy(), direct[key])
                assert not batch.fields["codes"][row, length:].any()  # zero padding
                seen += 1
    finally:
        loader.close()
    assert seen >= 8


FIELDS_ONLY_PROBE = """
import json, sys
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
from melcache.loader import DataConfig, make_loader
data = DataConfig(batch_frames=1000, num_workers=0, fields=("codes",), read_mel=False)
loader = make_loader(sys.argv[1], data)
batches = [next(iter(loader)) for _ in range(1)] + [b for b, _ in zip(loader, range(30))]
loader.close()
shapes = sorted({tuple(b.mel.shape[2:]) for b in batches})
same = all(b.mel_lengths.tolist() == b.field_lengths["codes"].tolist() for b in batches)
print(json.dumps({"opened": opened, "mel": shapes, "same": same, "rows": sum(map(len, batches))}))
"""


def test_a_model_of_fields_alone_reads_no_mel_shard(derived: Path) -> None:
    """``read_mel = False`` (a melcache_contract with ``"mel": False``): the files opened
    (an audit hook sees every open) hold no mel shard, and every frame count is the field's."""
    done = run_ok([sys.executable, "-c", FIELDS_ONLY_PROBE, str(derived)])
    seen = json.loads(done.stdout.splitlines()[-1])
    tars = {Path(p) for p in seen["opened"] if p.endswith(".tar")}
    mel_read = sum(p.stat().st_size for p in tars if p.parent == derived)
    field_read = sum(p.stat().st_size for p in tars if p.parent != derived)
    print(f"mel shard bytes opened {mel_read}, field shard bytes opened {field_read}")
    assert mel_read == 0 and field_read > 0
    assert seen["mel"] == [[0]] and seen["same"] and seen["rows"] > 30


def test_verify_names_a_flipped_byte_in_a_field_shard(derived: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(derived, cache)
    entry = json.loads((cache / "index.json").read_text())["fields"]["codes"]
    shard = cache / entry["folder"] / entry["shards"][1]["name"]
    rows = np.load(cache / entry["folder"] / "rows.npy")
    first = sum(s["samples"] for s in entry["shards"][:1])
    offset = int(rows[first][0]) + int(rows[first][1]) - 3  # inside the first utterance's codes
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x01
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    done = run_preprocess("verify", str(cache), check=False)
    print(done.stdout)
    assert done.returncode == 1
    assert f"{entry['folder']}/{shard.name}: sha256 differs" in done.stdout
    assert f"{shard.name}:{cache_key(cache, first)}: bytes {rows[first][0]}" in done.stdout


def one_error(stderr: str) -> bool:
    """One ``error:`` line and no traceback."""
    return stderr.count("error: ") == 1 and "Traceback" not in stderr


def cache_key(cache: Path, row: int) -> str:
    import melcache

    return melcache.open(cache).keys()[row]


def test_what_cannot_be_derived_is_one_line(derived: Path, dvae_run: Path, tmp_path: Path) -> None:

    # another provenance without --replace
    other = dvae_run.parent / "other"
    shutil.copytree(dvae_run, other)
    marker = sorted((other / "checkpoints").glob("step-*"))[-1] / "shared.pt"
    state = torch.load(marker, weights_only=True)
    state["model"]["dvae.coef"] = state["model"]["dvae.coef"] * 2
    torch.save(state, marker)
    cache = tmp_path / "cache"
    shutil.copytree(derived, cache)
    done = run_preprocess(*derive_args(cache, other), check=False)
    assert done.returncode == 2 and one_error(done.stderr), done.stderr
    assert (
        "field 'codes' exists with checkpoint_sha256" in done.stderr and "--replace" in done.stderr
    )
    old = json.loads((cache / "index.json").read_text())["fields"]["codes"]["folder"]
    run_preprocess(*derive_args(cache, other, "--replace"))
    new = json.loads((cache / "index.json").read_text())["fields"]["codes"]["folder"]
    assert new != old and not (cache / old).exists() and (cache / new).is_dir()
    # a derive into a cache still being built
    building = tmp_path / "building"
    shutil.copytree(derived, building)
    (building / "index.json").unlink()
    done = run_preprocess(*derive_args(building, dvae_run), check=False)
    assert done.returncode == 2 and one_error(done.stderr), done.stderr
    assert "is still being built" in done.stderr


def test_what_cannot_be_read_is_one_line(
    derived: Path, sample_cache: Path, dvae_run: Path, tmp_path: Path
) -> None:
    import melcache
    from melcache.errors import ShardError, UserError
    from melcache.loader import DataConfig, make_loader

    # a field shard of another cache, put in place of this one's
    elsewhere = tmp_path / "elsewhere"  # the whole sample corpus, other buckets: other shards
    shutil.copytree(sample_cache, elsewhere)
    run_preprocess(*derive_args(elsewhere, dvae_run))
    theirs = json.loads((elsewhere / "index.json").read_text())["fields"]["codes"]
    foreign = tmp_path / "foreign"
    shutil.copytree(derived, foreign)
    entry = json.loads((foreign / "index.json").read_text())["fields"]["codes"]
    name = entry["shards"][0]["name"]
    assert name == theirs["shards"][0]["name"]
    (foreign / entry["folder"] / name).unlink()
    shutil.copyfile(elsewhere / theirs["folder"] / name, foreign / entry["folder"] / name)
    done = run_preprocess("verify", str(foreign), check=False)
    assert f"{entry['folder']}/{name}: a field shard of another cache" in done.stdout, done.stdout
    with pytest.raises(ShardError, match="a field shard of another cache"):
        melcache.open(foreign)[0]
    loader = make_loader(foreign, DataConfig(num_workers=0, fields=("codes",)))
    try:
        with pytest.raises(ShardError, match="a field shard of another cache"):
            for _ in zip(loader, range(40), strict=False):
                pass
    finally:
        loader.close()
    # a field the cache lacks, and one whose provenance differs from the declaration
    for fields, provenance, said in (
        (("speaker",), {}, "has no derived field 'speaker'"),
        (("codes",), {"codes": {"checkpoint_sha256": "0" * 64}}, "checkpoint_sha256 = '"),
    ):
        with pytest.raises(UserError, match=said) as raised:
            make_loader(
                derived, DataConfig(num_workers=0, fields=fields, field_provenance=provenance)
            )
        assert "\n" not in str(raised.value)


def test_a_models_contract_declares_fields_and_their_provenance(derived: Path) -> None:
    """``melcache_contract["fields"]``: names, or names to provenance keys, merged with ``[data]
    field_provenance``; a mismatch is one line naming both values; ``"mel": False`` needs fields."""
    from melcache.errors import UserError
    from melcache.loader import DataConfig, make_loader
    from train.model.contract import declared, loader_data

    wanted = {"codes": {"encoder": DVAE_ENCODER, "dtype": "int16"}}
    model = type(
        "GPT", (), {"melcache_contract": {"inputs": "batch", "fields": wanted, "mel": False}}
    )
    spec = declared(model, "tests:GPT")
    digest = json.loads((derived / "index.json").read_text())["fields"]["codes"]["provenance"]
    base = DataConfig(num_workers=0, batch_frames=1000)
    data = loader_data(base, spec)
    assert data.fields == ("codes",) and not data.read_mel
    loader = make_loader(derived, data)
    try:
        batch = next(iter(loader))
        assert batch.mel.shape[2] == 0 and batch.fields["codes"].shape[2] == 4
    finally:
        loader.close()
    pinned = DataConfig(num_workers=0, field_provenance={"codes": {"checkpoint_sha256": "f" * 64}})
    with pytest.raises(UserError) as raised:
        make_loader(derived, loader_data(pinned, spec))
    message = str(raised.value)
    assert digest["checkpoint_sha256"] in message and "f" * 64 in message and "\n" not in message
    for table in (
        {"inputs": "batch", "mel": False},
        {"fields": ["codes"]},
        {"inputs": "batch", "fields": ["A b"]},
    ):
        with pytest.raises(UserError, match="melcache_contract"):
            declared(type("Bad", (), {"melcache_contract": table}), "tests:Bad")


def test_a_fields_only_model_trains_on_two_ranks(derived: Path, tmp_path: Path) -> None:
    """The trainer with a model of codes alone (``tests.support.plugin_models:CodesOnly``, ``"mel":
    False``): batches of codes and text, its loss falling, no mel shard warning."""
    impl = "model.impl=tests.support.plugin_models:CodesOnly"
    done = run_ok(train_cmd(derived, tmp_path, impl, max_steps=20), timeout=300)
    losses = [r["loss"] for r in metrics(tmp_path) if "loss" in r]
    print(f"loss per window {losses}")
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert "utterances.table" not in done.stderr


def test_a_released_layout_safetensors_loads_and_gives_chattts_own_indices(tmp_path: Path) -> None:
    """A ``DVAE.safetensors`` laid out as ChatTTS releases it (ChatTTS's own ``DVAE`` built from
    its own ``Config``, as ``ChatTTS.core`` builds it, saved by safetensors; random weights, as
    none can be downloaded here) loads by ``--checkpoint FILE``, its sizes read off the
    tensors; the codes are ChatTTS's own ``GFSQ.forward`` indices, transposed to [B, T, 4]."""
    needs_extra("ChatTTS", "chattts")
    from dataclasses import asdict

    from ChatTTS.config.config import Config
    from ChatTTS.model.dvae import DVAE
    from safetensors.torch import save_file

    from examples.chattts_dvae.adapter import encoder

    torch.manual_seed(0)
    config = Config().dvae
    chattts = DVAE(
        decoder_config=asdict(config.decoder),
        encoder_config=asdict(config.encoder),
        vq_config=asdict(config.vq),
        dim=config.decoder.idim,
    ).eval()
    path = tmp_path / "DVAE.safetensors"
    save_file({k: v.contiguous() for k, v in chattts.state_dict().items()}, str(path))
    made = encoder(checkpoint=str(path))
    assert (
        made.config["dim"] == 512 and made.config["layers"] == 12 and made.config["vq_dim"] == 1024
    )
    mel = torch.randn(1, 64, 100) - 4
    with torch.inference_mode():
        ours = made.module(mel)
        x = chattts.downsample_conv(mel.transpose(1, 2) / chattts.coef)
        theirs = chattts.vq_layer(chattts.encoder(x))  # [B, 4, T / 2]
    assert ours.shape == (1, 32, 4) and torch.equal(ours, theirs.transpose(1, 2).long())


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("folder", "../../etc", "folder = '../../etc', expected its own"),
        ("shape", "4", "shape = '4'"),
        ("dtype", "object", "dtype = 'object'"),
        ("rows", {"sha256": "x"}, "expected its sha256"),
        ("shards", [{"name": "/etc/passwd"}], "is not a shard name"),
    ],
)
def test_a_forged_field_entry_is_one_line_before_any_file_is_opened(
    derived: Path, tmp_path: Path, key: str, value: object, said: str
) -> None:
    import melcache
    from melcache.errors import UserError

    cache = tmp_path / "cache"
    shutil.copytree(derived, cache)
    index = json.loads((cache / "index.json").read_text())
    index["fields"]["codes"][key] = value
    (cache / "index.json").chmod(0o644)
    (cache / "index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=re.escape(said)) as raised:
        melcache.open(cache)
    assert "\n" not in str(raised.value)


@pytest.fixture
def cache(train_cache: Path, tmp_path: Path) -> Path:
    """A copy of ``train_cache`` to derive into."""
    return Path(shutil.copytree(train_cache, tmp_path / "cache"))


@pytest.mark.slow
def test_non_finite_encoder_outputs_never_enter_a_field(cache: Path) -> None:
    """NaN from the encoder, or finite values that overflow the field's float16, are refused in
    one line naming the shard and key; nothing is listed in the index."""
    for factory, why in [("nan_encoder", r"\d+ non-finite values \(NaN or infinity\), refused"),
                         ("huge_encoder", r"overflows float16")]:  # fmt: skip
        done = run_preprocess("derive", str(cache), "--field", "bad", "--encoder",
                              f"tests.support.plugin_encoders:{factory}", "--workers", "1", check=False)  # fmt: skip
        assert done.returncode == 2 and one_error(done.stderr), done.stderr
        assert re.search(rf"/b\d+-\d+\.tar:\S+: the encoder.*({why})", done.stderr), done.stderr
        assert "bad" not in json.loads((cache / "index.json").read_text()).get("fields", {})


# A derive of an older release, which stored what its encoder gave (_stored did not look): a
# sitecustomize, so derive's spawned workers run it too.
OLDER_DERIVE = """
import preprocess.write.field_shard as field_shard
field_shard._stored = lambda values, encoder, frames: values.astype(encoder.dtype)
"""


@pytest.mark.slow
def test_a_stored_non_finite_field_is_refused_by_verify_random_access_and_the_loader(
    cache: Path, tmp_path: Path
) -> None:
    args = ["derive", str(cache), "--field", "bad", "--encoder", "tests.support.plugin_encoders:nan_encoder",
            "--workers", "1"]  # fmt: skip
    (tmp_path / "older").mkdir()
    (tmp_path / "older" / "sitecustomize.py").write_text(OLDER_DERIVE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "older"), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "preprocess", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr  # digests and all: its shards check out
    done = run_preprocess("verify", str(cache), check=False)
    assert done.returncode != 0 and "non-finite values (NaN or infinity) in a float field" in (
        done.stdout + done.stderr
    )
    import melcache
    from melcache.errors import ShardError

    with melcache.open(cache) as opened, pytest.raises(ShardError, match=r"non-finite values"):
        opened[0].fields["bad"]
    from melcache.loader import DataConfig, make_loader

    config = DataConfig(batch_frames=2000, fields=("bad",), num_workers=0)
    with pytest.raises(ShardError, match=r"\.tar:\S+: non-finite values \(NaN or infinity\)"):
        next(iter(make_loader(str(cache), config)))


@pytest.mark.slow
def test_failing_user_code_is_one_line_naming_it_then_its_own_frames(cache: Path) -> None:

    def derive(encoder: str) -> list[str]:
        done = run_preprocess("derive", str(cache), "--field", "x", "--encoder", encoder,
                              "--workers", "1", check=False)  # fmt: skip
        assert done.returncode == 2, done.stderr
        return [line for line in done.stderr.splitlines() if not line.startswith("deriving ")]

    first, *frames = derive("tests.support.plugin_encoders:failing_encoder")
    assert re.fullmatch(
        r"error: the encoder tests\.support\.plugin_encoders\._Failing failed on \S+/b\d+-\d+\.tar:\S+ "
        r"\(its batch's first key; mel \[\d+, \d+, 100\]\): RuntimeError: boom inside encoder",
        first,
    ), first
    assert any("plugin_encoders.py" in f for f in frames) and "raise RuntimeError" in frames[-1]
    assert not any("/preprocess/" in f or "/torch/" in f for f in frames), frames
    (line,) = derive("os:system")  # no factory, and no frame of the user's to show
    assert line.startswith("error: --encoder 'os:system' failed when called as a factory")
    assert "TypeError" in line
