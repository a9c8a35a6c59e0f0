"""SparseKVCache.select_examples: beam search's reordering and expansion of the batch, exact across eviction."""
import numpy as np
import pytest
import torch

import sparse_attn as sa
from sparse_attn.kv_cache import SparseKVCache
from tests.test_kv_cache import BOUNDED, STARTS, W, _state

PATTERNS = [BOUNDED[0], BOUNDED[2], sa.Local(W - 1, 0) | sa.Sink(tokens=(5, 9))]


def _expected(pattern, q, k, v, starts, t0):
    """Rows of the new queries q (B, Hq, n, D) at positions t0.. over each example's full past k, v (B, Hkv, t, D)
    from its start, by the reference backend in float64; 0 before the start."""
    out = torch.zeros_like(q)
    for b, s in enumerate(starts.tolist()):
        first, end = max(t0, s), k.shape[2]
        if end > s:
            out[b, :, first - t0:] = sa.sparse_attention(q[b:b + 1, :, first - t0:], k[b:b + 1, :, s:end],
                                                         v[b:b + 1, :, s:end], pattern, backend="reference")[0]
    return out


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("pattern", PATTERNS, ids=repr)
def test_selected_examples_continue_exactly(pattern, backend):
    """A left-padded batch expanded into beams after the prefill, the beams reordered at every step (as beam
    search does), then the example that starts at 5 dropped: each row equals attention over its own full past."""
    g = torch.Generator().manual_seed(7)
    cache = SparseKVCache(pattern, backend=backend)
    cache.set_starts(STARTS)
    starts = torch.tensor(STARTS)
    k = v = torch.zeros(3, 2, 0, 8, dtype=torch.float64)                       # each row's full past (B, Hkv, t, D)
    for step, size in enumerate([13] + [1] * 30):
        if step == 1:
            index = torch.arange(3).repeat_interleave(2)                        # 3 examples -> 2 beams each
        elif step == 20:
            index = torch.tensor([5, 4, 0, 1])                                  # the rows that start at 5 go
        else:
            index = torch.randint(0, 2, (len(starts),), generator=g) + torch.arange(len(starts)) // 2 * 2
        if step:
            cache.select_examples(index)
            k, v, starts = k[index], v[index], starts[index]
        q, new_k, new_v = (torch.randn(len(starts), h, size, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
        t0 = k.shape[2]
        k, v = torch.cat([k, new_k], 2), torch.cat([v, new_v], 2)
        out = cache.attend(q, new_k, new_v)
        assert (out - _expected(pattern, q, k, v, starts, t0)).abs().max().item() <= 1e-12, step
    assert cache.starts.tolist() == starts.tolist() == [11, 11, 0, 0] and cache.batch == 4
    fixed = {p + s for p in cache.retention.fixed for s in (0, 11)}
    assert set(cache.positions.tolist()) == fixed | set(range(k.shape[2] - W, k.shape[2]))  # start 5's sinks gone


def test_a_bad_index_changes_nothing():
    pattern, g = sa.Local(3, 0) | sa.Sink(first=1), torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, h, 9, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    cache = SparseKVCache(pattern, backend="reference")
    cache.select_examples([0, 0])                                       # nothing held yet: nothing to select
    assert cache.batch is None and cache.seq_len == 0
    cache.attend(q[:, :, :8], k[:, :, :8], v[:, :, :8])
    before = _state(cache)
    for index in ([2], [-1], [0.0], [[0, 1]], [], torch.tensor([True, False])):
        with pytest.raises(ValueError, match=r"index must be ints in 0 \.\. 1 of shape \(n,\) with n >= 1 \(the "
                                             r"examples of this cache's batch of 2 to keep, in order\), got"):
            cache.select_examples(index)
        assert _state(cache) == before
    cache.select_examples(np.array([1]))
    out = cache.attend(q[1:, :, 8:], k[1:, :, 8:], v[1:, :, 8:])
    assert (out - sa.sparse_attention(q[1:, :, 8:], k[1:], v[1:], pattern, backend="reference")).abs().max() <= 1e-12


def test_starts_alone_are_selected_before_the_first_update():
    cache = SparseKVCache(sa.Local(3, 0) | sa.Sink(first=1), backend="reference")
    cache.set_starts([0, 3])
    cache.select_examples(torch.tensor([1, 1, 0]))
    assert cache.batch == 3 and cache.starts.tolist() == [3, 3, 0]
