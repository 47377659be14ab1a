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

    def __call__(self, meta: dict[str, Any]) -> bool:
        """Whether ``meta`` is selected."""
        return _truth(_evaluate(self.tree, meta))

    def value(self, meta: dict[str, Any]) -> Any:
        """The expression's value for ``meta``: a number, string, bool, or ``None`` where a
        field it names is missing."""
        value = _evaluate(self.tree, meta)
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


def _evaluate(node: ast.expr, meta: dict[str, Any]) -> Any:
    if isinstance(node, ast.BoolOp):
        values = (_truth(_evaluate(v, meta)) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.UnaryOp):
        value = _evaluate(node.operand, meta)
        if isinstance(node.op, ast.Not):
            return not _truth(value)
        return _MISSING if value is _MISSING or isinstance(value, str) else -value
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, meta)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = _evaluate(right_node, meta)
            try:
                if left is _MISSING or right is _MISSING or not _COMPARE[type(op)](left, right):
                    return False
            except TypeError:  # "en" < 3, or 3 in 4: not selected, not a crash
                return False
            left = right
        return True
    if isinstance(node, ast.Name):
        return _NAMES[node.id] if node.id in _NAMES else meta.get(node.id, _MISSING)
    if isinstance(node, ast.IfExp):
        return _evaluate(node.body if _truth(_evaluate(node.test, meta)) else node.orelse, meta)
    if isinstance(node, ast.List | ast.Tuple):
        return [_evaluate(v, meta) for v in node.elts]
    return node.value  # a Constant: _check allowed nothing else
