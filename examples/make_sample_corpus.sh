#!/usr/bin/env bash
# Regenerate the committed sample corpus in examples/wavs/ with espeak-ng and sox.
#
# The corpus is small (about 30 utterances, ~2 MB) but deliberately untidy, so that the
# feature cache's input handling is exercised end to end:
#   * three speaker folders (recursion), globally unique stems without dots;
#   * English and Mandarin text, one UTF-8 transcript line per utterance (<stem>.txt);
#   * durations from ~0.8 s to ~9 s (length bucketing);
#   * 16000 / 22050 / 24000 / 44100 / 48000 Hz, .wav and .flac, 16-bit PCM mostly,
#     plus one 24-bit FLAC, one 32-bit float WAV and one stereo file.
#
# The output is deterministic: espeak-ng is deterministic for a given text/voice/speed,
# and sox runs in repeatable mode (-R) so dither noise is seeded identically each run.
# The script is idempotent: it deletes and recreates examples/wavs/.
#
# Usage: bash examples/make_sample_corpus.sh   (from any directory)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$here/wavs"

for tool in espeak-ng sox; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "error: $tool not found on PATH (Debian: apt-get install espeak-ng sox libsox-fmt-all)" >&2
        exit 1
    fi
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

rm -rf "$out"
mkdir -p "$out"

# One utterance per line: speaker|stem|voice|speed|rate|ext|encoding|channels|text
#   encoding: s16 = 16-bit PCM, s24 = 24-bit PCM, f32 = 32-bit float (wav only)
# High rates (44.1/48 kHz) are mostly FLAC to keep the repository small.
manifest=$(cat <<'EOF'
en_f1|en_f1_01|en-us+f3|160|16000|wav|s16|1|Yes.
en_f1|en_f1_02|en-us+f3|150|22050|flac|s16|1|Good morning.
en_f1|en_f1_03|en-us+f3|170|24000|wav|s16|1|Please close the window.
en_f1|en_f1_04|en-us+f3|160|48000|flac|s16|1|The boat drifted toward the harbour.
en_f1|en_f1_05|en-us+f3|180|16000|flac|s16|1|She counted seven red apples in the wooden basket, then gave two of them to her younger brother.
en_f1|en_f1_06|en-us+f3|200|22050|wav|s16|1|Thank you.
en_f1|en_f1_07|en+f3|160|22050|flac|s24|1|A cold wind blew across the open field all night long.
en_f1|en_f1_08|en+f3|150|16000|flac|s16|1|The train to the city leaves at half past nine, so we should have breakfast early and walk to the station together.
en_f1|en_f1_09|en+f3|190|24000|flac|s16|1|Turn left at the bakery.
en_f1|en_f1_10|en+f3|140|16000|flac|s16|1|Every evening the old clockmaker wound each of the clocks in his shop, listening carefully to make sure that none of them had fallen behind.
en_f1|en_f1_11|en-us+f3|170|16000|wav|f32|1|Hello there.
en_f1|en_f1_12|en-us+f3|160|16000|flac|s16|1|Music drifted up from the street below while the children finished their homework.
en_m3|en_m3_01|en-gb|160|22050|flac|s16|1|No.
en_m3|en_m3_02|en-gb|150|16000|wav|s16|1|Where is the library?
en_m3|en_m3_03|en-gb|140|24000|flac|s16|1|The river rose quickly after three days of heavy rain in the hills.
en_m3|en_m3_04|en-gb|180|16000|wav|s16|2|Stop right there.
en_m3|en_m3_05|en-gb|170|16000|flac|s16|1|Bright sunlight poured through the tall windows of the empty concert hall, warming the rows of dusty velvet seats.
en_m3|en_m3_06|en+m3|200|16000|flac|s16|1|We need more paper for the printer, two boxes of pens, and a new set of folders for the meeting on Thursday afternoon.
en_m3|en_m3_07|en+m3|160|48000|flac|s16|1|Keep calm and carry on.
en_m3|en_m3_08|en+m3|150|24000|flac|s16|1|His grandmother kept a small garden of herbs behind the kitchen.
en_m3|en_m3_09|en+m3|190|16000|wav|s16|1|Absolutely.
en_m3|en_m3_10|en+m3|140|16000|flac|s16|1|After the storm had passed, the fishermen gathered on the pier to mend their nets and talk about the strange lights they had seen out at sea.
en_m3|en_m3_11|en-us|160|44100|flac|s16|1|The quick brown fox jumps over the lazy dog.
en_m3|en_m3_12|en-us|180|16000|flac|s16|1|Could you read that number again, slowly this time?
en_m3|en_m3_13|en-us|170|24000|flac|s16|1|Open the door.
zh|zh_01|cmn|150|16000|wav|s16|1|你好。
zh|zh_02|cmn|170|22050|flac|s16|1|今天天气很好。
zh|zh_03|cmn|180|16000|flac|s16|1|我每天早上七点起床。
zh|zh_04|cmn|190|24000|flac|s16|1|这本书非常有意思。
zh|zh_05|cmn|170|16000|flac|s16|1|请问，火车站在哪里？
EOF
)

count=0
while IFS='|' read -r speaker stem voice speed rate ext enc channels text; do
    mkdir -p "$out/$speaker"
    raw="$tmp/$stem.wav"
    # espeak-ng always writes 22050 Hz mono 16-bit PCM.
    espeak-ng -v "$voice" -s "$speed" -w "$raw" -- "$text"

    # FLAC is always integer PCM, so sox only takes a bit depth for it.
    case "$ext:$enc" in
        wav:s16) fmt=(-e signed-integer -b 16) ;;
        wav:s24) fmt=(-e signed-integer -b 24) ;;
        wav:f32) fmt=(-e floating-point -b 32) ;;
        flac:s16) fmt=(-b 16 -C 8) ;;
        flac:s24) fmt=(-b 24 -C 8) ;;
        *) echo "error: unsupported format $ext/$enc for $stem" >&2; exit 1 ;;
    esac
    effects=()
    if [[ "$rate" != 22050 ]]; then
        effects+=(rate -v "$rate")
    fi
    if [[ "$channels" != 1 ]]; then
        effects+=(channels "$channels")
    fi
    # -C 8 (FLAC): strongest compression, to keep the repository small.
    # -R: repeatable mode (fixed dither seed) so reruns produce byte-identical files.
    # The ${a[@]+...} form keeps empty arrays safe under `set -u` on old bash (macOS 3.2).
    sox -R "$raw" "${fmt[@]}" "$out/$speaker/$stem.$ext" \
        ${effects[@]+"${effects[@]}"}
    printf '%s\n' "$text" >"$out/$speaker/$stem.txt"
    count=$((count + 1))
done <<<"$manifest"

echo "wrote $count utterances to $out ($(du -sh "$out" | cut -f1))"
