"""backend="auto" runs short float32 CPU calls as SDPA with the pattern's mask: the same attention as the kernels
(against the float64 reference, forward and backward, rows with no key included), and only where it is meant to."""
import logging

import pytest
import torch

import sparse_attn as sa
from sparse_attn.backends import sdpa
from sparse_attn.backends.numba import backend as numba_backend


def _inputs(batch=2, q_heads=4, kv_heads=2, n=100, dim=16, kv_batch=None, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, n, dim, generator=generator)
    k, v = (torch.randn(kv_batch or batch, kv_heads, n, dim, generator=generator) for _ in range(2))
    return q, k, v


def _grads(q, k, v, pattern, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = sa.sparse_attention(q, k, v, pattern, **kwargs)
    out.backward(torch.ones_like(out))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.fixture
def kernels_refused(monkeypatch):
    """Makes every numba kernel call fail: what runs is the SDPA route."""
    def refuse(*args, **kwargs):
        raise AssertionError("the kernels ran")
    monkeypatch.setattr(numba_backend, "attention", refuse)


CASES = {
    "longformer": dict(pattern=sa.Local(20) | sa.Global(first=2)),
    "per head, causal": dict(pattern=sa.PerHead([sa.Local(5), sa.Stride(7), sa.Local(30, 0), sa.Dense()]),
                             causal=True),
    "rows with no key": dict(pattern=sa.Global(tokens=(50,)) & sa.Causal()),
    "key padding": dict(pattern=sa.Local(9), key_padding_mask=torch.arange(100) >= torch.tensor([[100], [61]])),
    "documents": dict(pattern=sa.Local(9) | sa.Global(first=1), documents=sa.documents_from_lengths([[30, 70],
                                                                                                     [100, 0]])),
}


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("kv_batch", [None, 1], ids=["kv per example", "one kv"])
def test_the_sdpa_route_equals_the_reference(case, kv_batch, kernels_refused):
    q, k, v = _inputs(kv_batch=kv_batch)
    kwargs = dict(CASES[case])
    if kwargs.get("documents") is not None and kv_batch == 1:
        pytest.skip("documents take k, v per example")
    pattern = kwargs.pop("pattern")
    got = _grads(q, k, v, pattern, **kwargs)
    expected = _grads(q.double(), k.double(), v.double(), pattern, backend="reference", **kwargs)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=name)


def test_rows_with_no_key_are_zero_with_zero_gradients(kernels_refused):
    q, k, v = _inputs()
    out, dq, _, _ = _grads(q, k, v, sa.Global(tokens=(50,)) & sa.Causal())
    assert (out[:, :, :50] == 0).all() and (dq[:, :, :50] == 0).all() and out[:, :, 50:].abs().sum() > 0


def test_non_contiguous_inputs(kernels_refused):
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in _inputs(q_heads=2))
    assert not q.is_contiguous()
    torch.testing.assert_close(sa.sparse_attention(q, k, v, sa.Local(7)),
                               sa.sparse_attention(q, k, v, sa.Local(7), backend="reference"))


@pytest.mark.parametrize("why, call", [
    ("a backend named", lambda q: sa.sparse_attention(q, q, q, sa.Local(5), backend="numba")),
    ("softcap", lambda q: sa.sparse_attention(q, q, q, sa.Local(5), softcap=5.0)),
    ("ALiBi", lambda q: sa.sparse_attention(q, q, q, sa.Local(5), alibi_slopes=torch.ones(4))),
    ("sinks", lambda q: sa.sparse_attention(q, q, q, sa.Local(5), sinks=torch.zeros(4))),
    ("the lse asked for", lambda q: sa.sparse_attention(q, q, q, sa.Local(5), return_lse=True)),
    ("float64", lambda q: sa.sparse_attention(q.double(), q.double(), q.double(), sa.Local(5))),
    ("more pairs", lambda q: sa.sparse_attention(*(torch.randn(2, 4, 300, 16),) * 3, sa.Local(5))),
    ("a NaN", lambda q: sa.sparse_attention(q, q, q.index_fill(2, torch.tensor([99]), float("nan")), sa.Local(5))),
], ids=lambda x: x if isinstance(x, str) else "")
def test_other_calls_run_the_kernels(why, call, monkeypatch):
    ran = []
    attention = numba_backend.attention
    monkeypatch.setattr(numba_backend, "attention", lambda *args, **kwargs: ran.append(1) or attention(*args,
                                                                                                        **kwargs))
    call(torch.randn(2, 4, 100, 16))
    assert ran == [1], why


def test_the_threshold_counts_pairs_over_examples_and_heads(kernels_refused):
    n = 256
    q = torch.randn(1, 8, n, 16)
    assert q.shape[0] * q.shape[1] * n * n == sdpa.MAX_PAIRS
    sa.sparse_attention(q, q, q, sa.Local(5))                                  # at the threshold: SDPA
    with pytest.raises(AssertionError, match="the kernels ran"):
        sa.sparse_attention(torch.randn(2, 8, n, 16), *(torch.randn(2, 8, n, 16),) * 2, sa.Local(5))


def test_the_route_taken_is_logged_at_debug(caplog, kernels_refused):
    q = torch.randn(1, 2, 64, 16)
    with caplog.at_level(logging.DEBUG, logger="sparse_attn.dispatch"):
        sa.sparse_attention(q, q, q, sa.Local(5))
    assert "backend='auto': SDPA with the pattern's mask (8192 query/key pairs; SDPA at most 524288)" in caplog.text
