"""ChatTTS's text tokenizer for ``[data] tokenizer``, and one trained from a cache's texts.

``[data] tokenizer = "examples.chattts_gpt.tokenizer:ChatTTSTokenizer"`` with ``vocab =`` a
``BertTokenizerFast`` folder: ChatTTS's released ``asset/tokenizer`` (21178 ids), or one that
:func:`train_tokenizer` made for a run from scratch::

    python -m examples.chattts_gpt.tokenizer CACHE [CACHE ...] --out DIR [--vocab-size N]

That one is WordPiece (Hugging Face ``tokenizers``) with ChatTTS's own normaliser and
pre-tokeniser kind (``bert-base-chinese``'s: lower case, one token per CJK character), saved as
a ``BertTokenizerFast`` with ChatTTS's special tokens and ``[PAD]`` = 0, melcache's padding id
(``train/model/tokenizers.py``): so ``python -m train export`` can write it into ChatTTS's
``asset/tokenizer``. Each text is framed as ChatTTS frames it for its GPT without a speaker
embedding (``ChatTTS/model/speaker.py``): ``[Stts][empty_spk]TEXT[Ptts]``, with no BERT special
tokens; ``vocab_size`` is the tokenizer's length (ChatTTS's ``num_text_tokens``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from melcache.errors import UserError

FRAME = "[Stts][empty_spk]{}[Ptts]"
BERT_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # [PAD] first: id 0
# ChatTTS's control tokens (its released tokenizer's added tokens), so prompts that use them
# ([speed_5], [uv_break], ...) tokenise as in ChatTTS.
CHATTTS_TOKENS = (
    "[Stts]", "[Ptts]", "[spk_emb]", "[empty_spk]", "[Ebreak]", "[uv_break]", "[v_break]",
    "[lbreak]", "[laugh]", *(f"[break_{i}]" for i in range(8)), *(f"[speed_{i}]" for i in range(10)),
    *(f"[oral_{i}]" for i in range(10)), *(f"[laugh_{i}]" for i in range(3)),
)  # fmt: skip


class ChatTTSTokenizer:
    """``text`` → ChatTTS's token ids (picklable: the loader's workers get a copy)."""

    def __init__(self, vocab: str = "asset/tokenizer") -> None:
        from transformers import BertTokenizerFast

        self.folder = vocab
        if not (Path(vocab) / "tokenizer.json").is_file():
            raise UserError(
                f"ChatTTS's tokenizer: {vocab}/tokenizer.json not found (set [data] vocab to "
                "the asset/tokenizer folder of a ChatTTS release, or to one made by `python -m "
                'examples.chattts_gpt.tokenizer CACHE --out DIR`; or use [data] tokenizer = "bytes")'
            )
        self._bert = BertTokenizerFast.from_pretrained(vocab)
        if self._bert.pad_token_id != 0:
            raise UserError(f"{vocab}: its [PAD] is id {self._bert.pad_token_id}, not 0")
        self.vocab_size = len(self._bert)

    def __call__(self, text: str) -> list[int]:
        return self._bert.encode(FRAME.format(text), add_special_tokens=False)


def train_tokenizer(texts: Iterable[str], out: Path, vocab_size: int = 8000) -> int:
    """Train a ChatTTS-compatible WordPiece tokenizer on ``texts`` and save it into ``out`` as
    a ``BertTokenizerFast``; its size (at most ``vocab_size``, less where the texts hold
    fewer pieces)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import BertTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size - len(CHATTTS_TOKENS), special_tokens=list(BERT_TOKENS)
    )
    tokenizer.train_from_iterator(texts, trainer)
    fast = BertTokenizerFast(tokenizer_object=tokenizer, do_lower_case=True)
    fast.add_special_tokens({"additional_special_tokens": list(CHATTTS_TOKENS)})
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    from examples.chattts.asset import write_special_tokens_map

    write_special_tokens_map(out)
    return len(fast)


def cache_texts(caches: Iterable[str]) -> Iterator[str]:
    """Every non-empty text of ``caches`` (``melcache.open``: each utterance read once)."""
    import melcache

    for location in caches:
        with melcache.open(location) as cache:
            for utterance in cache:
                if utterance.text:
                    yield utterance.text


def main(argv: list[str] | None = None) -> int:
    """``python -m examples.chattts_gpt.tokenizer CACHE ... --out DIR``."""
    p = argparse.ArgumentParser(
        prog="python -m examples.chattts_gpt.tokenizer",
        description="Train a ChatTTS-compatible tokenizer (WordPiece, saved as a "
        "BertTokenizerFast with ChatTTS's special tokens, [PAD] = 0) on caches' texts; then "
        'train the GPT with [data] tokenizer = "examples.chattts_gpt.tokenizer:ChatTTSTokenizer" '
        "and vocab = DIR.",
    )
    p.add_argument("caches", nargs="+", help="cache folders (or URLs) whose texts to learn")
    p.add_argument("--out", type=Path, required=True, help="folder to write the tokenizer into")
    p.add_argument("--vocab-size", type=int, default=8000, help="most ids (default 8000)")
    args = p.parse_args(argv)
    try:
        size = train_tokenizer(cache_texts(args.caches), args.out, args.vocab_size)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: a ChatTTS tokenizer of {size} ids from {', '.join(args.caches)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
