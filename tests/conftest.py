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

import torch

import tests.tolerance  # noqa: F401  (warms float64 exp up on import)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHECKOUT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join([CHECKOUT, *filter(None, [os.environ.get("PYTHONPATH")])])
