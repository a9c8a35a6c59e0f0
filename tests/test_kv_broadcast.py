"""K/V batch broadcast: q (B, Hq, Nq, D) with k, v (1, Hkv, Nk, D), one k, v read by every example.

Every backend is compared with the float64 reference run on k and v explicitly expanded to batch B
(``k.expand(B, ...)``), whose autograd sums dk and dv over the batch: values, lse, dq, dk, dv.
"""
from __future__ import annotations

import pytest
import torch

import sparse_attn as sa
from sparse_attn.api import sparse_attention

from .tolerance import assert_within_rule

# name: (B, Hq, Hkv, n_q, n_k, D, pattern, causal, padded keys, globals per example)
CASES = {
    "mha": (3, 2, 2, 70, 70, 16, sa.Local(10) | sa.Global(first=2), False, 0, 0),
    "gqa-causal": (2, 4, 2, 80, 80, 16, sa.Local(20) | sa.Sink(first=3), True, 0, 0),
    "mqa": (3, 4, 1, 64, 64, 8, sa.Local(8) | sa.Stride(9), False, 0, 0),
    "nq<nk-shared-prefix": (2, 2, 1, 30, 100, 16, sa.Local(40) | sa.Sink(first=4), True, 0, 0),
    "nq>nk-empty-rows": (2, 2, 2, 60, 25, 16, sa.Dense(), True, 0, 0),
    "key-padding": (3, 2, 1, 50, 50, 16, sa.Local(12), False, 20, 0),
    "per-example-globals": (2, 4, 2, 90, 90, 16, sa.Local(6), False, 0, 3),
    "padding-and-globals": (3, 2, 2, 72, 72, 16, sa.Local(5) | sa.Random(1, seed=2, block_size=16), False, 30, 2),
    "B=1": (1, 2, 1, 60, 60, 16, sa.Local(10) | sa.Global(first=1), False, 0, 0),
}
# The rest (GQA and MQA, n_q != n_k, padding, globals, causal, each with one k, v): tests/test_conformance.py's
# kv-broadcast, nq<nk and nq>nk shapes.
OUTSIDE_THE_MATRIX = ["mha", "padding-and-globals", "B=1"]


def make_case(name, dtype=torch.float64, block_size=16):
    """q (B, ...), k, v (1, ...) in ``dtype`` and the layout (batch B where a mask is per example)."""
    batch, hq, hkv, n_q, n_k, dim, pattern, causal, padded, n_global = CASES[name]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, hq, n_q, dim, generator=gen, dtype=torch.float64)   # (B, Hq, Nq, D)
    k = torch.randn(1, hkv, n_k, dim, generator=gen, dtype=torch.float64)      # (1, Hkv, Nk, D)
    v = torch.randn(1, hkv, n_k, dim, generator=gen, dtype=torch.float64)
    key_padding_mask = global_mask = None
    if padded:   # example b pads its last padded * b // (B - 1) keys: example 0 none, the last `padded`
        key_padding_mask = torch.zeros(batch, n_k, dtype=torch.bool)
        for b in range(batch):
            key_padding_mask[b, n_k - padded * b // max(batch - 1, 1):] = True
    if n_global:  # example b makes tokens b * 11 + (0, 29, 58, ...) global
        global_mask = torch.zeros(batch, n_q, dtype=torch.bool)
        for b in range(batch):
            global_mask[b, b * 11::29][:n_global] = True
    layout = pattern.layout(n_q, n_k, heads=hq, block_size=block_size, causal=causal,
                            key_padding_mask=key_padding_mask, global_mask=global_mask)
    return [t.to(dtype) for t in (q, k, v)], layout


def run(backend, q, k, v, layout, expand=False):
    """out, lse, dq, dk, dv of a loss through out and the finite lse; ``expand``: k, v expanded to
    q's batch first (the oracle), so their gradients are the sums over the batch."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    kk, vv = (t.expand(q.shape[0], -1, -1, -1) for t in (k, v)) if expand else (k, v)
    out, lse = sparse_attention(q, kk, vv, layout, backend=backend, return_lse=True)
    gen = torch.Generator().manual_seed(1)
    w_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device, out.dtype)
    w_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64).to(lse.device, lse.dtype)
    loss = (out * w_out).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * w_lse).sum()
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def assert_matches_oracle(backend, q, k, v, layout):
    """float64 inputs: equal to the expanded float64 reference to 1e-10; else within the tolerance rule
    (the baseline: the reference in the inputs' dtype, on expanded k, v)."""
    got = run(backend, q, k, v, layout)
    oracle = run("reference", *(t.double() for t in (q, k, v)), layout, expand=True)
    assert got[3].shape == k.shape and got[4].shape == v.shape                 # dk, dv: batch 1
    assert torch.equal(torch.isinf(got[1]), torch.isinf(oracle[1])), "lse: -inf rows differ"
    finite = torch.isfinite(oracle[1])
    got[1][~finite] = oracle[1][~finite] = 0
    names = ("out", "lse", "dq", "dk", "dv")
    if q.dtype == torch.float64:
        for name, a, b in zip(names, got, oracle):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=name)
        return
    baseline = run("reference", q, k, v, layout, expand=True)
    baseline[1][~finite] = 0
    for name, a, b, base in zip(names, got, oracle, baseline):
        assert a.dtype == (torch.float32 if name == "lse" else q.dtype), name
        assert_within_rule(name, a, b, base)


@pytest.mark.parametrize("name", OUTSIDE_THE_MATRIX)
@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_float64_matches_expanded_reference(backend, name):
    (q, k, v), layout = make_case(name)
    assert_matches_oracle(backend, q, k, v, layout)


@pytest.mark.parametrize("name", ["mha", "padding-and-globals"])
def test_numba_float32_within_tolerance_rule(name):
    (q, k, v), layout = make_case(name, torch.float32)
    assert_matches_oracle("numba", q, k, v, layout)


@pytest.mark.parametrize("name", ["padding-and-globals"])
def test_triton_within_tolerance_rule(name):
    """On the GPU, else Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU)."""
    pytest.importorskip("triton", reason='needs triton (its interpreter without a GPU): pip install ".[triton]"')
    device = "cuda" if torch.cuda.is_available() else "cpu"
    (q, k, v), layout = make_case(name, torch.float32)
    assert_matches_oracle("triton", *(t.to(device) for t in (q, k, v)), layout.to(device))


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_call_time_masks_take_the_batch_of_q(backend):
    """A Pattern with per-example key_padding_mask and global_mask: the layout is built for q's batch."""
    (q, k, v), _ = make_case("padding-and-globals")
    padding, globals_ = torch.zeros(3, 72, dtype=torch.bool), torch.zeros(3, 72, dtype=torch.bool)
    padding[2, 50:] = True
    globals_[1, [3, 40]] = True
    kwargs = dict(key_padding_mask=padding, global_mask=globals_, return_lse=True)
    out, lse = sparse_attention(q, k, v, sa.Local(5), backend=backend, **kwargs)
    ref_out, ref_lse = sparse_attention(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), sa.Local(5),
                                        backend="reference", **kwargs)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_prebuilt_layout_of_batch_1_is_shared(backend):
    """A layout built without per-example masks (batch 1) serves q of batch B and k, v of batch 1."""
    (q, k, v), _ = make_case("mqa")
    layout = (sa.Local(8) | sa.Stride(9)).layout(64, heads=4, block_size=16)
    assert layout.batch == 1
    assert_matches_oracle(backend, q, k, v, layout)


def test_numba_backward_is_deterministic():
    """Every example's dK/dV terms go into the rows of the task that owns them, in a fixed order."""
    (q, k, v), layout = make_case("gqa-causal", torch.float32)
    first, second = run("numba", q, k, v, layout), run("numba", q, k, v, layout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_numba_ops_opcheck_and_gradcheck():
    """The custom ops' fake (shape) implementations and autograd agree with the kernels on batch-1 k, v."""
    from sparse_attn.backends.numba import backend as numba_backend

    (q, k, v), layout = make_case("mqa")
    rest = (list(layout.index), layout.block_size, 0.25)
    torch.library.opcheck(numba_backend.numba_attention, (q, k, v, *rest))
    out, lse, stats, argmax = numba_backend.numba_attention(q, k, v, *rest)
    torch.library.opcheck(numba_backend.numba_attention_backward,
                          (torch.randn_like(out), q, k, v, out, lse, stats, argmax, torch.randn_like(lse), *rest))
    small = [t[..., :20, :4].clone().requires_grad_() for t in (q[:, :2], k[:, :1], v[:, :1])]
    small_layout = sa.Local(5).layout(20, heads=2, block_size=16, causal=True)
    assert torch.autograd.gradcheck(lambda q, k, v: sparse_attention(q, k, v, small_layout, backend="numba",
                                                                     return_lse=True), small)


def test_meta_tensors_give_shapes():
    q = torch.empty(3, 4, 20, 8, device="meta", requires_grad=True)
    k, v = (torch.empty(1, 2, 30, 8, device="meta", requires_grad=True) for _ in range(2))
    out, lse = sparse_attention(q, k, v, sa.Local(4), return_lse=True)
    assert out.shape == (3, 4, 20, 8) and lse.shape == (3, 4, 20)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == (1, 2, 30, 8) and v.grad.shape == (1, 2, 30, 8)


@pytest.mark.parametrize("k_batch, v_batch, message", [
    (2, 2, r"k must have batch 1 or 3 and head_dim 8 like q \(3, 2, 16, 8\), got shape \(2, 2, 16, 8\); "
           r"batch 1 shares one k, v with every example of q"),
    (1, 3, r"k and v must have the same batch \(both 1 to share them with every example of q, or both q's batch "
           r"3\), got k \(1, 2, 16, 8\) and v \(3, 2, 16, 8\)"),
    (3, 1, r"k and v must have the same batch .*got k \(3, 2, 16, 8\) and v \(1, 2, 16, 8\)"),
])
def test_batch_errors_name_the_shapes_and_the_fix(k_batch, v_batch, message):
    q = torch.randn(3, 2, 16, 8)
    k, v = torch.randn(k_batch, 2, 16, 8), torch.randn(v_batch, 2, 16, 8)
    with pytest.raises(ValueError, match=message):
        sparse_attention(q, k, v, sa.Local(2), backend="reference")
