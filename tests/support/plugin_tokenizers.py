"""Tokenizers for the contract tests (``data.tokenizer = "tests.support.plugin_tokenizers:NAME"``)."""

from __future__ import annotations

from typing import ClassVar


class ZeroBased:
    """Letters from 0, as many packages count: breaks the id 0 padding rule."""

    vocab_size = 27

    def __call__(self, text: str) -> list[int]:
        return [ord(c) - ord("a") for c in text.lower() if c.isalpha()]


class _Gives:
    """Returns ``self.output`` for any text: a tokenizer that returns the wrong thing."""

    vocab_size = 100
    output: object = None

    def __call__(self, text: str) -> object:
        return self.output


class GivesStr(_Gives):
    output = "1 2 3"


class GivesNone(_Gives):
    output = None


class GivesNested(_Gives):
    output: ClassVar[object] = [[1, 2], [3]]


class GivesHuge(_Gives):
    output: ClassVar[object] = [1, 2**70]


class GivesPastVocab(_Gives):
    output: ClassVar[object] = [1, 100]


class GivesFloats(_Gives):
    output: ClassVar[object] = [1.9, 2.0]


class LaterBad:
    """Sound on the start's probe text (it has "1, 2, 3"), floats for any other text: what
    only the per-sample check in the loader's workers can catch."""

    vocab_size = 300

    def __call__(self, text: str) -> list[float] | list[int]:
        if "1, 2, 3" in text:
            return [b + 1 for b in text.encode()]
        return [1.5] * len(text)


def needs_an_argument(path: str) -> GivesStr:
    """A factory that cannot be called with no arguments."""
    return GivesStr()
