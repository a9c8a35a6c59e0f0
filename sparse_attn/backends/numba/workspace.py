"""Memory the kernels reuse from one call to the next: their operand copies, a set of buffers per calling
thread, and the memory of the results (out, the gradients) that nothing refers to any more.

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

Results (``result``) are returned to the caller, so their memory is reused only once every tensor that
shows it is gone: a result is a view of a pooled buffer, and when its last view dies the buffer becomes a
*spare* that a later result of about its size (1 to 2 times) takes. At most ``SPARE_RESULTS`` spares are
kept (process-wide: a result may die on any thread), the oldest dropped first; ``release`` frees them too.
Results under ``SMALLEST_SPARE`` bytes are fresh tensors.

>>> out = result((4096, 64), torch.float32)                  # 1 MiB
>>> address = out.data_ptr()
>>> del out                                                   # its last view: the buffer is a spare
>>> result((4096, 64), torch.float32).data_ptr() == address   # (and back again: nothing holds it)
True
>>> kept = result((4096, 64), torch.float32)
>>> result((4096, 64), torch.float32).data_ptr() != kept.data_ptr()   # a held result is never reused
True
>>> release(); held_bytes()
0

A result is a tensor on memory the pool owns (as ``torch.from_numpy`` makes them): it cannot be resized in
place (``resize_`` to a larger size raises), which fresh ``torch.empty`` results can.
"""
from __future__ import annotations

import math
import threading
import weakref

import torch

SPARE_RESULTS = 4  # result buffers kept for reuse once nothing refers to them (a forward's out and a backward's
                   # dq, dk, dv: a training step of one layer)
SMALLEST_SPARE = 1 << 20  # bytes: smaller results are plain torch.empty, kept off the pool's bookkeeping (a lock,
                          # a finalizer, a numpy view per result): the pool is for results whose fresh memory is a
                          # new mapping (glibc maps every allocation of 32 MiB and more)

_THREAD = threading.local()
_SPARES: list[torch.Tensor] = []  # result buffers (uint8) no result uses, oldest first
_SPARES_LOCK = threading.RLock()  # a result's last view may die on any thread, or inside a call here (GC)


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


def result(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape`` and ``dtype`` for a call to return: in a spare buffer
    of 1 to 2 times its size if there is one, else in a new one, which becomes a spare once the tensor and
    every view of it are gone. Under ``SMALLEST_SPARE`` bytes, a fresh tensor."""
    size = math.prod(shape) * dtype.itemsize
    if size < SMALLEST_SPARE:
        return torch.empty(shape, dtype=dtype)
    buffer = _take_spare(size)
    if buffer is None:
        buffer = torch.empty(size, dtype=torch.uint8)
    words = torch.int16 if dtype == torch.bfloat16 else dtype                   # numpy has no bfloat16
    view = buffer[:size].view(words).numpy().reshape(shape)
    finalizer = weakref.finalize(view, _give_back, buffer)   # runs when the last tensor showing view is gone
    finalizer.atexit = False
    return torch.from_numpy(view).view(dtype)


def _take_spare(size: int) -> torch.Tensor | None:
    """The smallest spare buffer of size to 2 x size bytes, taken from the spares, or None."""
    with _SPARES_LOCK:
        fits = [i for i, buffer in enumerate(_SPARES) if size <= buffer.numel() <= 2 * size]
        if not fits:
            return None
        return _SPARES.pop(min(fits, key=lambda i: _SPARES[i].numel()))


def _give_back(buffer: torch.Tensor) -> None:
    """A result's buffer that nothing shows any more becomes a spare (the oldest spare beyond the cap is dropped)."""
    with _SPARES_LOCK:
        _SPARES.append(buffer)
        del _SPARES[:-SPARE_RESULTS]


def held_bytes() -> int:
    """The bytes this thread's buffers and the spare result buffers hold."""
    with _SPARES_LOCK:
        spares = sum(buffer.numel() for buffer in _SPARES)
    return spares + sum(buffer.numel() for buffer in _buffers().values())


def release() -> None:
    """Free this thread's buffers and the spare result buffers (later calls allocate them again)."""
    _THREAD.buffers = {}
    with _SPARES_LOCK:
        _SPARES.clear()


def _buffers() -> dict[str, torch.Tensor]:
    if not hasattr(_THREAD, "buffers"):
        _THREAD.buffers = {}
    return _THREAD.buffers
