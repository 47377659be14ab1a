#!/usr/bin/env bash
# ChatTTS pretrained with melcache on the committed sample corpus, from random init, in four
# steps: build the cache of ChatTTS's mels → train ChatTTS's DVAE on them → derive its codes
# into the cache beside the mels (no mel shard rewritten) → train ChatTTS's GPT on text + codes.
#   bash examples/chattts_pretrain.sh OUT      # OUT/shards, OUT/dvae, OUT/gpt
# Rerunning resumes every step. With ChatTTS's released weights, skip the DVAE step and give
# derive its DVAE.safetensors as --checkpoint; with its asset/tokenizer files, set
# CHATTTS_TOKENIZER and the GPT config's [data] tokenizer (examples/chattts_gpt/config.toml).
set -euo pipefail
OUT=$(realpath -m "${1:?usage: bash examples/chattts_pretrain.sh OUT}")
cd "$(dirname "$0")/.."
TRAIN=(python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m train)
python3 -m preprocess build --src examples/wavs --out "$OUT/shards" --config examples/sample_corpus.toml
"${TRAIN[@]}" --shards "$OUT/shards" --config examples/chattts_dvae/config.toml --out "$OUT/dvae" --max-steps 20
python3 -m preprocess derive "$OUT/shards" --field codes \
  --encoder examples.chattts_dvae.adapter:encoder --checkpoint "$OUT/dvae"
python3 -m preprocess verify "$OUT/shards"
"${TRAIN[@]}" --shards "$OUT/shards" --config examples/chattts_gpt/config.toml --out "$OUT/gpt" --max-steps 20
