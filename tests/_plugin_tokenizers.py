"""Tokenizers for the contract tests (``data.tokenizer = "tests._plugin_tokenizers:NAME"``)."""

from __future__ import annotations


class ZeroBased:
    """Letters from 0, as many packages count: breaks the id 0 padding rule."""

    vocab_size = 27

    def __call__(self, text: str) -> list[int]:
        return [ord(c) - ord("a") for c in text.lower() if c.isalpha()]
