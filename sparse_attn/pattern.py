"""The Pattern algebra: which (query, key) pairs may interact.

>>> import sparse_attn as sa
>>> p = sa.Local(1) | sa.Global(first=1)
>>> p.mask(5)[0].int()
tensor([[1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 0, 1, 1, 1],
        [1, 0, 0, 1, 1]], dtype=torch.int32)

Patterns are small immutable specs, independent of sequence length. Every operation that needs a
length first *resolves* the pattern for a context (n_q, n_k, head) into a tree of rules that answer
three questions, all vectorised over numpy int64 arrays and none of them N x N:

- ``_allows(i, j, ctx)``: token level, may the query at position i and the key at position j interact?
- ``_classify(blocks, ctx)``: for blocks given by their valid token ranges, is the block nonempty,
  full (every valid pair allowed), and a *signature*: two blocks of one rule with equal signatures
  have the same token mask (up to the block's own bounds), so a layout materialises one mask per
  signature instead of one per block.
- ``_candidates(ctx, block_size)``: a sorted superset of the nonempty block keys
  ``r * n_key_blocks + c``, in time proportional to its size; ``None`` for patterns that touch a
  large fraction of all blocks (Stride, Causal, Dense), which are then classified block by block.

Positions: keys are at 0..n_k-1 and query row i is at position ``i + n_k - n_q`` (bottom-right
aligned, as FlashAttention and FlexAttention align a decode step); with n_q == n_k they coincide.
Rules see positions; blocks and masks are indexed by query row.

Arguments are Python ints of any size; resolving clamps them to the context (a window or block wider
than the sequence is the sequence, a Stride offset counts modulo the stride), so rules only ever
compute with int64 values bounded by the sequence lengths (at most ``MAX_LENGTH``). Combinators nest
at most ``MAX_DEPTH`` levels, which keeps every tree walk (``==``, ``repr``, pickling, resolving) far
from Python's recursion limit.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import numpy as np

from .checks import as_int, check_int

if TYPE_CHECKING:
    import torch

MAX_LENGTH = 2**31 - 1  # n_q, n_k: block indices are int32, and positions times block sizes stay in int64
MAX_DEPTH = 64          # nested levels of |, & and PerHead (chains of one operator are flattened, not nested)


class _Ctx(NamedTuple):
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


class _Blocks(NamedTuple):
    """Blocks as inclusive position ranges: queries i0..i1, keys j0..j1 (int64 arrays)."""

    i0: np.ndarray
    i1: np.ndarray
    j0: np.ndarray
    j1: np.ndarray


def _n_blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def _as_columns(sig: np.ndarray, n: int) -> np.ndarray:
    """A signature as an (n, k) int64 matrix; leaves may return a single column as a vector."""
    sig = np.asarray(sig, dtype=np.int64)
    return sig if sig.ndim == 2 else np.broadcast_to(sig, (n,))[:, None]


def _set_int(spec: Pattern, field: str, minimum: int | None = None) -> None:
    """Check a spec's int field and store it as a Python int (so arithmetic on it never wraps)."""
    value = check_int(f"{type(spec).__name__} {field}", getattr(spec, field), minimum)
    object.__setattr__(spec, field, value)


def _check_tokens(name: str, tokens) -> tuple[int, ...]:
    try:
        values = [None] if isinstance(tokens, (str, bytes)) else [as_int(t) for t in tokens]
    except TypeError:  # not iterable
        values = [None]
    if None in values:
        raise TypeError(f"{name} must be a sequence of ints, got {tokens!r}")
    tokens = tuple(sorted(set(values)))
    if tokens and tokens[0] < 0:
        raise ValueError(f"{name} must hold token positions >= 0, got {tokens[0]}")
    return tokens


def _ranges_to_keys(rows: np.ndarray, c_min: np.ndarray, c_max: np.ndarray, n_kb: int) -> np.ndarray:
    """Keys r * n_kb + c for c in [c_min, c_max] per row (empty where c_min > c_max)."""
    counts = np.maximum(c_max - c_min + 1, 0)
    starts = np.repeat(rows * n_kb + c_min - np.cumsum(counts) + counts, counts)
    return starts + np.arange(counts.sum(), dtype=np.int64)


def _count_in(sorted_values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """How many of ``sorted_values`` lie in [lo, hi], elementwise."""
    return np.searchsorted(sorted_values, hi, "right") - np.searchsorted(sorted_values, lo, "left")


def _member(sorted_values: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Elementwise ``x in sorted_values``."""
    if sorted_values.size == 0:
        return np.zeros(np.shape(x), dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_values, x), sorted_values.size - 1)
    return sorted_values[pos] == x


class Pattern:
    """Base class of all patterns: immutable, hashable, composable with ``|`` and ``&``.

    >>> (Local(128) | Global(first=1)).layout(4096, heads=12).density  # doctest: +SKIP
    """

    _type: ClassVar[str]
    _registry: ClassVar[dict[str, type[Pattern]]] = {}
    _depth: ClassVar[int] = 0  # combinator levels in this pattern (set per instance on combinators)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "_type" in cls.__dict__:
            Pattern._registry[cls._type] = cls

    # --- algebra -------------------------------------------------------------------------------
    def __or__(self, other: Pattern) -> Pattern:
        check_pattern("right operand of |", other)
        return Union(self, other)

    def __and__(self, other: Pattern) -> Pattern:
        check_pattern("right operand of &", other)
        return Intersection(self, other)

    # --- user-facing views ---------------------------------------------------------------------
    def mask(self, n_q: int, n_k: int | None = None, heads: int = 1) -> torch.Tensor:
        """Dense token mask, ``torch.bool`` of shape (heads, n_q, n_k). For small N only.

        >>> Causal().mask(3)[0].int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
        """
        import torch  # here, not at module level: specs and the CLI's --help need no torch

        n_q, n_k = _check_lengths(n_q, n_k)
        self.check_heads(heads)
        i = np.arange(n_q, dtype=np.int64)[:, None] + (n_k - n_q)       # query positions
        j = np.arange(n_k, dtype=np.int64)[None, :]
        per_head = self.head_dependent
        rows = []
        for h in range(heads if per_head else 1):
            ctx = _Ctx(n_q, n_k, h)
            rows.append(np.broadcast_to(self._resolve(ctx)._allows(i, j, ctx), (n_q, n_k)))
        out = torch.from_numpy(np.stack(rows))
        return out if per_head else out.expand(heads, n_q, n_k).clone()

    def layout(self, n_q: int, n_k: int | None = None, heads: int = 1, block_size: int = 64,
               *, causal: bool = False, global_mask=None, key_padding_mask=None):
        """Compile into a :class:`~sparse_attn.layout.BlockLayout` (cached when no masks are given).

        >>> lay = (Local(256) | Global(first=16)).layout(1 << 20, heads=12)  # doctest: +SKIP
        """
        from .layout import build_layout  # layout imports pattern, not the other way round

        return build_layout(self, n_q, n_k, heads, block_size, causal=causal,
                            global_mask=global_mask, key_padding_mask=key_padding_mask)

    @property
    def head_dependent(self) -> bool:
        """True when heads may differ (PerHead or Random inside), so layouts store every head."""
        return any(child.head_dependent for child in self._children())

    # --- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain dict of builtins, e.g. ``{"type": "local", "before": 256}``; see ``from_dict``."""
        d = {"type": self._type}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple) and value and isinstance(value[0], Pattern):
                d[f.name] = [p.to_dict() for p in value]
            elif value != self._default(f):
                d[f.name] = list(value) if isinstance(value, tuple) else value
        return d

    @staticmethod
    def from_dict(d: dict) -> Pattern:
        """Inverse of ``to_dict``.

        >>> Pattern.from_dict({"type": "local", "before": 4})
        Local(4)
        """
        return _from_dict(d, level=0)

    def __repr__(self) -> str:
        parts = []
        for index, f in enumerate(dataclasses.fields(self)):
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING and index == len(parts):
                parts.append(repr(value))
            elif value != self._default(f):
                parts.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    # --- internals -----------------------------------------------------------------------------
    def _default(self, f: dataclasses.Field):
        """A field's default; ``after`` defaults to ``before`` (symmetric windows)."""
        return self.before if f.name == "after" else _field_default(f)

    def _children(self) -> tuple[Pattern, ...]:
        return ()

    def check_heads(self, heads: int) -> None:
        check_int("heads", heads, 1)
        for child in self._children():
            child.check_heads(heads)

    def _resolve(self, ctx: _Ctx) -> Pattern:
        """This pattern for one (n_q, n_k, head): sugar expanded, Random blocks chosen."""
        return self

    def _allows(self, i: np.ndarray, j: np.ndarray, ctx: _Ctx) -> np.ndarray:
        raise TypeError(f"{type(self).__name__} must be resolved before use")  # pragma: no cover

    def _classify(self, b: _Blocks, ctx: _Ctx) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise TypeError(f"{type(self).__name__} must be resolved before use")  # pragma: no cover

    def _candidates(self, ctx: _Ctx, block_size: int) -> np.ndarray | None:
        return None


def _field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _from_dict(d: dict, level: int) -> Pattern:
    """``Pattern.from_dict`` of a dict nested ``level`` combinations deep (refused past MAX_DEPTH)."""
    if not isinstance(d, dict) or "type" not in d:
        raise ValueError(f"a pattern dict needs a 'type' key, got {d!r}")
    kind = d["type"]
    cls = Pattern._registry.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown pattern type {kind!r}; expected one of {sorted(Pattern._registry)}")
    kwargs = {}
    for key, value in d.items():
        if key == "type":
            continue
        if key not in {f.name for f in dataclasses.fields(cls)}:
            fields = [f.name for f in dataclasses.fields(cls)]
            raise ValueError(f"pattern type {kind!r} has no field {key!r}; its fields are {fields}")
        if isinstance(value, list) and value and isinstance(value[0], dict):
            if level == MAX_DEPTH:
                raise _depth_error(f"the pattern dict's {kind!r}", level + 1)
            value = [_from_dict(v, level + 1) for v in value]
        kwargs[key] = value
    if cls in (Union, Intersection):  # they take their members as *patterns
        return cls(*kwargs.get("patterns", ()))
    return cls(**kwargs)


def _depth_error(what: str, depth: int) -> ValueError:
    return ValueError(f"{what} would nest {depth} levels of |, & and PerHead, more than MAX_DEPTH={MAX_DEPTH}; "
                      f"combine the members of one operator once instead of nesting them: sa.Union(*members) or "
                      f"sa.Intersection(*members) (a chain of one operator is flattened and counts as one level), "
                      f"and factor shared terms: (a & m) | (b & m) == (a | b) & m")


def check_pattern(name: str, value) -> None:
    if not isinstance(value, Pattern):
        raise TypeError(f"{name} must be a sparse_attn Pattern, got {type(value).__name__}: {value!r}")


def _check_lengths(n_q: int, n_k: int | None) -> tuple[int, int]:
    n_q = check_int("n_q", n_q, 1, MAX_LENGTH)
    return n_q, n_q if n_k is None else check_int("n_k", n_k, 1, MAX_LENGTH)


# ------------------------------------------------------------------------------------------------
# Leaf patterns
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, repr=False)
class Local(Pattern):
    """Sliding window: query ``i`` sees keys ``i - before .. i + after``.

    ``Local(256)`` is Longformer's ``attention_window=512``; FlashAttention's ``window_size=(l, r)``
    is ``Local(l, r)``. With ``block_size=b`` the window is counted in aligned blocks of ``b``
    tokens (BigBird's sliding blocks): query block ``i // b`` sees key blocks
    ``i // b - before .. i // b + after``.

    >>> Local(1, 0).mask(3)[0].int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [0, 1, 1]], dtype=torch.int32)
    """

    _type: ClassVar[str] = "local"
    before: int
    after: int | None = None
    block_size: int = 1

    def __post_init__(self):
        _set_int(self, "before", 0)
        if self.after is None:
            object.__setattr__(self, "after", self.before)
        _set_int(self, "after", 0)
        _set_int(self, "block_size", 1)

    def __repr__(self) -> str:
        args = [repr(self.before)] + ([repr(self.after)] if self.after != self.before else [])
        args += [f"block_size={self.block_size}"] if self.block_size != 1 else []
        return f"Local({', '.join(args)})"

    def _resolve(self, ctx):
        """Clamped to the context: a block of ``span`` positions already holds them all (every
        ``i // u`` is 0, or -1 before position 0), and no two positions are more than
        ``span // u + 1`` blocks apart."""
        u = min(self.block_size, ctx.span)
        reach = ctx.span // u + 1
        return Local(min(self.before, reach), min(self.after, reach), u)

    def _allows(self, i, j, ctx):
        u = self.block_size
        d = j // u - i // u
        return (d >= -self.before) & (d <= self.after)

    def _classify(self, b, ctx):
        u = self.block_size
        d_lo = b.j0 // u - b.i1 // u
        d_hi = b.j1 // u - b.i0 // u
        nonempty = (d_hi >= -self.before) & (d_lo <= self.after)
        full = (d_lo >= -self.before) & (d_hi <= self.after)
        sig = ((b.i0 // u - b.j0 // u) * u + b.i0 % u) * u + b.j0 % u
        return nonempty, full, sig

    def _candidates(self, ctx, block_size):
        u, n_kb = self.block_size, _n_blocks(ctx.n_k, block_size)
        r = np.arange(_n_blocks(ctx.n_q, block_size), dtype=np.int64)
        i0, i1 = r * block_size + ctx.shift, np.minimum((r + 1) * block_size, ctx.n_q) - 1 + ctx.shift
        j_min = np.maximum((i0 // u - self.before) * u, 0)
        j_max = np.minimum((i1 // u + self.after) * u + u - 1, ctx.n_k - 1)
        return _ranges_to_keys(r, j_min // block_size, np.where(j_max >= j_min, j_max // block_size, -1), n_kb)


@dataclasses.dataclass(frozen=True, repr=False)
class Stride(Pattern):
    """Every ``stride``-th key: ``(i - j - offset) % stride == 0`` (Sparse Transformer "strided").

    >>> Stride(2).mask(4)[0].int()
    tensor([[1, 0, 1, 0],
            [0, 1, 0, 1],
            [1, 0, 1, 0],
            [0, 1, 0, 1]], dtype=torch.int32)
    """

    _type: ClassVar[str] = "stride"
    stride: int
    offset: int = 0

    def __post_init__(self):
        _set_int(self, "stride", 1)
        _set_int(self, "offset")

    def _resolve(self, ctx):
        """Clamped to the context: only differences ``i - j`` in (-span, span) occur, so the offset
        counts modulo the stride, and a stride of at least 2 * span allows one difference at most,
        which a stride of 2 * span keeps (offset ``span`` when none occurs)."""
        stride, offset, span = self.stride, self.offset % self.stride, ctx.span
        if stride <= 2 * span:
            return Stride(stride, offset)
        allowed = offset if offset < span else offset - stride if offset - stride > -span else span
        return Stride(2 * span, allowed % (2 * span))

    def _allows(self, i, j, ctx):
        return (i - j - self.offset) % self.stride == 0

    def _classify(self, b, ctx):
        lo, hi = b.i0 - b.j1 - self.offset, b.i1 - b.j0 - self.offset
        nonempty = lo + (-lo) % self.stride <= hi
        full = nonempty & ((self.stride == 1) | (lo == hi))
        return nonempty, full, (b.i0 - b.j0 - self.offset) % self.stride


@dataclasses.dataclass(frozen=True, repr=False)
class Dilated(Pattern):
    """Dilated window (Longformer): ``Local(before * dilation, after * dilation) & Stride(dilation)``.

    >>> Dilated(1, 2).mask(5)[0, 2].int()
    tensor([1, 0, 1, 0, 1], dtype=torch.int32)
    """

    _type: ClassVar[str] = "dilated"
    _depth: ClassVar[int] = 1  # it resolves to Local & Stride
    before: int
    dilation: int
    after: int | None = None

    def __post_init__(self):
        _set_int(self, "before", 0)
        _set_int(self, "dilation", 1)
        if self.after is None:
            object.__setattr__(self, "after", self.before)
        _set_int(self, "after", 0)

    def _resolve(self, ctx):
        d = self.dilation
        return Intersection(Local(self.before * d, self.after * d), Stride(d))._resolve(ctx)


@dataclasses.dataclass(frozen=True, repr=False)
class Global(Pattern):
    """Global tokens (symmetric): their rows and columns are dense.

    ``tokens`` are explicit positions, ``first``/``last`` count from each end of the sequence (the
    key positions; queries share them, see the module docstring). Positions at or beyond the length
    are ignored, so one pattern works at every length.

    >>> Global(first=1).mask(3)[0].int()
    tensor([[1, 1, 1],
            [1, 0, 0],
            [1, 0, 0]], dtype=torch.int32)
    """

    _type: ClassVar[str] = "global"
    tokens: tuple[int, ...] = ()
    first: int = 0
    last: int = 0

    def __post_init__(self):
        object.__setattr__(self, "tokens", _check_tokens("Global tokens", self.tokens))
        _set_int(self, "first", 0)
        _set_int(self, "last", 0)

    def positions(self, n: int) -> np.ndarray:
        """The global positions in a sequence of ``n`` tokens, sorted int64.

        >>> Global(tokens=(5, 50), last=2).positions(10).tolist()
        [5, 8, 9]
        """
        n = check_int("n", n, 0)
        explicit = np.asarray([t for t in self.tokens if t < n], dtype=np.int64)
        head = np.arange(min(self.first, n), dtype=np.int64)
        tail = np.arange(max(n - self.last, 0), n, dtype=np.int64)
        return np.unique(np.concatenate([explicit, head, tail]))

    def _resolve(self, ctx):
        positions = self.positions(ctx.n_k)
        return _TokenGlobal(positions, positions)


@dataclasses.dataclass(frozen=True, repr=False)
class Sink(Pattern):
    """Sink columns (StreamingLLM): every query sees these keys; their rows are unchanged.

    ``tokens`` are explicit positions, ``first`` the first keys; with ``period=p`` also every key
    ``j`` with ``j % p >= p - width`` (the summary columns of the Sparse Transformer's "fixed"
    pattern).

    >>> Sink(first=1).mask(3)[0].int()
    tensor([[1, 0, 0],
            [1, 0, 0],
            [1, 0, 0]], dtype=torch.int32)
    """

    _type: ClassVar[str] = "sink"
    tokens: tuple[int, ...] = ()
    first: int = 0
    period: int = 0
    width: int = 1

    def __post_init__(self):
        object.__setattr__(self, "tokens", _check_tokens("Sink tokens", self.tokens))
        _set_int(self, "first", 0)
        _set_int(self, "period", 0)
        _set_int(self, "width", 1)
        if self.period and self.width > self.period:
            raise ValueError(f"Sink width must be <= period, got width={self.width}, period={self.period}")

    def _resolve(self, ctx):
        n = ctx.n_k
        parts = [np.asarray([t for t in self.tokens if t < n], dtype=np.int64),
                 np.arange(min(self.first, n), dtype=np.int64)]
        if self.period and self.period - self.width < n:
            # period p: columns [s + p - width, s + p) of every period start s, cut at n
            step = min(self.period, n)
            starts = np.arange(0, n, step, dtype=np.int64)
            first = starts + (self.period - self.width)
            last = np.minimum(starts + step, n) - 1
            parts.append(_ranges_to_keys(np.zeros_like(starts), first, last, 0))
        return _TokenGlobal(np.zeros(0, dtype=np.int64), np.unique(np.concatenate(parts)))


@dataclasses.dataclass(frozen=True, repr=False)
class Causal(Pattern):
    """Query row i sees keys ``j <= i + (n_k - n_q)``: no key after the query's position.

    >>> Causal().mask(2, 3)[0].int()
    tensor([[1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    """

    _type: ClassVar[str] = "causal"

    def _allows(self, i, j, ctx):
        return j <= i

    def _classify(self, b, ctx):
        return b.j0 <= b.i1, b.j1 <= b.i0, b.i0 - b.j0


@dataclasses.dataclass(frozen=True, repr=False)
class Dense(Pattern):
    """Every pair. ``Dense().layout(...)`` runs ordinary attention through the block kernels."""

    _type: ClassVar[str] = "dense"

    def _allows(self, i, j, ctx):
        return np.ones(np.broadcast_shapes(np.shape(i), np.shape(j)), dtype=bool)

    def _classify(self, b, ctx):
        ones = np.ones(b.i0.shape, dtype=bool)
        return ones, ones, np.zeros(b.i0.shape, dtype=np.int64)


@dataclasses.dataclass(frozen=True, repr=False)
class Random(Pattern):
    """Random key blocks (BigBird): each (head, query block) gets ``blocks`` key blocks.

    Blocks are ``block_size`` positions and chosen among the key blocks that the other members of
    the same union leave untouched, deterministically from (seed, head, query block): no global RNG,
    identical in training and evaluation (and in a decode step), different across heads.

    >>> int(Random(2, block_size=4).mask(32)[0, 0].sum())
    8
    """

    _type: ClassVar[str] = "random"
    blocks: int
    seed: int = 0
    block_size: int = 64

    def __post_init__(self):
        _set_int(self, "blocks", 0)
        _set_int(self, "seed", 0)
        _set_int(self, "block_size", 1)

    @property
    def head_dependent(self) -> bool:
        return True

    def _resolve(self, ctx):
        return self._choose(ctx, excluded=None)

    def _choose(self, ctx: _Ctx, excluded: Pattern | None) -> _RandomTiles:
        """Pick tiles row by row, skipping tiles that ``excluded`` (a resolved rule) touches.

        A tile row's picks depend on that row alone, so only the rows holding a query are picked: a
        decode step (n_q = 1) costs one row, and sees the tiles the full sequence's last row sees.
        """
        u = min(self.block_size, ctx.n_k)  # a wider tile is the same single tile over every key
        n_qt = n_kt = _n_blocks(ctx.n_k, u)
        first = max(ctx.n_k - ctx.n_q, 0) // u  # the tile row of the first query position
        rows_ctx = _Ctx(ctx.n_k - first * u, ctx.n_k, ctx.head)  # bottom-right aligned: block row r = tile first + r
        blocked = np.zeros(0, dtype=np.int64)
        if excluded is not None:
            blocked = block_table(excluded, rows_ctx, u)[0] + first * n_kt
        rows = np.arange(first, n_qt, dtype=np.int64)
        n_free = n_kt - _count_in(blocked, rows * n_kt, rows * n_kt + n_kt - 1)
        every = rows[n_free <= self.blocks]  # these rows take all their free tiles, without drawing
        taken = np.union1d(blocked, _ranges_to_keys(every, np.zeros_like(every), np.full_like(every, n_kt - 1), n_kt))
        rows, n_free = rows[n_free > self.blocks], n_free[n_free > self.blocks]
        for t in range(self.blocks if rows.size else 0):  # here blocks < n_free <= n_kt
            # the pick-th free tile of the row: least c with c - #taken(<= c) == pick (monotone fixed point)
            pick = (_hash(self.seed, ctx.head, rows, t) % (n_free - t).astype(np.uint64)).astype(np.int64)
            c = pick
            while True:
                c_next = pick + _count_in(taken, rows * n_kt, rows * n_kt + c)
                if np.array_equal(c_next, c):
                    break
                c = c_next
            taken = np.union1d(taken, rows * n_kt + c)
        return _RandomTiles(np.setdiff1d(taken, blocked, assume_unique=True), u, n_kt)


def _hash(seed: int, head: int, rows: np.ndarray, t: int) -> np.ndarray:
    """splitmix64 of (seed, head, row, t): a counter-based random uint64 per row."""
    base = (seed * 0x9E3779B97F4A7C15 ^ (head + 1) * 0xBF58476D1CE4E5B9 ^ (t + 1) * 0x94D049BB133111EB) % 2**64
    x = np.uint64(base) + rows.astype(np.uint64) * np.uint64(0xD6E8FEB86659FD93)  # arrays wrap silently
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


# ------------------------------------------------------------------------------------------------
# Combinators
# ------------------------------------------------------------------------------------------------
def _set_members(node: Pattern, members: tuple[Pattern, ...], limit: int | None = MAX_DEPTH) -> None:
    """Store a combinator's members and its depth, refusing more than ``limit`` levels."""
    depth = 1 + max(p._depth for p in members)
    if limit is not None and depth > limit:
        raise _depth_error(f"this {type(node).__name__}", depth)
    object.__setattr__(node, "patterns", members)
    object.__setattr__(node, "_depth", depth)


def _flatten(cls, patterns) -> tuple[Pattern, ...]:
    flat = []
    for p in patterns:
        check_pattern(f"every member of {cls.__name__}", p)
        flat.extend(p.patterns if type(p) is cls else (p,))
    return tuple(flat)


class _Combination(Pattern):
    patterns: tuple[Pattern, ...]
    _symbol: ClassVar[str]

    def __init__(self, *patterns: Pattern):
        flat = _flatten(type(self), patterns)
        if len(flat) < 1:
            raise ValueError(f"{type(self).__name__} needs at least one pattern")
        _set_members(self, flat)

    def __repr__(self) -> str:
        parts = [f"({p!r})" if isinstance(p, _Combination) else repr(p) for p in self.patterns]
        return f" {self._symbol} ".join(parts)

    def _children(self):
        return self.patterns

    def _resolve(self, ctx):
        return type(self)(*(p._resolve(ctx) for p in self.patterns))

    def _classify_children(self, b, ctx):
        results = [p._classify(b, ctx) for p in self.patterns]
        columns = []
        for nonempty, full, child_sig in results:
            # a child's part of the block mask: state -2 absent, -1 full, 0 partial (then its signature)
            state = np.where(full, -1, np.where(nonempty, 0, -2))
            columns.append(state[:, None])
            columns.append(np.where(state[:, None] == 0, _as_columns(child_sig, b.i0.shape[0]), 0))
        return results, np.concatenate(columns, axis=1)


@dataclasses.dataclass(frozen=True, repr=False, init=False)
class Union(_Combination):
    """``p | q``: pairs allowed by any member."""

    _type: ClassVar[str] = "union"
    _symbol: ClassVar[str] = "|"
    patterns: tuple[Pattern, ...]

    def _resolve(self, ctx):
        rest = [p._resolve(ctx) for p in self.patterns if not isinstance(p, Random)]
        excluded = Union(*rest) if rest else None
        randoms = [p._choose(ctx, excluded) for p in self.patterns if isinstance(p, Random)]
        return Union(*rest, *randoms)

    def _allows(self, i, j, ctx):
        out = self.patterns[0]._allows(i, j, ctx)
        for p in self.patterns[1:]:
            out = out | p._allows(i, j, ctx)
        return out

    def _classify(self, b, ctx):
        results, sig = self._classify_children(b, ctx)
        nonempty = np.logical_or.reduce([r[0] for r in results])
        full = np.logical_or.reduce([r[1] for r in results])
        return nonempty, full, sig

    def _candidates(self, ctx, block_size):
        keys = [p._candidates(ctx, block_size) for p in self.patterns]
        if any(k is None for k in keys):
            return None
        return np.unique(np.concatenate(keys))


@dataclasses.dataclass(frozen=True, repr=False, init=False)
class Intersection(_Combination):
    """``p & q``: pairs allowed by every member."""

    _type: ClassVar[str] = "intersection"
    _symbol: ClassVar[str] = "&"
    patterns: tuple[Pattern, ...]

    def _allows(self, i, j, ctx):
        out = self.patterns[0]._allows(i, j, ctx)
        for p in self.patterns[1:]:
            out = out & p._allows(i, j, ctx)
        return out

    def _classify(self, b, ctx):
        results, sig = self._classify_children(b, ctx)
        nonempty = np.logical_and.reduce([r[0] for r in results])
        full = np.logical_and.reduce([r[1] for r in results])
        return nonempty, full, sig

    def _candidates(self, ctx, block_size):
        keys = [k for k in (p._candidates(ctx, block_size) for p in self.patterns) if k is not None]
        if not keys:
            return None
        out = keys[0]
        for k in keys[1:]:
            out = np.intersect1d(out, k, assume_unique=True)
        return out


@dataclasses.dataclass(frozen=True, repr=False, init=False)
class PerHead(Pattern):
    """Head ``h`` uses ``patterns[h]``; the length must equal the number of query heads.

    >>> PerHead([Local(0), Dense()]).mask(2, heads=2).int().tolist()
    [[[1, 0], [0, 1]], [[1, 1], [1, 1]]]
    """

    _type: ClassVar[str] = "per_head"
    patterns: tuple[Pattern, ...]

    def __init__(self, patterns):
        patterns = tuple(patterns) if not isinstance(patterns, Pattern) else None
        if not patterns:
            raise ValueError("PerHead needs a non-empty list of patterns, one per query head")
        for p in patterns:
            check_pattern("every member of PerHead", p)
        _set_members(self, patterns)

    def __repr__(self) -> str:
        return f"PerHead({list(self.patterns)!r})"

    @property
    def head_dependent(self) -> bool:
        return True

    def _children(self):
        return self.patterns

    def check_heads(self, heads):
        super().check_heads(heads)
        if len(self.patterns) != heads:
            raise ValueError(f"PerHead has {len(self.patterns)} patterns but heads={heads}; "
                             f"give one pattern per query head")

    def _resolve(self, ctx):
        return self.patterns[ctx.head]._resolve(ctx)


# ------------------------------------------------------------------------------------------------
# Resolved rules that only exist for one (n_q, n_k, head)
# ------------------------------------------------------------------------------------------------
class _TokenGlobal(Pattern):
    """Rows ``rows`` and columns ``cols`` (sorted int64 positions) are dense."""

    def __init__(self, rows: np.ndarray, cols: np.ndarray):
        self.rows, self.cols = rows, cols

    def _allows(self, i, j, ctx):
        return _member(self.rows, i) | _member(self.cols, j)

    def _classify(self, b, ctx):
        n_rows = _count_in(self.rows, b.i0, b.i1)
        n_cols = _count_in(self.cols, b.j0, b.j1)
        nonempty = (n_rows > 0) | (n_cols > 0)
        full = (n_rows == b.i1 - b.i0 + 1) | (n_cols == b.j1 - b.j0 + 1)
        sig = np.stack([n_rows > 0, np.where(n_rows > 0, b.i0, 0), n_cols > 0, np.where(n_cols > 0, b.j0, 0)], axis=1)
        return nonempty, full, sig

    def _candidates(self, ctx, block_size):
        n_qb, n_kb = _n_blocks(ctx.n_q, block_size), _n_blocks(ctx.n_k, block_size)
        query_rows = self.rows - ctx.shift
        row_blocks = np.unique(query_rows[(query_rows >= 0) & (query_rows < ctx.n_q)] // block_size)
        col_blocks = np.unique(self.cols // block_size)
        by_row = _ranges_to_keys(row_blocks, np.zeros_like(row_blocks), np.full_like(row_blocks, n_kb - 1), n_kb)
        by_col = (np.arange(n_qb, dtype=np.int64)[:, None] * n_kb + col_blocks[None, :]).reshape(-1)
        return np.unique(np.concatenate([by_row, by_col]))


class _KeyPadding(Pattern):
    """Keys where ``padding`` (bool, length n_k) is True are never attended."""

    def __init__(self, padding: np.ndarray):
        self.padding = padding
        self.valid_before = np.concatenate([[0], np.cumsum(~padding)])  # valid keys in [0, j)

    def _allows(self, i, j, ctx):
        return ~self.padding[j]

    def _classify(self, b, ctx):
        n_valid = self.valid_before[b.j1 + 1] - self.valid_before[b.j0]
        return n_valid > 0, n_valid == b.j1 - b.j0 + 1, b.j0


class _RandomTiles(Pattern):
    """Chosen tiles of ``u`` x ``u`` tokens, as sorted keys ``R * n_kt + C``."""

    def __init__(self, chosen: np.ndarray, u: int, n_kt: int):
        self.chosen, self.u, self.n_kt = chosen, u, n_kt

    def _allows(self, i, j, ctx):
        return _member(self.chosen, (i // self.u) * self.n_kt + j // self.u)

    def _classify(self, b, ctx):
        u, n_kt = self.u, self.n_kt
        r0, r1, c0, c1 = b.i0 // u, b.i1 // u, b.j0 // u, b.j1 // u
        count = np.zeros(b.i0.shape, dtype=np.int64)
        for dr in range(int((r1 - r0).max(initial=0)) + 1):
            row = np.where(r0 + dr <= r1, (r0 + dr) * n_kt, -1 - n_kt)  # rows past r1 count nothing
            count += _count_in(self.chosen, row + c0, row + c1)
        area = (r1 - r0 + 1) * (c1 - c0 + 1)
        return count > 0, count == area, self._signature(b, r0, r1, c0, c1)

    def _signature(self, b, r0, r1, c0, c1):
        """Blocks within 2 x 2 tiles (tiles at least as large as blocks): the block's offset in its
        tile and which of its tiles are chosen. Blocks over more tiles keep a tile of their own (the
        block's position): random tiles rarely repeat there, and bits would cost (block / u)^2 each."""
        rows, cols = int((r1 - r0).max(initial=0)) + 1, int((c1 - c0).max(initial=0)) + 1
        if rows * cols > 4:
            return np.stack([b.i0, b.j0], axis=1)
        bits = [b.i0 % self.u, b.j0 % self.u]
        for dr in range(rows):
            for dc in range(cols):
                inside = (r0 + dr <= r1) & (c0 + dc <= c1)
                bits.append(inside & _member(self.chosen, (r0 + dr) * self.n_kt + c0 + dc))
        return np.stack(bits, axis=1).astype(np.int64)

    def _candidates(self, ctx, block_size):
        u, n_kb = self.u, _n_blocks(ctx.n_k, block_size)
        tile_r, tile_c = self.chosen // self.n_kt, self.chosen % self.n_kt
        first_row = np.maximum(tile_r * u - ctx.shift, 0)                 # query rows of each tile
        last_row = np.minimum(tile_r * u + u - 1 - ctx.shift, ctx.n_q - 1)
        seen = first_row <= last_row
        first_row, last_row, tile_c = first_row[seen], last_row[seen], tile_c[seen]
        keys = []
        for dr in range(-(-u // block_size) + 1):
            r = np.minimum(first_row // block_size + dr, last_row // block_size)
            for dc in range(-(-u // block_size) + 1):
                c = np.minimum((tile_c * u) // block_size + dc, (np.minimum(tile_c * u + u, ctx.n_k) - 1) // block_size)
                keys.append(r * n_kb + c)
        return np.unique(np.concatenate(keys))


def with_call_data(rule: Pattern, global_positions: np.ndarray | None = None, causal: bool = False,
                   padding: np.ndarray | None = None) -> Pattern:
    """A resolved rule with one example's call-time data: ``((rule | global tokens) & causal) & ~padding``.

    These are the library's own levels, at most two on top of a pattern's: MAX_DEPTH does not count them.
    """
    if global_positions is not None:
        rule = _combine_unlimited(Union, rule, _TokenGlobal(global_positions, global_positions))
    narrowing = ([Causal()] if causal else []) + ([_KeyPadding(padding)] if padding is not None else [])
    return _combine_unlimited(Intersection, rule, *narrowing) if narrowing else rule


def _combine_unlimited(cls: type[_Combination], *patterns: Pattern) -> _Combination:
    node = object.__new__(cls)
    _set_members(node, _flatten(cls, patterns), limit=None)
    return node


# ------------------------------------------------------------------------------------------------
# Block classification of a resolved rule
# ------------------------------------------------------------------------------------------------
_DENSE_CHUNK = 1 << 22  # blocks classified at once when a pattern has no cheap candidate list


def block_table(rule: Pattern, ctx: _Ctx, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nonempty blocks of a resolved rule: sorted keys ``r * n_kb + c``, full flags, signatures.

    Work and memory are proportional to the candidate blocks: the rule's own candidate list, or
    every block (in chunks) for patterns that touch most blocks anyway.
    """
    n_qb, n_kb = _n_blocks(ctx.n_q, block_size), _n_blocks(ctx.n_k, block_size)
    keys = rule._candidates(ctx, block_size)
    if keys is not None:
        return _classify_keys(rule, ctx, block_size, keys)
    rows_per_chunk = max(1, _DENSE_CHUNK // n_kb)
    parts = [_classify_keys(rule, ctx, block_size, np.arange(r * n_kb, min(r + rows_per_chunk, n_qb) * n_kb))
             for r in range(0, n_qb, rows_per_chunk)]
    return tuple(np.concatenate(column) for column in zip(*parts))


def _classify_keys(rule, ctx, block_size, keys):
    n_kb = _n_blocks(ctx.n_k, block_size)
    r, c = keys // n_kb, keys % n_kb
    blocks = _Blocks(r * block_size + ctx.shift, np.minimum((r + 1) * block_size, ctx.n_q) - 1 + ctx.shift,
                     c * block_size, np.minimum((c + 1) * block_size, ctx.n_k) - 1)
    nonempty, full, sig = rule._classify(blocks, ctx)
    nonempty, full = np.broadcast_to(nonempty, keys.shape), np.broadcast_to(full, keys.shape)
    return keys[nonempty], full[nonempty], _as_columns(sig, keys.shape[0])[nonempty]
