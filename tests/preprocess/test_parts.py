"""Builds split across parts and corpora planned without opening them (issue #13): each part
scans only its share, parts meet through OUT or torchrun, scans and plans are reused, and
manifest lengths spare the audio headers but never silently change an utterance."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf

from tests.support.helpers import (
    REPO,
    SAMPLE_CORPUS,
    build_args,
    build_command,
    cache_digests,
    run_ok,
    run_preprocess,
    torchrun,
)

pytestmark = pytest.mark.slow  # builds in subprocesses

# Runs `python -m preprocess ARGS` recording every file Python opens (an audit hook) and every
# file libsndfile opens (soundfile's SoundFile): audio is checked by a stat, then read in C.
AUDITED = """
import json, runpy, sys
import soundfile
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
sound_file = soundfile.SoundFile.__init__
def recorded(self, file, *args, **kwargs):
    opened.append(str(file))
    sound_file(self, file, *args, **kwargs)
soundfile.SoundFile.__init__ = recorded
log, sys.argv = sys.argv[1], ["preprocess", *sys.argv[2:]]
try:
    runpy.run_module("preprocess", run_name="__main__")
finally:
    with open(log, "w") as file:
        json.dump(opened, file)
"""


def audited(log: Path, *args: str) -> subprocess.Popen[str]:
    """Start an audited ``python -m preprocess ARGS`` (one process: use ``--workers 1``)."""
    command = [sys.executable, "-c", AUDITED, str(log), *args]
    return subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finished(proc: subprocess.Popen[str]) -> str:
    """Wait for ``proc``; return its stdout, failing with its stderr on a non-zero exit."""
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    return stdout


def opened_inputs(log: Path, corpus: Path) -> set[str]:
    """Corpus files (audio and transcripts) a run opened, relative to the corpus."""
    root = str(corpus.resolve())
    return {
        os.path.relpath(p, root) for p in json.loads(log.read_text()) if p.startswith(root + os.sep)
    }


def copy_corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    shutil.copytree(SAMPLE_CORPUS, corpus)
    return corpus


def test_each_part_scans_only_its_share(tmp_path: Path) -> None:
    """Three parts at once: every audio file and transcript is opened by exactly one part,
    each opens a third, and the last part prints the plan of the whole corpus."""
    corpus, out = copy_corpus(tmp_path), tmp_path / "out"
    procs = [
        audited(
            tmp_path / f"part{k}.json",
            *build_args(corpus, out, "--workers", "1", "--part", f"{k}/3", "--dry-run"),
        )
        for k in range(3)
    ]
    printed = [finished(p) for p in procs]
    shares = [opened_inputs(tmp_path / f"part{k}.json", corpus) for k in range(3)]
    audio = {str(p.relative_to(corpus)) for p in corpus.rglob("*") if p.suffix in (".wav", ".flac")}
    assert len(audio) == 30 and set.union(*shares) == audio | {
        str(p.relative_to(corpus)) for p in corpus.rglob("*.txt")
    }
    for k, share in enumerate(shares):
        assert len(share & audio) == 10, f"part {k} opened {sorted(share & audio)}"
        stems = {os.path.splitext(p)[0] for p in share}
        assert len(stems) == 10  # its transcripts are those of its own audio files
        for other in shares[k + 1 :]:
            assert not share & other
    assert sum("30 utterances" in p for p in printed) >= 1  # whoever scanned last planned


def test_parts_at_once_equal_one_build_and_reuse_scan_and_plan(
    tmp_path: Path, sample_cache: Path, small_shards_config: Path
) -> None:
    """Two parts started together end with the one-part build's cache; a rerun of a part opens
    no corpus file to plan (scan and plan are reused) and finds every shard done."""
    out = tmp_path / "out"
    args = ["--config", str(small_shards_config), "--workers", "1"]
    procs = [
        subprocess.Popen(
            build_command(SAMPLE_CORPUS, out, *args, "--part", f"{k}/2"),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(2)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr
        assert "another build is writing" not in stderr  # parts are expected, not duplicates
    assert cache_digests(out) == cache_digests(sample_cache)
    log = tmp_path / "rerun.json"
    finished(audited(log, *build_args(SAMPLE_CORPUS, out, *args, "--part", "0/2")))
    assert opened_inputs(log, SAMPLE_CORPUS) == set()
    assert cache_digests(out) == cache_digests(sample_cache)


def test_torchrun_build_equals_one_process_build(
    tmp_path: Path, sample_cache: Path, small_shards_config: Path
) -> None:
    """``torchrun --nproc-per-node 2 -m preprocess build``: two ranks, gloo barriers, one cache
    byte for byte equal to a single process's."""
    out = tmp_path / "out"
    done = run_ok(
        torchrun(
            "-m",
            "preprocess",
            *build_args(SAMPLE_CORPUS, out, "--config", str(small_shards_config), "--workers", "1"),
        )
    )
    assert cache_digests(out) == cache_digests(sample_cache)
    assert "part 1/2 done" in done.stderr  # rank 1 wrote its half; rank 0 the index


def test_rank_without_torchrun_builds_the_whole_corpus(
    tmp_path: Path, sample_cache: Path, small_shards_config: Path
) -> None:
    """RANK/WORLD_SIZE exported by a launcher that is not torchrun split nothing, loudly."""
    out = tmp_path / "out"
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "4"}
    done = subprocess.run(
        build_command(SAMPLE_CORPUS, out, "--config", str(small_shards_config), "--workers", "1"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "not torchrun: building the WHOLE corpus" in done.stderr
    assert cache_digests(out) == cache_digests(sample_cache)


def test_dry_run_prints_the_plan_and_the_build_reuses_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_preprocess(*build_args(SAMPLE_CORPUS, out, "--workers", "1", "--dry-run"))
    assert "30 utterances" in done.stdout and " shards, about " in done.stdout
    assert "rejected before decoding: 0" in done.stdout
    assert not list(out.glob("*.tar")) and not (out / "index.json").exists()
    meta = out / ".build" / "scan-1" / "part-0" / "meta.json"
    scanned = json.loads(meta.read_text())["scan_id"]
    done = run_preprocess(*build_args(SAMPLE_CORPUS, out, "--workers", "1"))
    assert "not scanning again" in done.stderr
    assert json.loads(meta.read_text())["scan_id"] == scanned
    assert json.loads((out / "index.json").read_text())["totals"]["utterances"] == 30


def manifest_corpus(tmp_path: Path) -> tuple[Path, dict[str, float]]:
    """A manifest over the sample corpus whose rows give their lengths, three ways."""
    root = copy_corpus(tmp_path)
    rows, seconds = [], {}
    for audio in sorted(root.rglob("*.wav")) + sorted(root.rglob("*.flac")):
        source = str(audio.relative_to(root))
        info = sf.info(audio)
        seconds[source] = info.frames / info.samplerate
        row = {"audio_filepath": source, "text": audio.with_suffix(".txt").read_text()}
        if len(rows) % 2:
            row |= {"num_samples": info.frames, "sampling_rate": info.samplerate}
        else:
            row["duration"] = round(seconds[source], 6)
        rows.append(row)
    rows[0]["duration"] += 0.004  # within one hop (10.7 ms at 24 kHz): padded, kept
    rows[2]["duration"] += 0.5  # a wrong duration: rejected when decoded
    manifest = root / "train.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest, seconds


def test_manifest_lengths_plan_without_opening_audio(tmp_path: Path) -> None:
    manifest, _ = manifest_corpus(tmp_path)
    out, log = tmp_path / "out", tmp_path / "opened.json"
    printed = finished(audited(log, *build_args(manifest, out, "--workers", "1", "--dry-run")))
    assert "30 utterances" in printed
    assert opened_inputs(log, manifest.parent) == {"train.jsonl"}  # no audio header was read
    run_preprocess(*build_args(manifest, out, "--workers", "1"))
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rejected] == [rows[2]["audio_filepath"]]
    assert "decoded length" in rejected[0]["reason"] and rejected[0]["stage"] == "decode"
    assert run_preprocess("verify", str(out)).returncode == 0


def test_changed_transcript_is_caught_and_rescan_recovers(tmp_path: Path) -> None:
    corpus, out = copy_corpus(tmp_path), tmp_path / "out"
    run_preprocess(*build_args(corpus, out, "--workers", "1", "--dry-run"))
    transcript = corpus / "zh" / "zh_01.txt"
    with open(transcript, "a") as file:  # edited in place: no folder listing changes
        file.write(" 补充")
    done = run_preprocess(*build_args(corpus, out, "--workers", "1"), check=False)
    assert done.returncode == 2 and "zh_01.wav" in done.stderr and "--rescan" in done.stderr
    run_preprocess(*build_args(corpus, out, "--workers", "1", "--rescan"))
    (corpus / "zh" / "zh_01.wav").unlink()  # a listing change: scanned again without asking
    run_preprocess(*build_args(corpus, out, "--workers", "1"))
    index = json.loads((out / "index.json").read_text())
    assert index["totals"]["discovered"] == 29
    assert sorted(p.name for p in out.glob("*.tar")) == sorted(s["name"] for s in index["shards"])
    assert run_preprocess("verify", str(out)).returncode == 0


def test_where_builds_the_selection_and_counts_the_rest(tmp_path: Path) -> None:
    manifest, _ = manifest_corpus(tmp_path)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    for number, row in enumerate(rows):
        row |= {"language": "zh" if number % 3 == 0 else "en", "dnsmos": 2.5 + number / 10}
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, where = tmp_path / "out", 'language == "en" and dnsmos >= 3.2'
    kept = [r for r in rows if r["language"] == "en" and r["dnsmos"] >= 3.2]
    done = run_preprocess(
        *build_args(manifest, out, "--workers", "2", "--where", where, "--dry-run")
    )
    assert f"left out by --where: {len(rows) - len(kept)}" in done.stdout
    done = run_preprocess(*build_args(manifest, out, "--workers", "2", "--where", where))
    assert f"{len(rows) - len(kept)} left out by --where" in done.stdout
    index = json.loads((out / "index.json").read_text())
    assert index["totals"]["filtered_out"] == len(rows) - len(kept)
    assert index["totals"]["discovered"] == len(kept)  # left out is not rejected
    assert run_preprocess("verify", str(out)).returncode == 0
    assert "left out by --where" in run_preprocess("inspect", str(out)).stdout
    bad = run_preprocess(
        *build_args(manifest, tmp_path / "bad", "--where", "open('x')"), check=False
    )
    assert bad.returncode == 2 and "--where" in bad.stderr and "Traceback" not in bad.stderr


def _builds_at_once(out: Path, runs: list[tuple[list[str], dict[str, str]]]) -> list[str]:
    """Start one build of the sample corpus into ``out`` per (arguments, environment) at once
    (parts wait for each other); their stderr, each having exited 0."""
    procs = [
        subprocess.Popen(
            build_command(SAMPLE_CORPUS, out, *args),
            cwd=REPO,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, env in runs
    ]
    logs = []
    for proc in procs:
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr
        logs.append(stderr)
    return logs


def test_slurm_array_tasks_numbered_from_1_equal_the_parts_they_stand_for(
    tmp_path: Path, sample_cache: Path, small_shards_config: Path
) -> None:
    """``--array=1-2``: task 2 builds part 1/2 (0-based) and says so in its first line; the
    two tasks end with the cache ``--part 0/2`` + ``--part 1/2`` give, byte for byte."""
    args = ["--config", str(small_shards_config), "--workers", "1"]
    task = {"SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "2"}
    out = tmp_path / "array"
    logs = _builds_at_once(out, [(args, {**task, "SLURM_ARRAY_TASK_ID": str(i)}) for i in (1, 2)])
    assert logs[1].splitlines()[0] == (
        f"building part 1/2 (0-based) of {SAMPLE_CORPUS} into {out}: SLURM_ARRAY_TASK_ID=2 "
        "SLURM_ARRAY_TASK_MIN=1 SLURM_ARRAY_TASK_COUNT=2; workers 1 (--workers)"
    )
    assert logs[0].splitlines()[0].startswith("building part 0/2 (0-based)")
    parted = tmp_path / "parted"
    _builds_at_once(parted, [([*args, "--part", f"{k}/2"], {}) for k in (0, 1)])
    assert cache_digests(out) == cache_digests(parted) == cache_digests(sample_cache)
