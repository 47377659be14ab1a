#!/usr/bin/env bash
# The GPU training benchmark (see benchmarks/gpu_bench.py); run from the repository root.
exec python -m benchmarks.gpu_bench "$@"
