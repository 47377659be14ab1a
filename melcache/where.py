"""Select utterances by their metadata, as ``language == "en" and dnsmos >= 3.2``: the build's
``--where`` and the loader's ``data.where`` (and ``data.balance.weight``, a value per utterance).

The expression is parsed with :mod:`ast` and evaluated by walking the tree: only field names,
literals (strings, numbers, ``true``/``false``/``null``, lists of them), comparisons
(``== != < <= > >= in not in``), ``and``, ``or``, ``not``, ``A if C else B`` and parentheses
are allowed, so a corpus's metadata can never run code. A comparison with a field the
metadata lacks, or between values that cannot be ordered (a string and a number), is false.
"""

from __future__ import annotations

import ast
import io
import operator
import tokenize
import unicodedata
from collections.abc import Callable
from typing import Any

from melcache.errors import UserError
from melcache.format import is_unicode

_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
_MISSING = object()
# Far beyond any expression typed or generated on purpose (a list of thousands of speakers
# fits); the parser and the walks below are then cheap and never recurse deeply.
MAX_CHARACTERS = 100_000
MAX_DEPTH = 100


class Where:
    """A parsed expression; call it with a metadata dict. ``name`` is what errors call it
    (``--where``, ``data.where``)."""

    def __init__(self, text: str, name: str = "--where") -> None:
        self.text = text
        self.tree = _parse(text, name)
        self.fields = sorted(_check(self.tree, text, name))
        self._run = _compile(self.tree)

    def __call__(self, meta: dict[str, Any]) -> bool:
        """Whether ``meta`` is selected."""
        return _truth(self._run(meta))

    def value(self, meta: dict[str, Any]) -> Any:
        """The expression's value for ``meta``: a number, string, bool, or ``None`` where a
        field it names is missing."""
        value = self._run(meta)
        return None if value is _MISSING else value


def _parse(text: str, name: str) -> ast.expr:
    """The tree of ``text``; :class:`UserError` when it is not UTF-8, too long, not an
    expression, or nested deeper than :data:`MAX_DEPTH`."""
    shown = _shown(text)
    if not is_unicode(text):  # a byte of the command line that is not UTF-8
        raise UserError(f"{name} {text[:200]!a}: not valid UTF-8")
    if len(text) > MAX_CHARACTERS:
        raise UserError(f"{name} {shown}: longer than {MAX_CHARACTERS} characters")
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        raise UserError(f"{name} {shown}: not an expression ({exc.msg})") from None
    except (RecursionError, MemoryError, ValueError):  # the parser's stack, a NUL byte
        raise UserError(f"{name} {shown}: nested too deeply for the parser") from None
    if _depth(tree) > MAX_DEPTH:
        raise UserError(f"{name} {shown}: nested more than {MAX_DEPTH} levels deep")
    _check_names(text, name)
    return tree


def _shown(text: str) -> str:
    """``text`` quoted for a one-line error, its middle left out when long."""
    return repr(text) if len(text) <= 200 else f"{text[:80]!r}… ({len(text)} characters)"


def _depth(tree: ast.AST) -> int:
    """How deep ``tree`` is, counted without recursion."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth <= MAX_DEPTH:  # deeper than that is refused anyway
            stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def _check_names(text: str, name: str) -> None:
    """:class:`UserError` for a name written in characters Python folds into others (NFKC):
    ``ｌａｎｇ`` (full width) would otherwise silently select on the field ``lang``."""
    if text.isascii():
        return
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        folded = unicodedata.normalize("NFKC", token.string)
        if token.type == tokenize.NAME and folded != token.string:
            raise UserError(
                f"{name} {_shown(text)}: the name {token.string!r} would be read as {folded!r} "
                "(Python folds full-width and compatibility characters); write the field's "
                "name exactly as the metadata has it"
            )


def _check(node: ast.expr, text: str, name: str) -> set[str]:
    """The field names ``node`` uses; :class:`UserError` naming the first thing not allowed."""
    parts: list[ast.expr] | None = None
    if isinstance(node, ast.BoolOp):
        parts = node.values
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub):
        parts = [node.operand]
    elif isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        parts = [node.left, *node.comparators]
    elif isinstance(node, ast.IfExp):
        parts = [node.test, node.body, node.orelse]
    elif isinstance(node, ast.List | ast.Tuple):
        parts = node.elts
    elif isinstance(node, ast.Name):
        return set() if node.id in _NAMES else {node.id}
    elif isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool):
        return set()
    if parts is None:
        raise UserError(
            f"{name} {_shown(text)}: {_shown(ast.unparse(node))} is not allowed; use field "
            "names, literals, comparisons (== != < <= > >= in, not in), and, or, not, "
            "A if C else B"
        )
    return set().union(*(_check(v, text, name) for v in parts))


def _truth(value: Any) -> bool:
    return value is not _MISSING and bool(value)


Compiled = Callable[[dict[str, Any]], Any]


def _compile(node: ast.expr) -> Compiled:
    """``node`` as a function of the metadata, built once: per row it then runs closures,
    not a walk deciding each node's kind again: 2–2.6× faster a row (6.6 → 3.3 µs for
    ``snr >= 20 and language in ["en", "zh"]``), some 30 s less per start at 10 M utterances."""
    if isinstance(node, ast.BoolOp):
        parts = [_compile(v) for v in node.values]
        if isinstance(node.op, ast.And):
            return lambda meta: all(_truth(part(meta)) for part in parts)
        return lambda meta: any(_truth(part(meta)) for part in parts)
    if isinstance(node, ast.UnaryOp):
        operand = _compile(node.operand)
        if isinstance(node.op, ast.Not):
            return lambda meta: not _truth(operand(meta))
        return lambda meta: _negated(operand(meta))
    if isinstance(node, ast.Compare):
        return _compare([_compile(node.left), *map(_compile, node.comparators)], node.ops)
    if isinstance(node, ast.Name):
        if node.id in _NAMES:
            return _constant(_NAMES[node.id])
        name = node.id
        return lambda meta: meta.get(name, _MISSING)
    if isinstance(node, ast.IfExp):
        test, body, orelse = _compile(node.test), _compile(node.body), _compile(node.orelse)
        return lambda meta: body(meta) if _truth(test(meta)) else orelse(meta)
    if isinstance(node, ast.List | ast.Tuple):
        items = [_compile(v) for v in node.elts]
        if all(isinstance(v, ast.Constant) for v in node.elts):  # a literal list: built once
            return _constant([item({}) for item in items])
        return lambda meta: [item(meta) for item in items]
    return _constant(node.value)  # a Constant: _check allowed nothing else


def _constant(value: Any) -> Compiled:
    return lambda meta: value


def _negated(value: Any) -> Any:
    return _MISSING if value is _MISSING or isinstance(value, str) else -value


def _compare(values: list[Compiled], ops: list[ast.cmpop]) -> Compiled:
    """A chained comparison: false where a side is missing or the two cannot be compared
    (``"en" < 3``, ``3 in 4``: not selected, not a crash)."""
    tests = [_COMPARE[type(op)] for op in ops]

    def compare(meta: dict[str, Any]) -> bool:
        left = values[0](meta)
        for test, right_of in zip(tests, values[1:], strict=True):
            right = right_of(meta)
            try:
                if left is _MISSING or right is _MISSING or not test(left, right):
                    return False
            except TypeError:
                return False
            left = right
        return True

    return compare
