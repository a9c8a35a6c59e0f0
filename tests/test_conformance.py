"""One conformance test per backend over the case matrix of tests/cases.py (patterns x call-time data x shapes):
out, lse and the gradients dq, dk, dv of a loss through both, on the pattern and call-time data as a user passes
them.

- reference, float64: equal (to 1e-10) to the oracle of tests/score_mods_oracle.py on the case's token mask, both
  written from DESIGN's formulas and definitions, not from any backend;
- numba: float64 equal to the reference to 1e-10, float32 within the tolerance rule (tests/tolerance.py);
- triton: with a GPU every case in every kernel dtype; without one, Triton's interpreter runs the kernels (seconds
  a case), so every shape and every call-time data once (``ONE_OF_EACH``) in float32; within the tolerance rule;
  skipped without triton.
"""
import importlib.util

import pytest
import torch

from tests.cases import CASES, ONE_OF_EACH
from tests.helpers import DEVICE, ON_CUDA, OUTPUTS, assert_matches_oracle, make_qkv, run_backend
from tests.score_mods_oracle import oracle
from tests.tolerance import FLOORS

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason='needs triton (its interpreter without a GPU): pip install ".[triton]"')
TRITON_CASES, TRITON_DTYPES = (CASES, list(FLOORS)) if ON_CUDA else (ONE_OF_EACH, [torch.float32])


def case_inputs(case, dtype, device="cpu"):
    """q, k, v of the case in ``dtype`` and the weights of the loss: grad_out like q, grad_lse like lse (float64)."""
    s = case.shape
    q, k, v = make_qkv(s.batch, s.q_heads, s.kv_heads, s.n_q, s.n_k, s.head_dim, dtype, kv_batch=s.kv_batch,
                       device=device)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(device)
    grad_lse = torch.randn(q.shape[:3], generator=gen, dtype=torch.float64).to(device)
    return (q, k, v), grad_out, grad_lse


def attend(backend, case, q, k, v, grad_out, grad_lse):
    """out, lse, dq, dk, dv of ``backend`` on the case's pattern and call-time data (moved to q's device)."""
    call = {name: value.to(q.device) if torch.is_tensor(value) else value for name, value in case.call_data().items()}
    return run_backend(backend, q, k, v, case.pattern, grad_out, grad_lse, **call)


def oracle_outputs(case, q, k, v, grad_out, grad_lse, dtype=torch.float64):
    """out, lse, dq, dk, dv of the oracle's formulas on the case's token mask, for the same loss as ``attend``:
    in float64 the oracle; in a half dtype the tolerance rule's baseline (torch in that dtype, no upcast)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = oracle(q, k, v, case.mask().to(q.device), q.shape[-1] ** -0.5, dtype=dtype)
    loss = (out * grad_out).sum() + (torch.where(torch.isinf(lse), 0, lse) * grad_lse).sum()
    loss.backward()
    return out, lse, q.grad, k.grad, v.grad


def assert_float64_equal(got, want):
    """Every output within 1e-10 (lse: -inf exactly where ``want`` has it)."""
    for name, a, b in zip(OUTPUTS, got, want):
        assert a.dtype == torch.float64, name
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=name)


def assert_conforms(backend, case, dtype, device="cpu"):
    """``backend`` against the float64 reference: equal in float64, within the tolerance rule in other dtypes.
    The rule's baseline is torch's computation in ``dtype``: the reference backend in float32; in float16 and
    bfloat16 the oracle's formulas run in that dtype (the reference backend computes half inputs in float32,
    which would hold a kernel to the error of rounding its inputs and outputs alone)."""
    (q, k, v), grad_out, grad_lse = case_inputs(case, dtype, device)
    got = attend(backend, case, q, k, v, grad_out, grad_lse)
    reference = attend("reference", case, q.double(), k.double(), v.double(), grad_out, grad_lse)
    if dtype == torch.float64:
        assert_float64_equal(got, reference)
    else:
        half = dtype in (torch.float16, torch.bfloat16)
        baseline = (oracle_outputs(case, q, k, v, grad_out, grad_lse, dtype) if half
                    else attend("reference", case, q, k, v, grad_out, grad_lse))
        assert_matches_oracle(got, reference, baseline)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_equals_the_float64_oracle(case):
    (q, k, v), grad_out, grad_lse = case_inputs(case, torch.float64)
    got = attend("reference", case, q, k, v, grad_out, grad_lse)
    assert_float64_equal(got, oracle_outputs(case, q, k, v, grad_out, grad_lse))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_numba_conforms_to_the_reference(case, dtype):
    assert_conforms("numba", case, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
def test_triton_conforms_to_the_reference(case, dtype):
    assert_conforms("triton", case, dtype, DEVICE)
