"""What a pattern means for one (n_q, n_k, head): the rules that ``Pattern.mask`` and the compiler evaluate.

>>> import numpy as np, sparse_attn as sa
>>> rule = resolve(sa.Dilated(1, 2) | sa.Global(first=1), Context(n_q=6, n_k=6, head=0))
>>> rule
UnionRule(IntersectionRule(WindowRule(before=2, after=2, unit=1), StrideRule(stride=2, offset=0)),
          TokenRule(rows=[0], cols=[0]))
>>> rule.allows(np.array([3]), np.arange(6))                  # query position 3 against every key
array([ True,  True, False,  True, False,  True])

A ``Pattern`` (pattern.py) is the user's spec, independent of sequence length. ``resolve`` turns it,
for a :class:`Context` (n_q, n_k, head), into a tree of :class:`Rule` objects: sugar expanded
(``Dilated`` is a window and a stride), ``Global``/``Sink`` turned into token positions, ``PerHead``'s
pattern for the head picked, ``Random``'s tiles chosen. A rule answers three questions, vectorised over
numpy int64 arrays and none of them N x N:

- ``allows(i, j)``: token level, may the query at position i and the key at position j interact?
- ``classify(blocks)``: for blocks given by their token ranges (:class:`BlockRanges`), is the block
  nonempty, full (every valid pair allowed), and a *signature*: two blocks of one rule with equal
  signatures have the same token mask (up to the block's own bounds), so a layout materialises one
  mask per signature instead of one per block.
- ``candidates(ctx, block_size)``: a sorted superset of the nonempty block keys
  ``r * n_key_blocks + c``, in time proportional to its size; ``None`` for rules that touch a large
  fraction of all blocks (stride, causal, dense), which are then classified block by block.

Positions: keys are at 0..n_k-1 and query row i is at position ``i + n_k - n_q`` (bottom-right aligned,
as FlashAttention and FlexAttention align a decode step); with n_q == n_k they coincide. Rules see
positions; blocks and masks are indexed by query row.

Pattern arguments are Python ints of any size; resolving clamps them to the context (a window or tile
wider than the sequence is the sequence, a stride offset counts modulo the stride), so rules only
ever compute with int64 values bounded by the sequence lengths (at most ``blocks.MAX_LENGTH``).

Imports run one way: pattern.py imports this module (``Pattern.mask`` resolves), and this module never
imports pattern.py. It reads a spec's ``kind`` tag and public fields only, and looks the kind up in
``RESOLVERS``, so the user's classes carry no evaluation code and rules can never be combined,
serialised or passed where a Pattern is expected. A new pattern kind is a spec class in pattern.py
with a new ``kind`` and a resolver here, ``@resolver(kind)``, returning existing rules or a new
:class:`Rule` subclass; the compiler needs no change (docs/architecture.md lists every step).
"""
from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from typing import ClassVar, NamedTuple, Protocol

import numpy as np

from .blocks import block_bounds, ceil_div


class PatternSpec(Protocol):
    """What the compiler, the rules and retention read from a pattern spec (``sparse_attn.Pattern`` is one):
    ``kind`` picks its resolver in ``RESOLVERS``; the spec's own fields are read by that resolver.

    >>> import sparse_attn as sa
    >>> spec: PatternSpec = sa.Local(2) | sa.Global(first=1)
    >>> spec.kind, spec.head_dependent, len(spec.children)
    ('union', False, 2)
    """

    @property
    def kind(self) -> str: ...                         # the resolver's key ("local", "union", ...)

    @property
    def head_dependent(self) -> bool: ...              # may heads differ (else one layout head serves all)

    @property
    def children(self) -> tuple[PatternSpec, ...]: ...  # the specs a combinator combines; () for a leaf

    def check_heads(self, heads: int) -> None: ...      # a ValueError unless it runs with ``heads`` query heads


class Context(NamedTuple):
    """One (n_q, n_k, head) a pattern is resolved for."""

    n_q: int
    n_k: int
    head: int

    @property
    def shift(self) -> int:
        """Position of query row 0: queries are the last n_q positions of the key sequence."""
        return self.n_k - self.n_q

    @property
    def span(self) -> int:
        """Positions lie in [min(shift, 0), n_k - 1]: any two differ by less than ``span``."""
        return max(self.n_q, self.n_k)

    def query_positions(self, rows: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions of the first and last query of query blocks ``rows``."""
        first, last = block_bounds(rows, block_size, self.n_q)
        return first + self.shift, last + self.shift


class BlockRanges(NamedTuple):
    """Blocks as inclusive position ranges: queries i0..i1, keys j0..j1 (int64 arrays)."""

    i0: np.ndarray
    i1: np.ndarray
    j0: np.ndarray
    j1: np.ndarray

    @staticmethod
    def at(ctx: Context, rows: np.ndarray, cols: np.ndarray, block_size: int, offset: int = 0) -> BlockRanges:
        """Blocks (rows[k], cols[k]) of ``block_size`` tokens, cut at the sequence ends. With ``offset`` the
        block grid starts ``offset`` tokens before position 0 (where a packed document lies in the blocks
        of its row), so the first blocks are cut as well."""
        i0, i1 = block_bounds(rows, block_size, ctx.n_q + offset)
        j0, j1 = block_bounds(cols, block_size, ctx.n_k + offset)
        return BlockRanges(np.maximum(i0 - offset, 0) + ctx.shift, i1 - offset + ctx.shift,
                           np.maximum(j0 - offset, 0), j1 - offset)


# ------------------------------------------------------------------------------------------------
# Rules
# ------------------------------------------------------------------------------------------------
class Rule(abc.ABC):
    """A pattern resolved for one :class:`Context`; see the module docstring for the three questions."""

    @abc.abstractmethod
    def allows(self, i: np.ndarray | np.integer, j: np.ndarray) -> np.ndarray:
        """May query position ``i`` and key position ``j`` interact (bool, broadcast shape)?"""

    @abc.abstractmethod
    def classify(self, b: BlockRanges) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(nonempty, full, signature) of every block; a signature is a vector or an (n, k) matrix."""

    def candidates(self, ctx: Context, block_size: int) -> np.ndarray | None:
        """Sorted keys ``r * n_key_blocks + c`` that include every nonempty block, or None for all blocks."""
        return None

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={_short(value)}" for name, value in vars(self).items() if not name.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _short(value) -> str:
    if isinstance(value, np.ndarray):
        return repr(value.tolist()) if value.size <= 8 else f"<{value.size} values>"
    return repr(value)


class WindowRule(Rule):
    """Local: ``-before <= j // unit - i // unit <= after``."""

    def __init__(self, before: int, after: int, unit: int):
        self.before, self.after, self.unit = before, after, unit

    def allows(self, i, j):
        d = j - i if self.unit == 1 else j // self.unit - i // self.unit      # (int64 division is slow)
        return (d >= -self.before) & (d <= self.after)

    def classify(self, b):
        u = self.unit
        d_lo = b.j0 // u - b.i1 // u
        d_hi = b.j1 // u - b.i0 // u
        nonempty = (d_hi >= -self.before) & (d_lo <= self.after)
        full = (d_lo >= -self.before) & (d_hi <= self.after)
        sig = ((b.i0 // u - b.j0 // u) * u + b.i0 % u) * u + b.j0 % u
        return nonempty, full, sig

    def candidates(self, ctx, block_size):
        u, n_kb = self.unit, ceil_div(ctx.n_k, block_size)
        r = np.arange(ceil_div(ctx.n_q, block_size), dtype=np.int64)
        i0, i1 = ctx.query_positions(r, block_size)
        j_min = np.maximum((i0 // u - self.before) * u, 0)
        j_max = np.minimum((i1 // u + self.after) * u + u - 1, ctx.n_k - 1)
        return _ranges_to_keys(r, j_min // block_size, np.where(j_max >= j_min, j_max // block_size, -1), n_kb)


class StrideRule(Rule):
    """Stride: ``(i - j - offset) % stride == 0``."""

    def __init__(self, stride: int, offset: int):
        self.stride, self.offset = stride, offset

    def allows(self, i, j):
        return (i - j - self.offset) % self.stride == 0

    def classify(self, b):
        lo, hi = b.i0 - b.j1 - self.offset, b.i1 - b.j0 - self.offset
        nonempty = lo + (-lo) % self.stride <= hi
        full = nonempty & ((self.stride == 1) | (lo == hi))
        return nonempty, full, (b.i0 - b.j0 - self.offset) % self.stride


class TokenRule(Rule):
    """Rows ``rows`` and columns ``cols`` (sorted int64 positions) are dense: global and sink tokens."""

    def __init__(self, rows: np.ndarray, cols: np.ndarray):
        self.rows, self.cols = rows, cols

    def allows(self, i, j):
        return _member(self.rows, i) | _member(self.cols, j)

    def classify(self, b):
        n_rows = _count_in(self.rows, b.i0, b.i1)
        n_cols = _count_in(self.cols, b.j0, b.j1)
        nonempty = (n_rows > 0) | (n_cols > 0)
        full = (n_rows == b.i1 - b.i0 + 1) | (n_cols == b.j1 - b.j0 + 1)
        sig = np.stack([n_rows > 0, np.where(n_rows > 0, b.i0, 0), n_cols > 0, np.where(n_cols > 0, b.j0, 0)], axis=1)
        return nonempty, full, sig

    def candidates(self, ctx, block_size):
        n_qb, n_kb = ceil_div(ctx.n_q, block_size), ceil_div(ctx.n_k, block_size)
        query_rows = self.rows - ctx.shift
        row_blocks = np.unique(query_rows[(query_rows >= 0) & (query_rows < ctx.n_q)] // block_size)
        col_blocks = np.unique(self.cols // block_size)
        by_row = _ranges_to_keys(row_blocks, np.zeros_like(row_blocks), np.full_like(row_blocks, n_kb - 1), n_kb)
        by_col = (np.arange(n_qb, dtype=np.int64)[:, None] * n_kb + col_blocks[None, :]).reshape(-1)
        return np.unique(np.concatenate([by_row, by_col]))


class KeyPaddingRule(Rule):
    """Keys where ``padding`` (bool, length n_k) is True are never attended."""

    def __init__(self, padding: np.ndarray):
        self.padding = padding
        self._valid_before = np.concatenate([[0], np.cumsum(~padding)])  # valid keys in [0, j)

    def allows(self, i, j):
        return ~self.padding[j]

    def classify(self, b):
        n_valid = self._valid_before[b.j1 + 1] - self._valid_before[b.j0]
        return n_valid > 0, n_valid == b.j1 - b.j0 + 1, b.j0


class CausalRule(Rule):
    """Causal: ``j <= i`` (positions, so bottom-right aligned)."""

    def allows(self, i, j):
        return j <= i

    def classify(self, b):
        return b.j0 <= b.i1, b.j1 <= b.i0, b.i0 - b.j0


class DenseRule(Rule):
    """Every pair."""

    def allows(self, i, j):
        return np.ones(np.broadcast_shapes(np.shape(i), np.shape(j)), dtype=bool)

    def classify(self, b):
        ones = np.ones(b.i0.shape, dtype=bool)
        return ones, ones, np.zeros(b.i0.shape, dtype=np.int64)


class TilesRule(Rule):
    """Chosen tiles of ``unit`` x ``unit`` positions, as sorted keys ``R * n_kt + C``: tile row R holds the
    positions ``origin + R * unit ..``, tile column C the keys ``C * unit ..`` (Random's tiles from position
    0, a ``Blocks`` grid's from the first query row)."""

    def __init__(self, chosen: np.ndarray, unit: int, n_kt: int, origin: int = 0):
        self.chosen, self.unit, self.n_kt, self.origin = chosen, unit, n_kt, origin

    def allows(self, i, j):
        return _member(self.chosen, ((i - self.origin) // self.unit) * self.n_kt + j // self.unit)

    def classify(self, b):
        u, n_kt = self.unit, self.n_kt
        r0, r1, c0, c1 = (b.i0 - self.origin) // u, (b.i1 - self.origin) // u, b.j0 // u, b.j1 // u
        count = np.zeros(b.i0.shape, dtype=np.int64)
        for dr in range(int((r1 - r0).max(initial=0)) + 1):
            row = np.where(r0 + dr <= r1, (r0 + dr) * n_kt, -1 - n_kt)  # rows past r1 count nothing
            count += _count_in(self.chosen, row + c0, row + c1)
        area = (r1 - r0 + 1) * (c1 - c0 + 1)
        return count > 0, count == area, self._signature(b, r0, r1, c0, c1)

    def _signature(self, b, r0, r1, c0, c1):
        """Blocks over at most 256 tiles (tiles at least as large as blocks, or a Blocks grid up to 15 times
        finer than the layout): the block's offset in its tile and which of its tiles are chosen, as bits
        in int64 columns of 62. Blocks over more tiles keep a tile of their own (the block's position)."""
        rows, cols = int((r1 - r0).max(initial=0)) + 1, int((c1 - c0).max(initial=0)) + 1
        if rows * cols > 256:
            return np.stack([b.i0, b.j0], axis=1)
        chosen = np.zeros((ceil_div(rows * cols, 62), *b.i0.shape), dtype=np.int64)
        for dr in range(rows):
            for dc in range(cols):
                inside = (r0 + dr <= r1) & (c0 + dc <= c1)
                bit = inside & _member(self.chosen, (r0 + dr) * self.n_kt + c0 + dc)
                column, shift = divmod(dr * cols + dc, 62)
                chosen[column] |= bit.astype(np.int64) << shift
        return np.stack([(b.i0 - self.origin) % self.unit, b.j0 % self.unit, *chosen], axis=1)

    def candidates(self, ctx, block_size):
        u, n_kb = self.unit, ceil_div(ctx.n_k, block_size)
        tile_r, tile_c = self.chosen // self.n_kt, self.chosen % self.n_kt
        first_position, last_position = block_bounds(tile_r, u, ctx.n_k - self.origin)  # positions of each tile
        first_row = np.maximum(first_position + self.origin - ctx.shift, 0)              # its query rows
        last_row = last_position + self.origin - ctx.shift
        seen = first_row <= last_row
        first_row, last_row = first_row[seen], last_row[seen]
        first_key, last_key = block_bounds(tile_c[seen], u, ctx.n_k)                # keys of each tile
        keys = []
        for dr in range(ceil_div(u, block_size) + 1):
            r = np.minimum(first_row // block_size + dr, last_row // block_size)
            for dc in range(ceil_div(u, block_size) + 1):
                c = np.minimum(first_key // block_size + dc, last_key // block_size)
                keys.append(r * n_kb + c)
        return np.unique(np.concatenate(keys))


class ComplementRule(Rule):
    """Pairs ``inner`` does not allow. A block full for ``inner`` is empty here and an empty one full; a
    partial block stays partial with the inner's signature (equal inner tiles, equal complements). Blocks
    are cut at the sequence ends, so full means every pair of the sequence in it. No candidates: a
    complement touches most blocks; an intersection takes its candidates from its other members."""

    def __init__(self, inner: Rule):
        self.inner = inner

    def allows(self, i, j):
        return np.logical_not(self.inner.allows(i, j))

    def classify(self, b):
        nonempty, full, sig = self.inner.classify(b)
        return np.logical_not(full), np.logical_not(nonempty), sig


class _CombinationRule(Rule):
    """Members of one operator, combined by ``_combine`` (logical or / and); nested members of the same
    operator are flattened into it."""

    _combine: ClassVar[np.ufunc]
    members: tuple[Rule, ...]

    def __init__(self, *members: Rule):
        self.members = tuple(m for member in members
                             for m in (member.members if type(member) is type(self) else (member,)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.members))})"

    def allows(self, i, j):
        return functools.reduce(self._combine, (m.allows(i, j) for m in self.members))

    def classify(self, b):
        results = [m.classify(b) for m in self.members]
        columns = []
        for nonempty, full, member_sig in results:
            # a member's part of the block mask: state -2 absent, -1 full, 0 partial (then its signature)
            state = np.where(full, -1, np.where(nonempty, 0, -2))
            columns.append(state[:, None])
            columns.append(np.where(state[:, None] == 0, _as_columns(member_sig, b.i0.shape[0]), 0))
        nonempty = self._combine.reduce([r[0] for r in results])
        full = self._combine.reduce([r[1] for r in results])
        return nonempty, full, np.concatenate(columns, axis=1)


class UnionRule(_CombinationRule):
    """Pairs allowed by any member."""

    _combine = np.logical_or

    def candidates(self, ctx, block_size):
        keys = [m.candidates(ctx, block_size) for m in self.members]
        if any(k is None for k in keys):
            return None
        return np.unique(np.concatenate(keys))


class IntersectionRule(_CombinationRule):
    """Pairs allowed by every member."""

    _combine = np.logical_and

    def candidates(self, ctx, block_size):
        keys = [k for k in (m.candidates(ctx, block_size) for m in self.members) if k is not None]
        if not keys:
            return None
        out = keys[0]
        for k in keys[1:]:
            out = np.intersect1d(out, k, assume_unique=True)
        return out


# ------------------------------------------------------------------------------------------------
# Resolving a spec
# ------------------------------------------------------------------------------------------------
RESOLVERS: dict[str, Callable[[object, Context], Rule]] = {}  # a spec's ``kind`` -> its resolver


def resolver(kind: str):
    """Register the decorated ``fn(spec, ctx) -> Rule`` as the resolver of specs of ``kind``."""
    def register(fn):
        RESOLVERS[kind] = fn
        return fn
    return register


def resolve(spec: PatternSpec, ctx: Context) -> Rule:
    """The rule a Pattern spec stands for in ``ctx``: sugar expanded, positions found, Random tiles chosen."""
    kind = getattr(spec, "kind", None)
    if kind not in RESOLVERS:
        raise TypeError(f"no rule for {type(spec).__name__} (kind {kind!r}): a pattern kind needs a resolver in "
                        f"sparse_attn.rules, registered with @resolver(kind); known kinds are {sorted(RESOLVERS)}")
    return RESOLVERS[kind](spec, ctx)


def window(before: int, after: int, unit: int, ctx: Context) -> WindowRule:
    """A window clamped to the context: a unit of ``span`` positions already holds them all (every
    ``i // unit`` is 0, or -1 before position 0), and no two positions are more than ``span // unit + 1``
    units apart."""
    unit = min(unit, ctx.span)
    reach = ctx.span // unit + 1
    return WindowRule(min(before, reach), min(after, reach), unit)


def stride(step: int, offset: int, ctx: Context) -> StrideRule:
    """A stride clamped to the context: only differences ``i - j`` in (-span, span) occur, so the offset
    counts modulo the stride, and a stride of at least 2 * span allows one difference at most, which a
    stride of 2 * span keeps (offset ``span`` when none occurs)."""
    offset, span = offset % step, ctx.span
    if step <= 2 * span:
        return StrideRule(step, offset)
    allowed = offset if offset < span else offset - step if offset - step > -span else span
    return StrideRule(2 * span, allowed % (2 * span))


def token_positions(n: int, tokens=(), first: int = 0, last: int = 0) -> np.ndarray:
    """Sorted int64 positions below ``n``: the explicit ``tokens``, the first ``first`` and the last ``last``.

    >>> token_positions(10, tokens=(5, 50), last=2).tolist()
    [5, 8, 9]
    """
    if not tokens and not last:                                     # the first ones only: a decode step's sinks
        return np.arange(min(first, n), dtype=np.int64)
    explicit = np.asarray([t for t in tokens if t < n], dtype=np.int64)
    head = np.arange(min(first, n), dtype=np.int64)
    tail = np.arange(max(n - last, 0), n, dtype=np.int64)
    return np.unique(np.concatenate([explicit, head, tail]))


@resolver("local")
def _resolve_local(spec, ctx):
    return window(spec.before, spec.after, spec.block_size, ctx)


@resolver("stride")
def _resolve_stride(spec, ctx):
    return stride(spec.stride, spec.offset, ctx)


@resolver("dilated")
def _resolve_dilated(spec, ctx):
    d = spec.dilation
    return IntersectionRule(window(spec.before * d, spec.after * d, 1, ctx), stride(d, 0, ctx))


@resolver("global")
def _resolve_global(spec, ctx):
    positions = token_positions(ctx.n_k, spec.tokens, spec.first, spec.last)
    return TokenRule(positions, positions)


@resolver("sink")
def _resolve_sink(spec, ctx):
    n = ctx.n_k
    parts = [token_positions(n, spec.tokens, spec.first)]
    if spec.period and spec.period - spec.width < n:
        # period p: columns [s + p - width, s + p) of every period start s, cut at n
        step = min(spec.period, n)
        starts = np.arange(0, n, step, dtype=np.int64)
        first = starts + (spec.period - spec.width)
        last = np.minimum(starts + step, n) - 1
        parts.append(_ranges_to_keys(np.zeros_like(starts), first, last, 0))
    return TokenRule(np.zeros(0, dtype=np.int64), parts[0] if len(parts) == 1 else np.unique(np.concatenate(parts)))


@resolver("causal")
def _resolve_causal(spec, ctx):
    return CausalRule()


@resolver("dense")
def _resolve_dense(spec, ctx):
    return DenseRule()


@resolver("random")
def _resolve_random(spec, ctx):
    return random_tiles(spec.blocks, spec.seed, spec.block_size, ctx, excluded=None)


@resolver("union")
def _resolve_union(spec, ctx):
    """Random members choose among the tiles that the other members leave untouched (``union_exclusion``)."""
    rest = [resolve(p, ctx) for p in spec.patterns if p.kind != "random"]
    excluded = union_exclusion(spec, ctx, rest)
    randoms = [random_tiles(p.blocks, p.seed, p.block_size, ctx, excluded) for p in spec.patterns if p.kind == "random"]
    return UnionRule(*rest, *randoms)


def union_exclusion(spec, ctx: Context, resolved: list[Rule] | None = None) -> Rule | None:
    """What the Random members of the union ``spec`` draw around in ``ctx``: its other members (None: there are
    none), ``resolved`` in ctx if given. A Random draws at each tile row's first position, which may come before
    the first query (a decode step's row starts earlier), so for the choice the other members are resolved from
    the first Random row's first position on: a Random nested in them (``Stride(1) & Random(1)``) would otherwise
    hold only the rows of the queries. The layout (``resolve``) and the FlexAttention predicate
    (``sparse_attn.flex``) both draw around this rule, so they choose the same tiles."""
    others = [p for p in spec.patterns if p.kind != "random"]
    if not others:
        return None
    rest = resolved if resolved is not None else [resolve(p, ctx) for p in others]
    tiles = [min(p.block_size, ctx.n_k) for p in spec.patterns if p.kind == "random"]
    first = min((max(ctx.shift, 0) // u * u for u in tiles), default=max(ctx.shift, 0))
    wide = Context(ctx.n_k - first, ctx.n_k, ctx.head)

    def for_the_choice(p, rule):                          # a Blocks grid's rows are the call's queries: kept as is
        kinds = _kinds(p)
        return resolve(p, wide) if wide.n_q > ctx.n_q and "random" in kinds and "blocks" not in kinds else rule

    return UnionRule(*(for_the_choice(p, rule) for p, rule in zip(others, rest)))


def _kinds(spec) -> set[str]:
    """The kinds of a pattern tree's nodes."""
    return {spec.kind}.union(*(_kinds(child) for child in spec.children))


@resolver("intersection")
def _resolve_intersection(spec, ctx):
    return IntersectionRule(*(resolve(p, ctx) for p in spec.patterns))


@resolver("per_head")
def _resolve_per_head(spec, ctx):
    return resolve(spec.patterns[ctx.head], ctx)


@resolver("complement")
def _resolve_complement(spec, ctx):
    return ComplementRule(resolve(spec.pattern, ctx))


@resolver("blocks")
def _resolve_blocks(spec, ctx):
    """The grid's True blocks as tiles of ``block_size`` from the first query row (its rows are query rows)."""
    spec.check_grid(ctx.n_q, ctx.n_k)
    grid = spec.blocks[ctx.head] if spec.blocks.ndim == 3 else spec.blocks       # (n_qb, n_kb)
    unit = min(spec.block_size, ctx.span)  # a block past both lengths is the one block of the grid
    return TilesRule(np.flatnonzero(grid).astype(np.int64), unit, grid.shape[1], origin=ctx.shift)


def random_tiles(blocks: int, seed: int, tile: int, ctx: Context, excluded: Rule | None) -> TilesRule:
    """``blocks`` random tiles of ``tile`` positions for every tile row R, among the key tiles before it
    (0 .. R - 1) that ``excluded`` leaves untouched at the row's first position ``R * tile``.

    A row's draw reads only keys before that position and the row's first query, which exist in every
    sequence holding any query of the row: it depends on (seed, head, R) and never on n_q or n_k. So a
    decode step, a chunk of a prefill and every longer sequence see at a position the tiles the full
    sequence sees there, and only the rows holding a query are drawn (a decode step costs one row).

    >>> rule = random_tiles(1, 0, 4, Context(n_q=16, n_k=16, head=0), excluded=None)
    >>> (rule.chosen // rule.n_kt).tolist(), bool((rule.chosen % rule.n_kt < rule.chosen // rule.n_kt).all())
    ([1, 2, 3], True)
    """
    u = min(tile, ctx.n_k)  # a tile as long as the sequence has no tile before it, as with any longer tile
    n_kt = ceil_div(ctx.n_k, u)
    rows = np.arange(max(ctx.shift, 0) // u, n_kt, dtype=np.int64)  # the tile rows holding a query
    blocked = np.zeros(0, dtype=np.int64) if excluded is None else _touched_before(excluded, ctx, u, rows, n_kt)
    n_free = rows - _count_in(blocked, rows * n_kt, rows * n_kt + rows - 1)
    every = rows[n_free <= blocks]  # these rows take all their free tiles, without drawing
    free = _ranges_to_keys(every, np.zeros_like(every), every - 1, n_kt)
    free = free[~_member(blocked, free)]
    taken = np.insert(blocked, np.searchsorted(blocked, free), free)  # sorted merge: blocked may be most tiles
    rows, n_free = rows[n_free > blocks], n_free[n_free > blocks]
    for t in range(blocks if rows.size else 0):  # here blocks < n_free <= R
        # the pick-th free tile of the row: the least c with c - #taken(<= c) == pick, found by bisection as
        # that count never decreases in c (log2(R) steps, however densely the other members take the row)
        pick = (_hash(seed, ctx.head, rows, t) % (n_free - t).astype(np.uint64)).astype(np.int64)
        lo, hi = pick, rows - 1
        while (lo < hi).any():
            mid = (lo + hi) // 2
            enough = mid - _count_in(taken, rows * n_kt, rows * n_kt + mid) >= pick
            lo, hi = np.where(enough, lo, mid + 1), np.where(enough, mid, hi)
        picked = rows * n_kt + lo                          # sorted, and free until now: insert, no re-sort
        taken = np.insert(taken, np.searchsorted(taken, picked), picked)
    return TilesRule(np.setdiff1d(taken, blocked, assume_unique=True), u, n_kt)


def _touched_before(rule: Rule, ctx: Context, u: int, rows: np.ndarray, n_kt: int) -> np.ndarray:
    """Sorted keys ``R * n_kt + c`` (c < R, R in ``rows``) of the key tiles that ``rule`` touches at position
    ``R * u``: the rule's candidates in the grid of tile rows, or every tile before the row (in chunks).
    ``rows`` are consecutive and never empty (the last query is at position n_k - 1, in the last tile row)."""
    first = int(rows[0])
    rows_ctx = Context(ctx.n_k - first * u, ctx.n_k, ctx.head)  # bottom-right aligned: block row r = tile first + r
    keys = rule.candidates(rows_ctx, u)
    if keys is None:
        rows_per_chunk = max(1, _DENSE_CHUNK // n_kt)
        chunks = (rows[s:s + rows_per_chunk] for s in range(0, rows.size, rows_per_chunk))
        return np.concatenate([_touched_at_first_positions(rule, u, n_kt,
                                                           _ranges_to_keys(r, np.zeros_like(r), r - 1, n_kt))
                               for r in chunks])
    keys = keys + first * n_kt
    return _touched_at_first_positions(rule, u, n_kt, keys[keys % n_kt < keys // n_kt])


def _touched_at_first_positions(rule: Rule, u: int, n_kt: int, keys: np.ndarray) -> np.ndarray:
    """The tiles ``keys`` (R * n_kt + c, c < R) that ``rule`` touches at position R * u."""
    first_position, first_key = keys // n_kt * u, keys % n_kt * u
    nonempty, _, _ = rule.classify(BlockRanges(first_position, first_position, first_key, first_key + u - 1))
    return keys[np.broadcast_to(nonempty, keys.shape)]


def _hash(seed: int, head: int, rows: np.ndarray, t: int) -> np.ndarray:
    """splitmix64 of (seed, head, row, t): a counter-based random uint64 per row."""
    base = (seed * 0x9E3779B97F4A7C15 ^ (head + 1) * 0xBF58476D1CE4E5B9 ^ (t + 1) * 0x94D049BB133111EB) % 2**64
    x = np.uint64(base) + rows.astype(np.uint64) * np.uint64(0xD6E8FEB86659FD93)  # arrays wrap silently
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def with_call_data(rule: Rule, global_positions: np.ndarray | None = None, causal: bool = False,
                   padding: np.ndarray | None = None) -> Rule:
    """A rule with one example's call-time data: ``((rule | global tokens) & causal) & ~padding``."""
    if global_positions is not None:
        rule = UnionRule(rule, TokenRule(global_positions, global_positions))
    narrowing = ([CausalRule()] if causal else []) + ([KeyPaddingRule(padding)] if padding is not None else [])
    return IntersectionRule(rule, *narrowing) if narrowing else rule


# ------------------------------------------------------------------------------------------------
# Block classification of a rule
# ------------------------------------------------------------------------------------------------
_DENSE_CHUNK = 1 << 22  # blocks classified at once when a rule has no cheap candidate list


def block_table(rule: Rule, ctx: Context, block_size: int,
                offset: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nonempty blocks of a rule: sorted keys ``r * n_kb + c``, full flags, signatures (n, k).

    Work and memory are proportional to the candidate blocks: the rule's own candidate list, or
    every block (in chunks) for rules that touch most blocks anyway. With ``offset`` (0 <= offset <
    block_size) the blocks are those of a grid that starts ``offset`` tokens before position 0, with
    ``n_kb = ceil((n_k + offset) / block_size)`` (see :meth:`BlockRanges.at`).

    >>> import sparse_attn as sa
    >>> ctx = Context(n_q=16, n_k=16, head=0)
    >>> keys, full, _ = block_table(resolve(sa.Local(8), ctx), ctx, block_size=8)
    >>> keys.tolist(), full.tolist()                      # 2 x 2 blocks: the diagonal ones are full
    ([0, 1, 2, 3], [True, False, False, True])
    """
    n_qb, n_kb = ceil_div(ctx.n_q + offset, block_size), ceil_div(ctx.n_k + offset, block_size)
    keys = rule.candidates(ctx, block_size)
    if keys is not None:
        return _classify_keys(rule, ctx, block_size, _offset_keys(keys, ctx, block_size, offset), offset)
    rows_per_chunk = max(1, _DENSE_CHUNK // n_kb)
    parts = [_classify_keys(rule, ctx, block_size, np.arange(r * n_kb, min(r + rows_per_chunk, n_qb) * n_kb), offset)
             for r in range(0, n_qb, rows_per_chunk)]
    keys, full, signatures = (np.concatenate(column) for column in zip(*parts))
    return keys, full, signatures


def _offset_keys(keys: np.ndarray, ctx: Context, block_size: int, offset: int) -> np.ndarray:
    """Keys of the unshifted grid -> sorted keys of the blocks they overlap in the grid shifted by ``offset``:
    a block of the first grid overlaps blocks (r, c), (r + 1, c), (r, c + 1), (r + 1, c + 1) of the second."""
    if not offset:
        return keys
    n_kb = ceil_div(ctx.n_k, block_size)
    n_qb_shifted, n_kb_shifted = ceil_div(ctx.n_q + offset, block_size), ceil_div(ctx.n_k + offset, block_size)
    rows, cols = keys // n_kb, keys % n_kb
    shifted = [((rows + dr) * n_kb_shifted + cols + dc)[(rows + dr < n_qb_shifted) & (cols + dc < n_kb_shifted)]
               for dr in (0, 1) for dc in (0, 1)]
    return np.unique(np.concatenate(shifted))


def _classify_keys(rule, ctx, block_size, keys, offset=0):
    n_kb = ceil_div(ctx.n_k + offset, block_size)
    nonempty, full, sig = rule.classify(BlockRanges.at(ctx, keys // n_kb, keys % n_kb, block_size, offset))
    nonempty, full = np.broadcast_to(nonempty, keys.shape), np.broadcast_to(full, keys.shape)
    return keys[nonempty], full[nonempty], _as_columns(sig, keys.shape[0])[nonempty]


# ------------------------------------------------------------------------------------------------
# Sorted-array helpers
# ------------------------------------------------------------------------------------------------
def _as_columns(sig: np.ndarray, n: int) -> np.ndarray:
    """A signature as an (n, k) int64 matrix; leaves may return a single column as a vector."""
    sig = np.asarray(sig, dtype=np.int64)
    return sig if sig.ndim == 2 else np.broadcast_to(sig, (n,))[:, None]


def _ranges_to_keys(rows: np.ndarray, c_min: np.ndarray, c_max: np.ndarray, n_kb: int) -> np.ndarray:
    """Keys r * n_kb + c for c in [c_min, c_max] per row (empty where c_min > c_max)."""
    counts = np.maximum(c_max - c_min + 1, 0)
    starts = np.repeat(rows * n_kb + c_min - np.cumsum(counts) + counts, counts)
    return starts + np.arange(counts.sum(), dtype=np.int64)


def _count_in(sorted_values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """How many of ``sorted_values`` lie in [lo, hi], elementwise."""
    return np.searchsorted(sorted_values, hi, "right") - np.searchsorted(sorted_values, lo, "left")


def _member(sorted_values: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Elementwise ``x in sorted_values`` (sorted, without repeats)."""
    if sorted_values.size == 0:
        return np.zeros(np.shape(x), dtype=bool)
    first, last = sorted_values[0], sorted_values[-1]
    if last - first == sorted_values.size - 1:                         # a run (the first k tokens): two bounds
        return (x >= first) & (x <= last)
    pos = np.minimum(np.searchsorted(sorted_values, x), sorted_values.size - 1)
    return sorted_values[pos] == x
