"""Retention: which past keys a pattern still lets a future query reach, for a decoding KV cache.

>>> import sparse_attn as sa
>>> r = retention(sa.Local(4, 0) | sa.Sink(first=2))
>>> r.bounded, r.fixed, r.window
(True, (0, 1), 4)
>>> r.kept(t=10, n=10).tolist()              # the next query is at position 10: sinks and the last 4 keys
[0, 1, 6, 7, 8, 9]
>>> retention(sa.Stride(4) | sa.Local(8)).reason
'Stride(4) can reach any past key'

Decoding appends keys at positions 0, 1, 2, ...; the query at position i sees the keys of its step,
``0 .. n_k - 1`` with ``n_k >= i + 1`` (``n_k == i + 1`` token by token, larger for a query inside a
prefill chunk), with the pattern resolved as ``sparse_attention(q_new, k_all, v_all, pattern)``
resolves it (bottom-right aligned). A key at position j < t that no query at a position >= t can
attend is never needed again, and a cache may drop it.

The analysis reads the spec tree (its ``kind`` tags and public fields), as the rules do:

- ``Local(l, r, block_size=u)`` keeps the trailing ``l * u + u - 1`` positions (``l`` when u = 1):
  the look-ahead ``r`` only reaches keys that arrive later.
- ``Sink`` keeps its tokens; ``Global(tokens, first)`` keeps its tokens, and a global *query* at a
  future position g sees every key, so everything is kept until the query at g has run
  (``dense_until``). ``Global(last=L)`` makes the newest tokens global (in decoding the newest query
  is always among the last L), so their rows reach every key: unbounded on its own.
- ``Causal``, ``Dense``, ``Stride``, ``Random``, ``Blocks``, a complement and a periodic
  ``Sink(period=...)`` (a column every period: a number of columns growing with the sequence) are
  unbounded; ``Dilated`` is a window and a stride, bounded by its window.
- ``a | b`` is bounded when both are (fixed tokens united, the larger window); ``a & b`` when
  either is (the unbounded side only narrows: the bounded sides' fixed tokens, the smaller window).
- ``PerHead`` takes the union over heads: a cache holds one set of positions for every head.
- ``documents=`` plays no part: packed documents are a training-time layout, a cache decodes one
  sequence per example.

``fixed``, ``window`` and ``dense_until`` describe what a cache stores, a superset of the keys
still reachable. ``sees_all_held`` says when one new query attends all of it (a decode step needs no mask):
``Local`` (unit 1) keeps the keys its window attends, ``Sink`` and ``Global`` the columns every query
attends; a union keeps this when a member of the largest window does, an intersection or ``PerHead`` when
every bounded member (every head) holds the same fixed tokens and window, and the unbounded members of an
intersection are ``Causal`` or ``Dense``. :meth:`Retention.kept` is exact where the pattern is built from ``Local``,
``Sink``, ``Global``, ``Causal`` and ``Dense`` with ``|``, ``&`` and ``PerHead``: it then drops every
key that no future query attends (minimal); elsewhere it returns the stored superset (safe).

``ANALYSES`` holds, for every kind in ``pattern.KINDS``, its bound and whether ``kept()`` is exact for
it: a kind without an entry is a ``TypeError``, never a silent guess.

Imports run one way: this module imports ``pattern`` (``check_pattern``), ``rules`` (``kept`` resolves
the pattern) and ``checks``; none of them imports it. ``kv_cache`` imports it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .checks import check_int
from .pattern import check_pattern
from .rules import Context, PatternSpec, resolve


@dataclasses.dataclass(frozen=True)
class Retention:
    """What a cache must keep for ``pattern`` over ``heads`` query heads; see the module docstring.

    bounded:     False when some future query may reach any past key (then a cache keeps everything).
    fixed:       positions kept forever (sinks, global tokens), sorted.
    window:      a key at position j < t stays while j >= t - window (t: the next query's position).
    dense_until: while t <= dense_until a global query is still to come and may reach every key
                 (-1: none).
    rows:        the positions of global queries in the pattern (where kept() looks beyond t).
    reason:      for an unbounded pattern, the part that makes it so ("" when bounded).
    exact:       whether kept() evaluates the pattern (exact and minimal) or returns the stored superset.
    sees_all_held: past dense_until, the query at t attends every key a cache holds then (the fixed tokens
                 before t and t - window .. t): a decode step of one token needs no mask.
    """

    pattern: PatternSpec
    heads: int
    bounded: bool
    fixed: tuple[int, ...]
    window: int
    dense_until: int
    rows: tuple[int, ...]
    reason: str
    exact: bool
    sees_all_held: bool

    def kept(self, t: int, n: int) -> np.ndarray:
        """Sorted positions among ``0 .. n - 1`` that a query at a position >= ``t`` may still attend.

        Keys at ``t`` or later are always kept (a query of the current chunk may look ahead to them).
        """
        t, n = check_int("t", t, 0), check_int("n", n, 0)
        if not self.bounded or t <= self.dense_until:
            candidates: np.ndarray = np.arange(n, dtype=np.int64)
        else:
            start = min(max(t - self.window, 0), n)                  # the window: start .. n - 1
            fixed = np.asarray([p for p in self.fixed if p < start], dtype=np.int64)
            candidates = np.concatenate([fixed, np.arange(start, n, dtype=np.int64)])
        if not self.exact:
            return candidates
        past = candidates[candidates < t]
        return np.concatenate([past[self.reached(t, past)], candidates[candidates >= t]])

    def reached(self, t: int, keys: np.ndarray) -> np.ndarray:
        """For keys at positions < t (int64 array): does some query at a position >= t attend it? Exact
        for the kinds listed in the module docstring; ``kept`` calls it only for those."""
        queries = [t] + [g for g in self.rows if g > t]
        out = np.zeros(keys.shape, dtype=bool)
        for i in queries:
            for head in range(self.heads if self.pattern.head_dependent else 1):
                out |= resolve(self.pattern, Context(1, i + 1, head)).allows(np.int64(i), keys)
        return out


@dataclasses.dataclass(frozen=True)
class _Bound:
    """The analysis of one subtree: an unbounded one has ``reason`` set and only ``past_attended`` used."""

    reason: str = ""
    fixed: frozenset = frozenset()
    window: int = 0
    dense_until: int = -1
    fixed_attended: bool = False   # every query attends each fixed token before it
    window_attended: bool = False  # the query at t attends every key in t - window .. t
    past_attended: bool = False    # every query attends every key before it (Causal, Dense)


def retention(pattern: PatternSpec, heads: int | None = None) -> Retention:
    """The retention of ``pattern`` for ``heads`` query heads; None: as many as a ``PerHead`` (or a per-head
    ``Blocks`` grid) in the pattern names, else 1 (only ``kept``'s evaluation of such a pattern depends on them).

    >>> import sparse_attn as sa
    >>> r = retention(sa.Global(first=2) | sa.Local(3, 0))
    >>> r.fixed, r.window, r.dense_until                      # everything kept until query 1 has run
    ((0, 1), 3, 1)
    >>> retention(sa.Local(8) & sa.Causal()).window
    8
    """
    check_pattern("pattern", pattern)
    heads = _heads_named(pattern) if heads is None else check_int("heads", heads, 1)
    pattern.check_heads(heads)
    bound = _analyse(pattern)
    return Retention(pattern=pattern, heads=heads, bounded=not bound.reason, fixed=tuple(sorted(bound.fixed)),
                     window=bound.window, dense_until=bound.dense_until, rows=_global_rows(pattern),
                     reason=bound.reason, exact=_exact(pattern),
                     sees_all_held=not bound.reason and bound.fixed_attended and bound.window_attended)


def _exact(spec) -> bool:
    return _analysis(spec).exact and all(_exact(p) for p in spec.children)


def _heads_named(spec) -> int:
    if spec.kind == "per_head":
        return len(spec.patterns)
    if spec.kind == "blocks" and spec.blocks.ndim == 3:          # a grid per head
        return spec.blocks.shape[0]
    return max((_heads_named(p) for p in spec.children), default=1)


def _global_rows(spec) -> tuple[int, ...]:
    """Positions of the global queries (``Global``'s tokens and first tokens) anywhere in the tree."""
    if spec.kind == "global":
        return tuple(sorted(set(spec.tokens) | set(range(spec.first))))
    return tuple(sorted(set().union(*(_global_rows(p) for p in spec.children))))


def _analysis(spec) -> KindAnalysis:
    if spec.kind not in ANALYSES:
        raise TypeError(f"no retention for {type(spec).__name__} (kind {spec.kind!r}): a pattern kind needs an entry "
                        f"in sparse_attn.retention.ANALYSES (its bound, and whether kept() may evaluate it); known "
                        f"kinds are {sorted(ANALYSES)}")
    return ANALYSES[spec.kind]


def _analyse(spec) -> _Bound:
    return _analysis(spec).bound(spec)


def _unbounded(spec) -> _Bound:
    return _Bound(reason=f"{spec!r} can reach any past key")


def _every_past_key(spec) -> _Bound:
    return _Bound(reason=f"{spec!r} can reach any past key", past_attended=True)


def _local(spec) -> _Bound:
    u = spec.block_size
    # query block t // u sees key blocks from t // u - before; with unit 1 every key of the window
    return _Bound(window=spec.before * u + u - 1, fixed_attended=True, window_attended=u == 1)


def _dilated(spec) -> _Bound:
    return _Bound(window=spec.before * spec.dilation, fixed_attended=True, window_attended=spec.dilation == 1)


def _sink(spec) -> _Bound:
    if spec.period:
        return _Bound(reason=f"{spec!r} keeps a column every {spec.period} tokens, a number growing with the "
                             f"sequence")
    return _Bound(fixed=frozenset(spec.tokens) | frozenset(range(spec.first)), fixed_attended=True)


def _global(spec) -> _Bound:
    if spec.last:
        return _Bound(reason=f"{spec!r} makes the newest tokens global: their rows reach every past key")
    tokens = frozenset(spec.tokens) | frozenset(range(spec.first))
    return _Bound(fixed=tokens, dense_until=max(tokens, default=-1), fixed_attended=True)


def _union(spec) -> _Bound:
    """Bounded when every member is: the fixed tokens united, the largest window. Each member attends its own
    fixed tokens; a member of the largest window may attend all of it."""
    members = [_analyse(p) for p in spec.patterns]
    bound = _united(members)
    if bound.reason:
        return dataclasses.replace(bound, past_attended=any(m.past_attended for m in members))
    return dataclasses.replace(bound, fixed_attended=all(m.fixed_attended for m in members),
                               window_attended=any(m.window_attended for m in members if m.window == bound.window))


def _per_head(spec) -> _Bound:
    """The union over heads (one cache serves every head); each head attends all of it only when every head
    holds the same fixed tokens and window."""
    members = [_analyse(p) for p in spec.patterns]
    bound = _united(members)
    if bound.reason:
        return dataclasses.replace(bound, past_attended=all(m.past_attended for m in members))
    return dataclasses.replace(
        bound, fixed_attended=all(m.fixed_attended and m.fixed == bound.fixed for m in members),
        window_attended=all(m.window_attended and m.window == bound.window for m in members))


def _united(members: list[_Bound]) -> _Bound:
    """What a cache keeps for members that all hold: unbounded if one is, else their fixed tokens united, the
    largest window and the last global query (who attends it is the caller's to say)."""
    unbounded = [m.reason for m in members if m.reason]
    if unbounded:
        return _Bound(reason=unbounded[0])
    return _Bound(fixed=frozenset().union(*(m.fixed for m in members)), window=max(m.window for m in members),
                  dense_until=max(m.dense_until for m in members))


def _intersection(spec) -> _Bound:
    """Bounded when a member is; the unbounded members only narrow. Until every member's global queries
    have run (t <= min dense_until) all keys stay; then some member is past its global queries and
    bounds the set by its fixed tokens and window: the largest window while any member still has global
    queries to come, the smallest when none has any."""
    members = [_analyse(p) for p in spec.patterns]
    bounded = [m for m in members if not m.reason]
    if not bounded:
        return _Bound(reason=" and ".join(m.reason for m in members), past_attended=all(m.past_attended
                                                                                      for m in members))
    with_rows = any(m.dense_until >= 0 for m in bounded)
    fixed = frozenset().union(*(m.fixed for m in bounded))
    window = (max if with_rows else min)(m.window for m in bounded)
    others_attend = all(m.past_attended for m in members if m.reason)    # the unbounded members narrow nothing
    return _Bound(fixed=fixed, window=window, dense_until=min(m.dense_until for m in bounded),
                  fixed_attended=others_attend and all(m.fixed_attended and m.fixed == fixed for m in bounded),
                  window_attended=others_attend and all(m.window_attended and m.window >= window for m in bounded))


class KindAnalysis(NamedTuple):
    """How retention reads one pattern kind.

    bound: the kind's :class:`_Bound` (an unbounded one names the reason).
    exact: whether its rule is monotone in the query position (windows that only move forward, fixed
           columns, global rows), so that what the queries >= t reach is what the query at t and the
           global queries after t reach, and ``kept()`` can evaluate exactly that.
    """

    bound: Callable[[object], _Bound]
    exact: bool


ANALYSES: dict[str, KindAnalysis] = {  # a spec's ``kind`` -> how retention reads it; every kind has one
    "local": KindAnalysis(_local, exact=True), "stride": KindAnalysis(_unbounded, exact=False),
    "dilated": KindAnalysis(_dilated, exact=False), "global": KindAnalysis(_global, exact=True),
    "sink": KindAnalysis(_sink, exact=True), "causal": KindAnalysis(_every_past_key, exact=True),
    "dense": KindAnalysis(_every_past_key, exact=True), "random": KindAnalysis(_unbounded, exact=False),
    "blocks": KindAnalysis(_unbounded, exact=False), "union": KindAnalysis(_union, exact=True),
    "intersection": KindAnalysis(_intersection, exact=True), "complement": KindAnalysis(_unbounded, exact=False),
    "per_head": KindAnalysis(_per_head, exact=True),
}
