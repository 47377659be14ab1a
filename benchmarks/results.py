"""Run the benchmarks and write their results tables into docs/results.md (between markers).

    python -m benchmarks.results [--quick]
        [--only results|trainer|loader|scale|tars|storage|budgets|trackers|gpu] [--data DIR]

Runs, one after another on this machine: ``benchmarks.build.build_bench`` (build throughput
against a naive librosa loop), collects the JSON lines it prints, and replaces the section of
docs/results.md between ``<!-- results:begin -->`` and ``<!-- results:end -->`` with a table
naming each row's command and the machine; ``benchmarks/train/trainer_bench.py`` (trainer overhead
and data wait) fills ``<!-- trainer:begin -->`` … ``<!-- trainer:end -->``,
``benchmarks.loader.loader_bench`` (streaming loader against on-the-fly
extraction, and its shard check) fills ``<!-- loader:begin -->`` … ``<!-- loader:end -->``
the same way, ``benchmarks.build.scale_bench`` (planning time and memory per utterance)
``<!-- scale:begin -->``, ``benchmarks.store.tar_bench`` (tars of mp3 against loose wav)
``<!-- tars:begin -->``, ``benchmarks.store.storage_bench`` (fp16 against the compact storage, and
Lhotse's lilcom when installed) ``<!-- storage:begin -->``, ``benchmarks.train.budget_bench`` (one
global batch budget against ``train tune``'s per-bucket table) ``<!-- budgets:begin -->``,
``benchmarks.train.tracker_bench`` (step time with no tracker, a hanging one and TensorBoard)
``<!-- trackers:begin -->``,
and the rows ``bash benchmarks/gpu_bench.sh`` leaves in ``benchmarks/gpu_results.jsonl`` on a GPU machine
fill ``<!-- gpu:begin -->`` … ``<!-- gpu:end -->``. Nothing in the tables is typed by hand.
``--data DIR`` keeps every benchmark's corpora and caches under ``DIR`` (a sub-folder each).

README.md holds no generated section: its "Headline numbers" table is a few figures picked by
hand from docs/results.md, each linking to its table there, and is updated by hand when
those tables change.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "results.md"  # where every section between markers lives


def run_json(command: list[str], data: Path | None = None) -> list[dict[str, Any]]:
    """Run a benchmark (keeping its corpora and caches in ``data`` when given, else where it
    keeps them by default); return every JSON object it printed on stdout (one per line or
    block)."""
    command = [*command, "--data", str(data)] if data else command
    print("$", " ".join(command), file=sys.stderr, flush=True)
    out = subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True).stdout
    decoder, objects, at = json.JSONDecoder(), [], 0
    while (start := out.find("{", at)) != -1:
        obj, at = decoder.raw_decode(out, start)
        objects.append(obj)
    return objects


def machine() -> str:
    """One line naming the machine the numbers came from."""
    cpu = platform.processor() or platform.machine()
    model = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            cpu,
        )
        if Path("/proc/cpuinfo").exists()
        else cpu
    )
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{len(os.sched_getaffinity(0))} cores ({model}), {gpu}, torch {torch.__version__}, Python {platform.python_version()}"


def table(quick: bool, data: Path | None = None) -> str:
    """Run the build benchmark and render its rows as markdown."""
    py = sys.executable
    build_cmd = [py, "-m", "benchmarks.build.build_bench", "--hours", "0.5" if quick else "3"]
    load_before = os.getloadavg()[0]  # others' work on the same cores moves every figure
    build = {row["row"]: row for row in run_json(build_cmd, data and data / "build")}
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    b, naive, comp = (
        build["preprocess build"],
        build["naive librosa loop"],
        build["components, one core"],
    )
    ratio = build["ratio"]
    bound = comp[f"bound_{b['workers']}_workers_x"]
    stock_bound = comp[f"stock_bound_{b['workers']}_workers_x"]
    lines = [
        f"Measured {datetime.date.today()} on {machine()}, by `python -m benchmarks.results` "
        f"(1-minute load average {load}).",
        "",
        "| what | melcache | reference | ratio | command |",
        "|---|---|---|---|---|",
        f"| build, steady real-time factor ({b['workers']} workers, {b['audio_hours']} h) | {b['steady_real_time_x']}× | naive librosa loop {naive['real_time_x']}× | {build['ratio']['build_steady_over_naive']}× | `{_cmd(build_cmd)}` |",
        f"| build, steady, the same corpus already at 24 kHz (no resampling step) | {build['preprocess build, sources already 24 kHz']['steady_real_time_x']}× | | | same |",
        f"| build against its bound: decode + soxr HQ + mel measured alone, same run, × {b['workers']} cores (median of {ratio['rounds']} rounds, each against the bound timed around it) | {b['steady_real_time_x']}× | {bound}× (per core: decode {comp['decode_real_time_x']}×, resample {comp['resample_real_time_x']}×, mel {comp['mel_real_time_x']}×) | {ratio['build_steady_over_component_bound']:.0%} of bound (IQR {_percents(ratio, 'build_steady_over_component_bound_iqr')}) | same |",
        f"| the same in CPU time: the three steps' CPU seconds alone over the build's (all its processes) | {b['cpu_s_per_audio_hour']} CPU s per audio hour | | {ratio['build_cpu_over_component_bound']:.0%} of bound (IQR {_percents(ratio, 'build_cpu_over_component_bound_iqr')}) | same |",
        f"| the same against the concurrent bound: the three steps in {b['workers']} processes at once, as the build's workers run them, timed in the same rounds; it is {ratio['concurrent_bound_over_bound']:.0%} of the bound in wall (IQR {_percents(ratio, 'concurrent_bound_over_bound_iqr')}), {ratio['concurrent_bound_over_bound_cpu']:.0%} in CPU time (IQR {_percents(ratio, 'concurrent_bound_over_bound_cpu_iqr')}) | | | {ratio['build_steady_over_concurrent_bound']:.0%} in wall (IQR {_percents(ratio, 'build_steady_over_concurrent_bound_iqr')}), {ratio['build_cpu_over_concurrent_bound']:.0%} in CPU time (IQR {_percents(ratio, 'build_cpu_over_concurrent_bound_iqr')}) | same |",
        f"| the issue's reference recipe alone (libsndfile float decode + soxr HQ + stock torchaudio mel), same run, × {b['workers']} cores | | {stock_bound}× (per core: decode {comp['decode_stock_real_time_x']}×, mel {comp['mel_stock_real_time_x']}×) | | same |",
        f"| build wall time per hour of audio | {b['wall_s_per_audio_hour']} s | | | same |",
        f"| storage per hour of audio (float16 mel) | {b['cache_mb_per_audio_hour']} MB | 172.8 MB raw 16-bit 24 kHz PCM | | same |",
    ]
    return "\n".join(lines)


def _percents(row: dict[str, Any], key: str) -> str:
    """An interquartile range of ratios as percentages, ``low … high``."""
    low, high = row[key]
    return f"{low:.0%} … {high:.0%}"


def trainer_table(quick: bool, data: Path | None = None) -> str:
    """Run the trainer benchmark and render its rows as markdown: each overhead as the median
    per-round ratio, CPU time / wall, with the CPU time's interquartile range."""
    command = [sys.executable, "benchmarks/train/trainer_bench.py"]
    command += ["--steps", "10" if quick else "20", "--rounds", "3" if quick else "30"]
    trainer = run_json(command)[0]  # one indented JSON object
    o, shrunk, wait = trainer["overhead"], trainer["machinery"], trainer["data_wait"]
    load = ", ".join(f"{x:.1f}" for x in trainer["load_average"])

    def cell(key: str) -> str:
        iqr = o.get(f"{key}_pct_cpu_iqr")
        spread = f" (CPU IQR {iqr[0]:+.1f} … {iqr[1]:+.1f})" if iqr else ""
        return f"{o[f'{key}_pct_cpu']:+.1f} % / {o[f'{key}_pct_wall']:+.1f} %{spread}"

    return "\n".join(
        [
            f"Measured {datetime.date.today()} on {machine()}, by `python -m benchmarks.results "
            f"--only trainer`: {o['rounds']} rounds of {o['steps_per_round']} steps per loop, "
            f"{o['precision']}, bare loop {o['bare_ms_per_step_cpu']} CPU ms per step, load average "
            f"{load} (before, between and after the parts). Each figure is a median of per-round "
            "ratios, so the two parts need not add up to the whole.",
            "",
            "| what | melcache | command |",
            "|---|---|---|",
            f"| trainer overhead vs a bare loop (median, CPU time / wall) | {cell('overhead')} | `{_cmd(command)}` |",
            f"| the recipe's clipping alone (the bare loop + `clip_grad_norm_` at `optim.grad_clip` = {o['grad_clip']:g}, over the bare loop) | {cell('clipping')} | same |",
            f"| the trainer's machinery alone (the trainer over that clipped bare loop) | {cell('overhead_over_clipped')} | same |",
            f"| the trainer's machinery in milliseconds, the model shrunk to nothing (trainer − clipped bare loop, median of {shrunk['rounds']} rounds of {shrunk['steps_per_round']} steps, CPU time / wall) | {shrunk['over_clipped_ms_per_step_cpu']:.2f} ms / {shrunk['over_clipped_ms_per_step_wall']:.2f} ms a step (bare loop {shrunk['bare_ms_per_step_cpu']} CPU ms) | same |",
            f"| trainer data wait, 2-process run on the sample corpus (steady, median of {wait['runs']} runs, range) | {wait['data_wait_pct_steady_median']:.2f} % ({wait['data_wait_pct_steady_range'][0]:.2f} … {wait['data_wait_pct_steady_range'][1]:.2f}) | same |",
        ]
    )


def loader_table(quick: bool, data: Path | None = None) -> str:
    """Run the loader benchmark and render its rows as markdown."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.loader.loader_bench",
        "--hours",
        "0.5" if quick else "4",
    ]
    rows = run_json(command, data and data / "loader")
    base, ratios = rows[0], rows[-1]
    run = {(r["cache"], r["shard_check"]): r for r in rows[1:-1]}
    ours, off, sha = run["current", "fast"], run["current", "off"], run["current", "sha256"]
    old, old_off = run["previous", "fast"], run["previous", "off"]
    cpu = {key: line["one_process_samples_per_cpu_s"] for key, line in run.items()}
    fast, none, sha256 = '`"fast"`', '`"off"`', '`"sha256"`'

    def one_process(key: tuple[str, str], reference: tuple[str, str]) -> str:
        """First / second pass: samples per CPU second against the reference's, and ratios."""
        prefix = f"{key[0]}_{key[1]}_one_process"
        return (
            f"{cpu[key]['first_pass']:.0f} / {cpu[key]['second_pass']:.0f} | "
            f"{cpu[reference]['first_pass']:.0f} / {cpu[reference]['second_pass']:.0f} | "
            f"{ratios[prefix + '_first_pass']:.2f}× / {ratios[prefix + '_second_pass']:.2f}×"
        )

    return "\n".join(
        [
            f"Measured {datetime.date.today()} on {machine()}, by `python -m benchmarks.results "
            f"--only loader`. A checked-over-unchecked ratio is the median over {ours['turns']} "
            f"rounds of turns (warm, {ours['workers']} workers) or "
            f"{ours['one_process_samples_per_cpu_s']['rounds']} one-process loaders (CPU time) "
            "of the ratio within a round.",
            "",
            "| what | melcache | reference | ratio | command |",
            "|---|---|---|---|---|",
            f"| loader samples/s (warm, {ours['workers']} workers, default shard check) | {ours['samples_per_s']:.0f} | on-the-fly {base['samples_per_s']:.0f} | {ours['ratio']:.1f}× | `{_cmd(command)}` |",
            f"| samples/s, shard check {fast} (xxh3_128 every read) over {none}, this release's cache, warm | {ours['samples_per_s']:.0f} | {off['samples_per_s']:.0f} | {ratios['current_fast']:.2f}× | same |",
            f"| the same, the previous release's cache (no xxh3_128 in its index: sha256 at a worker's first read of a shard, then xxh3_128) | {old['samples_per_s']:.0f} | {old_off['samples_per_s']:.0f} | {ratios['previous_fast']:.2f}× | same |",
            f"| {sha256} (sha256 every read, the previous default) over {none}, warm | {sha['samples_per_s']:.0f} | {off['samples_per_s']:.0f} | {ratios['current_sha256']:.2f}× | same |",
            f"| one process, samples per CPU second, first / second pass: {fast} over {none}, this release's cache | {one_process(('current', 'fast'), ('current', 'off'))} | same |",
            f"| the same, the previous release's cache | {one_process(('previous', 'fast'), ('previous', 'off'))} | same |",
            f"| the same, {sha256} over {none} | {one_process(('current', 'sha256'), ('current', 'off'))} | same |",
            f"| loader padding (padded ÷ all frames) | {ours['padding_fraction']:.1%} | on-the-fly random batches {base['padding_fraction']:.1%} | | same |",
            f"| loader: first batch after resuming at 1 % / 90 % of an epoch | {ours['resume_first_batch_s']['1%']} s / {ours['resume_first_batch_s']['90%']} s | | | same |",
        ]
    )


def scale_table(quick: bool, data: Path | None = None) -> str:
    """Run the planning benchmark and render its rows as markdown."""
    sizes = ["20000", "50000", "200000"] if quick else ["100000", "250000", "1000000", "3000000"]
    command = [sys.executable, "-m", "benchmarks.build.scale_bench", "--sizes", *sizes]
    rows = run_json(command, data and data / "scale")
    runs = [r for r in rows if r["row"] == "dry run"]
    growth = [r for r in rows if r["row"] == "growth"]
    parts = next(r for r in rows if r["row"] == "parts")
    lines = [
        f"Measured {datetime.date.today()} on {machine()}, by `python -m benchmarks.results --only scale`"
        f" (`{_cmd(command)}`): `build --dry-run --workers 2` of a JSONL manifest whose rows "
        "carry `duration`.",
        "",
        "| utterances | scan s | plan s | peak RSS of the planning process |",
        "|---|---|---|---|",
        *(
            f"| {r['utterances']:,} | {r['scan_s']} | {r['plan_s']} | {r['peak_rss_mb']} MB |"
            for r in runs
        ),
        "",
        "| growth | bytes per utterance | µs per utterance (scan + plan) |",
        "|---|---|---|",
        *(
            f"| {g['from']:,} → {g['to']:,} | {g['bytes_per_utt']} | {g['us_per_utt']} |"
            for g in growth
        ),
        "",
        f"The same {parts['utterances']:,} rows on the same 2 cores: 1 part of 1 worker "
        f"{parts['one_part_one_worker_wall_s']} s, 1 part of 2 workers "
        f"{parts['one_part_2_workers_wall_s']} s, 2 parts of 1 worker at once "
        f"{parts['two_parts_wall_s']} s (each scanning half: {parts['two_parts_scan_s']} s).",
    ]
    return "\n".join(lines)


def tar_table(quick: bool, data: Path | None = None) -> str:
    """Run the tar benchmark and render its rows as one markdown table row."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.store.tar_bench",
        "--hours",
        "0.1" if quick else "0.5",
    ]
    rows = {row["row"]: row for row in run_json(command, data and data / "tars")}
    loose, ratio = rows["loose wav"], rows["ratio"]
    lines = [
        f"Measured {datetime.date.today()} on {machine()}, by `python -m benchmarks.results "
        "--only tars`.",
        "",
        "| what | melcache | reference | ratio | command |",
        "|---|---|---|---|---|",
    ]
    for row, what, key in (
        ("tars of mp3", "WebDataset tars of mp3 + json", "tars_over_loose"),
        ("parquet of mp3", "Parquet of mp3 (row groups of 100)", "parquet_over_loose"),
    ):
        packed = rows[row]
        lines.append(
            f"| build real-time factor from {what} ({packed['workers']} workers, "
            f"{packed['audio_hours']} h) | {packed['real_time_x']}× | the same audio as loose "
            f"wav {loose['real_time_x']}× | {ratio[key]}× | `{_cmd(command)}` |"
        )
    return "\n".join(lines)


def storage_table(quick: bool, data: Path | None = None) -> str:
    """Run the storage benchmark and render one row per storage kind (and Lhotse's)."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.store.storage_bench",
        "--hours",
        "0.1" if quick else "1",
    ]
    rows = run_json(command, data and data / "storage")
    ratio = next(row for row in rows if row["row"] == "ratio")
    lines = [
        f"Measured {datetime.date.today()} on {machine()}, by `{_cmd(command)}` "
        f"(loader and build side by side, {rows[0]['workers']} workers; error against the "
        "float32 mel the build computes). Loader: compact "
        f"{ratio['loader_compact_over_fp16']}× fp16's samples/s; build: "
        f"{ratio['build_compact_over_fp16']}× fp16's real-time factor.",
        "",
        "| storage | mel MB per hour | shard MB per hour | max abs error | mean abs error "
        "| build real-time factor | loader samples/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["row"] == "ratio":
            continue
        cells = [row.get(k, "—") for k in ("mel_mb_per_hour", "shard_mb_per_hour")]
        cells += [row["max_abs_error"], row["mean_abs_error"]]
        cells += [
            f"{row['build_real_time_x']}×" if "build_real_time_x" in row else "—",
            row.get("loader_samples_per_s", "—"),
        ]
        lines.append(f"| {row['row']} | " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def budget_table(quick: bool, data: Path | None = None) -> str:
    """Run the budget benchmark and render one global budget against the tuned table."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.train.budget_bench",
        "--hours",
        "0.5" if quick else "4",
    ]
    rows = run_json(command, data and data / "budgets")
    total = rows[-1]

    def cells(row: dict[str, Any], name: str) -> str:
        return (
            f"{row[f'{name}_samples_per_batch']} | {row[f'{name}_padded_frames_per_batch']:,} | "
            f"{row[f'{name}_padding_pct']} %"
        )

    return "\n".join(
        [
            f"Measured {datetime.date.today()} on {machine()}, by `python -m benchmarks.results "
            f"--only budgets` (`{_cmd(command)}`): budgets tuned on {total['tuned_on']}; one "
            f"epoch of every shard planned as the loader plans it, under one global budget of "
            f"{total['global_budget']:,} frames (the largest safe for every bucket) and under "
            "the table.",
            "",
            "| bucket | longest (frames) | global: utterances per batch | padded frames per "
            "batch | padding | table budget | table: utterances per batch | padded frames per "
            "batch | padding |",
            "|---|---|---|---|---|---|---|---|---|",
            *(
                f"| {r['bucket']} | {r['max_frames']} | {cells(r, 'global')} | "
                f"{r['tuned_budget']:,} | {cells(r, 'table')} |"
                for r in rows[:-1]
            ),
            f"| all | | {cells(total, 'global')} | | {cells(total, 'table')} |",
        ]
    )


def tracker_table(quick: bool, data: Path | None = None) -> str:
    """Run the tracker benchmark and render the step time without a tracker, with a hanging
    one and with TensorBoard, side by side."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.train.tracker_bench",
        "--rounds",
        "3" if quick else "9",
    ]
    (row,) = run_json(command, data and data / "trackers")
    lines = [
        f"Measured {datetime.date.today()} on {machine()}, by `{_cmd(command)}` (tiny model, "
        f"one process, {row['steps_per_round']} steps per setting in each of {row['rounds']} "
        "rotating rounds, a record to the trackers every step). Slowdown: the median of the "
        "rounds' ratios to no tracker. The hand-off of one record to the hanging tracker: "
        f"{max(row['hand_off'].values())} µs, {row['hand_off_pct_of_step']} % of a step.",
        "",
        "| trackers | ms per step (wall) | slowdown | main thread's CPU ms per step | slowdown |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("none", "none"), ("hanging", "one whose every call sleeps 60 s"),
                        ("tensorboard", "TensorBoard")):  # fmt: skip
        wall, cpu = row[f"{name}_ms_per_step"], row[f"{name}_cpu_ms_per_step"]
        if name == "none":
            lines.append(f"| {label} | {wall} | | {cpu} | |")
            continue
        slow, cpu_slow = row[f"{name}_slowdown_pct"], row[f"{name}_cpu_slowdown_pct"]
        lines.append(f"| {label} | {wall} | {slow:+.2f} % | {cpu} | {cpu_slow:+.2f} % |")
    return "\n".join(lines)


GPU_RESULTS = REPO / "benchmarks" / "gpu_results.jsonl"


def gpu_table(quick: bool, data: Path | None = None) -> str:
    """The rows ``bash benchmarks/gpu_bench.sh`` left in ``GPU_RESULTS``, as markdown; it is
    run on a GPU machine, not from here."""
    if not GPU_RESULTS.exists():
        return "Not measured yet: no GPU has been lent to this project. `bash benchmarks/gpu_bench.sh` fills this in."
    from benchmarks.train.gpu_bench import markdown_table

    rows = [json.loads(line) for line in GPU_RESULTS.read_text().splitlines() if line.strip()]
    stamp = datetime.date.fromtimestamp(GPU_RESULTS.stat().st_mtime)
    return (
        f"Measured {stamp} by `bash benchmarks/gpu_bench.sh` ({rows[0]['model']} model on "
        f"{rows[0]['device']}; table from `benchmarks/{GPU_RESULTS.name}`), rendered on {machine()}.\n\n"
        + markdown_table(rows)
    )


SECTIONS = {
    "results": table,
    "trainer": trainer_table,
    "loader": loader_table,
    "scale": scale_table,
    "tars": tar_table,
    "storage": storage_table,
    "budgets": budget_table,
    "trackers": tracker_table,
    "gpu": gpu_table,
}


def replace_section(text: str, name: str, rendered: str) -> str:
    """``text`` with its section between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``
    replaced by ``rendered``; a page without that section is an error naming it."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"{PAGE.relative_to(REPO)} has no {begin} … {end} section")
    return re.sub(
        re.escape(begin) + ".*?" + re.escape(end),
        lambda _: f"{begin}\n{rendered}\n{end}",
        text,
        flags=re.S,
    )


def _cmd(command: list[str]) -> str:
    return " ".join(["python", *command[1:]])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="small corpora (a check, not numbers to publish)"
    )
    parser.add_argument(
        "--only", choices=sorted(SECTIONS), help="refresh one section of docs/results.md only"
    )
    parser.add_argument(
        "--data", type=Path, help="keep the benchmarks' corpora and caches here (default: theirs)"
    )
    args = parser.parse_args()
    for name, render in SECTIONS.items():
        if args.only not in (None, name):
            continue
        rendered = render(args.quick, args.data)
        PAGE.write_text(replace_section(PAGE.read_text(), name, rendered))
        print(rendered)


if __name__ == "__main__":
    main()
