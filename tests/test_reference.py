"""The reference backend against torch SDPA with an explicit dense mask: values and gradients."""
import pytest
import torch
import torch.nn.functional as F

import sparse_attn as sa
from sparse_attn.backends import reference


def qkv(batch=2, q_heads=4, kv_heads=2, n_q=50, n_k=50, dim=16, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def make(h, n):
        return torch.randn(batch, h, n, dim, generator=gen, dtype=dtype).requires_grad_()

    return make(q_heads, n_q), make(kv_heads, n_k), make(kv_heads, n_k)


def sdpa_with_mask(q, k, v, mask):
    """Dense attention over ``mask`` (B or 1, H, n_q, n_k); rows with no key give 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return torch.where(mask.any(-1, keepdim=True), out, 0.0)


def assert_same_values_and_grads(q, k, v, pattern, mask, **kwargs):
    ours = sa.sparse_attention(q, k, v, pattern, backend="reference", **kwargs)
    theirs = sdpa_with_mask(q, k, v, mask)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-10)
    grad = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad)
    theirs_grads = torch.autograd.grad(theirs, (q, k, v), grad)
    for name, a, b in zip("qkv", ours_grads, theirs_grads):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-10, msg=f"d{name}")


PATTERNS = [sa.Local(5), sa.Local(3, 0) | sa.Global(first=2), sa.Stride(4) | sa.Local(1), sa.bigbird(block=8),
            sa.Dilated(3, 2) & sa.Causal(), sa.Dense()]


@pytest.mark.parametrize("pattern", PATTERNS, ids=repr)
@pytest.mark.parametrize("n_q, n_k", [(50, 50), (37, 61), (1, 1), (64, 64)])
def test_matches_sdpa(pattern, n_q, n_k):
    q, k, v = qkv(n_q=n_q, n_k=n_k)
    assert_same_values_and_grads(q, k, v, pattern, pattern.mask(n_q, n_k, heads=4)[None])


def test_padding_and_per_example_globals():
    q, k, v = qkv(batch=3)
    padding = torch.arange(50)[None, :] >= torch.tensor([[50], [31], [7]])
    global_mask = torch.zeros(3, 50, dtype=torch.bool)
    global_mask[0, [0, 20]] = True
    global_mask[1, 5] = True
    pattern = sa.Local(2)
    mask = pattern.mask(50, heads=4)[None] | global_mask[:, None, :, None] | global_mask[:, None, None, :]
    mask = mask & ~padding[:, None, None, :]
    assert_same_values_and_grads(q, k, v, pattern, mask, key_padding_mask=padding, global_mask=global_mask)


def test_empty_rows_give_zero_output_minus_inf_lse_and_zero_grads():
    q, k, v = qkv(batch=1, n_q=20, n_k=20)
    padding = torch.zeros(1, 20, dtype=torch.bool)
    padding[0, :10] = True                                             # rows 0..6 only see keys 0..9
    out, lse = sa.sparse_attention(q, k, v, sa.Local(3, 0), key_padding_mask=padding, backend="reference",
                                   return_lse=True)
    empty = torch.arange(20) < 10
    assert (out[0, :, empty] == 0).all() and torch.isinf(lse[0, :, empty]).all() and (lse[0, :, empty] < 0).all()
    assert torch.isfinite(lse[0, :, ~empty]).all()
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[0, :, empty] == 0).all()


def test_lse_is_the_log_sum_exp_of_allowed_scores():
    q, k, v = qkv(batch=1, q_heads=2, kv_heads=2, n_q=30, n_k=30)
    pattern = sa.Local(4) | sa.Global(first=1)
    _, lse = sa.sparse_attention(q, k, v, pattern, backend="reference", return_lse=True, scale=0.3)
    scores = (q @ k.transpose(-1, -2)) * 0.3
    expected = scores.masked_fill(~pattern.mask(30, heads=2)[None], float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, expected)


def test_chunked_evaluation_equals_one_chunk(monkeypatch):
    q, k, v = qkv(n_q=100, n_k=100)
    pattern = sa.Local(7) | sa.Global(first=1)
    whole = sa.sparse_attention(q, k, v, pattern, backend="reference")
    monkeypatch.setattr(reference, "_SCORES_PER_CHUNK", 1)             # one query block at a time
    chunked = sa.sparse_attention(q, k, v, pattern, backend="reference")
    torch.testing.assert_close(chunked, whole, atol=0, rtol=0)
    assert_same_values_and_grads(q, k, v, pattern, pattern.mask(100, heads=4)[None])


def test_half_precision_inputs_keep_their_dtype():
    q, k, v = (t.detach().to(torch.bfloat16) for t in qkv())
    out, lse = sa.sparse_attention(q, k, v, sa.Local(4), backend="reference", return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_non_contiguous_inputs():
    q, k, v = qkv()
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert not qt.is_contiguous()
    assert_same_values_and_grads(qt, k, v, sa.Local(3), sa.Local(3).mask(50, heads=4)[None])


@pytest.mark.slow
def test_gradcheck():
    q, k, v = qkv(batch=1, q_heads=2, kv_heads=1, n_q=9, n_k=11, dim=4)
    pattern = sa.Local(2) | sa.Global(first=1)
    assert torch.autograd.gradcheck(
        lambda q, k, v: sa.sparse_attention(q, k, v, pattern, backend="reference"), (q, k, v))
