"""The Numba CPU backend against the reference backend: values, lse and gradients."""
from __future__ import annotations

import ctypes
import doctest
import json
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch

import sparse_attn as sa
from sparse_attn.api import sparse_attention
from sparse_attn.backends import numba as numba_package
from sparse_attn.backends.numba import backend as numba_backend
from sparse_attn.backends.numba import backward, bundles, forward, lowlevel, mods, near_max, panels, schedule, workspace

from .helpers import NUMBA_CASES as CASES
from .helpers import NUMBA_IDS as IDS
from .helpers import OUTPUTS as _OUTPUTS
from .helpers import assert_agrees_row_by_row, case_inputs, flat_run, nonfinite_case, run_case
from .tolerance import assert_within_rule


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float64_matches_reference(case):
    (q, k, v), layout = case_inputs(case, torch.float64)
    out, lse, grads = run_case("numba", q, k, v, layout)
    ref_out, ref_lse, ref_grads = run_case("reference", q, k, v, layout)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=0)  # -inf where the reference has -inf
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(grad, ref, atol=1e-10, rtol=0, msg=name)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float32_within_tolerance_rule(case, float32_route):
    (q, k, v), layout = case_inputs(case, torch.float32)
    out, lse, grads = run_case("numba", q, k, v, layout)
    base_out, base_lse, base_grads = run_case("reference", q, k, v, layout)
    oracle_out, oracle_lse, oracle_grads = run_case("reference", *(t.detach().double().requires_grad_() for t in (q, k, v)),
                                                layout)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(oracle_lse))
    finite = torch.isfinite(oracle_lse)
    assert_within_rule("out", out, oracle_out, base_out)
    assert_within_rule("lse", lse[finite], oracle_lse[finite], base_lse[finite])
    for name, grad, base, oracle in zip(("dq", "dk", "dv"), grads, base_grads, oracle_grads):
        assert_within_rule(name, grad, oracle, base)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_non_finite_inputs_reach_exactly_what_meets_them(tensor, value, dtype, float32_route):
    """A NaN or inf at token 60 (in a full and in a partial block, next to pairs that causality
    masks inside computed tiles) and at token 35 (a padded key, an empty row) of one tensor. Before,
    a NaN query row gave out 0 and lse -inf as if empty, a NaN key was dropped, and the backward
    had no NaN where the reference has them."""
    q, k, v, layout = nonfinite_case(dtype)
    x = {"q": q, "k": k, "v": v}[tensor]
    x[0, 0, 60, 3] = value
    x[0, 0, 35, 5] = value
    out, lse, dq, dk, dv = assert_agrees_row_by_row(q, k, v, layout)
    assert not torch.isfinite(out).all()                                        # the value did reach something
    empty = slice(0, 40)                                   # empty rows and padded keys: 0, -inf, no gradient
    assert (out[:, :, empty] == 0).all() and (lse[:, :, empty] == float("-inf")).all()
    assert (dq[:, :, empty] == 0).all() and (dk[:, :, empty] == 0).all() and (dv[:, :, empty] == 0).all()


def _same_sign_rows(shape, magnitude, dtype, gen):
    """Rows of one sign each, |entries| >= magnitude / 2: the dot product of two of them overflows
    whatever the summation order (random signs would overflow or cancel depending on it)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64).abs() + 0.5
    sign = torch.randint(0, 2, (*shape[:-1], 1), generator=gen) * 2 - 1
    return (x * sign * magnitude).to(dtype)


@pytest.mark.parametrize("dtype, magnitude", [(torch.float32, 1e19), (torch.float64, 1e160)])
def test_overflowing_inputs_agree_with_the_reference(dtype, magnitude, float32_route):
    """Scores that overflow to +inf give NaN rows with lse +inf, rows whose every score is -inf are
    empty, as in the reference; inputs of magnitude 1e19 used to give all-zero float32 rows.
    First every score overflows, then those of 6 huge queries with 6 huge keys (other rows see the
    huge keys through finite logits of order magnitude)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, layout = nonfinite_case(dtype)
    q, k = (_same_sign_rows(t.shape, magnitude, dtype, gen) for t in (q, k))
    out, lse, *_ = assert_agrees_row_by_row(q, k, v * magnitude, layout)
    assert torch.isnan(out).any() and (lse == float("inf")).any() and (lse[:, :, 40:] == float("-inf")).any()
    q, k, v, layout = nonfinite_case(dtype)
    q[:, :, 70:76] = _same_sign_rows((1, 2, 6, 16), magnitude, dtype, gen)
    k[:, :, 60:66] = _same_sign_rows((1, 1, 6, 16), magnitude, dtype, gen)
    out, *_ = assert_agrees_row_by_row(q, k, v, layout)       # rows 80-95: huge but finite logits
    assert torch.isnan(out[:, :, 70:76]).any() and torch.isfinite(out[:, :, 80:]).all()


def test_huge_scale_backward_is_exact(float32_route):
    """scale=1e10 (Dense, N=64) makes every softmax one-hot: dv = the dO of the rows each key wins,
    and dq, dk come from the lse term alone, as torch computes them. The backward recomputes P from
    scores of order 1e11, where BLAS rounds the forward's and the backward's matmul shapes a few
    ulps apart (ulp 8192): dv was 3e37 where the exact value is 6, dq and dk were inf."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    layout = sa.Dense().layout(64, heads=2)
    got, base = (flat_run(backend, *(t.float() for t in (q, k, v)), layout, 1e10)
                 for backend in ("numba", "reference"))
    oracle = flat_run("reference", q, k, v, layout, 1e10)
    for name, x, y, z in zip(_OUTPUTS, got, base, oracle):
        assert_within_rule(name, x, z, y)


@pytest.mark.parametrize("pattern, n", [(sa.Dense(), 256), (sa.Local(100) | sa.Global(first=3), 1000)],
                         ids=["dense-256", "longformer-1000"])
def test_large_logits_backward_within_rule(pattern, n, float32_route):
    """Logits with std ~900 (float32): out, lse, dq, dk, dv within the tolerance rule against float64.
    Before, dv had 3e-3 against torch's 2e-5 (dense-256): BLAS rounds a score a few ulps apart in
    the backward's matmul shapes and the forward's, and exp2 makes that P's relative error (the
    lse's round trip through natural-log units came second)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 64, generator=gen, dtype=torch.float64) for _ in range(3))
    q, k = q * 900 ** 0.5, k * 900 ** 0.5                    # q . k / sqrt(64) has std 900
    layout = pattern.layout(n, heads=2)
    got, base = (flat_run(backend, *(t.float() for t in (q, k, v)), layout) for backend in ("numba", "reference"))
    oracle = flat_run("reference", q, k, v, layout)
    for name, x, y, z in zip(_OUTPUTS, got, base, oracle):
        assert_within_rule(name, x, z, y)


# Logits of std 100-500 (issue 23, item 8): the randomized sweep, fixed. Patterns with full and
# partial blocks, ragged lengths, causal or not, head dims 16-64: (pattern, n, block size).
LARGE_LOGIT_PATTERNS = [(sa.Dense(), 96, 32), (sa.Local(40) | sa.Global(first=3), 200, 16),
                        (sa.Stride(7) | sa.Local(5), 100, 16), (sa.Random(2, seed=1, block_size=32) | sa.Local(10), 256, 32),
                        (sa.Local(30) | sa.Sink(first=2), 128, 64)]
LARGE_LOGIT_CASES = [(pattern, n, block, causal, dim, seed) for pattern, n, block in LARGE_LOGIT_PATTERNS
                     for causal, dim in [(False, 16), (True, 32), (False, 64)] for seed in range(4)]
SWEEP_KERNELS = ("numba", "torch", "float32 scores", "ideal")   # whose errors large_logit_errors measures


def float32_score_attention(q, k, v, layout, scale=None):
    """Attention in float64 whose base-2 scores are rounded to float32 once, as numba's large-logit
    rows hold them (``near_max``: the products summed in float64, ``scale log2(e)`` in float32, one
    rounding); everything else, P, l, out, delta, dS and the gradient sums, exact in float64 (autograd
    passes the rounding through as the identity): a kernel that holds its scores in float32 and does
    every other step exactly. Run on the float32 inputs, its outputs rounded to float32 once (dense
    mask: small N only).

    >>> q = k = v = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    >>> out, lse = float32_score_attention(q, k, v, sa.Dense().layout(3))
    >>> out.shape, lse.shape
    (torch.Size([1, 1, 3, 4]), torch.Size([1, 1, 3]))
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    alpha = float(np.float32(scale * np.log2(np.e)))
    scores = (torch.einsum("bhqd,bhkd->bhqk", q, k) * alpha).float().double()
    scores = scores.masked_fill(~layout.to_dense(), float("-inf"))
    row_max = scores.amax(-1, keepdim=True).detach()
    row_max = torch.where(torch.isinf(row_max), 0.0, row_max)            # empty rows: any finite shift
    weights = torch.exp2(scores - row_max)
    total = weights.sum(-1, keepdim=True)
    empty = total == 0
    total = torch.where(empty, 1.0, total)
    lse = torch.where(empty, float("-inf"), (row_max + torch.log2(total)) * np.log(2))
    return torch.einsum("bhqk,bhkd->bhqd", weights / total, v), lse[..., 0]


def large_logit_inputs(n, dim, seed):
    """Float64 q, k, v (1, 2, n, dim), q and k scaled so that the logits have a std drawn from 100-500."""
    gen = torch.Generator().manual_seed(seed)
    std = 100 + 400 * torch.rand((), generator=gen, dtype=torch.float64).item()
    q, k, v = (torch.randn(1, 2, n, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    return q * std ** 0.5, k * std ** 0.5, v                      # q . k / sqrt(dim) has std `std`


def large_logit_errors(pattern, n, block, causal, dim, seed):
    """(5, 5) float64: per output (out, lse, dq, dk, dv), the max error against float64 of each of
    SWEEP_KERNELS on the float32 inputs (numba; torch in float32, the reference backend: the rule's
    baseline; float32_score_attention; the ideal float32 kernel, the reference in float64, the outputs
    rounded to float32 once), then the output's scale (its largest |value|)."""
    q, k, v = large_logit_inputs(n, dim, seed)
    layout = pattern.layout(n, heads=2, block_size=block, causal=causal)
    inputs = [t.float() for t in (q, k, v)]
    runs = [flat_run("numba", *(t.clone() for t in inputs), layout),
            flat_run("reference", *(t.clone() for t in inputs), layout),
            flat_run(float32_score_attention, *(t.double() for t in inputs), layout),
            flat_run("reference", *(t.double() for t in inputs), layout)]
    oracle = flat_run("reference", q, k, v, layout)
    errors = torch.empty(5, 5, dtype=torch.float64)
    for o, want in enumerate(oracle):
        finite = torch.isfinite(want)
        for r, run in enumerate(runs):
            assert torch.isfinite(run[o][finite]).all()
            errors[o, r] = (run[o][finite].float().double() - want[finite]).abs().max()
        errors[o, 4] = want[finite].abs().max()
    return errors


@pytest.fixture(scope="module")
def large_logit_sweep():
    """(60, 5, 5): large_logit_errors of every case of LARGE_LOGIT_CASES."""
    return torch.stack([large_logit_errors(*case) for case in LARGE_LOGIT_CASES])


def rule_ratios(errors):
    """(..., 5, 4) errors of SWEEP_KERNELS over the rule's allowance (2 x torch float32's error + 1e-5;
    at most 1 within the rule), from large_logit_errors' (..., 5, 5)."""
    return errors[..., :4] / (2 * errors[..., 1:2] + 1e-5)


def float32_score_excess(errors):
    """(..., 5): how far numba's error is above 1.1 x float32_score_attention's + 12 float32 ulps of the
    output's scale (scale x 2^-23), in those ulps (<= 0: within), from large_logit_errors' (..., 5, 5)."""
    numba, _, scores_f32, _, scale = errors.unbind(-1)
    ulp = scale * 2.0 ** -23
    return (numba - (1.1 * scores_f32 + 12 * ulp)) / ulp


def test_large_logits_sweep_within_rule(large_logit_sweep):
    """60 cases (5 patterns x (causal, head dim) x 4 seeds): out and lse always within the tolerance
    rule, and at most 2 of the 180 gradients outside it, by at most 1.5x (today 1, by 1.19x). Before,
    15 of 180 were, by up to 3.0x: the backward recomputed the scores near each row's max with BLAS
    in other matmul shapes than the forward, a few ulps of 1000 apart, so its P disagreed with the
    forward's out, l and delta. Why not every gradient: the rule's own resolution at these logits
    (test_large_logits_numba_is_float32_scores_rounded_once)."""
    ratios = rule_ratios(large_logit_sweep)[..., 0]                                # (60, 5): numba's
    assert (ratios[:, :2] <= 1).all(), f"out, lse: {ratios[:, :2].max(0).values.tolist()}"
    grads = ratios[:, 2:]
    assert (grads > 1).sum() <= 2 and grads.max() <= 1.5, f"{(grads > 1).sum()} of 180 outside, worst {grads.max():.2f}x"


def test_large_logits_numba_is_float32_scores_rounded_once(large_logit_sweep):
    """At logits of std 100-500 numba's float32 error, in every output of every case, is at most 1.1x
    that of float32_score_attention (float64 arithmetic but for one rounding of each base-2 score to
    float32, as numba's exact scores near the max are rounded) plus 12 float32 ulps of the output's
    scale, and where numba breaks the rule, so does that kernel. So the delta, dS = P (dP - delta) and
    the dq, dk, dv sums add no cancellation that matters: what is left, up to 10.6 ulps of dq's scale
    over 1,500 cases (e.g. dq 1.7e-5 off where that kernel is 1.6e-6 off and torch 1.5e-5), is dP
    and delta summed in float32, as torch sums them (delta summed in float64 took dq's worst from
    4.0 ulps to 2.1 over 300 cases, and no gradient back inside the rule). What breaks the rule is
    the scores' rounding to float32 (half an ulp, 3e-5 at a base-2 score of 1000, which exp2 makes P's
    relative error): torch's float32 scores have it too, rounded more often, so the rule, 2x torch's
    error, compares two draws of the same error. Over 1,500 cases (these configurations, seeds 0-99): numba broke the rule in 44 of 4,500
    gradients (by up to 2.8x), float32_score_attention in 43 (one dk at 0.99x where numba has 1.01x),
    the ideal float32 kernel (the reference in float64 on the float32 inputs, rounded once) in 18 (by
    up to 1.9x: test_ideal_float32_kernel_breaks_the_rule_at_large_logits). numba's error over
    float32_score_attention's: median 1.00; over the ideal kernel's: median 1.6, up to 22x (torch's:
    median 4.8)."""
    excess = float32_score_excess(large_logit_sweep)
    assert (excess <= 0).all(), f"numba above float32 scores + 10% + 12 ulps by up to {excess.max():.1f} ulps"
    ratios = rule_ratios(large_logit_sweep)
    numba_breaks = ratios[..., 0] > 1
    assert numba_breaks.any() and (ratios[..., 2][numba_breaks] > 0.95).all(), "numba breaks the rule alone"


def test_ideal_float32_kernel_breaks_the_rule_at_large_logits():
    """The tolerance rule cannot resolve float32 kernels at logits of std 100-500: on the float32 inputs
    of this case (logits of std 477, seed 40 of the 1,500-case sweep), exact arithmetic (the
    reference in float64, rounded to float32 once) is 1.34x the rule's allowance in out, 1.51x in dq,
    1.14x in dk. Its whole error is the rounding of q, k and v to float32 (and of its outputs, once),
    and torch's own roundings happen to cancel part of it here. numba, which also rounds its scores
    to float32, is at 2.35x, 2.76x and 2.08x, as float32_score_attention is."""
    errors = large_logit_errors(sa.Local(30) | sa.Sink(first=2), 128, 64, False, 16, seed=40)
    ideal = rule_ratios(errors)[:, 3]                                              # (5,)
    assert (ideal[[0, 2, 3]] > 1).all(), f"ideal kernel / allowance: {ideal.tolist()}"
    assert (float32_score_excess(errors) <= 0).all()


@pytest.mark.parametrize("std", [1, 100, 400])
@pytest.mark.parametrize("pattern", [sa.Dense(), sa.Local(20) | sa.Global(first=2)], ids=["dense", "longformer"])
def test_backward_probabilities_are_the_forwards(pattern, std):
    """The backward's P equals the forward's (float32, 64 tokens, blocks of 16): with v = identity,
    out[i] is row i of the forward's P, and with dout = e_0 for every row, dv[j, 0] = sum_i P[i, j] of
    the backward's. Before, at logits of std 100-400 they differed by 8e-6 to 6e-5 (BLAS's rounding of
    the scores near the max differed between the passes' matmul shapes); now by float32 rounding."""
    n, heads = 64, 2
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, heads, n, 64, generator=gen) * std ** 0.5 for _ in range(2))
    v = torch.eye(n, 64).expand(1, heads, n, 64).contiguous().requires_grad_()   # v_j = e_j
    out = sparse_attention(q, k, v, pattern.layout(n, heads=heads, block_size=16), backend="numba")
    dout = torch.zeros_like(out)
    dout[..., 0] = 1
    out.backward(dout)
    forward = out.detach().sum(2)                                                  # (1, H, n): sum_i P[i, j]
    assert (forward - v.grad[..., 0]).abs().max() < 1e-6


def test_empty_rows_are_zero_with_minus_inf_lse_and_zero_grads():
    (q, k, v), layout = case_inputs(CASES[IDS.index("empty-rows")], torch.float32)
    out, lse, (dq, dk, dv) = run_case("numba", q, k, v, layout)
    empty = torch.isinf(lse)                                                    # (B, Hq, Nq)
    assert empty.sum() > 0 and (~empty).sum() > 0
    assert (lse[empty] == float("-inf")).all()
    assert (out[empty] == 0).all() and (dq[empty] == 0).all()
    assert (dk[:, :, :20] == 0).all() and (dv[:, :, :20] == 0).all()           # padded keys get no gradient
    for t in (out, dq, dk, dv):
        assert not torch.isnan(t).any()


def test_non_contiguous_inputs():
    (q, k, v), layout = case_inputs(CASES[0], torch.float64)
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
    assert not qt.is_contiguous()
    out, lse, grads = run_case("numba", qt, kt, vt, layout)
    ref_out, ref_lse, ref_grads = run_case("reference", q, k, v, layout)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, atol=1e-10, rtol=0)


def test_deterministic_bitwise():
    (q, k, v), layout = case_inputs(CASES[IDS.index("gqa")], torch.float32)
    first, second = run_case("numba", q, k, v, layout), run_case("numba", q, k, v, layout)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case_id", ["gqa", "n1", "global-row-spans-panels"])
def test_backward_per_worker_dq_buffers(threads, case_id):
    """dQ is summed from one buffer per worker (some get no task when there are fewer key blocks
    than workers): exact at any thread count, bitwise reproducible at a given one."""
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"needs {threads} Numba threads")
    (q, k, v), layout = case_inputs(CASES[IDS.index(case_id)], torch.float64)
    previous = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        first, second = run_case("numba", q, k, v, layout), run_case("numba", q, k, v, layout)
    finally:
        numba.set_num_threads(previous)
    _, _, ref_grads = run_case("reference", q, k, v, layout)
    for grad, again, ref in zip(first[2], second[2], ref_grads):
        assert torch.equal(grad, again)
        torch.testing.assert_close(grad, ref, atol=1e-10, rtol=0)


def test_static_schedule_deals_every_task_once_balanced():
    costs = np.array([80, 1, 9, 9, 10, 0, 10, 9, 9, 1], np.int64)
    order = schedule.heaviest_first(costs)
    for workers in (1, 2, 3, 16):
        ptr, tasks = schedule.static_schedule(order, costs, workers)
        assert ptr[0] == 0 and ptr[-1] == len(costs) and np.all(np.diff(ptr) >= 0)
        assert sorted(tasks) == list(range(len(costs)))
        loads = [int((costs[tasks[ptr[w]:ptr[w + 1]]] + 1).sum()) for w in range(workers)]
        assert max(loads) - min(loads) <= 81                                      # LPT: within the heaviest task
        assert all(np.all(np.diff(tasks[ptr[w]:ptr[w + 1]]) > 0) for w in range(workers))  # each in id order
        again = schedule.static_schedule(order, costs, workers)
        assert np.array_equal(ptr, again[0]) and np.array_equal(tasks, again[1])
    ptr, tasks = schedule.static_schedule(order, costs, 2)
    assert list(tasks[ptr[0]:ptr[1]]) == [0]                                      # the global task alone
    assert list(tasks[ptr[1]:ptr[2]]) == list(range(1, 10))


def test_gradcheck_float64():
    layout = (sa.Local(5) | sa.Global(first=2)).layout(40, 40, heads=2, block_size=16, causal=True)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 40, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 40, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: sparse_attention(q, k, v, layout, backend="numba",
                                                                     return_lse=True), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [300, 1000])
def test_argmax_is_a_key_holding_the_row_maximum(dtype, n):
    """The forward's argmax (the backward pins each row's maximum there) is a key of the row's maximum score:
    query i points along axis i % 16, and two copies of a key stand out along that axis (an exact tie), at
    random positions in the lanes, groups and tail of the panel row; every other key scores lower."""
    gen = torch.Generator().manual_seed(n)
    q = 4 * torch.eye(16, dtype=dtype)[torch.arange(n) % 16].reshape(1, 1, n, 16)     # (B, H, N, D), one-hot
    k = torch.rand(1, 1, n, 16, generator=gen, dtype=dtype) * 2 - 1
    pairs = torch.randperm(n, generator=gen)[:32].reshape(16, 2)                      # distinct keys
    for axis, (j1, j2) in enumerate(pairs.tolist()):
        k[0, 0, j1] = k[0, 0, j2] = torch.where(torch.arange(16) == axis, 5.0, k[0, 0, j1])
    layout = sa.Dense().layout(n, n, block_size=64)
    argmax = numba_backend.numba_attention(q, k, k, list(layout.index), 64, 0.25)[3][0, 0]       # (N,)
    copies = pairs[torch.arange(n) % 16]                                              # (N, 2)
    assert ((argmax[:, None] == copies).any(1)).all()


def _op_args(dtype=torch.float32):
    (q, k, v), layout = case_inputs(CASES[IDS.index("gqa")], dtype)
    return (q, k, v, list(layout.index), layout.block_size, 0.25)


def test_opcheck():
    torch.library.opcheck(numba_backend.numba_attention, _op_args())
    q, k, v, *rest = _op_args(torch.float64)
    out, lse, stats, argmax = (t.detach() for t in numba_backend.numba_attention(q, k, v, *rest))
    torch.library.opcheck(numba_backend.numba_attention_backward,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, stats, argmax,
                           torch.randn_like(lse), *rest))


def test_torch_compile_fullgraph_forward_backward():
    (q, k, v), layout = case_inputs(CASES[IDS.index("gqa")], torch.float32)

    def attend(q, k, v):
        out, lse = sa.sparse_attention(q, k, v, layout, scale=0.2, backend="numba", return_lse=True)
        return out.square().sum() + torch.where(torch.isinf(lse), 0.0, lse).sum()

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_loss = attend(q, k, v)
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    torch.testing.assert_close(loss, ref_loss)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_compute_in_float32(dtype, monkeypatch):
    """float16 always, bfloat16 where the CPU has no native bf16 (here: as if; tests/test_numba_bf16.py
    covers the bf16 matmuls)."""
    monkeypatch.setattr(numba_backend, "native_bf16", lambda: (False, "as if"))
    (q, k, v), layout = case_inputs(CASES[0], dtype)
    out, lse, grads = run_case("numba", q, k, v, layout)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert all(g.dtype == dtype for g in grads)
    base_out, _, base_grads = run_case("reference", q, k, v, layout)
    oracle_out, _, oracle_grads = run_case("reference", *(t.detach().double().requires_grad_() for t in (q, k, v)), layout)
    assert_within_rule("out", out, oracle_out, base_out)
    for name, grad, base, oracle in zip(("dq", "dk", "dv"), grads, base_grads, oracle_grads):
        assert_within_rule(name, grad, oracle, base)


def test_pattern_argument_uses_block_size_64(monkeypatch):
    seen, run = [], numba_backend.attention
    monkeypatch.setattr(numba_backend, "attention", lambda q, k, v, layout, *args: (seen.append(layout.block_size),
                                                                               run(q, k, v, layout, *args))[1])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 150, 16, generator=gen)
    out = sparse_attention(q, q, q, sa.Local(30), backend="numba")
    ref = sparse_attention(q, q, q, sa.Local(30), backend="reference")
    torch.testing.assert_close(out, ref)
    assert seen == [64]


_LARGE_BLOCKS = r"""
import json, resource, torch, sparse_attn as sa

q = torch.randn(1, 1, 64, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)

def run(layout, backend):
    out = sa.sparse_attention(q, q, q, layout, backend=backend)
    return [out.detach(), *torch.autograd.grad(out.square().sum(), q)]

layouts = [sa.Local(1).layout(64, block_size=bs) for bs in (20000, 2**17)]
refs = [run(layout, "reference") for layout in layouts]
run(sa.Local(1).layout(64), "numba")                                          # compiled before the limit
size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + 2**30, resource.RLIM_INFINITY))
close = [all(torch.allclose(a, b, atol=1e-5) for a, b in zip(run(layout, "numba"), ref))
         for layout, ref in zip(layouts, refs)]
print(json.dumps(close))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and RLIMIT_AS")
def test_block_size_beyond_the_sequence_uses_memory_of_the_sequence():
    """block_size 20000 and 2**17 for 64 tokens: worker scratch is sized by what a block holds in this
    sequence (min(block_size, n)), not by block_size; before, 2**17 asked for 64 GiB per worker and
    failed with SystemError, and 20000 reserved 1.6 GB per panel buffer. Forward and backward run under
    an address-space limit of 1 GiB above what the process holds, and match the reference."""
    run = subprocess.run([sys.executable, "-c", _LARGE_BLOCKS], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.splitlines()[-1]) == [True, True]


@numba.njit
def _lane_maximum_of(row, start):
    return lowlevel.lane_maximum(row, start)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lane_maximum_is_the_max_of_whole_groups_and_its_first_lane(dtype):
    """best = max(start, row[:whole]) over whole groups of 16 columns (the tail is _row_max's), NaN skipped, -inf
    kept; lane = the first u whose columns u, u + 16, ... hold it. Rows of every length mod 64 (the loop's
    four vectors, the groups of 16 left over), ties between lanes, and a NaN start."""
    rng = np.random.default_rng(0)
    lanes = lowlevel.LANES
    for n in (0, 15, 16, 17, 48, 64, 100, 127, 128, 1093):
        row = (rng.standard_normal(n) * 50).astype(dtype)
        row[rng.random(n) < 0.1] = np.nan
        row[rng.random(n) < 0.1] = -np.inf
        whole = n - n % lanes
        for start in (-np.inf, 0.0, 1e9):
            columns = [row[u:whole:lanes] for u in range(lanes)]
            maxima = [max(start, c[~np.isnan(c)].max(initial=-np.inf)) for c in columns]
            best, lane = _lane_maximum_of(row, dtype(start))
            assert best == max(maxima)
            if best > start:
                assert lane == maxima.index(best)
    tied = np.zeros(128, dtype)
    tied[[37, 19, 90]] = 5                                        # lanes 5, 3 and 10 hold 5: the first is 3
    assert _lane_maximum_of(tied, dtype(0)) == (5, 3)
    best, lane = _lane_maximum_of(tied, dtype(np.nan))
    assert np.isnan(best) and lane == 0


@pytest.mark.parametrize("module", [numba_package, numba_backend, forward, backward, panels, near_max, schedule, bundles,
                                    mods, lowlevel, workspace], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_non_cpu_tensors_are_refused():
    q = torch.empty(1, 1, 64, 16, device="meta")  # sparse_attention answers meta tensors before any backend
    with pytest.raises(ValueError, match=r"backend='numba' runs on CPU tensors.*backend='triton'.*\.cpu\(\)"):
        numba_backend.check(q, q, q, sa.Local(4).layout(64))


def test_available():
    ok, reason = numba_backend.available()
    blas = lowlevel.matmul_blas().name
    assert ok and "numba" in reason and f"matmuls on {blas}" in reason
    wanted = os.environ.get(lowlevel.BLAS_VARIABLE)
    assert not wanted or blas == {"torch": lowlevel.MKL_BLAS, "scipy": lowlevel.SCIPY_BLAS}[wanted]


def test_matmuls_on_torchs_mkl_where_torch_exports_it():
    if os.environ.get(lowlevel.BLAS_VARIABLE) or lowlevel.torch_cpu_exports("sgemm_") is None:
        pytest.skip(f"{lowlevel.BLAS_VARIABLE} is set, or this torch exports no MKL")
    assert lowlevel.matmul_blas().name == lowlevel.MKL_BLAS


@pytest.mark.parametrize("value", ["mkl", "openblas", "Torch"])
def test_unknown_blas_choice_is_refused(monkeypatch, value):
    monkeypatch.setenv(lowlevel.BLAS_VARIABLE, value)
    lowlevel.matmul_blas.cache_clear()
    try:
        ok, reason = numba_backend.available()
    finally:
        monkeypatch.undo()
        lowlevel.matmul_blas.cache_clear()
    assert not ok and f"{lowlevel.BLAS_VARIABLE}={value!r}" in reason and "'torch'" in reason and "'scipy'" in reason


def test_scipy_blas_passes_the_oracle_tests():
    """The BLAS where torch exports none (macOS, aarch64 wheels), chosen by SPARSE_ATTN_NUMBA_BLAS=scipy:
    this file's float64 and float32 oracle tests (float32 on the BLAS route), in a process that takes it."""
    env = dict(os.environ, **{lowlevel.BLAS_VARIABLE: "scipy"})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "float64_matches_reference or (float32_within_tolerance_rule and blas) or test_available"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"\n{2 * len(CASES) + 1} passed" in run.stdout, run.stdout[-1000:]


def test_workers_restore_the_threads_blas_setting():
    """The kernels' workers set MKL to one thread on their own thread and restore the setting after: the
    calling thread (a worker too) keeps its own setting (3 here; torch.set_num_threads sets it too) through
    forward and backward."""
    if lowlevel.matmul_blas().name != lowlevel.MKL_BLAS:
        pytest.skip("the kernels call scipy's BLAS here (its thread count is process-wide: KernelSection)")
    set_local = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(lowlevel.matmul_blas().threads_local)
    q = torch.randn(1, 2, 300, 16, requires_grad=True)
    layout = sa.Local(40).layout(300, heads=2, block_size=64)
    mine = set_local(3)
    try:
        out = sparse_attention(q, q, q, layout, backend="numba")
        out.sum().backward()
    finally:
        setting = set_local(mine)
    assert setting == 3


_CONCURRENT_CALLS = r"""
import json, threading
import numba, torch, sparse_attn as sa
from sparse_attn.api import sparse_attention
from sparse_attn.backends.numba import lowlevel

def run(q, k, v):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = sparse_attention(q, k, v, layout, backend="numba")
    return [out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v))]

layout = (sa.Local(32) | sa.Global(first=2)).layout(700, heads=4, block_size=64)
gen = torch.Generator().manual_seed(0)
inputs = [[torch.randn(1, 4, 700, 32, generator=gen) for _ in range(3)] for _ in range(6)]
blas = lowlevel.scipy_openblas()
if blas is not None:
    blas.scipy_openblas_set_num_threads(2)
expected = [run(*x) for x in inputs]
results = {}
threads = [threading.Thread(target=lambda i=i: results.update({i: [run(*inputs[i]) for _ in range(4)]}))
           for i in range(len(inputs))]
for t in threads:
    t.start()
for t in threads:
    t.join()
equal = all(torch.equal(a, b) for i, want in enumerate(expected) for got in results[i] for a, b in zip(got, want))
print(json.dumps({"equal": equal, "layer": numba.threading_layer(), "blas": lowlevel.matmul_blas().name,
                  "blas_threads": None if blas is None else blas.scipy_openblas_get_num_threads()}))
"""


@pytest.mark.parametrize("layer, blas", [("default", "default"), ("workqueue", "default"), ("default", "scipy"),
                                         ("workqueue", "scipy")])
def test_calls_from_several_threads(layer, blas):
    """Six threads running forward + backward at once get the single-threaded results, on either BLAS;
    scipy's OpenBLAS thread count is restored exactly and it never warns about OpenMP loops (its warning
    is printed by C code: a subprocess captures it); the workqueue layer, which aborts the process
    on concurrent launches, runs the calls one at a time."""
    env = dict(os.environ, NUMBA_THREADING_LAYER=layer)
    if blas != "default":
        env[lowlevel.BLAS_VARIABLE] = blas
    run = subprocess.run([sys.executable, "-c", _CONCURRENT_CALLS], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "OpenBLAS Warning" not in run.stderr, run.stderr[-2000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["equal"]
    assert report["blas_threads"] in (2, None)
    assert layer == "default" or report["layer"] == layer
    assert blas == "default" or report["blas"] == lowlevel.SCIPY_BLAS


@numba.njit(fastmath=lowlevel.FASTMATH)
def _tanh_of_each(x, out):
    for i in range(x.size):
        out[i] = lowlevel.tanh(x[i])


def test_float32_tanh_within_3e7_of_float64_and_nan_stays_nan():
    """lowlevel.tanh in float32 (the softcap's, forward and backward): 2.7e-7 relative on a grid through the
    clamp at |x| = 8 and tiny values, never above 1 in magnitude, odd, NaN for NaN, +-(1 - 2.3e-7) for +-inf."""
    x = np.concatenate([np.linspace(-12, 12, 200_001), np.geomspace(1e-30, 1, 1001)]).astype(np.float32)
    got = np.empty_like(x)
    _tanh_of_each(x, got)
    exact = np.tanh(x.astype(np.float64))
    assert (np.abs(got - exact) <= 3e-7 * np.abs(exact)).all()
    grid, values = x[:200_001], got[:200_001]
    mirrored = grid[::-1] == -grid
    assert (np.abs(got) <= 1).all() and mirrored.sum() > 100_000 and (values[::-1] == -values)[mirrored].all()
    special = np.array([np.nan, np.inf, -np.inf], np.float32)
    _tanh_of_each(special, special)
    assert np.isnan(special[0]) and special[1] == -special[2] and 1 - 3e-7 < special[1] < 1


@numba.njit(fastmath=lowlevel.FASTMATH)
def _exp2_of_each(x, out):
    for i in range(x.size):
        out[i] = lowlevel.exp2(x[i])


def test_float32_exp2_within_1e7_of_float64_zero_below_minus_126_and_nan_stays_nan():
    """lowlevel.exp2 in float32 over what the kernels pass (a score minus a maximum, x <= 0): 1e-7 relative where
    2 ** x is a normal float32, exactly 0 below -126 and for -inf (a masked score), never a subnormal, NaN for
    NaN; up to 127 too."""
    x = np.concatenate([np.linspace(-130, 0, 400_001), np.linspace(0, 127, 1001)]).astype(np.float32)
    got = np.empty_like(x)
    _exp2_of_each(x, got)
    exact = np.exp2(x.astype(np.float64))
    normal = x >= -126
    assert (np.abs(got[normal] - exact[normal]) <= 1e-7 * exact[normal]).all() and (got[~normal] == 0).all()
    special = np.array([np.nan, -np.inf, 0], np.float32)
    _exp2_of_each(special, special)
    assert np.isnan(special[0]) and special[1] == 0 and special[2] == 1


@numba.njit(fastmath=lowlevel.FASTMATH)
def _softcap_panel(config, s, c0, c1):
    mods.modify(mods.head_modifiers(config, 0, 0, 0), s, c0, c1, 0)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="reads x86 assembly")
def test_float32_softcap_pass_is_a_packed_loop():
    """The softcap over a panel's columns compiles to packed divisions (divps/vdivps): a scalar loop (a
    zero-division branch in tanh, or a column slice of unknown stride) made softcap=50 double the forward."""
    modifiers = mods.call_modifiers(50.0, None, torch.float32, n_q=4, n_k=40)
    config = bundles.Config(64, 16, np.float32(0.125), np.float32(0.125 / np.log(2)), *modifiers)
    s = np.ones((4, 40), np.float32)
    _softcap_panel(config, s, 3, 37)
    assembly = _softcap_panel.inspect_asm(_softcap_panel.signatures[0])
    assert any(line.split()[:1] in (["divps"], ["vdivps"]) for line in assembly.splitlines())
    capped = 50 / np.log(2) * np.tanh(np.log(2) / 50)                # base-2 score 1: c log2(e) tanh(ln 2 / c)
    assert np.allclose(s[:, 3:37], capped, rtol=1e-6) and (s[:, :3] == 1).all() and (s[:, 37:] == 1).all()


# ------------------------------------------------------------------------------------------------
# Panels that only some rows of a query block need (the rows of global tokens, past the band)
# ------------------------------------------------------------------------------------------------
def test_a_panel_past_the_band_computes_only_the_global_rows():
    """Query block 0 of `Local(20) | Global(first=3)` over PANEL_KEYS + 300 keys, blocks of 64: its first panel holds the band
    (every row); the panel after it holds only tiles whose allowed rows are the 3 global ones, so only those rows
    are computed there. A band row block's one panel needs every row. The backward walks key blocks: key block 0's
    panels past the band compute its 3 global keys alone."""
    layout = (sa.Local(20) | sa.Global(first=3)).layout(panels.PANEL_KEYS + 300, block_size=64)
    rows = bundles.block_index(*layout.index[:6], transposed=False)
    columns = bundles.block_index(*layout.index[6:], layout.index.masks, transposed=True)
    per_panel = panels.PANEL_KEYS // 64
    scratch = bundles.Panel(np.empty(per_panel, np.int64), np.empty(per_panel, np.int64))

    def row_windows(index, block):
        found, rest = [], bundles.segment(index, 0, 0, block)
        while panels.has_blocks(rest):
            count, rest = panels.next_panel(rest, scratch, per_panel)
            found.append(panels.panel_rows(scratch.tiles, count, index.row_spans, 64))
        return found

    assert row_windows(rows, 0) == [(0, 64), (0, 3)] == row_windows(columns, 0)
    assert row_windows(rows, 10) == [(0, 64)] == row_windows(columns, 10)


ROW_WINDOW_CASES = {  # pattern, n, modifiers: global rows at the start and at the end of a row block, modifiers on
    "first": (sa.Local(20) | sa.Global(first=3), panels.PANEL_KEYS + 300, {}),
    "last": (sa.Local(20) | sa.Global(last=5), panels.PANEL_KEYS + 300, {}),
    "mods": (sa.Local(8) | sa.Global(first=2), panels.PANEL_KEYS + 200, dict(softcap=3.0, alibi_slopes=torch.tensor([0.1, 0.3]))),
}


@pytest.mark.parametrize("name", list(ROW_WINDOW_CASES))
def test_panels_of_some_rows_match_the_reference(name):
    """Forward and backward through panels that compute only their rows (positions and ALiBi distances
    shifted to them), against the reference in float64."""
    pattern, n, modifiers = ROW_WINDOW_CASES[name]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    layout = pattern.layout(n, heads=2, block_size=64)
    results = []
    for backend in ("numba", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = sparse_attention(*leaves, layout, backend=backend, return_lse=True, **modifiers)
        grads = torch.autograd.grad((out * out).sum() + lse.sum(), leaves)
        results.append((out, lse, *grads))
    for name_, got, want in zip(_OUTPUTS, *results):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12, msg=name_)


@pytest.mark.parametrize("name", list(ROW_WINDOW_CASES))
def test_float32_panels_of_some_rows_within_rule(name, float32_route):
    """The same panels in float32 on each matmul route (the brgemm route multiplies the row window's rows of
    q, and the backward's of k and v), against the float64 reference within the tolerance rule."""
    pattern, n, modifiers = ROW_WINDOW_CASES[name]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    layout = pattern.layout(n, heads=2, block_size=64)
    results = []
    for backend, dtype in (("numba", torch.float32), ("reference", torch.float32), ("reference", torch.float64)):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = sparse_attention(*leaves, layout, backend=backend, return_lse=True, **modifiers)
        w_out, w_lse = (torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
                        for x in (out, lse))                                    # a random linear loss, as run_case's
        grads = torch.autograd.grad((out * w_out.to(dtype)).sum() + (lse * w_lse.to(dtype)).sum(), leaves)
        results.append((out, lse, *grads))
    for name_, got, base, want in zip(_OUTPUTS, *results):
        assert_within_rule(name_, got, want, base)
