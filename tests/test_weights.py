"""attention_weights(): the softmax probabilities of the allowed pairs, sparse, never N x N."""
import numpy as np
import pytest
import scipy.sparse
import torch

import sparse_attn as sa


def dense_probabilities(q, k, mask, scale=None):
    """The oracle: masked softmax over all pairs in float64; rows with no key are 0."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    scores = q.double() @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)   # (B, H, Nq, Nk)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


@pytest.mark.parametrize("pattern, n_q, n_k, heads, kv_heads", [
    (sa.Local(3) | sa.Global(first=1), 70, 70, 2, 2),                     # N not a multiple of the block
    (sa.preset("bigbird-itc"), 200, 200, 3, 1),                            # per-head random blocks, GQA
    (sa.Local(5, 0), 7, 40, 2, 2),                                          # Nq != Nk (bottom-right aligned)
    (sa.Stride(3) & sa.Local(0, 4), 1, 1, 1, 1),                            # N = 1
])
def test_matches_dense_softmax(pattern, n_q, n_k, heads, kv_heads):
    torch.manual_seed(0)
    q, k = torch.randn(2, heads, n_q, 16), torch.randn(2, kv_heads, n_k, 16)
    weights = sa.attention_weights(q, k, pattern, block_size=16)
    expected = dense_probabilities(q, k, pattern.mask(n_q, n_k, heads=heads)[None])
    assert len(weights) == 2 and all(len(row) == heads for row in weights)
    for b in range(2):
        for h in range(heads):
            w = weights[b][h]
            assert isinstance(w, scipy.sparse.csr_array) and w.shape == (n_q, n_k)
            np.testing.assert_allclose(w.toarray(), expected[b, h].numpy(), atol=1e-6)
            assert w.nnz == int(pattern.mask(n_q, n_k, heads=heads)[h].sum())


def test_rows_sum_to_one_and_empty_rows_are_empty():
    torch.manual_seed(0)
    q = k = torch.randn(1, 1, 50, 8)
    padding = torch.zeros(1, 50, dtype=torch.bool)
    padding[0, :10] = True
    w = sa.attention_weights(q, k, sa.Local(4, 0), key_padding_mask=padding)[0][0]   # rows 0..9 see only padding
    sums = w.sum(axis=1)
    np.testing.assert_allclose(sums[10:], 1.0, atol=1e-6)
    assert (np.diff(w.indptr)[:10] == 0).all() and (sums[:10] == 0).all()


def test_masks_causal_and_layout_agree_with_the_oracle():
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 40, 8).double(), torch.randn(2, 2, 40, 8).double()
    glob = torch.zeros(2, 40, dtype=torch.bool)
    glob[1, 5] = True
    pattern = sa.Local(2)
    weights = sa.attention_weights(q, k, pattern, causal=True, global_mask=glob, scale=0.5)
    layout = pattern.layout(40, heads=2, causal=True, global_mask=glob)
    expected = dense_probabilities(q, k, layout.to_dense(), scale=0.5)
    for b in range(2):
        assert weights[b][0].dtype == np.float64
        np.testing.assert_allclose(weights[b][1].toarray(), expected[b, 1].numpy(), atol=1e-12)
    from_layout = sa.attention_weights(q, k, layout, scale=0.5)
    np.testing.assert_array_equal(from_layout[1][0].toarray(), weights[1][0].toarray())


def test_long_sparse_input_stores_only_the_allowed_pairs():
    n = 16384                                   # a dense float32 N x N would be 1 GiB
    q = k = torch.randn(1, 1, n, 8)
    pattern = sa.Local(16) | sa.Global(first=1)
    w = sa.attention_weights(q, k, pattern)[0][0]
    assert w.nnz == pattern.layout(n).allowed_pairs()
    assert w.data.nbytes + w.indices.nbytes < 20 * 2**20
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-4)


@pytest.mark.parametrize("call, error, message", [
    (lambda q, k: sa.attention_weights(q[0], k, sa.Local(1)), ValueError,
     r"q must have shape \(batch, heads, seq_len, head_dim\), got \(2, 8, 4\)"),
    (lambda q, k: sa.attention_weights(q, k[:, :, :, :2], sa.Local(1)), ValueError, "k must have batch 1 and head_dim 4"),
    (lambda q, k: sa.attention_weights(q, k, "local"), TypeError, "pattern must be a sparse_attn Pattern"),
    (lambda q, k: sa.attention_weights(q, k, sa.Local(1), scale=0), ValueError, "scale must be a finite positive float"),
    (lambda q, k: sa.attention_weights(q, k, sa.Local(1).layout(8, heads=2), causal=True), ValueError,
     "part of a prebuilt BlockLayout"),
    (lambda q, k: sa.attention_weights(q, k, sa.Local(1), key_padding_mask=torch.zeros(1, 8)), TypeError,
     "key_padding_mask must be a torch.bool tensor"),
    (lambda q, k: sa.attention_weights(q.to("meta"), k.to("meta"), sa.Local(1)), ValueError,
     "attention_weights returns probabilities, which meta tensors do not have"),
])
def test_errors(call, error, message):
    q = k = torch.randn(1, 2, 8, 4)
    with pytest.raises(error, match=message):
        call(q, k)


def test_blocks_larger_than_the_sequence():
    q, k = torch.randn(1, 2, 30, 8), torch.randn(1, 2, 20, 8)
    pattern = sa.Local(3) | sa.Global(first=1)
    weights = sa.attention_weights(q, k, pattern, block_size=2**20)
    expected = dense_probabilities(q, k, pattern.mask(30, 20, heads=2)[None])
    np.testing.assert_allclose(weights[0][1].toarray(), expected[0, 1].numpy(), atol=1e-6)


def test_a_k_of_batch_1_is_shared_by_every_example():
    torch.manual_seed(0)
    q, k = torch.randn(3, 2, 20, 8, dtype=torch.float64), torch.randn(1, 1, 20, 8, dtype=torch.float64)
    pattern = sa.Local(3) | sa.Global(first=1)
    shared = sa.attention_weights(q, k, pattern)
    copied = sa.attention_weights(q, k.expand(3, -1, -1, -1), pattern)
    assert all((a != b).nnz == 0 for a, b in zip(np.ravel(shared), np.ravel(copied)))
