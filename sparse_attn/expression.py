"""PATTERN text -> Pattern: a preset name, a TOML pattern file, or a safe expression.

>>> parse_pattern("Local(64) | Global(first=2)")
(Local(64) | Global(first=2), None)
>>> parse_pattern("dilated-longformer")[1]          # a preset file's heads
12
>>> parse_pattern("__import__('os')")
Traceback (most recent call last):
...
sparse_attn.expression.PatternTextError: pattern expression: '__import__' is not a pattern constructor; use one of ...

Which of the three a text is: a path ending in ``.toml``, or one with a ``/`` and no call in it,
is a file; a bare name (``bigbird-itc``) that is not a constructor is a preset; anything else is an
expression. Expressions are parsed with ``ast`` and evaluated by walking the tree, never with
``eval``: calls to ``CONSTRUCTORS`` (every class in ``pattern.KINDS`` and the named constructors of
``presets``), int/str/bool constants, lists/tuples, keyword arguments, unary minus, ``|``, ``&`` and
``~`` (complement). Chains such as ``a | b | c | ...`` and ``~~~p`` are evaluated without recursion, so
thousands of operands work.

>>> parse_pattern("Local(4) & ~Global(first=1)")[0]
Local(4) & ~Global(first=1)
>>> parse_pattern("Blocks([[1, 0], [1, 1]], 64) | ~~Causal()")[0]      # ~~p is p
Blocks([[1, 0], [1, 1]], 64) | Causal()

Every error is a ``PatternTextError`` (a ``ValueError``) whose message says what was wrong and
what is accepted; the ``sparse-attn`` command prints it as ``sparse-attn: error: ...``.
"""
from __future__ import annotations

import ast
import functools
import operator
import os
import re
from collections.abc import Callable

from . import presets
from .pattern import KINDS, Pattern, PerHead

# every pattern kind by its class name, then the named constructors of presets.py
CONSTRUCTORS: dict[str, Callable[..., Pattern]] = {
    **{cls.__name__: cls for cls in KINDS.values()}, "longformer": presets.longformer, "bigbird": presets.bigbird,
    "sparse_transformer": presets.sparse_transformer, "streaming": presets.streaming, "preset": presets.preset,
}
_NAME = re.compile(r"[A-Za-z][\w-]*")    # a preset name (or a benchmark label), never an expression or a path
_BAD_ARGUMENT = (ValueError, TypeError, OverflowError, MemoryError, RecursionError)  # what bad sizes or patterns raise


class PatternTextError(ValueError):
    """A text that is not a preset, a readable pattern file or a valid pattern expression."""


def parse_pattern(text: str, named: dict[str, str] | None = None) -> tuple[Pattern, int | None]:
    """A preset name, a TOML file or a safe expression -> (pattern, heads the file asks for or None).

    ``named`` maps extra names (the benchmark's labels) to PATTERN texts.

    >>> parse_pattern("bigbird-itx")
    Traceback (most recent call last):
    ...
    sparse_attn.expression.PatternTextError: no preset named 'bigbird-itx'; did you mean bigbird-itc? ...
    """
    named = named or {}
    if text in named:
        return parse_pattern(named[text])
    if text.endswith(".toml") or ("/" in text or os.sep in text) and "(" not in text:  # expressions call
        return _load_file(text)
    if _NAME.fullmatch(text) and text not in CONSTRUCTORS:
        return _load_preset(text, named)
    return _parse_expression(text), None


def per_head_count(pattern: Pattern) -> int | None:
    """The number of heads a ``PerHead`` inside ``pattern`` asks for, None without one.

    >>> import sparse_attn as sa
    >>> per_head_count(sa.PerHead([sa.Local(1), sa.Dense()]) | sa.Global(first=1))
    2
    """
    lengths, stack = set(), [pattern]
    while stack:  # iterative: expressions may nest deeply
        node = stack.pop()
        if isinstance(node, PerHead):
            lengths.add(len(node.patterns))
        stack.extend(node.children)
    return lengths.pop() if len(lengths) == 1 else None  # several lengths: the layout says which is wrong


def _load_file(text: str) -> tuple[Pattern, int | None]:
    try:
        return presets.load_pattern(text), presets.declared_heads(text)
    except _BAD_ARGUMENT as error:
        raise PatternTextError(str(error)) from None


def _load_preset(name: str, named: dict[str, str]) -> tuple[Pattern, int | None]:
    choices = list(dict.fromkeys([*named, *presets.list_presets()]))
    if name not in choices:
        raise PatternTextError(f"no preset named {name!r}; {presets.did_you_mean(name, choices)}PATTERN is one of "
                               f"{', '.join(choices)}, a .toml file or an expression such as "
                               f"'Local(64) | Global(first=2)'")
    path = presets.preset_path(name)
    return presets.load_pattern(path), presets.declared_heads(path)


def _parse_expression(text: str) -> Pattern:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as error:
        raise PatternTextError(f"pattern {text[:80]!r} is not a preset ({', '.join(presets.list_presets())}), a "
                               f".toml file or a valid expression: {error.msg}") from None
    except (RecursionError, MemoryError):
        raise PatternTextError(f"pattern expression of {len(text):,} characters nests too deeply for Python's "
                               f"parser; write it to a .toml file with sa.save_pattern") from None
    except UnicodeError:  # bytes that are not UTF-8 arrive as surrogates
        raise PatternTextError(f"pattern {text!r} is not valid UTF-8 text") from None
    try:
        value = _evaluate(tree.body)
    except PatternTextError:
        raise
    except _BAD_ARGUMENT as error:
        raise PatternTextError(f"pattern expression {text[:200]!r}: {error or type(error).__name__}") from None
    if not isinstance(value, Pattern):
        raise PatternTextError(f"pattern expression {text!r} gives a {type(value).__name__}, not a Pattern; "
                               f"call it, e.g. 'longformer()'")
    return value


def _operands(node: ast.BinOp) -> list[ast.AST]:
    """``a | b | c`` parses as ``(a | b) | c``: its operands left to right, without recursion."""
    op, operands = type(node.op), []
    left: ast.expr = node
    while isinstance(left, ast.BinOp) and isinstance(left.op, op):
        operands.append(left.right)
        left = left.left
    return [left, *reversed(operands)]


def _evaluate(node: ast.AST):
    """Walk an expression tree that may only build patterns."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, str, bool)):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_evaluate(item) for item in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _evaluate(node.operand)
        if isinstance(value, bool) or not isinstance(value, int):
            raise PatternTextError(f"pattern expression: unary minus applies to ints only, got {value!r}")
        return -value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
        inversions = 0
        while isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):  # ~~~p: no recursion
            inversions, node = inversions + 1, node.operand
        value = _evaluate(node)
        if not isinstance(value, Pattern):
            raise PatternTextError(f"pattern expression: '~' complements a pattern, got {value!r}")
        return ~value if inversions % 2 else value                                  # ~~p is p
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitOr, ast.BitAnd)):
        values = [_evaluate(operand) for operand in _operands(node)]
        for value in values:
            if not isinstance(value, Pattern):
                raise PatternTextError(f"pattern expression: '|' and '&' combine patterns, got {value!r}")
        return functools.reduce(operator.or_ if isinstance(node.op, ast.BitOr) else operator.and_, values)
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in CONSTRUCTORS:
            name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
            raise PatternTextError(f"pattern expression: {name!r} is not a pattern constructor; use one of "
                                   f"{', '.join(CONSTRUCTORS)}")
        if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            raise PatternTextError("pattern expression: *args and **kwargs are not allowed")
        args = [_evaluate(a) for a in node.args]
        kwargs = {k.arg: _evaluate(k.value) for k in node.keywords if k.arg is not None}  # None: refused above
        return CONSTRUCTORS[node.func.id](*args, **kwargs)
    if isinstance(node, ast.Name) and node.id in CONSTRUCTORS:
        raise PatternTextError(f"pattern expression: {node.id} must be called, e.g. {node.id}(...)")
    if isinstance(node, ast.Name):
        raise PatternTextError(f"{node.id!r} is not a preset ({', '.join(presets.list_presets())}), a .toml file "
                               f"or a pattern expression such as 'Local(64) | Global(first=2)'")
    raise PatternTextError(f"pattern expression: {ast.unparse(node)[:80]!r} is not allowed; use pattern "
                           f"constructors ({', '.join(CONSTRUCTORS)}), int/str/bool constants, lists, '|', '&' and "
                           f"'~'")
