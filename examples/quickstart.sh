#!/usr/bin/env bash
# The main job end to end on the committed sample corpus: build the cache, verify it, summarise it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m preprocess build --src examples/wavs --out shards --config configs/chattts.toml
python3 -m preprocess verify shards
python3 -m preprocess inspect shards
