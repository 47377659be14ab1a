"""Derived fields: derive throughput and field size, beside computing the codes in the step.

    python -m benchmarks.build.derive_bench [--cache DIR] [--size tiny|released] [--batches 20]
                                      [--workers 1] [--data DIR]

1. Builds the committed sample corpus (``examples/sample_corpus.toml``) into ``--data``
   unless ``--cache`` names a cache, and saves a random-init ChatTTS DVAE (``--size``:
   ``released`` is ChatTTS's own config, dim 512, 12 layers; ``tiny`` the example config's)
   as a weights file: nothing can be downloaded here, and the encoder's cost does not
   depend on its weights.
2. Per device (CPU; CUDA too where there is one): ``preprocess derive --field codes`` of the
   whole cache with that file, timed: utterances/s and audio hours per hour; then the field's
   bytes per audio hour (the sidecar shards as stored, and the codes alone).
3. Where derive's time goes, on CPU: every shard's real ``derive_shard`` (one process, one
   thread, as one worker runs it), with the calls it makes timed: reading the mel shard
   (read, checked, split into samples), decoding the mels, the encoder's forward
   (``run_encoder``: the batch to the device, the forward, the result back), padding the
   batches and checking the results (the rest of ``encode_all``), and writing the field shard
   and its receipt (the rest). The forward's share is derive's throughput over its encoder's
   bare forward on the same batches.
4. Side by side, per batch of the loader (``[data] batch_frames`` 2000, one process): the
   encoder's forward on the batch's mel (what a trainer would do at every step without the
   field), against what reading the field adds to the loader (batches with ``data.fields =
   ["codes"]`` against without), and against a loader reading the field alone
   (``read_mel = false``: no mel shard opened).

One JSON line per row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.caches import build_sample_cache
from benchmarks.common.timed_calls import timing

REPO = Path(__file__).resolve().parents[2]
ENCODER = "examples.chattts_dvae.adapter:encoder"
SIZES = {
    "tiny": {"dim": 64, "hidden": 32, "layers": 2, "bn_dim": 16, "vq_dim": 128},
    "released": {},
}


def weights_file(size: str, folder: Path) -> Path:
    """A random-init DVAE of ``size`` saved as a plain state dict (``weights_only`` loads it)."""
    from examples.chattts_dvae.adapter import DVAE

    torch.manual_seed(0)
    args = SIZES[size]
    path = folder / f"dvae-{size}.pt"
    torch.save(DVAE(n_mels=100, **args).dvae.state_dict(), path)
    return path


def derive_row(cache: Path, weights: Path, device: str, workers: int) -> dict[str, Any]:
    """One timed derive of ``cache`` (a fresh copy) on ``device``."""
    from preprocess.derive import DeriveOptions, derive

    target = Path(tempfile.mkdtemp(prefix="derive-bench-")) / "cache"
    shutil.copytree(cache, target)
    started = time.perf_counter()
    entry = derive(DeriveOptions(target, "codes", ENCODER, str(weights), (0, 1), workers, device))
    wall = time.perf_counter() - started
    index = json.loads((target / "index.json").read_text())
    hours, utterances = index["totals"]["hours"], index["totals"]["utterances"]
    assert entry is not None
    payload = entry["totals"]["frames"] * 4 * 2  # int16 × 4 codebooks
    shutil.rmtree(target.parent)
    return {
        "row": f"derive codes ({device}, {workers} worker)",
        "utterances": utterances,
        "audio_hours": hours,
        "wall_s": round(wall, 2),
        "utterances_per_s": round(utterances / wall, 1),
        "audio_hours_per_hour": round(hours / (wall / 3600), 1),
        "field_mb_per_audio_hour": round(entry["totals"]["bytes"] / 1e6 / hours, 2),
        "codes_alone_mb_per_audio_hour": round(payload / 1e6 / hours, 3),
        "mel_mb_per_audio_hour": round(sum(s["bytes"] for s in index["shards"]) / 1e6 / hours, 1),
    }


def split_row(cache: Path, weights: Path) -> dict[str, Any]:
    """Each shard's ``derive_shard`` on CPU in this process, the calls it makes timed."""
    from melcache.index import index_storage
    from preprocess.write import field_shard
    from preprocess.write.field_shard import DeriveJob, init_worker, load_encoder

    index = json.loads((cache / "index.json").read_text())
    init_worker(load_encoder(ENCODER, str(weights), "cpu"), "cpu")
    out = Path(tempfile.mkdtemp(prefix="derive-split-"))
    jobs = [
        DeriveJob(str(cache), entry, out, out / f"{entry['name']}.json", "codes", "bench",
                  int(index["features"]["n_mels"]), index_storage(index),
                  field_shard.log_floor_value(index["features"]))
        for entry in index["shards"]
    ]  # fmt: skip
    calls = ["read_shard", "load_shard", "decode_mel", "encode_all", "run_encoder"]
    field_shard.derive_shard(jobs[0])  # warm: the first forward allocates
    with timing(field_shard, calls) as spent:
        started = time.perf_counter()
        for job in jobs:
            field_shard.derive_shard(job)
        total = time.perf_counter() - started
    shutil.rmtree(out)
    parts = {
        "read_s": spent["read_shard"] + spent["load_shard"],
        "decode_s": spent["decode_mel"],
        "forward_s": spent["run_encoder"],
        "pad_and_check_s": spent["encode_all"] - spent["run_encoder"],
    }
    parts["write_s"] = total - sum(parts.values())
    return {
        "row": "derive split (cpu, 1 thread)",
        "shards": len(jobs),
        "utterances": index["totals"]["utterances"],
        "total_s": round(total, 3),
        **{name: round(seconds, 4) for name, seconds in parts.items()},
        **{f"{name[:-2]}_pct": round(100 * seconds / total, 2) for name, seconds in parts.items()},
        "derive_over_bare_forward": round(parts["forward_s"] / total, 3),
    }


def step_rows(cache: Path, weights: Path, batches: int) -> list[dict[str, Any]]:
    """Per batch: the encoder's forward on the mel against reading the field."""
    from examples.chattts_dvae.adapter import encoder
    from melcache.loader import DataConfig, make_loader

    device = "cuda" if torch.cuda.is_available() else "cpu"
    made = encoder(checkpoint=str(weights), device=device)
    base = DataConfig(batch_frames=2000, num_workers=0)
    rows = []
    forward: list[float] = []
    for name, data in (
        ("loader, mel only", base),
        ("loader, mel + codes", dataclasses.replace(base, fields=("codes",))),
        (
            "loader, codes alone (read_mel = false)",
            dataclasses.replace(base, fields=("codes",), read_mel=False),
        ),
    ):
        loader = make_loader(cache, data)
        stream = iter(loader)
        next(stream)  # warm: the first shard reads and the worker's start
        started = time.perf_counter()
        for _ in range(batches):
            batch = next(stream)
            if data is base:  # the alternative: the codes computed in the step, from the mel
                mel = batch.mel.to(device).float()
                begun = time.perf_counter()
                with torch.inference_mode():
                    made.module(mel)
                if device == "cuda":
                    torch.cuda.synchronize()
                forward.append(time.perf_counter() - begun)
        wall = time.perf_counter() - started - (sum(forward) if data is base else 0.0)
        loader.close()
        rows.append({"row": name, "ms_per_batch": round(1e3 * wall / batches, 3)})
    rows.append(
        {
            "row": f"DVAE encoder forward in the step ({device})",
            "ms_per_batch": round(1e3 * sum(forward) / batches, 3),
        }
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, help="a built cache (default: the sample corpus)")
    parser.add_argument("--size", choices=sorted(SIZES), default="released")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "derive-bench")
    args = parser.parse_args()
    args.data.mkdir(parents=True, exist_ok=True)
    cache = args.cache
    if cache is None:
        cache = args.data / "cache"
        if not (cache / "index.json").exists():
            build_sample_cache(cache, REPO / "examples" / "sample_corpus.toml")
    weights = weights_file(args.size, args.data)
    torch.set_num_threads(1)  # as derive's workers run; the step's forward on one thread too
    devices = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    rows = [derive_row(cache, weights, device, args.workers) for device in devices]
    rows.append(split_row(cache, weights))
    derived = args.data / f"derived-{args.size}"
    if not (derived / "index.json").exists() or "fields" not in json.loads(
        (derived / "index.json").read_text()
    ):
        shutil.rmtree(derived, ignore_errors=True)
        shutil.copytree(cache, derived)
        from preprocess.derive import DeriveOptions, derive

        derive(DeriveOptions(derived, "codes", ENCODER, str(weights)))
    rows += step_rows(derived, weights, args.batches)
    for row in rows:
        print(json.dumps({"size": args.size, **row}))


if __name__ == "__main__":
    main()
