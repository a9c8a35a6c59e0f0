"""softcap, alibi_slopes and sinks everywhere a pattern runs outside ``sparse_attention`` itself (issue 27):
SparseSelfAttention, attention_weights, SparseKVCache decode (a step equals the full forward's row, ALiBi at
the tokens' positions after eviction, left padding) and the ALiBi alignment of key runs, each against the
float64 oracle of tests/score_mods_oracle.py."""
import itertools

import numpy as np
import pytest
import torch

import sparse_attn as sa
from sparse_attn.kv_cache import SparseKVCache
from sparse_attn.nn import SparseSelfAttention
from sparse_attn.score_mods import alibi_alignment
from tests.score_mods_oracle import oracle

DOUBLE = torch.float64


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DOUBLE)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=DOUBLE)


# --- SparseSelfAttention ---------------------------------------------------------------------------------
def split(t, heads):
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)                            # (B, H, N, D)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_layer_with_modifiers_equals_the_oracle(num_kv_heads):
    pattern = sa.Local(5, 0) | sa.Sink(first=2)
    layer = SparseSelfAttention(32, 4, pattern, num_kv_heads=num_kv_heads, softcap=4.0, alibi_slopes=SLOPES.tolist(),
                                sinks=True, backend="reference").double()
    with torch.no_grad():
        layer.sinks.copy_(randn(4, seed=1))
    x, padding = randn(2, 40, 32), torch.arange(40) >= torch.tensor([[40], [31]])
    out = layer(x, key_padding_mask=padding)
    q, k, v = split(layer.q_proj(x), 4), split(layer.k_proj(x), num_kv_heads), split(layer.v_proj(x), num_kv_heads)
    mask = torch.as_tensor(pattern.mask(40))[None] & ~padding[:, None, None, :]
    want, _ = oracle(q, k, v, mask, 8 ** -0.5, softcap=4.0, alibi_slopes=SLOPES, sinks=layer.sinks)
    want = layer.out_proj(want.masked_fill(padding[:, None, :, None], 0.0).transpose(1, 2).flatten(2))
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    grad = randn(*out.shape, seed=2)
    ours = torch.autograd.grad(out, [layer.sinks, layer.q_proj.weight], grad)
    theirs = torch.autograd.grad(want, [layer.sinks, layer.q_proj.weight], grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-10)
    assert ours[0].abs().min() > 0                                                  # the sinks learn


def test_global_projections_put_global_rows_at_their_positions_for_alibi():
    """Global rows through their own projections attend the whole sequence with ALiBi from their position."""
    layer = SparseSelfAttention(32, 4, sa.Local(2), global_projections=True, alibi_slopes=SLOPES,
                                backend="reference").double()
    x = randn(2, 30, 32)
    is_global = torch.zeros(2, 30, dtype=torch.bool)
    is_global[0, 12] = is_global[1, [3, 20]] = True
    out = layer(x, global_mask=is_global)
    q, k, v = (split(proj(x), 4) for proj in (layer.q_global_proj, layer.k_global_proj, layer.v_global_proj))
    rows, _ = oracle(q, k, v, torch.ones(30, 30, dtype=torch.bool), 8 ** -0.5, alibi_slopes=SLOPES)
    q, k, v = (split(proj(x), 4) for proj in (layer.q_proj, layer.k_proj, layer.v_proj))
    mask = torch.as_tensor(sa.Local(2).mask(30))[0] | is_global[:, None, :] | is_global[:, :, None]   # (B, N, N)
    ordinary, _ = oracle(q, k, v, mask[:, None], 8 ** -0.5, alibi_slopes=SLOPES)
    want = torch.where(is_global[:, None, :, None], rows, ordinary)
    torch.testing.assert_close(out, layer.out_proj(want.transpose(1, 2).flatten(2)), atol=1e-12, rtol=1e-10)


def test_layer_options_are_checked_and_shown():
    with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
        SparseSelfAttention(32, 4, sa.Local(2), softcap=-1.0)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(Hq,\) = \(4,\)"):
        SparseSelfAttention(32, 4, sa.Local(2), alibi_slopes=[0.5, 0.25])
    with pytest.raises(TypeError, match="alibi_slopes must be 4 floats"):
        SparseSelfAttention(32, 4, sa.Local(2), alibi_slopes="standard")
    with pytest.raises(TypeError, match="sinks must be a bool"):
        SparseSelfAttention(32, 4, sa.Local(2), sinks=torch.zeros(4))
    layer = SparseSelfAttention(32, 4, sa.Local(2), softcap=30.0, alibi_slopes=SLOPES, sinks=True)
    assert "softcap=30.0, alibi_slopes=..., sinks=True" in repr(layer)
    assert layer.alibi_slopes.dtype == torch.float32 and "alibi_slopes" in dict(layer.named_buffers())
    assert [name for name, _ in layer.named_parameters()].count("sinks") == 1


# --- attention_weights -----------------------------------------------------------------------------------
@pytest.mark.parametrize("softcap, slopes, sinks", itertools.product([None, 3.0], [False, True], [False, True]))
def test_attention_weights_equal_the_oracles_probabilities(softcap, slopes, sinks):
    """The oracle's probabilities: its output with the identity as values (row i, column j = P_ij)."""
    pattern = sa.Local(3) | sa.Global(first=1)
    q, k = randn(2, 4, 21, 8), randn(1, 2, 30, 8, seed=1)
    mods = {"softcap": softcap, "alibi_slopes": randn(2, 4, seed=2).abs() if slopes else None,
            "sinks": randn(4, seed=3) if sinks else None}
    weights = sa.attention_weights(q, k, pattern, block_size=16, **mods)
    identity = torch.eye(30, dtype=DOUBLE).expand(1, 2, 30, 30)
    probs, _ = oracle(q, k, identity, pattern.mask(21, 30), 8 ** -0.5, **mods)          # (2, 4, 21, 30)
    for b, h in itertools.product(range(2), range(4)):
        dense = torch.from_numpy(weights[b][h].toarray())
        torch.testing.assert_close(dense, probs[b, h], atol=1e-13, rtol=1e-10)
        assert weights[b][h].nnz == int(pattern.mask(21, 30).sum())


# --- SparseKVCache ---------------------------------------------------------------------------------------
BOUNDED = [sa.Local(7, 0) | sa.Sink(first=4), sa.Local(3, 2) | sa.Sink(tokens=(5, 9)),
           sa.Dilated(3, 2) | sa.Global(tokens=(20,))]
SCHEDULES = {"tokens": [1] * 40, "prefill": [13] + [1] * 27, "straddle": [7, 1, 9, 1, 1, 19, 1, 8, 1, 1, 5]}
MODS = {"all": dict(softcap=2.0, alibi_slopes=SLOPES[[0, 1, 1, 3]], sinks=randn(4, seed=5)),
        "alibi per example": dict(alibi_slopes=randn(2, 4, seed=6).abs()),
        "sinks": dict(sinks=randn(4, seed=7))}


def generate(cache, q, k, v, chunks, **mods):
    """The cache's (out, lse) over a generation in ``chunks``, and the oracle's rows over the full past."""
    outs, wants, start = [], [], 0
    for size in chunks:
        new, past = slice(start, start + size), slice(0, start + size)
        outs.append(cache.attend(q[:, :, new], k[:, :, new], v[:, :, new], return_lse=True, **mods))
        wants.append(oracle(q[:, :, new], k[:, :, past], v[:, :, past], cache.pattern.mask(size, start + size),
                            8 ** -0.5, **mods))
        start += size
    return [torch.cat(column, 2) for column in zip(*outs)], [torch.cat(column, 2) for column in zip(*wants)]


@pytest.mark.parametrize("mods", sorted(MODS))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("pattern", BOUNDED, ids=repr)
def test_a_decode_step_equals_the_full_forwards_row(pattern, schedule, mods):
    chunks = SCHEDULES[schedule]
    n = sum(chunks)
    q, k, v = randn(2, 4, n, 8), randn(2, 2, n, 8, seed=1), randn(2, 2, n, 8, seed=2)
    cache = SparseKVCache(pattern, backend="reference")
    (out, lse), (want_out, want_lse) = generate(cache, q, k, v, chunks, **MODS[mods])
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-10)
    assert len(cache.positions) < n                                                 # keys were evicted


@pytest.mark.parametrize("pattern", BOUNDED[:2], ids=repr)
def test_a_decode_step_on_numba_equals_the_full_forwards_row(pattern):
    """The runs of held positions through the Numba kernels' softcap and ALiBi (float64: their own dtype)."""
    chunks = SCHEDULES["straddle"]
    n = sum(chunks)
    q, k, v = randn(2, 4, n, 8), randn(2, 2, n, 8, seed=1), randn(2, 2, n, 8, seed=2)
    (out, lse), (want_out, want_lse) = generate(SparseKVCache(pattern, backend="numba"), q, k, v, chunks,
                                                **MODS["all"])
    torch.testing.assert_close(out, want_out, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=1e-8)


def test_a_left_padded_batch_with_modifiers_equals_each_sequence_alone():
    pattern, chunks, starts = sa.Local(7, 0) | sa.Sink(first=2), SCHEDULES["straddle"], [0, 5, 11]
    n = sum(chunks)
    q, k, v = randn(3, 4, n, 8), randn(3, 2, n, 8, seed=1), randn(3, 2, n, 8, seed=2)
    mods = dict(softcap=2.0, alibi_slopes=randn(3, 4, seed=3).abs(), sinks=randn(4, seed=4))
    cache = SparseKVCache(pattern, backend="reference")
    cache.set_starts(starts)
    (out, lse), _ = generate(cache, q, k, v, chunks, **mods)
    for b, s in enumerate(starts):
        alone = SparseKVCache(pattern, backend="reference")
        one = dict(mods, alibi_slopes=mods["alibi_slopes"][b])
        (_, _), (want_out, want_lse) = generate(alone, *(t[b:b + 1, :, s:] for t in (q, k, v)),
                                                _chunks_from(chunks, s), **one)
        torch.testing.assert_close(out[b:b + 1, :, s:], want_out, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(lse[b:b + 1, :, s:], want_lse, atol=1e-12, rtol=1e-10)
        assert not out[b, :, :s].any()                                               # padding rows: 0


def _chunks_from(chunks, start):
    """The chunk boundaries of a generation seen from ``start`` on."""
    ends = np.cumsum(chunks)
    cut = [int(e) - start for e in ends if e > start]
    return np.diff([0, *cut]).tolist()


def test_decode_modifiers_are_checked_before_the_update():
    cache = SparseKVCache(sa.Local(3, 0), backend="reference")
    x = randn(1, 4, 2, 8)
    cache.attend(x, x[:, :2], x[:, :2])
    with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
        cache.attend(x[:, :, :1], x[:, :2, :1], x[:, :2, :1], softcap=0.0)
    assert cache.seq_len == 2


# --- ALiBi's alignment of a run of keys ------------------------------------------------------------------
@pytest.mark.parametrize("n_q, n_k", [(1, 1), (1, 5), (4, 1), (3, 7), (6, 2)])
def test_alibi_alignment_gives_the_distance_of_every_pair(n_q, n_k):
    for query_start, key_start in itertools.product(range(12), range(12)):
        pad_keys, pad_rows, shift = alibi_alignment(query_start, n_q, key_start, n_k)
        offset = (n_k + pad_keys) - (n_q + pad_rows)                                 # the backend's n_k - n_q
        i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
        assert ((np.abs(i + offset - j) + shift) == np.abs((query_start + i) - (key_start + j))).all()
        assert pad_keys <= n_q + n_k and pad_rows <= n_q + n_k
