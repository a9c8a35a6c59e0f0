"""FlexAttention's view of a pattern: ``Pattern.mask_mod``, the predicate a FlexAttention user would write.

>>> import torch, sparse_attn as sa
>>> from torch.nn.attention.flex_attention import create_mask
>>> p = sa.Local(2) | sa.Global(first=1)
>>> mask_mod = p.mask_mod(8)                                  # (b, h, q_idx, kv_idx) -> bool tensor
>>> torch.equal(create_mask(mask_mod, 1, 1, 8, 8, device="cpu")[0], p.mask(8))
True

The predicate is composed from the pattern's tree as one writes a ``mask_mod`` by hand, in positions
``i = q_idx + (n_k - n_q)`` (bottom-right aligned, as every pattern) and ``j = kv_idx``:

=================  ==============================================================================
``Local(l, r)``    ``(i - j <= l) & (j - i <= r)``, ``(i - j).abs() <= l`` when l == r; with
                   ``block_size=u`` the same on ``i // u`` and ``j // u``
``Stride(s, o)``   ``(i - j - o) % s == 0``; ``Dilated``: its window and its stride
``Global``         ``(i < first) | (i >= n - last) | (i == t) | ...``, and the same on ``j``
``Sink``           the same on ``j`` only, and ``j % period >= period - width``
``Causal``         ``j <= i``; ``Dense``: always
``| & ~``          ``| & ~`` of the members' predicates
``PerHead``        ``torch.where(group[h] == k, p_k, ...)``, one branch per distinct member
``Random``         a bool table of its tiles per head, ``tiles[h, i // u, j // u]`` (n / u entries a
                   side: block granularity, never per token), drawn as the layout draws them
``Blocks``         its grid, ``grid[h, q_idx // b, kv_idx // b]``
=================  ==============================================================================

Pattern arguments are clamped as ``sparse_attn.rules`` clamps them, so every constant is bounded by the
sequence; ``Global``/``Sink`` token lists compare against a few constants, or look positions up in a bool
vector of n entries when there are more than ``FEW_TOKENS``. Call-time data are per-token lookups (O(N)):
``~key_padding_mask[b, kv_idx]``, ``global_mask[b, q_idx] | global_mask[b, kv_idx]``, and for packed
``documents`` ``doc[b, q_idx] == doc[b, kv_idx]``, positions counted from each document's start.

The tensors the predicate closes over live on ``device`` (the call-time data's device, else the CPU):
give ``create_block_mask(..., device=...)`` and ``flex_attention``'s inputs the same one. It runs under
``create_mask``, ``create_block_mask`` (``_compile`` or not), ``torch.compile`` and ``vmap``.

Imports: ``Pattern.mask_mod`` imports this module lazily (it imports torch); it reads a spec's ``kind``
and public fields, as ``sparse_attn.rules`` does, and never imports ``pattern``.
"""
from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from .blocks import ceil_div, check_lengths
from .checks import check_bool, check_int
from .compiler import check_call_masks
from .documents import Spans, document_spans, document_values, per_token
from .rules import (
    CausalRule,
    Context,
    DenseRule,
    IntersectionRule,
    Rule,
    StrideRule,
    TilesRule,
    WindowRule,
    random_tiles,
    resolve,
    union_exclusion,
)

FEW_TOKENS = 8  # Global/Sink token lists up to this long are compared as constants, longer ones looked up


class Indices(NamedTuple):
    """What every node's predicate reads: FlexAttention's indices and the positions they stand for."""

    b: torch.Tensor
    h: torch.Tensor
    q: torch.Tensor           # query row (q_idx)
    kv: torch.Tensor          # key (kv_idx)
    i: torch.Tensor           # query position: q + (n_k - n_q), or counted from its document's start
    j: torch.Tensor           # key position: kv, or counted from its document's start


Predicate = Callable[[Indices], torch.Tensor]


class _Documents(NamedTuple):
    """Packed documents: host spans (to draw Random per length) and per-token lookups (B, n) on the device."""

    spans: Spans
    ids: torch.Tensor          # (B, n) int64 document id of each token, -1 = padding
    start: torch.Tensor        # (B, n) int64 first token of each token's document (itself for padding)
    length: torch.Tensor       # (B, n) int64 length of each token's document (0 for padding)


class _Env(NamedTuple):
    """What node builders need besides the spec."""

    n_q: int
    n_k: int
    heads: int
    device: torch.device
    documents: _Documents | None
    tensors: list              # every tensor a predicate closes over (for the device check)

    def tensor(self, values) -> torch.Tensor:
        """A copy of ``values`` (a tensor or an array) on the device, recorded as closed over."""
        if isinstance(values, torch.Tensor):
            tensor = values.detach().to(self.device, copy=True)
        else:
            tensor = torch.from_numpy(np.array(values)).to(self.device)  # a copy: the spec's arrays are read-only
        self.tensors.append(tensor)
        return tensor

    def head_slots(self, heads: tuple[int, ...]):
        """(rows, slot): tables of a node used by ``heads`` only hold those heads' rows; ``slot(h)`` is head h's
        row (h itself when every head uses the node)."""
        if heads == tuple(range(self.heads)):
            return self.heads, lambda h: h
        row = np.zeros(self.heads, dtype=np.int64)
        row[list(heads)] = np.arange(len(heads))
        table = self.tensor(row)                                                                    # (heads,)
        return len(heads), lambda h: table[h]


def at(table: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``table[b, x]`` of a per-example (B, n) table; a table of one example serves every b."""
    return table[0, x] if table.shape[0] == 1 else table[b, x]


# ------------------------------------------------------------------------------------------------
# The public entry point (``Pattern.mask_mod``)
# ------------------------------------------------------------------------------------------------
def mask_mod(pattern, n_q: int, n_k: int | None = None, heads: int = 1, *, documents=None, key_padding_mask=None,
             global_mask=None, causal: bool = False, device=None) -> Callable:
    """What :meth:`Pattern.mask_mod` returns: the pattern's predicate ``(b, h, q_idx, kv_idx) -> bool tensor``.

    >>> import sparse_attn as sa
    >>> ids = torch.tensor([[0, 0, 0, 1, 1, -1]])             # two documents and one padding token
    >>> f = sa.Global(first=1).mask_mod(6, documents=ids)
    >>> f(0, 0, torch.arange(6)[:, None], torch.arange(6)[None, :]).int()
    tensor([[1, 1, 1, 0, 0, 0],
            [1, 0, 0, 0, 0, 0],
            [1, 0, 0, 0, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 0, 0]], dtype=torch.int32)

    Arguments are checked as ``pattern.layout(...)`` checks them, with the same errors.
    """
    n_q, n_k = check_lengths(n_q, n_k)
    heads = check_int("heads", heads, 1)
    causal = check_bool("causal", causal)
    pattern.check_heads(heads)
    check_call_masks(n_q, n_k, global_mask, key_padding_mask, None, documents)
    for name, value in (("documents", documents), ("key_padding_mask", key_padding_mask), ("global_mask", global_mask)):
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor: its values, which the predicate looks up, cannot be read; "
                             f"pass a tensor with values")
    ids = None if documents is None else document_values(documents)
    device = _device(device, documents, key_padding_mask, global_mask)
    env = _Env(n_q, n_k, heads, device, None, [])
    if ids is not None:
        env = env._replace(documents=_documents(ids, env))
    body = build(pattern, env, tuple(range(heads)))
    shift, docs = n_k - n_q, env.documents
    padding = None if key_padding_mask is None else env.tensor(key_padding_mask)           # (B, n_k) bool
    global_ = None if global_mask is None else env.tensor(global_mask)                     # (B, n) bool
    closed_over = bool(env.tensors)

    def mask_mod(b, h, q_idx, kv_idx):
        if closed_over and q_idx.device != device:
            raise ValueError(f"this mask_mod holds its lookup tables on {device} but was called with indices on "
                             f"{q_idx.device}; build it with mask_mod(..., device={str(q_idx.device)!r}) (and give "
                             f"create_block_mask the same device as the attention inputs)")
        if docs is None:
            i, j = (q_idx + shift if shift else q_idx), kv_idx
        else:
            i, j = q_idx - at(docs.start, b, q_idx), kv_idx - at(docs.start, b, kv_idx)
        allowed = body(Indices(b, h, q_idx, kv_idx, i, j))
        if global_ is not None:
            allowed = allowed | at(global_, b, q_idx) | at(global_, b, kv_idx)
        if causal:
            allowed = allowed & (j <= i)
        if padding is not None:
            allowed = allowed & ~at(padding, b, kv_idx)
        if docs is not None:
            document = at(docs.ids, b, q_idx)
            allowed = allowed & (document == at(docs.ids, b, kv_idx)) & (document >= 0)
        return allowed

    mask_mod.__doc__ = f"FlexAttention mask_mod of {pattern!r} for n_q={n_q}, n_k={n_k}, heads={heads}"
    return mask_mod


def _device(device, *data) -> torch.device:
    """The device the predicate's tables live on: ``device``, else the call-time data's, else the CPU."""
    if device is None:
        device = next((d.device for d in data if isinstance(d, torch.Tensor)), torch.device("cpu"))
    elif not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a torch.device or a string such as 'cuda', got {device!r} "
                        f"({type(device).__name__})")
    return torch.empty(0, device=device).device  # 'cuda' -> 'cuda:0': what the indices report


def _documents(ids: np.ndarray, env: _Env) -> _Documents:
    """Per-token lookups of checked (B, n) document ids."""
    spans = document_spans(ids)
    positions = np.tile(np.arange(ids.shape[1], dtype=np.int64), (ids.shape[0], 1))                  # (B, n)
    start = per_token(spans, positions, spans.start)                                                 # (B, n)
    length = per_token(spans, np.zeros(ids.shape, dtype=np.int64), spans.length)                     # (B, n)
    return _Documents(spans, env.tensor(ids), env.tensor(start), env.tensor(length))


# ------------------------------------------------------------------------------------------------
# Node builders, by the spec's kind
# ------------------------------------------------------------------------------------------------
BUILDERS: dict[str, Callable] = {}  # a spec's ``kind`` -> fn(spec, env, heads, union) -> Predicate


def builder(*kinds: str):
    """Register the decorated ``fn(spec, env, heads, union) -> Predicate`` for specs of ``kinds``."""
    def register(fn):
        for kind in kinds:
            BUILDERS[kind] = fn
        return fn
    return register


def build(spec, env: _Env, heads: tuple[int, ...], union=None) -> Predicate:
    """The predicate of ``spec`` for the heads ``heads`` (the only ones whose results are used); ``union``: the
    union a ``Random`` belongs to, or None (it draws among the tiles the union's other members leave free)."""
    kind = getattr(spec, "kind", None)
    if kind not in BUILDERS:
        raise TypeError(f"no mask_mod for {type(spec).__name__} (kind {kind!r}): a pattern kind needs a builder in "
                        f"sparse_attn.flex, registered with @builder(kind); known kinds are {sorted(BUILDERS)}")
    return BUILDERS[kind](spec, env, heads, union)


@builder("local", "stride", "dilated", "causal", "dense")
def _arithmetic(spec, env, heads, union) -> Predicate:
    """Leaves of pure arithmetic, from their rule (clamped to the sequence: a document is never longer)."""
    return _rule_predicate(resolve(spec, Context(env.n_q, env.n_k, 0)))


def _rule_predicate(rule: Rule) -> Predicate:
    if isinstance(rule, WindowRule):
        before, after, u = rule.before, rule.after, rule.unit
        if u == 1 and before == after:
            return lambda x: (x.i - x.j).abs() <= before
        if u == 1:
            return lambda x: (x.i - x.j <= before) & (x.j - x.i <= after)
        return lambda x: (x.i // u - x.j // u <= before) & (x.j // u - x.i // u <= after)
    if isinstance(rule, StrideRule):
        stride, offset = rule.stride, rule.offset
        return lambda x: (x.i - x.j - offset) % stride == 0
    if isinstance(rule, CausalRule):
        return lambda x: x.j <= x.i
    if isinstance(rule, DenseRule):
        return lambda x: torch.ones_like(x.i - x.j, dtype=torch.bool)
    if isinstance(rule, IntersectionRule):
        return _combine(operator.and_, [_rule_predicate(m) for m in rule.members])
    raise TypeError(f"no arithmetic mask_mod for {rule!r}")


def _combine(op, predicates: list[Predicate]) -> Predicate:
    if len(predicates) == 1:
        return predicates[0]
    return lambda x: functools.reduce(op, (p(x) for p in predicates))


@builder("union")
def _union(spec, env, heads, union) -> Predicate:
    return _combine(operator.or_, [build(p, env, heads, spec if p.kind == "random" else None) for p in spec.patterns])


@builder("intersection")
def _intersection(spec, env, heads, union) -> Predicate:
    return _combine(operator.and_, [build(p, env, heads) for p in spec.patterns])


@builder("complement")
def _complement(spec, env, heads, union) -> Predicate:
    inner = build(spec.pattern, env, heads)
    return lambda x: ~inner(x)


@builder("per_head")
def _per_head(spec, env, heads, union) -> Predicate:
    """One branch per distinct member, selected by a (heads,) lookup of the member each head uses."""
    distinct = list(dict.fromkeys(spec.patterns[h] for h in heads))
    predicates = [build(p, env, tuple(h for h in heads if spec.patterns[h] == p)) for p in distinct]
    if len(predicates) == 1:
        return predicates[0]
    group = env.tensor(np.array([distinct.index(p) if p in distinct else 0 for p in spec.patterns]))  # (heads,)

    def per_head(x):
        g = group[x.h]
        out = predicates[-1](x)
        for k in range(len(predicates) - 2, -1, -1):
            out = torch.where(g == k, predicates[k](x), out)
        return out

    return per_head


@builder("global")
def _global(spec, env, heads, union) -> Predicate:
    rows = _token_test(env, True, spec.tokens, spec.first, spec.last)
    cols = _token_test(env, False, spec.tokens, spec.first, spec.last)
    if rows is None or cols is None:     # both or neither: the same tokens, first and last
        return lambda x: torch.zeros_like(x.i - x.j, dtype=torch.bool)
    return lambda x: rows(x) | cols(x)


@builder("sink")
def _sink(spec, env, heads, union) -> Predicate:
    cols = _token_test(env, False, spec.tokens, spec.first, 0)
    period, width, n = spec.period, spec.width, env.n_k
    tests = [] if cols is None else [cols]
    if period and period - width < n:          # else no key is a summary column
        if period > n:                         # every position is below the period
            tests.append(lambda x: x.j >= period - width)
        else:
            tests.append(lambda x: x.j % period >= period - width)
    if not tests:
        return lambda x: torch.zeros_like(x.i - x.j, dtype=torch.bool)
    return _combine(operator.or_, tests)


def _token_test(env: _Env, rows: bool, tokens, first: int, last: int) -> Predicate | None:
    """Is the query (``rows``) or key position one of the tokens, the first ``first`` or the last ``last`` of
    its sequence (its document)? None when no position is."""
    n, docs = env.n_k, env.documents
    first, last = min(first, n), min(last, n)
    tokens = [t for t in tokens if t < n]
    negative = rows and docs is None and env.n_q > env.n_k       # query positions start below 0
    position = (lambda x: x.i) if rows else (lambda x: x.j)
    index = (lambda x: x.q) if rows else (lambda x: x.kv)
    tests: list[Predicate] = []
    if first:
        tests.append((lambda x: (position(x) >= 0) & (position(x) < first)) if negative
                     else (lambda x: position(x) < first))
    if last and docs is None:
        tests.append(lambda x: position(x) >= n - last)
    elif last and docs is not None:
        lengths = docs.length
        tests.append(lambda x: position(x) >= at(lengths, x.b, index(x)) - last)
    if len(tokens) <= FEW_TOKENS:
        tests += [lambda x, t=t: position(x) == t for t in tokens]  # type: ignore[misc]  # mypy: no lambda defaults
    else:
        member = np.zeros(n, dtype=bool)
        member[tokens] = True
        table = env.tensor(member)                                                                   # (n,) bool
        tests.append(lambda x: table[position(x).clamp(0, n - 1)] & (position(x) >= 0))
    return _combine(operator.or_, tests) if tests else None


@builder("blocks")
def _blocks(spec, env, heads, union) -> Predicate:
    """The grid, looked up by block: rows are query rows (``q_idx``), or document positions."""
    docs = env.documents
    if docs is None:
        spec.check_grid(env.n_q, env.n_k)
    else:
        for length in np.unique(docs.spans.length):
            try:
                spec.check_grid(int(length), int(length))
            except ValueError as error:  # the words of the compiler's refusal
                raise ValueError(f"with documents, the pattern is resolved for each document by itself, and a "
                                 f"document of {length} tokens fails: {error}") from error
    grid = env.tensor(spec.blocks)                                                  # ([H,] n_qb, n_kb) bool
    unit = min(spec.block_size, max(env.n_q, env.n_k))  # a block past both lengths is the grid's one block
    rows = (lambda x: x.q) if docs is None else (lambda x: x.i)
    cols = (lambda x: x.kv) if docs is None else (lambda x: x.j)
    if grid.ndim == 3:
        return lambda x: grid[x.h, rows(x) // unit, cols(x) // unit]
    return lambda x: grid[rows(x) // unit, cols(x) // unit]


@builder("random")
def _random(spec, env, heads, union) -> Predicate:
    """A bool table of the tiles drawn for each head (and document length), by ``sparse_attn.rules.random_tiles``
    around what the layout excludes in its union: n_q / u x n_k / u entries per head, where u is the tile."""
    docs = env.documents
    rows, slot = env.head_slots(heads)
    if docs is None:
        rules = [_drawn(spec, Context(env.n_q, env.n_k, h), union) for h in heads]
        u, n_kt = rules[0].unit, rules[0].n_kt
        first = max(env.n_k - env.n_q, 0) // u                        # tile row of the first query position
        tiles = np.zeros((rows, n_kt - first, n_kt), dtype=bool)                   # (heads used, tile rows, n_kt)
        for row, rule in enumerate(rules):
            tiles[row].reshape(-1)[rule.chosen - first * n_kt] = True
        table = env.tensor(tiles)
        if env.n_q > env.n_k:                                          # query positions start below 0
            return lambda x: table[slot(x.h), (x.i // u).clamp(min=0), x.j // u] & (x.i >= 0)
        if first:
            return lambda x: table[slot(x.h), x.i // u - first, x.j // u]
        return lambda x: table[slot(x.h), x.i // u, x.j // u]
    # documents: each draws in its own grid as a sequence by itself, so documents of one length draw the same
    # tiles; one grid per distinct length, the grids laid end to end in one flat table
    spans, n = docs.spans, env.n_k
    u = min(spec.block_size, n)  # a tile past a document's length is its one tile, as with min(tile, length)
    lengths, grid_of = np.unique(spans.length, return_inverse=True)       # (lengths,), (documents,)
    width = ceil_div(lengths, u)                                          # (lengths,) tiles a side
    base = np.concatenate([[0], np.cumsum(width * width)])                # (lengths + 1,) offsets
    tiles = np.zeros((rows, max(int(base[-1]), 1)), dtype=bool)         # (heads used, tiles of every length)
    for g, length in enumerate(lengths.tolist()):
        for row, h in enumerate(heads):
            tiles[row, base[g] + _drawn(spec, Context(length, length, h), union).chosen] = True
    table = env.tensor(tiles)
    tile_base = env.tensor(per_token(spans, np.zeros(docs.ids.shape, dtype=np.int64), base[grid_of]))  # (B, n)
    tile_width = env.tensor(per_token(spans, np.zeros(docs.ids.shape, dtype=np.int64), width[grid_of]))  # (B, n)
    last = tiles.shape[1] - 1

    def random_in_documents(x):
        # the query's document's grid; pairs across documents land anywhere (clamped), the document test drops them
        tile = at(tile_base, x.b, x.q) + x.i // u * at(tile_width, x.b, x.q) + x.j // u
        return table[slot(x.h), tile.clamp(0, last)]

    return random_in_documents


def _drawn(spec, ctx: Context, union) -> TilesRule:
    """The tiles the layout draws for ``spec`` in ``ctx``: around ``union_exclusion`` of its union (None: none)."""
    excluded = union_exclusion(union, ctx) if union is not None else None
    return random_tiles(spec.blocks, spec.seed, spec.block_size, ctx, excluded)
