#!/usr/bin/env bash
# The whole GPU check in one command, from any directory: the training benchmark
# (benchmarks/train/gpu_bench.py) sized to finish in about five minutes on one GPU, its rows kept in
# benchmarks/gpu_results.jsonl, and the README's GPU table rendered from them; then the
# trainer's overhead against a bare loop and its data wait (benchmarks/train/trainer_bench.py, kept
# in benchmarks/gpu_trainer.json) and derive at the released DVAE size with its split
# (benchmarks/build/derive_bench.py, kept in benchmarks/gpu_derive.jsonl). Arguments are passed on
# to gpu_bench and override these defaults; relative paths stay relative to where it is run.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
python3 -m benchmarks.train.gpu_bench --minutes 20 --steps 30 --warmup 10 \
    --json "$repo/benchmarks/gpu_results.jsonl" "$@"
cd "$repo" && python3 -m benchmarks.results --only gpu
python3 benchmarks/train/trainer_bench.py --steps 30 --rounds 10 | tee benchmarks/gpu_trainer.json
python3 -m benchmarks.build.derive_bench --size released | tee benchmarks/gpu_derive.jsonl
