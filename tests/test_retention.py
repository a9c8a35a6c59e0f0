"""Retention against brute force: a key kept() drops is never attended by a later query (safety), and for
Local/Sink/Global/Causal compositions every kept key is attended by one (minimality)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparse_attn as sa
from sparse_attn.retention import retention
from tests.strategies import pattern_trees, patterns

MARGIN = 12  # queries after the last existing key that the brute force tries


def attended(pattern, heads, t, n, last):
    """Keys < n that some query at a position i in [t, last) attends, in any step that holds keys 0..n_k-1 with
    i < n_k <= last: every query chunk [t, n_k) of sparse_attention(q_new, k_all, v_all, pattern)."""
    seen = np.zeros(n, dtype=bool)
    for n_k in range(max(t + 1, 1), last + 1):
        mask = pattern.mask(n_k - t, n_k, heads=heads).numpy()          # (heads, n_k - t, n_k): queries t..n_k-1
        seen |= mask.any((0, 1))[:n] if n <= n_k else np.pad(mask.any((0, 1)), (0, n - n_k))
    return seen


def decode_attended(pattern, heads, t, n, last):
    """Keys < n attended by some query i in [t, last) decoding token by token (the step holds keys 0..i)."""
    seen = np.zeros(n, dtype=bool)
    for i in range(t, last):
        row = pattern.mask(1, i + 1, heads=heads).numpy()[:, 0, :n].any(0)   # (min(n, i + 1),)
        seen[:len(row)] |= row
    return seen


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(patterns, st.integers(0, 40), st.integers(0, 40))
def test_safety_a_dropped_key_is_never_attended_later(pattern, n, t):
    kept = np.zeros(n, dtype=bool)
    kept[retention(pattern).kept(t, n)] = True
    reached = attended(pattern, 1, t, n, max(n, t) + MARGIN)
    assert not (reached & ~kept).any(), f"{pattern!r} t={t} n={n}: drops {np.flatnonzero(reached & ~kept)}"


exact_leaves = st.one_of(
    st.builds(sa.Local, st.integers(0, 12), st.integers(0, 6), st.sampled_from([1, 1, 3])),
    st.builds(sa.Sink, st.lists(st.integers(0, 40), max_size=3), st.integers(0, 4)),
    st.builds(sa.Global, st.lists(st.integers(0, 40), max_size=3), st.integers(0, 3), st.sampled_from([0, 0, 2])),
    st.just(sa.Causal()),
)
exact_patterns = st.recursive(exact_leaves, lambda inner: st.one_of(
    st.builds(lambda a, b: a | b, inner, inner), st.builds(lambda a, b: a & b, inner, inner)), max_leaves=5)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exact_patterns, st.integers(0, 40), st.integers(0, 45))
def test_minimality_every_kept_past_key_is_attended_by_a_later_query(pattern, n, t):
    r = retention(pattern)
    assert r.exact
    kept = r.kept(t, n)
    past = kept[kept < t]
    reached = decode_attended(pattern, 1, t, n, max(n, t, *r.rows, 0) + 2)
    assert reached[past].all(), f"{pattern!r} t={t} n={n}: keeps {past[~reached[past]]}, attended by none"
    assert (kept[kept >= t] == np.arange(t, n)).all()                      # the current chunk: all kept


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern_trees(st.builds(sa.Local, st.integers(0, 6), st.integers(0, 3))), st.data())
def test_per_head_retention_is_the_union_over_heads(first, data):
    second = data.draw(exact_patterns)
    pattern, n, t = sa.PerHead([first, second]), data.draw(st.integers(0, 30)), data.draw(st.integers(0, 30))
    kept = np.zeros(n, dtype=bool)
    kept[retention(pattern, heads=2).kept(t, n)] = True
    reached = attended(pattern, 2, t, n, max(n, t) + MARGIN)
    assert not (reached & ~kept).any()
    past = np.flatnonzero(kept[:t])
    if retention(pattern, heads=2).exact:                                  # no complement in the first head
            assert decode_attended(pattern, 2, t, n, max(n, t, *retention(second).rows, 0) + 2)[past].all()


bounded_leaves = st.one_of(
    exact_leaves,
    st.builds(sa.Dilated, st.integers(0, 6), st.integers(1, 3)),
    st.just(sa.Dense()),
    st.builds(sa.Stride, st.integers(1, 5)),
)
bounded_patterns = st.recursive(bounded_leaves, lambda inner: st.one_of(
    st.builds(lambda a, b: a | b, inner, inner), st.builds(lambda a, b: a & b, inner, inner),
    st.builds(lambda a, b: sa.PerHead([a, b]), inner, inner)), max_leaves=5)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bounded_patterns)
def test_sees_all_held_means_a_new_query_attends_every_key_a_cache_holds(pattern):
    """Past dense_until a cache holds the fixed tokens before t and t - window .. t (test_kv_cache checks
    that): where sees_all_held says so, the query at t attends each of them, on every head."""
    r = retention(pattern)
    if not r.sees_all_held:
        return
    assert r.bounded
    for t in range(r.dense_until + 1, r.dense_until + 2 + r.window + 12):
        held = sorted({p for p in r.fixed if p < t} | set(range(max(t - r.window, 0), t + 1)))
        row = pattern.mask(1, t + 1, heads=r.heads).numpy()[:, 0]                   # (heads, t + 1)
        assert row[:, held].all(), f"{pattern!r} t={t}: misses {np.array(held)[~row[:, held].all(0)]}"


@pytest.mark.parametrize("pattern, sees_all_held", [
    (sa.Local(4095, 0) | sa.Sink(first=4), True),
    (sa.Local(7) & sa.Causal(), True),
    (sa.Global(first=2) | sa.Local(5, 0), True),
    (sa.Local(4) & sa.Local(9), True),
    (sa.PerHead([sa.Local(3, 0) | sa.Sink(first=1), sa.Sink(first=1) | sa.Local(3, 1)]), True),
    (sa.Sink(first=4), False),                                       # holds the new token, which it does not attend
    (sa.Local(2, block_size=4), False),                              # a block window: not every key of it
    (sa.Dilated(3, 2), False),
    (sa.Stride(4) & sa.Local(6), False),
    (sa.Local(3) | sa.Sink(first=1) | sa.Local(9, block_size=2), False),  # the largest window is a block one
    (sa.PerHead([sa.Local(3), sa.Local(3) | sa.Sink(first=1)]), False),   # head 0 misses head 1's sink
    ((sa.Local(3) | sa.Sink(first=1)) & (sa.Local(3) | sa.Sink(first=2)), False),
    ((sa.Global(first=2) | sa.Local(5, 0)) & sa.Local(3, 0), False),     # holds the larger window: rows to come
])
def test_sees_all_held(pattern, sees_all_held):
    assert retention(pattern).sees_all_held == sees_all_held


@pytest.mark.parametrize("pattern, bounded, fixed, window, dense_until", [
    (sa.Local(4095, 0) | sa.Sink(first=4), True, (0, 1, 2, 3), 4095, -1),
    (sa.Local(7) & sa.Causal(), True, (), 7, -1),
    (sa.Local(2, block_size=4), True, (), 11, -1),
    (sa.Global(first=2) | sa.Local(5, 0), True, (0, 1), 5, 1),
    (sa.Dilated(3, 2), True, (), 6, -1),
    (sa.Local(4) & sa.Local(9), True, (), 4, -1),
    (sa.Stride(4) & sa.Local(6), True, (), 6, -1),
    (sa.Causal(), False, (), 0, -1),
])
def test_fields(pattern, bounded, fixed, window, dense_until):
    r = retention(pattern)
    assert (r.bounded, r.dense_until) == (bounded, dense_until)
    if bounded:
        assert (r.fixed, r.window, r.reason) == (fixed, window, "")


@pytest.mark.parametrize("pattern, part", [
    (sa.Local(8) | sa.Stride(4), "Stride(4)"),
    (sa.Dense(), "Dense()"),
    (sa.Random(2) | sa.Local(4), "Random(2)"),
    (~sa.Local(4), "~Local(4)"),
    (sa.Sink(period=8) | sa.Local(3), "Sink(period=8)"),
    (sa.Global(last=1) | sa.Local(3), "Global(last=1)"),
    (sa.Causal() & sa.Dense(), "Causal()"),
])
def test_unbounded_patterns_name_the_part(pattern, part):
    r = retention(pattern)
    assert not r.bounded and part in r.reason
    if not r.exact:                                          # no exact analysis: every key stays
        assert r.kept(50, 60).tolist() == list(range(60))


def test_sink_and_window_keeps_a_constant_set():
    r = retention(sa.Local(4095, 0) | sa.Sink(first=4))
    assert [len(r.kept(t, t)) for t in (4099, 10_000, 1_000_000)] == [4099] * 3


def test_heads_default_to_those_the_pattern_names():
    assert retention(sa.PerHead([sa.Local(1), sa.Local(2), sa.Sink(first=1)])).heads == 3
    assert retention(sa.Blocks(np.ones((2, 1, 1), dtype=bool), 64) | sa.Local(2)).heads == 2
    assert retention(sa.Local(2)).heads == 1


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="pattern must be a sparse_attn Pattern"):
        retention("Local(4)")
    with pytest.raises(ValueError, match="PerHead has 2 patterns but heads=3"):
        retention(sa.PerHead([sa.Local(1), sa.Dense()]), heads=3)
    with pytest.raises(ValueError, match="t must be >= 0"):
        retention(sa.Local(1)).kept(-1, 3)
