"""Text → token ids, chosen by ``[data] tokenizer``.

The padding rule, once: **id 0 is padding** (``text`` is padded with 0 past ``text_lengths``);
a tokenizer returns ids in ``1 .. vocab_size - 1`` and the model gets ``vocab_size`` (a
constructor parameter of that name). A model whose own scheme pads with another id (F5-TTS
pads with -1 and counts tokens from 0) shifts in its adapter: ``text - 1``.

- ``"bytes"`` (default): UTF-8 bytes + 1, vocabulary 257; any language, no file.
- ``"chars"``: one id per character of ``data.vocab`` (a UTF-8 file, one character per line,
  as F5-TTS's ``vocab.txt``): line ``i`` is id ``i + 1``; a character not in it is the last id
  (``<unk>``), so ``vocab_size`` = lines + 2.
- ``"package.module:name"``: ``name`` is a tokenizer (a callable ``str -> Sequence[int]`` with
  an int ``vocab_size``) or a class or zero-argument factory making one; it must be picklable (the
  loader's workers get a copy).

Every tokenizer is wrapped by :class:`Checked`, which refuses an id outside the vocabulary (id 0
included) with the text it came from, instead of an index error deep inside an embedding.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from melcache.bounded import read_limited
from melcache.errors import UserError
from melcache.loader.batch import BYTE_VOCAB_SIZE, PAD_ID, utf8_tokens

VOCAB_MAX_BYTES = 16 << 20


class Bytes:
    """UTF-8 bytes + 1."""

    vocab_size = BYTE_VOCAB_SIZE

    def __call__(self, text: str) -> np.ndarray:
        return utf8_tokens(text)


class Chars:
    """One id per character of a vocabulary file (see the module docstring)."""

    def __init__(self, path: str) -> None:
        try:
            lines = read_limited(path, VOCAB_MAX_BYTES).decode("utf-8").split("\n")
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise UserError(f"data.vocab = {path!r} cannot be read: {exc}") from None
        if lines and lines[-1] == "":
            lines.pop()  # the final newline
        chars = [line.removesuffix("\r") for line in lines]
        bad = next((c for c in chars if len(c) != 1), None)
        if bad is not None or len(set(chars)) != len(chars):
            why = f"line {bad!r} is not one character" if bad is not None else "repeats a line"
            raise UserError(f"data.vocab = {path!r} {why}")
        self.ids = {c: i + 1 for i, c in enumerate(chars)}
        self.unknown = len(chars) + 1
        self.vocab_size = len(chars) + 2

    def __call__(self, text: str) -> list[int]:
        return [self.ids.get(c, self.unknown) for c in text]


class Checked:
    """A tokenizer whose ids are checked against ``1 .. vocab_size - 1``."""

    def __init__(self, inner: Callable[[str], Sequence[int]], vocab_size: int, name: str) -> None:
        self.inner, self.vocab_size, self.name = inner, vocab_size, name

    def __call__(self, text: str) -> np.ndarray:
        ids = np.asarray(self.inner(text), dtype=np.int64)
        if ids.size and (ids.min() <= PAD_ID or ids.max() >= self.vocab_size):
            raise UserError(
                f"tokenizer {self.name} gave ids {ids.min()}..{ids.max()} for {text[:40]!r}: ids "
                f"must be in 1..{self.vocab_size - 1} (0 is padding; vocab_size {self.vocab_size})"
            )
        return ids


def build_tokenizer(spec: str, vocab: str = "") -> Checked:
    """The tokenizer ``[data] tokenizer = spec`` names (``vocab``: ``data.vocab``)."""
    if spec == "bytes":
        inner: Any = Bytes()
    elif spec == "chars":
        if not vocab:
            raise UserError('data.tokenizer = "chars" needs data.vocab, a file of one char a line')
        inner = Chars(vocab)
    else:
        inner = _import(spec)
    size = getattr(inner, "vocab_size", None)
    if not (isinstance(size, int) and size > 1) or not callable(inner):
        raise UserError(
            f"data.tokenizer = {spec!r} gave {type(inner).__name__}, which is not a callable "
            "with an int vocab_size > 1"
        )
    return Checked(inner, size, spec)


def _import(spec: str) -> Any:
    module_name, _, name = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UserError(f"data.tokenizer = {spec!r} cannot be imported: {exc}") from None
    factory = isinstance(found, type) or not hasattr(found, "vocab_size")
    return found() if factory else found
