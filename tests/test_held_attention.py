"""held_attention: a decode step's dense attention over a cache's held keys equals masked softmax in float64, with
GQA, per-head masks, rows with no key, keys shared by the batch and the score modifiers; and a SparseKVCache
decode step on the numba backend takes it (no layout per step)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_attn as sa
from sparse_attn.held_attention import dense_attention, held_mask
from sparse_attn.kv_cache import SparseKVCache
from sparse_attn.rules import Context, resolve
from sparse_attn.score_mods import ScoreMods, alibi_bias
from tests.strategies import patterns_for
from tests.tolerance import FLOORS, assert_within_rule


def oracle(q, k, v, mask, scale, softcap=0.0, bias=None):
    """Masked softmax, every query head against its key/value head (h // G): (out, lse) in q's dtype."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))         # (B or 1, Hq, m, D)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.expand(q.shape[0], -1, -1, -1)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores if bias is None else scores + bias
    scores = scores.masked_fill(~mask, -torch.inf)
    lse = torch.logsumexp(scores, -1)
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("bhqk,bhkd->bhqd", weights, v.expand(q.shape[0], -1, -1, -1)), lse


def inputs(dtype=torch.float64, batch=2, kv_batch=2, rows=3, keys=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 6, rows, 16, generator=g, dtype=torch.float64)                    # (B, Hq, n, D)
    k, v = (torch.randn(kv_batch, 2, keys, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(batch, 6, rows, keys, generator=g) < 0.5                               # per example, head
    mask[0, 1, 2] = False                                                                      # a row with no key
    return q, k, v, mask


@pytest.mark.parametrize("kv_batch", [1, 2])
@pytest.mark.parametrize("with_lse", [False, True])
def test_masked_rows_equal_the_oracle_float64(kv_batch, with_lse):
    q, k, v, mask = inputs(kv_batch=kv_batch)
    out, lse = dense_attention(q, k, v, mask, 0.25, return_lse=with_lse)
    want_out, want_lse = oracle(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    assert not out[0, 1, 2].any()                                                             # no key: 0
    if with_lse:
        torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)
        assert lse[0, 1, 2] == -torch.inf
    else:
        assert lse is None


def test_a_mask_shared_by_the_heads_and_no_mask():
    q, k, v, mask = inputs()
    shared = mask[:1, :1]                                                                     # (1, 1, n, m)
    torch.testing.assert_close(dense_attention(q, k, v, shared, 0.25)[0],
                               oracle(q, k, v, shared.expand(2, 6, -1, -1), 0.25)[0], atol=1e-12, rtol=1e-12)
    everything = torch.ones_like(mask)
    torch.testing.assert_close(dense_attention(q, k, v, None, 0.25)[0], oracle(q, k, v, everything, 0.25)[0],
                               atol=1e-12, rtol=1e-12)


def test_softcap_and_alibi_equal_the_oracle_float64():
    q, k, v, mask = inputs()
    slopes = torch.rand(2, 6, dtype=torch.float64)                                           # (B, Hq)
    query_pos, key_pos = torch.tensor([50, 51, 52]), torch.cat([torch.arange(4), torch.arange(20, 53)])
    out, lse = dense_attention(q, k, v, mask, 0.25, ScoreMods(softcap=3.0, alibi_slopes=slopes), query_pos, key_pos)
    want_out, want_lse = oracle(q, k, v, mask, 0.25, 3.0, alibi_bias(slopes, query_pos, key_pos))
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mods", [False, True])
def test_float32_and_bfloat16_within_the_tolerance_rule(dtype, mods):
    q, k, v, mask = inputs(keys=300)
    score_mods = ScoreMods(softcap=3.0) if mods else ScoreMods()
    out, _ = dense_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, 0.25, score_mods)
    assert out.dtype == dtype
    want = oracle(q, k, v, mask, 0.25, score_mods.softcap)[0]
    baseline = oracle(*(t.to(dtype) for t in (q, k, v)), mask, 0.25, score_mods.softcap)[0]
    assert_within_rule("out", out, want, baseline, FLOORS[dtype])


def test_held_mask_is_the_rule_at_the_held_positions_or_none():
    pattern = sa.Local(3, 0) | sa.Sink(first=2)
    rules = [resolve(pattern, Context(2, 100, 0))]
    held = np.array([0, 1, 95, 96, 97, 98, 99, 50])                                        # slot order, a stale key
    mask = held_mask(rules, np.array([98, 99]), held)
    assert mask.shape == (1, 2, 8)
    assert mask[0].astype(int).tolist() == [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1, 1, 0]]
    assert held_mask(rules, np.array([99]), held[:-1][[0, 1, 3, 4, 5, 6]]) is None           # all allowed
    assert not held_mask(rules, np.array([-1]), np.array([-3, -2, 0])).any()                  # padding positions


@settings(max_examples=150, deadline=None)
@given(pattern=patterns_for(3, 120), runs=st.lists(st.tuples(st.integers(0, 119), st.integers(1, 40)), min_size=1,
                                                   max_size=4))
def test_held_mask_is_none_exactly_where_the_rule_allows_every_pair(pattern, runs):
    """Runs of consecutive held positions in any slot order (fixed tokens, a ring that wrapped, duplicates): the
    mask is the rule's at those positions, and None exactly where it allows every pair."""
    rules = [resolve(pattern, Context(3, 120, 0))]
    held = np.concatenate([np.arange(start, min(start + length, 120)) for start, length in runs])
    queries = np.arange(117, 120)                                            # the step's 3 queries, bottom-right
    want = rules[0].allows(queries[:, None], held[None, :])
    mask = held_mask(rules, queries, held)
    assert (mask is None) == bool(want.all())
    assert mask is None or np.array_equal(mask[0], want)


def test_a_streaming_decode_step_on_numba_builds_no_layout():
    """The decode step reads the held keys once: no layout, no mask (every held key is allowed)."""
    cache = SparseKVCache(sa.Local(15, 0) | sa.Sink(first=4), backend="numba")
    x = torch.randn(1, 2, 40, 8, dtype=torch.float64)
    cache.attend(x.repeat(1, 2, 1, 1), x, x)                                                # prefill: its layout
    kept = dict(cache._layouts)
    for _ in range(30):
        x = torch.randn(1, 2, 1, 8, dtype=torch.float64)
        keys, values, positions = cache.update(x, x)
        assert cache._held_mask(4, positions.numpy()) is None
        cache.attention(x.repeat(1, 2, 1, 1), keys, values, positions)
    assert cache._layouts == kept
