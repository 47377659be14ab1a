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
  loader's workers get a copy). A factory with a ``vocab`` parameter is given ``data.vocab``
  (a tokenizer's files: ChatTTS's ``asset/tokenizer`` folder, for one).

Every tokenizer is wrapped by :class:`Checked`, which refuses an id outside the vocabulary (id 0
included), and any output that is not a flat sequence of ints, with the text it came from,
instead of an index error deep inside an embedding; :func:`build_tokenizer` calls it once on
:data:`PROBE` at start, so a tokenizer that returns the wrong thing is refused before step 1.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from melcache.bounded import read_limited
from melcache.errors import UserError
from melcache.loader.batch import BYTE_VOCAB_SIZE, token_ids, utf8_tokens

VOCAB_MAX_BYTES = 16 << 20
VOCAB_SIZE_MAX = 1 << 24  # the largest tokenizers have ~256k ids; more is an embedding's OOM
PROBE = "Hello, world. 1, 2, 3."  # what every tokenizer is called on once at start


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
        if not chars:  # every character would be <unk>: text that carries nothing
            raise UserError(f"data.vocab = {path!r} is empty: give one character per line")
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

    gives_checked_ids = True  # the loader's collation need not check its ids again

    def __init__(self, inner: Callable[[str], Sequence[int]], vocab_size: int, name: str) -> None:
        self.inner, self.vocab_size, self.name = inner, vocab_size, name

    def __call__(self, text: str) -> np.ndarray:
        return token_ids(self.inner, text, self.name, self.vocab_size)


def build_tokenizer(spec: str, vocab: str = "") -> Checked:
    """The tokenizer ``[data] tokenizer = spec`` names (``vocab``: ``data.vocab``)."""
    if spec == "bytes":
        inner: Any = Bytes()
    elif spec == "chars":
        if not vocab:
            raise UserError('data.tokenizer = "chars" needs data.vocab, a file of one char a line')
        inner = Chars(vocab)
    else:
        inner = _import(spec, vocab)
    size = getattr(inner, "vocab_size", None)
    if not (type(size) is int and 1 < size <= VOCAB_SIZE_MAX) or not callable(inner):
        raise UserError(
            f"data.tokenizer = {spec!r} gave {type(inner).__name__}, which is not a callable "
            f"with an int vocab_size in 2..{VOCAB_SIZE_MAX} (it has {size!r})"
        )
    checked = Checked(inner, size, spec)
    try:
        checked(PROBE)
    except UserError:
        raise
    except Exception as exc:  # a plugin's own bug: say where, in one line
        raise UserError(
            f"data.tokenizer = {spec!r} failed on {PROBE!r}: {type(exc).__name__}: {exc}"
        ) from None
    return checked


def _import(spec: str, vocab: str) -> Any:
    module_name, _, name = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UserError(f"data.tokenizer = {spec!r} cannot be imported: {exc}") from None
    if isinstance(found, type) or not hasattr(found, "vocab_size"):
        _check_factory(spec, found)
        takes_vocab = vocab and "vocab" in _parameters(found)
        try:
            return found(vocab=vocab) if takes_vocab else found()
        except UserError:
            raise
        except Exception as exc:
            raise UserError(
                f"data.tokenizer = {spec!r}: calling it to make the tokenizer failed "
                f"({type(exc).__name__}: {exc})"
            ) from None
    return found


def _check_factory(spec: str, found: Any) -> None:
    """Refuse, without calling it, what cannot be a zero-argument tokenizer factory: a
    non-callable, a built-in function (``os:system``) or one that needs arguments."""
    if not callable(found) or inspect.isbuiltin(found):
        raise UserError(
            f"data.tokenizer = {spec!r} names {type(found).__name__} {found!r}, not a tokenizer "
            "(a callable with an int vocab_size) or a class or zero-argument factory making one"
        )
    try:
        needed = [
            p.name
            for p in inspect.signature(found).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # no signature to read: calling it will tell
        return
    if needed:
        raise UserError(
            f"data.tokenizer = {spec!r} needs arguments {needed}: name a tokenizer, or a class "
            "or zero-argument factory making one"
        )


def _parameters(found: Any) -> set[str]:
    """The parameter names of a callable (none where it has no signature to read)."""
    try:
        return set(inspect.signature(found).parameters)
    except (TypeError, ValueError):
        return set()
