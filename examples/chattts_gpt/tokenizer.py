"""ChatTTS's own text tokenizer for ``[data] tokenizer``, where its files are:
``tokenizer = "examples.chattts_gpt.tokenizer:ChatTTSTokenizer"``.

ChatTTS 0.2.5 keeps a ``BertTokenizerFast`` in ``asset/tokenizer`` (``ChatTTS/config/config.py``
``tokenizer_path``; the files come with its released weights, which cannot be downloaded here).
The folder is ``$CHATTTS_TOKENIZER``, else ``asset/tokenizer`` under the working directory. Each
text is framed as ChatTTS frames it for its GPT without a speaker embedding
(``ChatTTS/model/speaker.py``): ``[Stts][empty_spk]TEXT[Ptts]``, with no BERT special tokens.
Its ``[PAD]`` is id 0, melcache's padding id (``train/model/tokenizers.py``), and ``vocab_size``
is the tokenizer's length: ChatTTS's ``num_text_tokens``, 21178 with the released files.
"""

from __future__ import annotations

import os
from pathlib import Path

from melcache.errors import UserError

FRAME = "[Stts][empty_spk]{}[Ptts]"


class ChatTTSTokenizer:
    """``text`` → ChatTTS's token ids (picklable: the loader's workers get a copy)."""

    def __init__(self, folder: str | None = None) -> None:
        from transformers import BertTokenizerFast

        self.folder = folder or os.environ.get("CHATTTS_TOKENIZER", "asset/tokenizer")
        if not (Path(self.folder) / "tokenizer.json").is_file():
            raise UserError(
                f"ChatTTS's tokenizer: {self.folder}/tokenizer.json not found (set "
                "CHATTTS_TOKENIZER to the asset/tokenizer folder of ChatTTS's released files, "
                'or use [data] tokenizer = "bytes")'
            )
        self._bert = BertTokenizerFast.from_pretrained(self.folder)
        if self._bert.pad_token_id != 0:
            raise UserError(f"{self.folder}: its [PAD] is id {self._bert.pad_token_id}, not 0")
        self.vocab_size = len(self._bert)

    def __call__(self, text: str) -> list[int]:
        return self._bert.encode(FRAME.format(text), add_special_tokens=False)
