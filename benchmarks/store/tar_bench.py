"""Build throughput from WebDataset tars of mp3 (the Emilia layout) and from Parquet of mp3
(the Hugging Face layout) against loose wav files.

    python -m benchmarks.store.tar_bench [--hours 0.5] [--workers 2] [--rounds 2] [--data DIR]

Makes (or reuses) a speech corpus with ``benchmarks.common.speech`` (22.05 kHz wav + transcripts),
packs the same utterances as mp3 with Emilia-style json (``text``, ``speaker``,
``duration``) into tars of 500 samples, and the same mp3 and fields into Parquet files of
500 rows in row groups of 100 (``datasets``' size for audio), then builds the three with the
real command, alternating, ``--rounds`` times each, and reports the best real-time factor of
each and their ratios to loose wav. mp3 costs a decoder that wav does not; the tars spare one
file open per utterance and never unpack; Parquet also copies its audio once into the
build's spool. One JSON line per row.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from pathlib import Path

import soundfile as sf

from benchmarks.common.caches import timed_build
from benchmarks.common.speech import make_corpus

PER_TAR = 500
PARQUET_ROW_GROUP = 100


def pack_tars(src: Path, out: Path) -> Path:
    """``src``'s utterances as mp3 + json in ``out/part-NNNNNN.tar``; reused when present."""
    marker = out / ".packed"
    if marker.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    wavs = sorted(src.rglob("*.wav"))
    for start in range(0, len(wavs), PER_TAR):
        with tarfile.open(out / f"part-{start // PER_TAR:06d}.tar", "w") as tar:
            for wav in wavs[start : start + PER_TAR]:
                audio, rate = sf.read(wav, dtype="float32")
                buffer = io.BytesIO()
                sf.write(buffer, audio, rate, format="MP3")
                data = buffer.getvalue()
                info = sf.info(io.BytesIO(data))
                meta = {
                    "text": wav.with_suffix(".txt").read_text(),
                    "speaker": wav.parent.name,
                    "duration": info.frames / info.samplerate,
                }
                key = f"{wav.parent.name}_{wav.stem}"
                for name, payload in (
                    (f"{key}.mp3", data),
                    (f"{key}.json", json.dumps(meta).encode()),
                ):
                    member = tarfile.TarInfo(name)
                    member.size = len(payload)
                    tar.addfile(member, io.BytesIO(payload))
    marker.touch()
    return out


def pack_parquet(tars: Path, out: Path) -> Path:
    """The tars' samples as Parquet rows (``audio`` = ``{bytes, path}``, ``text``, ``speaker``,
    ``duration``), one file per tar; reused when present."""
    import pyarrow as pa  # optional: the [parquet] extra
    import pyarrow.parquet as pq

    marker = out / ".packed"
    if marker.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(tars.glob("*.tar")):
        rows = []
        with tarfile.open(path) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
        for name, data in members.items():
            if name.endswith(".mp3"):
                meta = json.loads(members[name.removesuffix(".mp3") + ".json"])
                rows.append({"audio": {"bytes": data, "path": name}, **meta})
        table = pa.Table.from_pylist(rows)
        pq.write_table(table, out / f"{path.stem}.parquet", row_group_size=PARQUET_ROW_GROUP)
    marker.touch()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", type=Path, default=Path("/tmp/melcache-tar-bench"))
    args = parser.parse_args()
    loose = make_corpus(args.data / f"speech-{args.hours}h", args.hours)
    tars = pack_tars(loose, args.data / f"tars-{args.hours}h")
    parquet = pack_parquet(tars, args.data / f"parquet-{args.hours}h")
    layouts = {"loose wav": loose, "tars of mp3": tars, "parquet of mp3": parquet}
    best = dict.fromkeys(layouts, 0.0)
    audio: dict[str, float] = {}
    for _ in range(args.rounds):  # alternating, so all see the same machine load
        for name, src in layouts.items():
            wall, seconds, _ = timed_build(src, args.data / "cache", args.workers)
            best[name] = max(best[name], seconds / wall)
            audio[name] = seconds
    for name, factor in best.items():
        print(
            json.dumps(
                {
                    "row": name,
                    "audio_hours": round(audio[name] / 3600, 3),
                    "workers": args.workers,
                    "real_time_x": round(factor),
                }
            ),
            flush=True,
        )
    ratios = {
        "tars_over_loose": round(best["tars of mp3"] / best["loose wav"], 2),
        "parquet_over_loose": round(best["parquet of mp3"] / best["loose wav"], 2),
    }
    print(json.dumps({"row": "ratio", **ratios}), flush=True)


if __name__ == "__main__":
    main()
