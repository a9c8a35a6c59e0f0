"""softcap, alibi_slopes and sinks in sparse_attention (issue 27): the reference backend against the float64
oracle of tests/score_mods_oracle.py (written from the formulas), every combination, values and gradients;
add_sink's edge cases; bad input."""
import math

import pytest
import torch

import sparse_attn as sa
from sparse_attn.score_mods import NO_MODS, ScoreMods, add_sink, check_mods
from tests.cases import DOUBLE, MODS, make, modifiers
from tests.cases import SCORE_MOD_CASES as CASES
from tests.score_mods_oracle import oracle

WITH_MODS = [mods for mods in MODS if mods != (None, None, False)]   # without any: tests/test_conformance.py


@pytest.mark.parametrize("softcap, slopes, sinks", WITH_MODS, ids=lambda m: str(m))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_reference_equals_the_oracle(case, softcap, slopes, sinks):
    c = case()
    batch, q_heads, kv_heads, n_q, n_k = c["shapes"]
    kv_batch = c.get("kv_batch", batch)
    q = make((batch, q_heads, n_q, 8), 0)
    k, v = make((kv_batch, kv_heads, n_k, 8), 1), make((kv_batch, kv_heads, n_k, 8), 2)
    mods = modifiers(softcap, slopes, sinks, batch, q_heads)
    out, lse = sa.sparse_attention(q, k, v, c["pattern"], backend="reference", return_lse=True, scale=0.7,
                                   **c["options"], **mods)
    want_out, want_lse = oracle(q, k, v, c["mask"], 0.7, **mods)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-10)
    inputs = [q, k, v] + ([mods["sinks"]] if sinks else [])
    g_out, g_lse = make(out.shape, 3, grad=False), make(lse.shape, 4, grad=False)
    ours = torch.autograd.grad(_loss(out, lse, g_out, g_lse), inputs)
    theirs = torch.autograd.grad(_loss(want_out, want_lse, g_out, g_lse), inputs)
    for name, a, b in zip(["dq", "dk", "dv", "dsinks"], ours, theirs):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-10, msg=name)


def _loss(out, lse, g_out, g_lse):
    """A random linear function of out and the finite lse (empty rows without sinks have lse -inf)."""
    finite = torch.isfinite(lse)
    return (out * g_out).sum() + (torch.where(finite, lse, 0.0) * g_lse).sum()


def test_empty_rows_return_zero_with_the_sink_as_lse():
    q, k, v = make((1, 2, 6, 4), 0), make((1, 2, 6, 4), 1), make((1, 2, 6, 4), 2)
    sinks = torch.tensor([0.5, -math.inf], dtype=DOUBLE, requires_grad=True)
    padding = torch.ones(1, 6, dtype=torch.bool)
    out, lse = sa.sparse_attention(q, k, v, sa.Local(2), key_padding_mask=padding, sinks=sinks, return_lse=True,
                                   backend="reference")
    assert out.abs().max() == 0
    assert lse[0, 0].eq(0.5).all() and lse[0, 1].eq(-math.inf).all()
    grads = torch.autograd.grad(out.sum() + lse[:, 0].sum(), (q, k, v, sinks))
    assert all(torch.isfinite(g).all() for g in grads)
    assert grads[3].tolist() == [6.0, 0.0]


def test_a_nan_sink_propagates_to_its_head_only():
    out, lse = add_sink(torch.ones(1, 2, 3, 4), torch.zeros(1, 2, 3), torch.tensor([math.nan, 0.0]))
    assert out[0, 0].isnan().all() and lse[0, 0].isnan().all()
    assert out[0, 1].eq(0.5).all() and torch.isfinite(lse[0, 1]).all()


def test_add_sink_keeps_half_outputs_half():
    out, lse = add_sink(torch.ones(1, 1, 2, 4, dtype=torch.bfloat16), torch.zeros(1, 1, 2), torch.zeros(1))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.eq(0.5).all()


def test_no_modifier_is_the_no_mods_singleton():
    q = torch.zeros(1, 2, 3, 4)
    assert check_mods(q) == (NO_MODS, None)
    assert check_mods(q)[0] is NO_MODS


def test_sinks_on_numba_equal_the_oracle():
    """Sinks join outside the kernels, so the Numba backend takes them as it is (float64: its own dtype)."""
    q, k, v = make((2, 4, 50, 16), 0), make((2, 2, 50, 16), 1), make((2, 2, 50, 16), 2)
    sinks = make((4,), 5)
    p = sa.Local(8) | sa.Global(first=2)
    out, lse = sa.sparse_attention(q, k, v, p, sinks=sinks, return_lse=True, backend="numba")
    want_out, want_lse = oracle(q, k, v, p.mask(50), 0.25, sinks=sinks)
    torch.testing.assert_close(out, want_out, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=1e-8)
    g = make(out.shape, 3, grad=False)
    ours = torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v, sinks))
    theirs = torch.autograd.grad((want_out * g).sum() + want_lse.sum(), (q, k, v, sinks))
    for name, a, b in zip(["dq", "dk", "dv", "dsinks"], ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-8, msg=name)


def test_meta_tensors_give_shapes_with_sinks():
    q = torch.empty(2, 4, 10, 8, device="meta", requires_grad=True)
    k = v = torch.empty(2, 2, 10, 8, device="meta")
    sinks = torch.empty(4, device="meta", requires_grad=True)
    out, lse = sa.sparse_attention(q, k, v, sa.Local(2), softcap=5.0, sinks=sinks, return_lse=True,
                                   alibi_slopes=torch.empty(4, device="meta"))
    assert out.shape == (2, 4, 10, 8) and lse.shape == (2, 4, 10) and out.device.type == "meta"
    assert torch.autograd.grad(lse.sum(), sinks)[0].shape == (4,)


def tensors(b=2, h=4, n=16, d=8):
    return torch.randn(b, h, n, d), torch.randn(b, 2, n, d), torch.randn(b, 2, n, d)


def call(**kwargs):
    return sa.sparse_attention(*tensors(), sa.Local(2), backend="reference", **kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"softcap": 0}, ValueError, r"softcap must be a finite float > 0 .*got 0; pass softcap=None for no capping"),
    ({"softcap": -1.0}, ValueError, "softcap must be a finite float > 0 .*got -1.0"),
    ({"softcap": math.inf}, ValueError, "softcap must be a finite float > 0 .*got inf"),
    ({"softcap": math.nan}, ValueError, "softcap must be a finite float > 0 .*got nan"),
    ({"softcap": "30"}, TypeError, r"softcap must be a float > 0 or None, got '30' \(str\)"),
    ({"softcap": True}, TypeError, r"softcap must be a float > 0 or None, got True \(bool\)"),
    ({"alibi_slopes": [0.5] * 4}, TypeError,
     r"alibi_slopes must be a torch.Tensor of shape \(Hq,\) = \(4,\) or \(B, Hq\) = \(2, 4\), got list"),
    ({"alibi_slopes": torch.ones(4, dtype=torch.int64)}, TypeError,
     "alibi_slopes must be a floating-point tensor, got torch.int64"),
    ({"alibi_slopes": torch.ones(3)}, ValueError,
     r"alibi_slopes must have shape \(Hq,\) = \(4,\) or \(B, Hq\) = \(2, 4\), one slope per query head .*got \(3,\)"),
    ({"alibi_slopes": torch.ones(3, 4)}, ValueError, r"alibi_slopes must have shape .*got \(3, 4\)"),
    ({"alibi_slopes": torch.tensor([0.5, math.inf, 0.1, 0.1])}, ValueError, "alibi_slopes must be finite, got inf"),
    ({"alibi_slopes": torch.tensor([0.5, 0.1, math.nan, 0.1])}, ValueError, "alibi_slopes must be finite, got nan"),
    ({"alibi_slopes": torch.tensor([0.5, 0.1, -2e30, 0.1])}, ValueError,
     r"alibi_slopes must be at most 1e\+30 in size .*got -2e\+30; ALiBi's slopes"),
    ({"alibi_slopes": torch.ones(4, requires_grad=True)}, ValueError,
     r"alibi_slopes get no gradient .* pass alibi_slopes.detach\(\)"),
    ({"alibi_slopes": torch.ones(4, device="meta")}, ValueError,
     r"alibi_slopes must be on q's device cpu, got meta; move it with alibi_slopes.to\(q.device\)"),
    ({"sinks": torch.zeros(3)}, ValueError, r"sinks must have shape \(Hq,\) = \(4,\), one logit per query head, got \(3,\)"),
    ({"sinks": torch.zeros(1, 4)}, ValueError, r"sinks must have shape \(Hq,\) = \(4,\).*got \(1, 4\)"),
    ({"sinks": torch.zeros(4, dtype=torch.int32)}, TypeError, "sinks must be a floating-point tensor, got torch.int32"),
    ({"sinks": 0.0}, TypeError, r"sinks must be a torch.Tensor of shape \(Hq,\) = \(4,\), got float"),
    ({"sinks": torch.zeros(4, device="meta")}, ValueError, "sinks must be on q's device cpu, got meta"),
])
def test_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        call(**kwargs)


def test_slopes_are_read_once_and_again_after_an_in_place_change(monkeypatch):
    """A layer's slopes on a GPU are not read (a host sync) at every call; a change in place is still caught."""
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    reads = []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: reads.append(t.shape) or real(t))
    for _ in range(3):
        call(alibi_slopes=slopes)
    assert len(reads) == 1
    slopes[2] = math.nan
    with pytest.raises(ValueError, match="alibi_slopes must be finite, got nan"):
        call(alibi_slopes=slopes)


def test_comparing_mods_never_compares_tensor_values():
    """``mods == NO_MODS`` is the backends' test: equal softcaps and the same slopes tensor, never values."""
    slopes = torch.ones(1, 4)
    assert ScoreMods(0.0, slopes) != NO_MODS and ScoreMods(0.0, slopes) == ScoreMods(0.0, slopes)
    assert ScoreMods(0.0, slopes) != ScoreMods(0.0, slopes.clone()) and ScoreMods() == NO_MODS
    assert len({ScoreMods(), NO_MODS}) == 1
