"""The Pattern algebra: which (query, key) pairs may interact.

>>> import sparse_attn as sa
>>> p = sa.Local(1) | sa.Global(first=1)
>>> p.mask(5)[0].int()
tensor([[1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 0, 1, 1, 1],
        [1, 0, 0, 1, 1]], dtype=torch.int32)

Patterns are small immutable specs, independent of sequence length: this module holds what users
write (the leaf kinds, ``|``, ``&``, ``~``, ``PerHead``), their argument checks, serialisation and nesting
limit, and nothing that evaluates them. What a spec means for one (n_q, n_k, head) is in
``sparse_attn.rules``; ``Pattern.layout`` hands the spec to ``sparse_attn.compiler``, which builds a
``BlockLayout``.

Positions: keys are at 0..n_k-1 and query row i is at position ``i + n_k - n_q`` (bottom-right
aligned, as FlashAttention and FlexAttention align a decode step); with n_q == n_k they coincide.
Every pattern's definition is in positions.

Imports run one way: this module imports ``rules`` (``mask`` resolves the spec there) and, inside
``layout()`` only, ``compiler`` (which imports torch, and ``import sparse_attn`` must not), inside
``mask_mod()`` only, ``flex`` (the FlexAttention predicate); none of them imports this module. Rules
and ``flex`` read a spec's ``kind`` tag and its public fields.

``KINDS`` lists the pattern kinds once: a class with a ``kind`` tag registers itself there when it is
defined. ``from_dict``, pattern text (``expression.CONSTRUCTORS``) and the tests read it; the code that
means something per kind is keyed by the tag (``rules.RESOLVERS``, ``flex.BUILDERS``,
``retention.ANALYSES``), and ``tests/test_pattern_kinds.py`` checks that every kind has each of them.

>>> KINDS["local"] is Local, list(KINDS)[-2:]
(True, ['complement', 'per_head'])

Arguments are Python ints of any size (resolving clamps them to the sequence). Combinators nest at
most ``MAX_DEPTH`` levels, which keeps every tree walk (``==``, ``repr``, pickling, resolving) far
from Python's recursion limit.
"""
from __future__ import annotations

import dataclasses
import sys
import types
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .blocks import ceil_div, check_lengths
from .checks import as_int, check_int
from .rules import Context, resolve, token_positions

if TYPE_CHECKING:
    import torch

    from .layout import BlockLayout

MAX_DEPTH = 64          # nested levels of |, &, ~ and PerHead (chains of | or & are flattened, not nested)
_KINDS: dict[str, type[Pattern]] = {}
KINDS = types.MappingProxyType(_KINDS)  # every pattern kind: its ``kind`` tag -> its class, in definition order


def _set_int(spec: Pattern, field: str, minimum: int | None = None) -> None:
    """Check a spec's int field and store it as a Python int (so arithmetic on it never wraps)."""
    _set_int_value(spec, field, getattr(spec, field), minimum)


def _set_int_value(spec: Pattern, field: str, value, minimum: int | None = None) -> None:
    """Check ``value`` for a spec's int field and store it as a Python int."""
    object.__setattr__(spec, field, check_int(f"{type(spec).__name__} {field}", value, minimum))


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


class Pattern:
    """Base class of all patterns: immutable, hashable, composable with ``|`` and ``&``.

    >>> (Local(128) | Global(first=1)).layout(4096, heads=12).density  # doctest: +SKIP
    """

    kind: ClassVar[str]  # the serialisation tag ("local", "union", ...), which rules dispatch on
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # every kind is a dataclass
    _depth: ClassVar[int] = 0  # combinator levels in this pattern (set per instance on combinators)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            _KINDS[cls.kind] = cls

    # --- algebra -------------------------------------------------------------------------------
    def __or__(self, other: Pattern) -> Pattern:
        check_pattern("right operand of |", other)
        return Union(self, other)

    def __and__(self, other: Pattern) -> Pattern:
        check_pattern("right operand of &", other)
        return Intersection(self, other)

    def __invert__(self) -> Pattern:
        """``~p``: the pairs ``p`` does not allow (``~~p`` gives back ``p``)."""
        return Complement(self)

    # --- user-facing views ---------------------------------------------------------------------
    def mask(self, n_q: int, n_k: int | None = None, heads: int = 1) -> torch.Tensor:
        """Dense token mask, ``torch.bool`` of shape (heads, n_q, n_k). For small N only.

        >>> Causal().mask(3)[0].int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
        """
        import torch  # here, not at module level: specs and the CLI's --help need no torch

        n_q, n_k = check_lengths(n_q, n_k)
        self.check_heads(heads)
        i = np.arange(n_q, dtype=np.int64)[:, None] + (n_k - n_q)       # query positions
        j = np.arange(n_k, dtype=np.int64)[None, :]
        per_head = self.head_dependent
        rows = []
        for h in range(heads if per_head else 1):
            rows.append(np.broadcast_to(resolve(self, Context(n_q, n_k, h)).allows(i, j), (n_q, n_k)))
        out = torch.from_numpy(np.stack(rows))
        return out if per_head else out.expand(heads, n_q, n_k).clone()

    def layout(self, n_q: int, n_k: int | None = None, heads: int = 1, block_size: int = 64,
               *, causal: bool = False, global_mask=None, key_padding_mask=None, documents=None) -> BlockLayout:
        """Compile into a :class:`~sparse_attn.layout.BlockLayout` (cached; call-time masks and documents
        are keyed by their values).

        ``causal``, ``key_padding_mask`` and ``global_mask`` as in ``sparse_attention``; ``documents``
        (B, n) int ids, -1 = padding: each document attends as a sequence by itself (see
        ``sparse_attn.documents``).

        >>> lay = (Local(256) | Global(first=16)).layout(1 << 20, heads=12)  # doctest: +SKIP
        >>> ids = np.array([[0, 0, 0, 1, 1, -1]])                 # two documents and one padding token
        >>> Global(first=1).layout(6, documents=ids).to_dense()[0, 0].int()
        tensor([[1, 1, 1, 0, 0, 0],
                [1, 0, 0, 0, 0, 0],
                [1, 0, 0, 0, 0, 0],
                [0, 0, 0, 1, 1, 0],
                [0, 0, 0, 1, 0, 0],
                [0, 0, 0, 0, 0, 0]], dtype=torch.int32)
        """
        from .compiler import build_layout  # here, not at module level: the compiler imports torch

        return build_layout(self, n_q, n_k, heads, block_size, causal=causal, global_mask=global_mask,
                            key_padding_mask=key_padding_mask, documents=documents)

    def mask_mod(self, n_q: int, n_k: int | None = None, heads: int = 1, *, documents=None, key_padding_mask=None,
                 global_mask=None, causal: bool = False, device=None):
        """The pattern as a FlexAttention predicate ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``, written as
        a FlexAttention user writes one: arithmetic for windows, strides, global and sink tokens, ``|``, ``&``,
        ``~`` of the members, a per-head select for ``PerHead``, and a lookup at block granularity only for
        ``Random`` and ``Blocks``. Call-time data as in :meth:`layout` (per-token lookups); ``device``: where
        its lookup tables live (default: the call-time data's device, else the CPU).

        >>> import torch
        >>> from torch.nn.attention.flex_attention import create_block_mask, create_mask
        >>> p = Local(256) | Global(first=16)                 # ((i - j).abs() <= 256) | (i < 16) | (j < 16)
        >>> bool((create_mask(p.mask_mod(1000), 1, 1, 1000, 1000, device="cpu")[0] == p.mask(1000)).all())
        True
        >>> block_mask = create_block_mask(p.mask_mod(4096), None, None, 4096, 4096, device="cpu")

        ``create_mask(p.mask_mod(n_q, n_k, heads), B, heads, n_q, n_k, device="cpu")`` equals
        ``p.mask(n_q, n_k, heads)``; with call-time data it equals ``p.layout(..., same data).to_dense()``. See
        ``sparse_attn.flex``.
        """
        from .flex import mask_mod  # here, not at module level: it imports torch

        return mask_mod(self, n_q, n_k, heads, documents=documents, key_padding_mask=key_padding_mask,
                        global_mask=global_mask, causal=causal, device=device)

    @property
    def head_dependent(self) -> bool:
        """True when heads may differ (PerHead or Random inside), so layouts store every head."""
        return any(child.head_dependent for child in self.children)

    @property
    def children(self) -> tuple[Pattern, ...]:
        """The patterns this one combines: the members of ``|``, ``&`` and ``PerHead``, the pattern of ``~``;
        ``()`` for the other kinds.

        >>> (Local(1) | ~Causal()).children
        (Local(1), ~Causal())
        """
        return ()

    # --- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain dict of builtins, e.g. ``{"type": "local", "before": 256}``; see ``from_dict``."""
        d: dict[str, Any] = {"type": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple) and value and isinstance(value[0], Pattern):
                d[f.name] = [p.to_dict() for p in value]
            elif isinstance(value, Pattern):
                d[f.name] = value.to_dict()
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
        parts: list[str] = []
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
        # only Local has ``after``, and it has ``before``
        return self.before if f.name == "after" else _field_default(f)  # type: ignore[attr-defined]

    def check_heads(self, heads: int) -> None:
        check_int("heads", heads, 1)
        for child in self.children:
            child.check_heads(heads)


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
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown pattern type {kind!r}; expected one of {sorted(KINDS)}")
    kwargs = {}
    for key, value in d.items():
        if key == "type":
            continue
        if key not in {f.name for f in dataclasses.fields(cls)}:
            fields = [f.name for f in dataclasses.fields(cls)]
            raise ValueError(f"pattern type {kind!r} has no field {key!r}; its fields are {fields}")
        nested = isinstance(value, dict) or isinstance(value, list) and value and isinstance(value[0], dict)
        if nested and level == MAX_DEPTH:
            raise _depth_error(f"the pattern dict's {kind!r}", level + 1)
        if isinstance(value, dict):                      # one member (Complement's pattern)
            value = _from_dict(value, level + 1)
        elif nested:
            value = [_from_dict(v, level + 1) for v in value]
        kwargs[key] = value
    if cls in (Union, Intersection):  # they take their members as *patterns
        return cls(*kwargs.get("patterns", ()))
    return cls(**kwargs)


def _depth_error(what: str, depth: int) -> ValueError:
    return ValueError(f"{what} would nest {depth} levels of |, &, ~ and PerHead, more than MAX_DEPTH={MAX_DEPTH}; "
                      f"combine the members of one operator once instead of nesting them: sa.Union(*members) or "
                      f"sa.Intersection(*members) (a chain of one operator is flattened and counts as one level), "
                      f"and factor shared terms: (a & m) | (b & m) == (a | b) & m")


def check_pattern(name: str, value) -> None:
    if not isinstance(value, Pattern):
        raise TypeError(f"{name} must be a sparse_attn Pattern such as sa.Local(256) | sa.Global(first=1), "
                        f"got {type(value).__name__}: {value!r}")


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

    kind: ClassVar[str] = "local"
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


@dataclasses.dataclass(frozen=True, repr=False)
class Stride(Pattern):
    """Every ``stride``-th key: ``(i - j - offset) % stride == 0`` (Sparse Transformer "strided").

    >>> Stride(2).mask(4)[0].int()
    tensor([[1, 0, 1, 0],
            [0, 1, 0, 1],
            [1, 0, 1, 0],
            [0, 1, 0, 1]], dtype=torch.int32)
    """

    kind: ClassVar[str] = "stride"
    stride: int
    offset: int = 0

    def __post_init__(self):
        _set_int(self, "stride", 1)
        _set_int(self, "offset")


@dataclasses.dataclass(frozen=True, repr=False)
class Dilated(Pattern):
    """Dilated window (Longformer): ``Local(before * dilation, after * dilation) & Stride(dilation)``.

    >>> Dilated(1, 2).mask(5)[0, 2].int()
    tensor([1, 0, 1, 0, 1], dtype=torch.int32)
    """

    kind: ClassVar[str] = "dilated"
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

    kind: ClassVar[str] = "global"
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
        return token_positions(check_int("n", n, 0), self.tokens, self.first, self.last)


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

    kind: ClassVar[str] = "sink"
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


@dataclasses.dataclass(frozen=True, repr=False)
class Causal(Pattern):
    """Query row i sees keys ``j <= i + (n_k - n_q)``: no key after the query's position.

    >>> Causal().mask(2, 3)[0].int()
    tensor([[1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    """

    kind: ClassVar[str] = "causal"


@dataclasses.dataclass(frozen=True, repr=False)
class Dense(Pattern):
    """Every pair. ``Dense().layout(...)`` runs ordinary attention through the block kernels."""

    kind: ClassVar[str] = "dense"


@dataclasses.dataclass(frozen=True, repr=False)
class Random(Pattern):
    """Random key blocks (BigBird): each (head, query block) gets ``blocks`` key blocks before its own.

    Blocks are ``block_size`` positions. Query block R (positions ``R * block_size ..``) draws among
    the key blocks 0 .. R - 1 that the other members of the same union leave untouched at the block's
    first position, deterministically from (seed, head, R): no global RNG, different across heads, and
    never from the sequence length, so training, evaluation, every longer sequence and a decode step
    see the same keys at a position. A query block with fewer free blocks takes all of them (block 0
    has none).

    >>> mask = Random(2, block_size=4).mask(32)[0]             # 8 query blocks of 4 tokens
    >>> mask[31].nonzero().flatten().tolist()                  # the last block draws 2 of blocks 0 .. 6
    [8, 9, 10, 11, 12, 13, 14, 15]
    >>> [int(mask[r].sum()) for r in (0, 4, 8)]                # blocks 0, 1, 2: none, block 0, 2 blocks
    [0, 4, 8]
    """

    kind: ClassVar[str] = "random"
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


@dataclasses.dataclass(frozen=True, repr=False, eq=False, init=False)
class Blocks(Pattern):
    """Any block layout: query row ``i`` and key ``j`` interact iff ``blocks[i // block_size, j // block_size]``.

    ``blocks`` is a bool (or 0/1 integer) tensor or array of shape (n_qb, n_kb), shared by every head,
    or (H, n_qb, n_kb), head ``h`` using ``blocks[h]`` (then ``heads`` must be H): a DeepSpeed
    ``make_layout`` result, a plan drawn elsewhere. The grid must cover the sequence exactly,
    ``ceil(n_q / block_size)`` rows and ``ceil(n_k / block_size)`` columns. Its rows are query
    *rows* (the grid is a layout), so with n_q != n_k it is not bottom-right aligned as the other
    patterns are: a decode step needs a grid of one row.

    >>> p = Blocks([[1, 0], [1, 1]], block_size=2)
    >>> p.mask(3)[0].int()                                    # the last block row and column are cut
    tensor([[1, 1, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    >>> p
    Blocks([[1, 0], [1, 1]], 2)

    The grid is copied into immutable bytes, so the spec is hashable and equal to any ``Blocks`` of the
    same values; ``p.blocks`` is a read-only bool array, and ``to_dict`` writes it as nested 0/1 lists.
    """

    kind: ClassVar[str] = "blocks"
    blocks: np.ndarray
    block_size: int

    def __init__(self, blocks, block_size: int):
        grid = _bool_grid(blocks)
        bits = np.ascontiguousarray(grid).tobytes()
        object.__setattr__(self, "_bits", bits)
        object.__setattr__(self, "_shape", tuple(int(size) for size in grid.shape))
        object.__setattr__(self, "blocks", np.frombuffer(bits, dtype=bool).reshape(grid.shape))  # never writeable
        _set_int_value(self, "block_size", block_size, 1)

    def __eq__(self, other) -> bool:
        return type(other) is Blocks and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self):
        return Blocks, (self.blocks, self.block_size)

    def _key(self) -> tuple:
        # _shape and _bits are set in __init__, outside the dataclass fields (not in repr, to_dict or ==): the
        # grid as builtins, so that reading the key (pattern_key, traced by torch.compile) touches no numpy array
        return self._shape, self.block_size, self._bits  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        grid = self.blocks
        shown = repr(grid.astype(np.uint8).tolist()) if grid.size <= 64 else \
            f"<bool {tuple(grid.shape)} grid, {int(grid.sum())} blocks set>"
        return f"Blocks({shown}, {self.block_size})"

    def to_dict(self) -> dict:
        return {"type": self.kind, "blocks": self.blocks.astype(np.uint8).tolist(), "block_size": self.block_size}

    @property
    def head_dependent(self) -> bool:
        return len(self._shape) == 3  # type: ignore[attr-defined]

    def check_heads(self, heads):
        super().check_heads(heads)
        shape = self._shape
        if len(shape) == 3 and shape[0] != heads:
            raise ValueError(f"Blocks has a grid for {shape[0]} heads, shape {shape}, "
                             f"but heads={heads}; give one (n_qb, n_kb) grid per query head, or one 2-D grid that "
                             f"every head shares")

    def check_grid(self, n_q: int, n_k: int) -> None:
        """Refuse lengths the grid does not cover exactly.

        >>> Blocks([[1, 0], [1, 1]], block_size=2).check_grid(5, 4)
        Traceback (most recent call last):
        ...
        ValueError: Blocks grid of 2 x 2 blocks of 2 tokens does not fit n_q=5, n_k=4: they need ceil(5 / 2) = 3
        rows and ceil(4 / 2) = 2 columns; build the grid for these lengths (3 x 2 blocks), or use lengths of 3..4
        queries and 3..4 keys with this grid
        """
        rows, cols = self.blocks.shape[-2:]
        bs = self.block_size
        need_rows, need_cols = ceil_div(n_q, bs), ceil_div(n_k, bs)
        if (rows, cols) != (need_rows, need_cols):
            raise ValueError(
                f"Blocks grid of {rows} x {cols} blocks of {bs} tokens does not fit n_q={n_q}, n_k={n_k}: they need "
                f"ceil({n_q} / {bs}) = {need_rows} rows and ceil({n_k} / {bs}) = {need_cols} columns; build the grid "
                f"for these lengths ({need_rows} x {need_cols} blocks), or use lengths of {(rows - 1) * bs + 1}.."
                f"{rows * bs} queries and {(cols - 1) * bs + 1}..{cols * bs} keys with this grid")


def _bool_grid(blocks) -> np.ndarray:
    """``Blocks``' grid as a bool numpy array (n_qb, n_kb) or (H, n_qb, n_kb), checked."""
    torch = sys.modules.get("torch")                     # a tensor implies torch is imported; never import it here
    if torch is not None and isinstance(blocks, torch.Tensor):
        if blocks.device.type == "meta":
            raise ValueError("Blocks blocks is a meta tensor, which has no values; pass the layout's values")
        blocks = blocks.detach().cpu().numpy()
    try:
        grid = np.asarray(blocks)
    except (ValueError, TypeError):                      # ragged nested lists
        grid = None
    if grid is None or not (grid.dtype == bool or np.issubdtype(grid.dtype, np.integer)):
        got = type(blocks).__name__ if grid is None else f"{type(blocks).__name__} of dtype {grid.dtype}"
        raise TypeError(f"Blocks blocks must be a bool (or 0/1 integer) tensor or array of shape (n_qb, n_kb) or "
                        f"(H, n_qb, n_kb), got {got}")
    if grid.ndim not in (2, 3) or grid.size == 0:
        raise ValueError(f"Blocks blocks must have shape (n_qb, n_kb) or (H, n_qb, n_kb) with every size >= 1, got "
                         f"shape {tuple(grid.shape)}")
    if grid.dtype != bool:
        other = np.setdiff1d(grid, (0, 1))
        if other.size:
            raise ValueError(f"Blocks blocks must hold bools or 0 and 1 only, got the value {other[0]}")
        grid = grid == 1
    return grid


# ------------------------------------------------------------------------------------------------
# Combinators
# ------------------------------------------------------------------------------------------------
def _set_depth(node: Pattern, members: tuple[Pattern, ...]) -> None:
    """Store a combinator's depth (one level over its deepest member), refusing more than ``MAX_DEPTH``."""
    depth = 1 + max(p._depth for p in members)
    if depth > MAX_DEPTH:
        raise _depth_error(f"this {type(node).__name__}", depth)
    object.__setattr__(node, "_depth", depth)


def _set_members(node: Pattern, members: tuple[Pattern, ...]) -> None:
    """Store a combinator's members and its depth."""
    _set_depth(node, members)
    object.__setattr__(node, "patterns", members)


def _flatten(cls, patterns) -> tuple[Pattern, ...]:
    flat: list[Pattern] = []
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

    @property
    def children(self) -> tuple[Pattern, ...]:
        return self.patterns


@dataclasses.dataclass(frozen=True, repr=False, init=False)
class Union(_Combination):
    """``p | q``: pairs allowed by any member."""

    kind: ClassVar[str] = "union"
    _symbol: ClassVar[str] = "|"
    patterns: tuple[Pattern, ...]


@dataclasses.dataclass(frozen=True, repr=False, init=False)
class Intersection(_Combination):
    """``p & q``: pairs allowed by every member."""

    kind: ClassVar[str] = "intersection"
    _symbol: ClassVar[str] = "&"
    patterns: tuple[Pattern, ...]


@dataclasses.dataclass(frozen=True, repr=False, init=False)
class Complement(Pattern):
    """``~p``: the pairs ``p`` does not allow. ``~`` of a complement gives back its pattern, so ``~~p == p``;
    ``Complement`` called on a complement keeps both levels, with the same mask.

    >>> (Local(1) & ~Local(0)).mask(4)[0].int()               # the window without its diagonal
    tensor([[0, 1, 0, 0],
            [1, 0, 1, 0],
            [0, 1, 0, 1],
            [0, 0, 1, 0]], dtype=torch.int32)
    >>> ~~Local(1) == Local(1), ~(Local(1) | Causal())
    (True, ~(Local(1) | Causal()))

    Blocks swap full and empty and partial blocks stay partial, so ``Local(256) & ~Global(first=1)``
    builds as fast as ``Local(256)``. It counts as one level of nesting (``MAX_DEPTH``).
    """

    kind: ClassVar[str] = "complement"
    pattern: Pattern

    def __init__(self, pattern: Pattern):
        check_pattern("the pattern of Complement (~)", pattern)
        _set_depth(self, (pattern,))
        object.__setattr__(self, "pattern", pattern)

    def __invert__(self) -> Pattern:
        return self.pattern

    def __repr__(self) -> str:
        inner = repr(self.pattern)
        return f"~({inner})" if isinstance(self.pattern, _Combination) else f"~{inner}"

    @property
    def children(self) -> tuple[Pattern, ...]:
        return (self.pattern,)


@dataclasses.dataclass(frozen=True, repr=False, init=False)
class PerHead(Pattern):
    """Head ``h`` uses ``patterns[h]``; the length must equal the number of query heads.

    >>> PerHead([Local(0), Dense()]).mask(2, heads=2).int().tolist()
    [[[1, 0], [0, 1]], [[1, 1], [1, 1]]]
    """

    kind: ClassVar[str] = "per_head"
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

    @property
    def children(self) -> tuple[Pattern, ...]:
        return self.patterns

    def check_heads(self, heads):
        super().check_heads(heads)
        if len(self.patterns) != heads:
            raise ValueError(f"PerHead has {len(self.patterns)} patterns but heads={heads}; "
                             f"give one pattern per query head")


# ------------------------------------------------------------------------------------------------
# Keys
# ------------------------------------------------------------------------------------------------
def pattern_key(pattern: Pattern) -> tuple:
    """``pattern`` as a value of builtins: its kind and fields, members as their keys, a ``Blocks`` grid as its
    shape and bytes. Equal patterns have equal keys, and ``pattern_from_key`` gives back an equal pattern.

    >>> pattern_key(Local(4) | Global(first=1))
    ('union', (('local', (4, 4, 1)), ('global', ((), 1, 0))))
    >>> pattern_from_key(pattern_key(Local(4) | Global(first=1))) == Local(4) | Global(first=1)
    True

    What ``sparse_attention`` hands torch.compile's host code instead of the pattern: reading the key reads
    only the pattern's values (Dynamo guards on them, never on the object's identity) and touches no numpy.
    """
    if pattern.children:
        return pattern.kind, tuple(pattern_key(member) for member in pattern.children)
    if isinstance(pattern, Blocks):
        return pattern.kind, pattern._key()
    return pattern.kind, tuple(getattr(pattern, f.name) for f in dataclasses.fields(pattern))


def pattern_from_key(key: tuple) -> Pattern:
    """The pattern of a ``pattern_key``."""
    kind, values = key
    cls = KINDS[kind]
    if cls is Blocks:
        shape, block_size, bits = values
        return Blocks(np.frombuffer(bits, dtype=bool).reshape(shape), block_size)
    if cls is PerHead:
        return PerHead([pattern_from_key(member) for member in values])
    if cls in (Union, Intersection, Complement):
        return cls(*map(pattern_from_key, values))
    return cls(*values)
