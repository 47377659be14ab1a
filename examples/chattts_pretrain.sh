#!/usr/bin/env bash
# ChatTTS pretrained with melcache on the committed sample corpus, from random init, and handed
# back to ChatTTS: build the cache of ChatTTS's mels → train ChatTTS's DVAE on them → derive its
# codes into the cache beside the mels (no mel shard rewritten) → train a ChatTTS tokenizer on
# the cache's texts → train ChatTTS's GPT on text + codes → export both runs as ChatTTS's own
# asset/ folder → speak a sentence with ChatTTS's own Chat from it.
#   bash examples/chattts_pretrain.sh OUT   # OUT/shards, dvae, tokenizer, gpt; OUT/asset, sample.wav
# Rerunning resumes every step. To start from ChatTTS's release instead (docs/models.md), set
# [model.args] release = "DIR" in both configs and train with its asset/tokenizer.
set -euo pipefail
OUT=$(realpath -m "${1:?usage: bash examples/chattts_pretrain.sh OUT}")
cd "$(dirname "$0")/.."
TRAIN=(python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m train)
python3 -m preprocess build --src examples/wavs --out "$OUT/shards" --config examples/sample_corpus.toml
"${TRAIN[@]}" --shards "$OUT/shards" --config examples/chattts_dvae/config.toml --out "$OUT/dvae" --max-steps 20
python3 -m preprocess derive "$OUT/shards" --field codes \
  --encoder examples.chattts_dvae.adapter:encoder --checkpoint "$OUT/dvae"
python3 -m preprocess verify "$OUT/shards"
if [ ! -f "$OUT/tokenizer/tokenizer.json" ]; then
  python3 -m examples.chattts_gpt.tokenizer "$OUT/shards" --out "$OUT/tokenizer" --vocab-size 1000
fi
"${TRAIN[@]}" --shards "$OUT/shards" --config examples/chattts_gpt/config.toml --out "$OUT/gpt" \
  --max-steps 20 "data.vocab=\"$OUT/tokenizer\""
# OUT holds the runs too: --force writes the export's files beside them (nothing is deleted).
python3 -m train export "$OUT/gpt" "$OUT/dvae" --out "$OUT" --force
python3 -m examples.chattts.chat "$OUT" --text "Hello from melcache." --wav "$OUT/sample.wav"
echo "made: the cache $OUT/shards (mels + codes), the runs $OUT/dvae and $OUT/gpt (their"
echo "metrics.jsonl), ChatTTS's asset/ in $OUT (Chat.load(source='custom', custom_path='$OUT')"
echo "after examples.chattts.chat.load_chat sets its sizes) and $OUT/sample.wav, spoken by it"
