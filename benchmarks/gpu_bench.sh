#!/usr/bin/env bash
# The whole GPU check in one command, from any directory: the training benchmark
# (benchmarks/train/gpu_bench.py) sized to finish in about five minutes on one GPU, its rows kept in
# benchmarks/gpu_results.jsonl, and the README's GPU table rendered from them; then the
# trainer's overhead against a bare loop and its data wait (benchmarks/train/trainer_bench.py, kept
# in benchmarks/gpu_trainer.json) and derive at the released DVAE size with its split
# (benchmarks/build/derive_bench.py, kept in benchmarks/gpu_derive.jsonl), and train tune's budgets
# on the declared sequence against today's at equal peak memory, on the cache gpu_bench built, for
# the prefix LM (text + frames, and its two axes) and the reference encoder-decoder (two axes)
# (benchmarks/train/sequence_tune_bench.py, both kept in benchmarks/gpu_sequence_tune.jsonl).
# Arguments are passed on to gpu_bench and override these defaults (MELCACHE_GPU_DATA: its
# --data folder); relative paths stay relative to where it is run.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
data="${MELCACHE_GPU_DATA:-/tmp/melcache-gpu-bench}"
python3 -m benchmarks.train.gpu_bench --minutes 20 --steps 30 --warmup 10 --data "$data" \
    --json "$repo/benchmarks/gpu_results.jsonl" "$@"
cd "$repo" && python3 -m benchmarks.results --only gpu
python3 benchmarks/train/trainer_bench.py --steps 30 --rounds 10 | tee benchmarks/gpu_trainer.json
python3 -m benchmarks.build.derive_bench --size released | tee benchmarks/gpu_derive.jsonl
cache="$(ls -d "$data"/cache-*m | head -n 1)"
for model in prefix encoder-decoder; do
    python3 -m benchmarks.train.sequence_tune_bench --cache "$cache" --config base \
        --max-batch-size 512 --model "$model"
done | tee benchmarks/gpu_sequence_tune.jsonl
