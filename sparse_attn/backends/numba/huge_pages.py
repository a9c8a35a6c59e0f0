"""Fresh result tensors that the system backs with transparent huge pages where it can (Linux).

>>> import torch
>>> from sparse_attn.backends.numba import huge_pages
>>> out = huge_pages.empty((1, 8, 16384, 64), torch.float32)       # 32 MiB, uninitialised
>>> out.shape, out.is_contiguous()
(torch.Size([1, 8, 16384, 64]), True)

Why: a call's outputs (the forward's ``out``, the backward's dQ, dK, dV) are new memory every call, as
large as q, and the kernels write each byte once. On 4 KiB pages the first write to each page is a page
fault: 8,192 of them for the 32 MiB above, several milliseconds that the kernels spend in the system
(benchmarks/results/numba_ab/ has the A/B). ``empty`` asks the system (``madvise(MADV_HUGEPAGE)``) to back
the tensor's 2 MiB-aligned interior with 2 MiB pages, one fault each. The memory is the tensor's own,
allocated by torch as usual and freed with it; nothing is kept between calls. Where transparent huge pages
are off (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``never``), on other systems, or for tensors
without a whole aligned 2 MiB inside, it is a plain ``torch.empty``.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import torch

_HUGE_PAGE = 2 << 20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)      # Linux only


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``, its whole 2 MiB pages advised
    for transparent huge pages."""
    tensor = torch.empty(shape, dtype=dtype)
    start = tensor.data_ptr()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE                       # the interior's first huge page
    end = (start + tensor.numel() * tensor.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end > first and _madvise is not None:
        _madvise(first, end - first, _ADVICE)        # advice only: a refusal (-1) leaves 4 KiB pages
    return tensor


def _libc_madvise():
    """libc's madvise(addr, length, advice) where the system has MADV_HUGEPAGE, else None."""
    if _ADVICE is None or not sys.platform.startswith("linux"):
        return None
    function = ctypes.CDLL(None).madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_madvise = _libc_madvise()
