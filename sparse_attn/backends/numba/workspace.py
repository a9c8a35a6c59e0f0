"""Buffers that the kernels' operand copies reuse from one call to the next, a set per calling thread.

>>> import torch
>>> from sparse_attn.backends.numba import workspace
>>> workspace.release()                                       # start with nothing held
>>> a = workspace.empty("S", (4, 8), torch.float32)
>>> b = workspace.empty("S", (2, 8), torch.float32)          # smaller: the same memory
>>> a.data_ptr() == b.data_ptr(), b.shape
(True, torch.Size([2, 8]))
>>> workspace.held_bytes()
128
>>> workspace.release()                                       # this thread's buffers are freed
>>> workspace.held_bytes()
0

Why: every call rewrites copies of its operands as large as K (brgemm's transposed K, bf16 pairs, the
backward's per-worker dQ sums; 33 MB each at N = 16K, 8 heads, D = 64 in float32). Taken fresh, each is a new
mapping from the system at these sizes, and every call pays its page faults again; kept, a buffer is faulted
in once (benchmarks/results/numba_ab/ has the A/B). A call uses a buffer only while it runs, and a thread runs one
call at a time, so buffers are per thread (a thread that ends frees its own). The kernels name a buffer
after the product it feeds ("S" holds K.T in the forward, Q.T in the backward), so a forward and a backward
share what they can. What stays held is, per name, the largest call's copy (``held_bytes``): in float32
with brgemm two copies the size of q plus the backward's ``threads - 1`` dQ sums; ``release`` frees them.
"""
from __future__ import annotations

import math
import threading

import torch

_THREAD = threading.local()


def empty(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape`` and ``dtype`` in this thread's buffer ``name``,
    which grows to the largest size asked for it and is reused by later calls. The tensor is valid until
    the next ``empty`` of the same name on this thread: one per operand of a call."""
    buffers = _buffers()
    size = math.prod(shape) * dtype.itemsize
    held = buffers.get(name)
    if held is None or held.numel() < size:
        held = buffers[name] = torch.empty(size, dtype=torch.uint8)
    return held[:size].view(dtype).view(shape)


def held_bytes() -> int:
    """The bytes this thread's buffers hold."""
    return sum(buffer.numel() for buffer in _buffers().values())


def release() -> None:
    """Free this thread's buffers (the next call allocates them again)."""
    _THREAD.buffers = {}


def _buffers() -> dict[str, torch.Tensor]:
    if not hasattr(_THREAD, "buffers"):
        _THREAD.buffers = {}
    return _THREAD.buffers
