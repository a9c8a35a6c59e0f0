"""The Numba backend's bfloat16 matmuls (oneDNN brgemm through torch) against the float64 reference:
the DESIGN rule in bf16 (at most 2x the error of torch's own bf16 attention, plus a floor) on
values, lse, dq, dk and dv, on every case of test_numba_backend, and the pieces underneath."""
from __future__ import annotations

import doctest
import subprocess
import sys

import llvmlite.binding as llvm
import numpy as np
import pytest
import torch

import sparse_attn as sa
from sparse_attn.backends.numba import backend as numba_backend
from sparse_attn.backends.numba import bf16 as numba_bf16
from sparse_attn.backends.numba.panels import PANEL_KEYS

from .helpers import NUMBA_CASES as CASES
from .helpers import NUMBA_IDS as IDS
from .helpers import assert_agrees_row_by_row, case_inputs, flat_run, nonfinite_case, run_case
from .tolerance import assert_within_rule

NATIVE, WHY = numba_bf16.native()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"bf16 matmuls do not run here: {WHY}")


def _floor(oracle):
    """FlashAttention's floor for half precision (its tests' ``fwd_atol``): twice what rounding to bf16
    loses at the oracle's magnitude, ``(x + 0.3 - 0.3) - x`` in bf16. One bf16 rounding of a result
    can land a whole ulp from the true value when torch's lands half an ulp from it."""
    oracle = oracle.double()
    return 2 * ((oracle.bfloat16() + 0.3 - 0.3).double() - oracle).abs().max().item() if oracle.numel() else 0.0


def _within_rule(q, k, v, layout, scale=None):
    """numba on bf16 q, k, v against the float64 reference, allowed 2x torch's bf16 error (the
    reference backend computing in bf16) + _floor; returns numba's (out, lse, grads)."""
    got = run_case("numba", q, k, v, layout, scale=scale)
    base = run_case("reference", q, k, v, layout, scale=scale)
    oracle = run_case("reference", *(t.detach().double().requires_grad_() for t in (q, k, v)), layout, scale=scale)
    (out, lse, grads), (base_out, base_lse, base_grads), (oracle_out, oracle_lse, oracle_grads) = got, base, oracle
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert all(g.dtype == torch.bfloat16 for g in grads)
    assert torch.equal(torch.isinf(lse), torch.isinf(oracle_lse))
    finite = torch.isfinite(oracle_lse)
    assert_within_rule("out", out, oracle_out, base_out, _floor(oracle_out))
    assert_within_rule("lse", lse[finite], oracle_lse[finite], base_lse[finite], 1e-5)   # float32, as torch's
    for name, grad, base_grad, oracle_grad in zip(("dq", "dk", "dv"), grads, base_grads, oracle_grads):
        assert_within_rule(name, grad, oracle_grad, base_grad, _floor(oracle_grad))
    return got


@needs_native
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bf16_within_tolerance_rule(case):
    (q, k, v), layout = case_inputs(case, torch.bfloat16)
    assert numba_backend.bf16_matmuls(q, layout.block_size)
    _within_rule(q, k, v, layout)


@needs_native
@pytest.mark.parametrize("n", [1, 63, 65, 1000, PANEL_KEYS + 76])
def test_bf16_odd_and_ragged_lengths(n):
    """Odd lengths pad the packed operands with a zero row; blocks of 64 and panels of PANEL_KEYS keys."""
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, 2, n, 64, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    _within_rule(q, k, v, (sa.Local(300) | sa.Global(first=5)).layout(n, heads=2))


@needs_native
def test_bf16_matmuls_change_the_result():
    """The bf16 path runs (its rounding differs from computing in float32) and stays within the rule."""
    (q, k, v), layout = case_inputs(CASES[IDS.index("mqa-block64")], torch.bfloat16)
    bf16 = sa.sparse_attention(q, k, v, layout, backend="numba")
    as_float = sa.sparse_attention(q.float(), k.float(), v.float(), layout, backend="numba").bfloat16()
    assert not torch.equal(bf16, as_float)


@needs_native
def test_bf16_non_contiguous_and_deterministic():
    (q, k, v), layout = case_inputs(CASES[IDS.index("gqa")], torch.bfloat16)
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
    assert not qt.is_contiguous()
    first, second, plain = run_case("numba", qt, kt, vt, layout), run_case("numba", qt, kt, vt, layout), \
        run_case("numba", q, k, v, layout)
    for a, b, c in zip((first[0], first[1], *first[2]), (second[0], second[1], *second[2]),
                       (plain[0], plain[1], *plain[2])):
        assert torch.equal(a, b) and torch.equal(a, c)


@needs_native
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_bf16_non_finite_inputs_reach_exactly_what_meets_them(tensor, value):
    """Rows and keys that meet a NaN or inf go to the exact path, as in float32."""
    q, k, v, layout = nonfinite_case(torch.bfloat16)
    x = {"q": q, "k": k, "v": v}[tensor]
    x[0, 0, 60, 3] = value
    x[0, 0, 35, 5] = value
    out, lse, dq, dk, dv = assert_agrees_row_by_row(q, k, v, layout)
    assert not torch.isfinite(out).all()
    empty = slice(0, 40)
    assert (out[:, :, empty] == 0).all() and (lse[:, :, empty] == float("-inf")).all()
    assert (dq[:, :, empty] == 0).all() and (dk[:, :, empty] == 0).all() and (dv[:, :, empty] == 0).all()


@needs_native
def test_bf16_large_logits_within_rule():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 500, 64, generator=gen, dtype=torch.float64) for _ in range(3))
    q, k = q * 30, k * 30                                        # q . k / sqrt(64) has std ~900
    layout = (sa.Local(100) | sa.Global(first=3)).layout(500, heads=2)
    got, base = (flat_run(backend, *(t.bfloat16() for t in (q, k, v)), layout) for backend in ("numba", "reference"))
    oracle = flat_run("reference", *(t.bfloat16().double() for t in (q, k, v)), layout)
    for name, x, y, z in zip(("out", "lse", "dq", "dk", "dv"), got, base, oracle):
        assert_within_rule(name, x, z, y, 1e-5 if name == "lse" else _floor(z))


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")   # torch.backends.mkldnn.flags' own
def test_odd_head_dim_and_disabled_onednn_compute_in_float32():
    """brgemm reads pairs along the head dim; oneDNN off makes torch's brgemm raise: both run the
    float32 path, bitwise equal to float32 inputs."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 100, 15, generator=gen).bfloat16()
    layout = sa.Local(20).layout(100, heads=2)
    assert not numba_backend.bf16_matmuls(q, layout.block_size)
    out = sa.sparse_attention(q, q, q, layout, backend="numba")
    assert torch.equal(out, sa.sparse_attention(q.float(), q.float(), q.float(), layout, backend="numba").bfloat16())
    native_here = numba_bf16.native()[0]
    with torch.backends.mkldnn.flags(enabled=False):
        usable, reason = numba_bf16.native()
    assert not usable
    if native_here:  # a CPU with bf16 dot products: disabling oneDNN is what turns them off, and says so
        assert "oneDNN" in reason, reason


def test_available_says_which_path_bf16_takes():
    ok, reason = numba_backend.available()
    bf16 = reason.split("bfloat16: ")[1]
    assert ok and (("brgemm" in bf16) == NATIVE)
    assert ("float32: matmuls on oneDNN brgemm" in reason) == numba_bf16.float32_brgemm()[0]


def test_round_bf16_matches_torch():
    x = torch.tensor([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5e-40, 3.4e38, float("inf"), -float("inf"), float("nan"),
                      0.0, -0.0, 1e-45])
    x = torch.cat([x, torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e3])
    want = x.bfloat16().view(torch.int16).numpy().view(np.uint16)
    got = np.array([numba_bf16.round_bf16(np.float32(value)) for value in x.numpy()], np.uint16)
    nan = np.isnan(x.numpy())
    assert np.array_equal(got[~nan], want[~nan]) and (got[nan] == 0x7FC0).all()
    assert [numba_bf16.to_float(np.uint16(bits)) for bits in want[:3]] == [1.0, 1.0, 1 + 2 ** -6]


def test_store_rounds_into_bf16_once_and_copies_into_floats():
    """store (the kernels' last write of out, dk, dv): into bf16 bits, torch's rounding of each float32 value
    (ties to even, NaN kept); into float32 and float64, the values themselves."""
    src = (torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 1e3)
    src[0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, float("inf"), float("nan")])
    values = src.numpy()
    bits = np.zeros(values.shape, np.uint16)
    numba_bf16.store(bits, values)
    want = src.bfloat16().view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(values)
    assert np.array_equal(bits[~nan], want[~nan]) and (bits[nan] == 0x7FC0).all()
    for dtype in (np.float32, np.float64):
        copied = np.zeros(values.shape, dtype)
        numba_bf16.store(copied, values)
        assert np.array_equal(copied, values.astype(dtype), equal_nan=True)


def test_pairs_layouts():
    t = torch.arange(3 * 4, dtype=torch.float32).reshape(3, 4).bfloat16()      # (N=3, D=4)
    rows = numba_bf16.pairs(t)                                                  # (2, 4, 2)
    as_float = np.vectorize(lambda b: numba_bf16.to_float(np.uint16(b)))
    assert as_float(rows[0]).T.tolist() == t[:2].float().tolist() and as_float(rows[1, :, 1]).tolist() == [0] * 4
    cols = numba_bf16.pairs_t(t)                                                # (D/2=2, N'=256 + 16, 2)
    assert cols.shape == (2, numba_bf16.ROW_MULTIPLE + numba_bf16.SKEW, 2) and not cols[:, 3:].any()
    assert as_float(cols[:, :3]).transpose(1, 0, 2).reshape(3, 4).tolist() == t.float().tolist()


@pytest.mark.parametrize("n, dim", [(1, 64), (37, 24), (300, 2), (1000, 64)])
def test_pairs_t_moves_every_bit_through_the_tiles(n, dim):
    """The words of bf16 pairs (NaN and inf bits too) land transposed, bit for bit, whether in a full 16 x 16
    tile or in a ragged end of the keys or the head dim, and the padding is zero."""
    t = torch.randn(2, 3, n, dim, generator=torch.Generator().manual_seed(n)).bfloat16() * 1000
    t[0, 0, 0, 0], t[1, 2, -1, -1] = float("nan"), float("-inf")
    cols = numba_bf16.pairs_t(t)                                             # (2, 3, D/2, N', 2)
    words = t.contiguous().view(torch.int32).transpose(-1, -2)              # (2, 3, D/2, N)
    got = torch.from_numpy(cols.reshape(*cols.shape[:-1], 2).view(np.int32)[..., 0])
    assert torch.equal(got[..., :n], words) and not got[..., n:].any()


@pytest.mark.parametrize("n, dim", [(1, 64), (37, 24), (300, 2), (1000, 64)])
def test_pairs_moves_every_bit_into_its_pair(n, dim):
    """Rows 2r and 2r + 1 of t, NaN and inf bits too, land in pair r bit for bit; after an odd N the last pair's
    second row is zero."""
    t = torch.randn(2, 3, n, dim, generator=torch.Generator().manual_seed(n)).bfloat16() * 1000
    t[0, 0, 0, 0], t[1, 2, -1, -1] = float("nan"), float("-inf")
    packed = torch.from_numpy(numba_bf16.pairs(t).view(np.int16))                 # (2, 3, ceil(N/2), D, 2)
    rows = packed.transpose(-1, -2).reshape(2, 3, -1, dim)                      # (2, 3, 2 ceil(N/2), D)
    assert torch.equal(rows[..., :n, :], t.view(torch.int16)) and not rows[..., n:, :].any()


@needs_native
@pytest.mark.parametrize("m, n, k, first", [(64, 64, 64, 0), (7, 50, 34, 3), (1, 1, 2, 0), (64, 1024, 64, 10)])
def test_brgemm_matches_float32_products(m, n, k, first):
    """c (+)= a @ B[:, first:first + n] on row slices with row strides, B packed with pairs_t."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k + 3, generator=gen).bfloat16()
    b = torch.randn(first + n + 2, k, generator=gen).bfloat16()                # B.T (rows of B.T: N)
    c = torch.randn(m, n + 5, generator=gen)
    want = c[:, :n] + a[:, :k].float() @ b[first:first + n].float().T
    bt = torch.nn.functional.pad(b, (0, k % 2))                                # an even K for pairs_t
    packed = numba_bf16.pairs_t(bt)
    numba_bf16.brgemm(numba_bf16.bits(a)[:, :k], packed.reshape(-1)[first * 2:], packed.shape[1], c.numpy()[:, :n],
                      True)
    torch.testing.assert_close(c[:, :n], want, rtol=1e-5, atol=1e-4)


def test_brgemm_refuses_an_odd_k():
    """B is packed in pairs of rows; on AMX an odd K made brgemm read and write out of bounds."""
    a = np.zeros((4, 33), np.uint16)
    with pytest.raises(ValueError, match="even number of columns"):
        numba_bf16.brgemm(a, np.zeros(34 * 256, np.uint16), 256, np.zeros((4, 8), np.float32), False)


RELEASE_THEN_ONEDNN = """
import torch
from numba import njit
from sparse_attn.backends.numba import bf16 as numba_bf16

@njit
def release():
    numba_bf16.release_tiles(1)      # any bf16 operands: the overload only looks at the type

def product():
    a, b = torch.randn(64, 64).bfloat16(), torch.randn(64, 64).bfloat16()
    c = torch.empty(64, 64)
    packed = numba_bf16.pairs_t(b)
    numba_bf16.brgemm(numba_bf16.bits(a), packed.reshape(-1), packed.shape[1], c.numpy(), False)
    release()
    torch.testing.assert_close(c, a.float() @ b.float().T, rtol=1e-5, atol=1e-4)

product()
torch.randn(512, 2048).bfloat16() @ torch.randn(2048, 300).bfloat16()   # oneDNN: on AMX, configures and releases the tiles
product()
print("ok")
"""


@needs_native
def test_a_released_brgemm_survives_onednn_on_the_same_thread():
    """brgemm configures the AMX tiles only when the thread's kernel changes; a oneDNN matmul in between
    releases them. Without release_tiles the second product ran unconfigured tile instructions (SIGILL on
    AMX CPUs), in a subprocess so that a crash fails this test instead of ending the run."""
    done = subprocess.run([sys.executable, "-c", RELEASE_THEN_ONEDNN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


@needs_native
def test_opcheck_bf16():
    (q, k, v), layout = case_inputs(CASES[IDS.index("gqa")], torch.bfloat16)
    args = (list(layout.index), layout.block_size, 0.25)
    torch.library.opcheck(numba_backend.numba_attention, (q, k, v, *args))
    out, lse, stats, argmax = (t.detach() for t in numba_backend.numba_attention(q, k, v, *args))
    assert out.dtype == torch.bfloat16 and lse.dtype == stats.dtype == torch.float32
    torch.library.opcheck(numba_backend.numba_attention_backward,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, stats, argmax,
                           torch.randn_like(lse), *args))


def test_docstring_examples():
    result = doctest.testmod(numba_bf16, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


# ------------------------------------------------------------------------------------------------
# float32 on brgemm (bf16.float32_brgemm): the same kernels on float32 operands
# ------------------------------------------------------------------------------------------------
def test_float32_route_follows_the_variable_and_the_cpu(monkeypatch):
    monkeypatch.setenv(numba_bf16.FLOAT32_VARIABLE, "blas")
    assert numba_bf16.float32_brgemm() == (False, "SPARSE_ATTN_NUMBA_FLOAT32=blas")
    monkeypatch.setenv(numba_bf16.FLOAT32_VARIABLE, "fast")
    with pytest.raises(ValueError, match="SPARSE_ATTN_NUMBA_FLOAT32='fast'.*'brgemm'.*'blas'.*or unset it"):
        numba_bf16.float32_brgemm()
    monkeypatch.delenv(numba_bf16.FLOAT32_VARIABLE)
    usable, why = numba_bf16.float32_brgemm()
    avx512 = bool(llvm.get_host_cpu_features().get("avx512f"))
    assert usable == avx512 and ("AVX-512" in why)
    with torch.backends.mkldnn.flags(enabled=False):
        assert numba_bf16.float32_brgemm() == (False, "oneDNN is disabled (torch.backends.mkldnn.enabled)")


@pytest.mark.parametrize("n", [1, 100, 1000, 1037])
def test_transposed_scales_pads_and_zeroes(n):
    """alpha k.T, (..., D, N', 1): N' a multiple of ROW_MULTIPLE plus SKEW, zeros after the keys."""
    k = torch.randn(2, 3, n, 16, generator=torch.Generator().manual_seed(n))
    packed = numba_bf16.transposed(k, 0.75)
    width = -(-n // numba_bf16.ROW_MULTIPLE) * numba_bf16.ROW_MULTIPLE + numba_bf16.SKEW
    assert packed.shape == (2, 3, 16, width, 1) and packed.dtype == np.float32
    got = torch.from_numpy(packed[..., 0])
    assert torch.equal(got[..., :n], (0.75 * k).transpose(-1, -2)) and (got[..., n:] == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("rows, cols, out_rows", [(64, 512, 64), (64, 2048, 64), (63, 2047, 64), (5, 17, 8),
                                                  (1, 15, 2), (3, 16, 3), (4, 0, 4)])
def test_transpose_moves_every_value_and_zeroes_the_padding(dtype, rows, cols, out_rows):
    """out (W, R') = x.T, columns R.. of out 0: whole tiles of 8 rows by 16 columns, the rows and columns left
    over, and the padding, over what out held before (bf16 bits and float32)."""
    x = np.random.default_rng(cols).integers(1, 60000, (rows, cols)).astype(dtype)
    out = np.full((cols, out_rows), 7, dtype)
    numba_bf16.transpose(x, out)
    assert np.array_equal(out[:, :rows], x.T) and (out[:, rows:] == 0).all()


def test_transposed_is_float32_whatever_torchs_default_dtype():
    k = torch.randn(1, 1, 40, 16, dtype=torch.float32)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        packed = numba_bf16.transposed(k, 2.0)
    finally:
        torch.set_default_dtype(default)
    assert packed.dtype == np.float32 and np.array_equal(packed[0, 0, :, :40, 0], (2 * k[0, 0]).T.numpy())


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")   # torch.backends.mkldnn.flags' own
def test_float32_routes_run_their_own_operands(monkeypatch, float32_route):
    """The brgemm route transposes k (forward), q and dO (backward) for brgemm; the BLAS route reads them as
    they are. Both within the rule (test_numba_backend runs every float32 case on both)."""
    made = []
    transposed = numba_bf16.transposed
    monkeypatch.setattr(numba_bf16, "transposed", lambda t, alpha, buffer: made.append(tuple(t.shape)) or transposed(t, alpha, buffer))
    (q, k, v), layout = case_inputs(CASES[IDS.index("gqa")], torch.float32)
    run_case("numba", q, k, v, layout)
    assert made == ([tuple(k.shape), tuple(q.shape), tuple(q.shape)] if float32_route == "brgemm" else [])
