#!/usr/bin/env bash
# The main job end to end on the committed sample corpus: build the cache, verify and picture
# it, train the tiny model for a few steps on 2 CPU processes, and plot the run.
# Rerunning resumes: the build finds its shards done, the trainer its last checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m preprocess build --src examples/wavs --out shards --config examples/sample_corpus.toml
python3 -m preprocess verify shards
python3 -m preprocess inspect shards --png runs/quickstart/cache --batch-frames 2000
python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m train \
  --shards shards --config tiny --out runs/quickstart --max-steps 30
python3 -m train plot runs/quickstart
