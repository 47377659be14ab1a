"""``--where``: select utterances by their metadata, as ``language == "en" and dnsmos >= 3.2``.

The expression is parsed with :mod:`ast` and evaluated by walking the tree: only field names,
literals (strings, numbers, ``true``/``false``/``null``, lists of them), comparisons
(``== != < <= > >= in not in``), ``and``, ``or``, ``not`` and parentheses are allowed, so a
corpus's metadata can never run code. A comparison with a field the metadata lacks, or
between values that cannot be ordered (a string and a number), is false.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from melcache.errors import UserError

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


class Where:
    """A parsed ``--where`` expression; call it with a metadata dict."""

    def __init__(self, text: str) -> None:
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError as exc:
            raise UserError(f"--where {text!r}: not an expression ({exc.msg})") from None
        self.text = text
        self.tree = tree
        self.fields = sorted(_check(tree, text))

    def __call__(self, meta: dict[str, Any]) -> bool:
        """Whether ``meta`` is selected."""
        return _truth(_evaluate(self.tree, meta))


def _check(node: ast.expr, text: str) -> set[str]:
    """The field names ``node`` uses; :class:`UserError` naming the first thing not allowed."""
    if isinstance(node, ast.BoolOp):
        return set().union(*(_check(v, text) for v in node.values))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _check(node.operand, text)
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        return set().union(*(_check(v, text) for v in [node.left, *node.comparators]))
    if isinstance(node, ast.Name):
        return set() if node.id in _NAMES else {node.id}
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | bool):
        return set()
    if isinstance(node, ast.List | ast.Tuple):
        return set().union(*(_check(v, text) for v in node.elts)) if node.elts else set()
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _check(node.operand, text)
    raise UserError(
        f"--where {text!r}: {ast.unparse(node)!r} is not allowed; use field names, literals, "
        "comparisons (== != < <= > >= in, not in), and, or, not"
    )


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
    if isinstance(node, ast.List | ast.Tuple):
        return [_evaluate(v, meta) for v in node.elts]
    return node.value  # a Constant: _check allowed nothing else
