"""Without CUDA, Triton kernels run in Triton's interpreter: the variable must be set before anything
imports triton (torch.compile does), so it is set here, before any test module is imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
