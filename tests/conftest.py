"""Set before any test module is imported:

- Without CUDA, Triton kernels run in Triton's interpreter: the variable must be set before anything
  imports triton (torch.compile does).
- Subprocesses the tests start (the CLI, import checks) import the same sparse_attn as the tests, the
  checkout's, wherever pytest is run from and whether or not the package is also installed.
- float64 ``torch.exp`` has run once before any oracle does: on some CPUs the first call of a process is
  less accurate than later ones (tests/tolerance.py, which warms it up on import, says why).
"""
import os
from pathlib import Path

import pytest
import torch

import tests.tolerance  # noqa: F401  (warms float64 exp up on import)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHECKOUT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join([CHECKOUT, *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.fixture
def pieces_of(monkeypatch):
    """Cut every row and column of more than ``blocks`` blocks into pieces in the Triton backend (the GPU does so
    only for rows much longer than the pass's average, too few in the small cases an interpreter affords)."""
    from sparse_attn.backends import triton_gpu, work_split

    def cut(blocks):
        monkeypatch.setattr(work_split, "MIN_PIECE_BLOCKS", blocks)
        monkeypatch.setattr(triton_gpu, "_programs", lambda device: 1 << 30)
    return cut


@pytest.fixture(params=["blas", "brgemm"])
def float32_route(request, monkeypatch):
    """The numba backend's float32 matmuls on each route (``bf16.float32_brgemm``: the BLAS's sgemm, or oneDNN's
    brgemm on transposed operands), whichever this CPU takes by default."""
    from sparse_attn.backends.numba import bf16

    monkeypatch.setenv(bf16.FLOAT32_VARIABLE, request.param)
    usable, why = bf16.float32_brgemm()
    if request.param == "brgemm" and not usable:
        pytest.skip(f"float32 brgemm does not run here: {why}")
    return request.param
