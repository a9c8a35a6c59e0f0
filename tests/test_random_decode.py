"""Random never depends on the sequence length (issue 23, item 6): a generation through the KV cache gives, at
every position, the row the full forward pass over a longer sequence gives there."""
import warnings

import pytest
import torch

import sparse_attn as sa
from sparse_attn.kv_cache import SparseKVCache

CAUSAL_RANDOM = [
    sa.Random(2) & sa.Causal(),
    (sa.Local(16, 0) | sa.Sink(first=4) | sa.Random(2, seed=3, block_size=32)) & sa.Causal(),
    (sa.Local(1, block_size=32) | sa.Global(first=32) | sa.Random(3, seed=1, block_size=32)) & sa.Causal(),
]
TRAINING_LENGTH = 1024
CHUNKS = [100, 155, 1, 255, 1, 487, 1, 24]  # a prefill, chunks, and single steps at positions 255, 511 and 999


def inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for _ in "qkv"]   # (B, H, N, D)


@pytest.mark.parametrize("pattern", CAUSAL_RANDOM, ids=repr)
def test_decoding_gives_the_rows_of_the_full_forward(pattern):
    q, k, v = inputs(TRAINING_LENGTH)
    full = sa.sparse_attention(q, k, v, pattern, backend="reference")                     # (1, 2, N, 8)
    cache, start, outs = SparseKVCache(pattern, backend="reference"), 0, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                       # Random reaches every past key: the cache says so
        for size in CHUNKS:
            new = slice(start, start + size)
            outs.append(cache.attend(q[:, :, new], k[:, :, new], v[:, :, new]))
            start += size
    assert start == TRAINING_LENGTH
    assert (torch.cat(outs, 2) - full).abs().max().item() <= 1e-12


@pytest.mark.parametrize("n", [256, 512, 1000])
@pytest.mark.parametrize("pattern", CAUSAL_RANDOM, ids=repr)
def test_a_decode_step_equals_the_last_row_of_the_full_forward_and_of_any_longer_one(pattern, n):
    q, k, v = inputs(TRAINING_LENGTH, seed=n)
    step = sa.sparse_attention(q[:, :, n - 1:n], k[:, :, :n], v[:, :, :n], pattern, backend="reference")
    for length in (n, TRAINING_LENGTH):
        full = sa.sparse_attention(q[:, :, :length], k[:, :, :length], v[:, :, :length], pattern, backend="reference")
        assert (step[:, :, 0] - full[:, :, n - 1]).abs().max().item() <= 1e-12, length


def test_a_decode_step_with_causal_true_equals_the_training_row():
    """The Hugging Face route: a non-causal pattern with causal=True at call time."""
    pattern, (q, k, v) = sa.Local(16) | sa.Random(2, seed=7, block_size=32), inputs(TRAINING_LENGTH, seed=1)
    full = sa.sparse_attention(q, k, v, pattern, causal=True, backend="reference")
    for n in (256, 512, 1000):
        step = sa.sparse_attention(q[:, :, n - 1:n], k[:, :, :n], v[:, :, :n], pattern, causal=True,
                                   backend="reference")
        assert (step[:, :, 0] - full[:, :, n - 1]).abs().max().item() <= 1e-12, n
