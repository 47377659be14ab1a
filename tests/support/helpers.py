"""Helpers shared by the test rooms: the sample corpus and how to build it, fault-injection
tools (builds to kill, a tiny disk, permissions that bind on root), and real 2-process
torchrun jobs.

Every process started by :func:`started` runs in its own session, so a test can SIGKILL the
build alone (as ``kill -9 PID`` would) or its whole process group (as a job scheduler would),
and a ``finally`` can always reap what is left.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from melcache.format import INDEX_NAME, REJECTED_NAME, decode_meta, fast_decode_mel
from melcache.host.lock import process_stat
from melcache.reader import DIGESTS
from melcache.tar.reader import group_samples, iter_members

# ---- the sample corpus and the build ------------------------------------------------------
REPO = Path(__file__).resolve().parents[2]
SAMPLE_CORPUS = REPO / "examples" / "wavs"
# Few buckets and small shards: the 30-utterance corpus then spreads over ≥ 8 shards,
# enough for 2 ranks × 2 workers.
SMALL_SHARDS_TOML = """
[build]
num_buckets = 4
min_shards = 8
"""


def run_preprocess(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``python -m preprocess ARGS`` as a user would; return the finished process."""
    done = subprocess.run(
        [sys.executable, "-m", "preprocess", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"preprocess {' '.join(args)} exited {done.returncode}:\n{done.stderr}"
        )
    return done


def build_cache(out: Path, config: Path, *extra: str) -> Path:
    """Build the sample corpus into ``out`` with ``config``, one worker, as a user would."""
    run_preprocess(
        "build",
        "--src",
        str(SAMPLE_CORPUS),
        "--out",
        str(out),
        "--config",
        str(config),
        "--workers",
        "1",
        *extra,
    )
    return out


# Short utterances only (≤ 4.5 s, 23 of the 30): attention cost grows with the square of the
# length, and the trainer tests run several 2-process jobs on shared CPU cores.
TRAIN_CACHE_TOML = """
[build]
num_buckets = 3
min_shards = 8
max_seconds = 4.5
"""


# ---- fault injection ---------------------------------------------------------------------
RECEIPTS = ".build"  # preprocess.write.mel_shard.RECEIPTS; importing it would import torch here
# Capabilities that let root read and search anything whatever its mode bits say.
READ_OVERRIDES = "-dac_override,-dac_read_search"


def build_args(src: Path, out: Path, *extra: str) -> list[str]:
    """``build --src SRC --out OUT EXTRA…``: arguments for ``run_preprocess``."""
    return ["build", "--src", str(src), "--out", str(out), *extra]


def build_command(src: Path, out: Path, *extra: str) -> list[str]:
    """``python -m preprocess build --src SRC --out OUT EXTRA…`` as a command line."""
    return [sys.executable, "-m", "preprocess", *build_args(src, out, *extra)]


# ---- the same audio in other layouts ----------------------------------------------------


def encoded(path: Path, extension: str) -> bytes:
    """The audio of ``path`` encoded as ``extension`` (mp3, flac, wav) by soundfile."""
    audio, rate = sf.read(path, dtype="float32")
    buffer = io.BytesIO()
    sf.write(buffer, audio, rate, format=extension.upper())
    return buffer.getvalue()


def read_samples(shard: Path) -> list[dict]:
    """The samples of one shard, read with melcache.format's general reader."""
    with open(shard, "rb") as stream:
        return list(group_samples(iter_members(stream, shard.name), shard.name))


def mels_by_text(cache: Path) -> dict[str, np.ndarray]:
    """Every mel of a cache, by its utterance's text: how two layouts' caches are compared."""
    found = {}
    for shard in sorted(cache.glob("*.tar")):
        with open(shard, "rb") as stream:
            for sample in group_samples(iter_members(stream, shard.name), shard.name):
                meta = decode_meta(sample["json"], shard.name)
                found[meta["text"]] = fast_decode_mel(sample["mel.npy"], 100, shard.name)
    return found


@contextlib.contextmanager
def started(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``command`` in a new session (stdout and stderr to ``log``); SIGKILL its group on exit."""
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def receipts(out: Path) -> int:
    """Shards a build in ``out`` has acknowledged so far."""
    return len(list((out / RECEIPTS).glob("*.json")))


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Poll ``condition`` every 5 ms until it holds (True) or ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


def group_gone(pgid: int, timeout: float) -> bool:
    """Whether every process of group ``pgid`` (orphaned pool workers too) exits in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _live_members(pgid):
            return True
        time.sleep(0.02)
    return False


def _live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies: an orphan exits into a zombie that
    only its new parent can reap, and PID 1 of a container may never do so."""
    if not Path("/proc/self/stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = process_stat(int(stat.parent.name))
        if fields is None:
            continue  # exited while we looked
        state, _, pgrp = fields[:3]
        if int(pgrp) == pgid and state != "Z":
            live.append(int(stat.parent.name))
    return live


def pool_workers(pid: int) -> list[int]:
    """Child process ids of ``pid`` (Linux /proc); the test is skipped elsewhere."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if not children.exists():
        pytest.skip("needs /proc/PID/task/PID/children (Linux) to find the pool workers")
    return [int(x) for x in children.read_text().split()]


def cache_digests(cache: Path) -> dict[str, str]:
    """sha256 of every shard, of index.json and of rejected.jsonl."""
    paths = [*sorted(cache.glob("*.tar")), cache / INDEX_NAME, cache / REJECTED_NAME]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def recorded(data: bytes) -> dict[str, int | str]:
    """What a build's index records of a shard's bytes (size and every digest): for a test
    that rewrites a shard together with its index entry."""
    return {"bytes": len(data), **{field: digest(data) for field, digest in DIGESTS.items()}}


def tree(root: Path) -> list[str]:
    """Every path under ``root``, relative and sorted: a snapshot to compare."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---- a small disk ------------------------------------------------------------------------
@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``mount`` syntax, e.g. ``900k``) on ``folder``, or skip."""
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount/umount here: cannot make a small disk to fill")
    done = _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(folder))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs (needs root or CAP_SYS_ADMIN): {done.stderr}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True, timeout=60).returncode:
            subprocess.run(["umount", "-l", str(folder)], check=True, timeout=60)  # busy: detach


def resize_tmpfs(folder: Path, size: str) -> None:
    """Grow a tmpfs mounted by :func:`small_tmpfs` in place, keeping its files (space freed)."""
    done = _mount("-o", f"remount,size={size}", str(folder))
    assert done.returncode == 0, f"cannot resize the tmpfs on {folder}: {done.stderr}"


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=60)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout, done.stderr.strip())


# ---- permissions that bind -----------------------------------------------------------------
@functools.cache
def _read_override_prefix() -> tuple[tuple[str, ...], str]:
    """A command prefix under which mode bits bind, or ``((), reason)`` when none works."""
    if os.geteuid() != 0:
        return (), ""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return (), "running as root without setpriv: a chmod 000 file stays readable"
    # Root keeps its uid (so the interpreter and packages under /root stay reachable) but
    # loses the two capabilities that bypass permission bits, for the command and its children.
    prefix = (setpriv, f"--bounding-set={READ_OVERRIDES}", f"--inh-caps={READ_OVERRIDES}")
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"melcache-unreadable-{os.getpid()}"
    probe.write_text("secret")
    probe.chmod(0)
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-c", f"open({str(probe)!r}).read()"],
            capture_output=True,
            timeout=60,
        )
    finally:
        probe.unlink()
    if done.returncode == 0:
        return (), "root still reads a chmod 000 file after dropping CAP_DAC_OVERRIDE here"
    return prefix, ""


def unprivileged_prefix() -> list[str]:
    """Prefix for a command that must not read files it has no permission for; else skip."""
    prefix, reason = _read_override_prefix()
    if reason:
        pytest.skip(reason)
    return list(prefix)


# ---- 2-process torchrun jobs (gloo on CPU) ----------------------------------------------
PROBE = Path(__file__).with_name("train_probe.py")
# Overrides of the tiny config for one-process CPU trainers (tiny_trainer, tiny_fit): the
# smallest model, no workers, no dropout, so each test run is fast and deterministic.
IN_PROCESS = [
    "data.batch_frames=800",
    "data.num_workers=0",
    "model.args.dim=32",
    "model.args.layers=1",
    "model.args.dropout=0.0",
    "model.args.prenet_dropout=0.0",
    "train.precision=fp32",
    "train.log_every=2",
    "train.checkpoint.every=100",
]
STEPS = 20
# Small and fp32 (bitwise comparisons); one loader worker process per rank, as in real runs.
SMALL = [
    "data.batch_frames=800",
    "data.num_workers=1",
    "model.args.dim=64",
    "model.args.layers=2",
    "train.precision=fp32",
    "train.log_every=5",
    "train.checkpoint.every=5",
    "train.ema_decay=0.99",
]


def torchrun(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        *args,
    ]


def train_cmd(
    cache: Path,
    out: Path,
    *extra: str,
    max_steps: int = STEPS,
    entry: tuple[str, ...] = ("-m", "train"),
) -> list[str]:
    return torchrun(
        *entry,
        "--shards",
        str(cache),
        "--config",
        str(REPO / "configs" / "tiny.toml"),
        "--out",
        str(out),
        "--max-steps",
        str(max_steps),
        *SMALL,
        *extra,
    )


def tiny_trainer(cache: Path, out: Path, overrides: list[str]):  # -> train.trainer.Trainer
    """A :class:`~train.trainer.Trainer` of the tiny config with ``overrides``, in this process
    on the CPU (imported here, not at the top: the build tests need no trainer)."""
    from train.config.tables import load_config
    from train.parallel.env import Env
    from train.trainer import Trainer

    cfg = load_config(REPO / "configs" / "tiny.toml", overrides)
    return Trainer(cfg, str(cache), out, Env(0, 1, 0, torch.device("cpu")))


def tiny_fit(cache: Path, out: Path, steps: int, overrides: list[str]):
    """:func:`tiny_trainer` trained to ``steps`` and closed."""
    t = tiny_trainer(cache, out, overrides)
    try:
        t.fit(max_steps=steps)
    finally:
        t.close()
    return t


def run_ok(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def checkpoint(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


def load(path: Path, name: str = "shared.pt") -> dict:
    return torch.load(path / name, map_location="cpu", weights_only=True)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (torchrun's worker processes), from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry.name))
    return children


def processes_naming(tag: str) -> list[int]:
    """Live processes with ``tag`` as one of their arguments (torchrun, its ranks, and their
    forked loader workers all carry the run's ``--out`` path)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # exited while we looked
        if tag.encode() in args and state != "Z" and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def same_weights(a: Path, b: Path) -> None:
    """Checkpoints ``a`` and ``b`` hold bitwise the same model, EMA, AdamW moments and
    adaptive states."""
    sa, sb = load(a), load(b)
    for key, tensor in sa["model"].items():
        assert torch.equal(tensor, sb["model"][key]), key
    for name, tensor in sa["ema"]["shadow"].items():
        assert torch.equal(tensor, sb["ema"]["shadow"][name]), name
    for pid, moments in sa["optimizer"]["state"].items():
        for key, tensor in moments.items():
            assert torch.equal(tensor, sb["optimizer"]["state"][pid][key]), (pid, key)
    for part in ("clip", "spikes", "noise_scale"):
        for key, value in sa.get(part, {}).items():
            other = sb[part][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other


def same_ddp_run(a: Path, b: Path) -> None:
    """:func:`same_weights`, and each of 2 ranks' loader position and torch RNG equal (the
    sub-streams named by content digest and bucket: the same cache may lie elsewhere)."""
    same_weights(a, b)
    for rank in (0, 1):
        ra, rb = load(a, f"rank-{rank:05d}.pt"), load(b, f"rank-{rank:05d}.pt")
        assert _placeless(ra["loader"]) == _placeless(rb["loader"])
        assert torch.equal(ra["rng"]["torch"], rb["rng"]["torch"])


def _placeless(state: dict) -> dict:
    """A loader state without the caches' locations (``streams``' first item)."""
    return {**state, "streams": [key[1:] for key in state.get("streams", [])]}


def dcp_weights(out: Path, step: int) -> dict:
    """The DCP shards of checkpoint ``step`` of a 2-rank FSDP2/HSDP run, gathered into plain
    tensors, by dotted key."""
    from train.run import dcp

    folder = checkpoint(out, step) / dcp.WEIGHTS
    assert (folder / ".metadata").is_file() and len(list(folder.glob("*.distcp"))) == 2
    return flat(dcp.read_full(folder))


def flat(tree: dict, prefix: str = "") -> dict:
    """A nested dict's leaves by dotted key."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


DVAE_ENCODER = "examples.chattts_dvae.adapter:encoder"  # ChatTTS's codes, for --encoder


def derive_args(cache: Path, run: Path, *extra: str) -> list[str]:
    """``preprocess derive`` of ChatTTS's codes into ``cache`` with the DVAE run ``run``."""
    return ["derive", str(cache), "--field", "codes", "--encoder", DVAE_ENCODER, "--checkpoint",
            str(run), "--workers", "1", *extra]  # fmt: skip


S3_BUCKET = "caches"  # the bucket conftest's endpoint fixture makes on its S3 server


def needs_extra(module: str, extra: str) -> object:
    """``module`` imported, or the test skipped with a reason naming the pyproject ``extra``
    that brings it: the README installs only ``.[test]``, CI adds the examples' extras."""
    return pytest.importorskip(
        module, reason=f"needs the {extra!r} extra: pip install -e '.[{extra}]'"
    )
