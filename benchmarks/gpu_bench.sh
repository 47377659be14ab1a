#!/usr/bin/env bash
# The GPU training benchmark (see benchmarks/gpu_bench.py), from any directory: relative
# paths in the arguments stay relative to where it is run.
repo="$(cd "$(dirname "$0")/.." && pwd)"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m benchmarks.gpu_bench "$@"
