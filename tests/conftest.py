"""Set before any test module is imported:

- Without CUDA, Triton kernels run in Triton's interpreter: the variable must be set before anything
  imports triton (torch.compile does).
- Subprocesses the tests start (the CLI, import checks) import the same sparse_attn as the tests, the
  checkout's, wherever pytest is run from and whether or not the package is also installed.
"""
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHECKOUT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join([CHECKOUT, *filter(None, [os.environ.get("PYTHONPATH")])])
