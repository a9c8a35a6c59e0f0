"""The Numba CPU backend: block-sparse flash attention on CPU tensors, forward and backward.

>>> import torch, sparse_attn as sa
>>> from sparse_attn.api import sparse_attention
>>> q = k = v = torch.randn(1, 2, 1000, 32)
>>> sparse_attention(q, k, v, sa.Local(64) | sa.Global(first=4), backend="numba").shape
torch.Size([1, 2, 1000, 32])

Algorithm
---------
Work is cut into *tasks*, one per (example, head, query block) in the forward and one per
(example, kv head, key block) in the backward.

Forward task (query block ``r`` of head ``h``), FlashAttention's online softmax:

1. Walk the row's key blocks (full and partial CSR lists merged in key order) in *panels* of up
   to ``_PANEL_KEYS`` keys. A panel is made of *runs* of consecutive key blocks, each run one
   matmul into its columns of the panel's score tile: a Longformer row (band plus global column)
   is one panel of two runs, so its softmax is one pass and its matmuls are few and large.
2. Per panel: ``S = (scale log2(e)) q[r] @ k[run].T`` per run (BLAS sgemm/dgemm, scores in base 2
   so ``exp2`` is used), ``-inf`` where a partial block's tile is False, then per row: new max
   ``m'`` (16 running lanes, so the reduction vectorises), ``P = exp2(S - m')``,
   ``l = l * exp2(m - m') + sum(P)``, ``acc = acc * exp2(m - m') + P @ v[run]`` per run (the gemm
   accumulates into acc: beta = 1). A partial block alone in its run is computed only on its
   tile's span of allowed keys (a Longformer band row's global-column block: 16 of 64 keys); the
   mask sets the rest of its columns to ``-inf``.
3. ``out = acc / l``, ``lse = (m + log2 l) * ln 2``; a row with no allowed key keeps ``l = 0`` and
   returns 0 and ``lse = -inf``.

The last block may be shorter than ``block_size``: panels are clipped to ``n_k`` and the query
block to ``n_q``, so full blocks need no mask; partial tiles are already False outside.

Backward (FlashAttention-2, recomputing ``P = exp2(S - lse2)`` from q, k and the saved lse;
``lse2 = lse * log2(e)``, ``+inf`` for empty rows so their ``P`` is exactly 0): one pass over key
blocks, 5 matmuls per computed block. A parallel prologue computes, per query row,
``delta = rowsum(dO * O) - dlse`` and ``lse2``. A task (key block ``c`` of kv head ``g``) walks,
for every query head of its GQA group, its query blocks (transposed CSR) in panels of runs, as the
forward does, and computes ``S.T = k[c] @ q[run].T`` and ``dP.T = v[c] @ dO[run].T`` per run,
``P.T`` and ``dS.T = P.T * (dP.T - delta)`` over the panel, then per run ``dV[c] += P.T @ dO[run]``,
``dK[c] += scale dS.T @ q[run]`` (rows the task owns) and ``dQ[run] += scale dS @ k[c]``; a
partial block alone in its run is computed only on its tile's span of allowed queries (the
global rows' block: 16 of 64 queries).

Scheduling and determinism:

- Forward: ``prange`` over one worker per thread; workers take tasks from a shared counter (an
  atomic fetch-add: Numba's OpenMP ``prange`` splits iterations statically, which would give one
  thread all the heavy global rows), in heaviest-first order (rows by block count). A task owns
  its output rows, so the result does not depend on which worker ran it.
- Backward: dK and dV rows are owned by their task, but dQ rows get terms from many key blocks.
  The tasks are dealt *statically* to the workers (heaviest first, each to the least-loaded
  worker so far: a function of the layout and the thread count only); worker ``w`` adds its dQ
  terms, in its fixed task order, into its own dQ-sized buffer (``dq`` itself for worker 0), and
  the buffers are summed in worker order at the end. No atomics on data, no races, and two runs
  with the same thread count are bitwise identical.

Memory beyond inputs, outputs and gradients: O(N) (lse, delta, task lists), per-worker scratch of
two ``block x _PANEL_KEYS`` panels, and ``threads - 1`` dQ-sized buffers in the backward: O(threads x N x D).
Gradients and dQ buffers are zeroed inside the kernel by the worker that owns them.

Matmuls call BLAS ?gemm directly (the binding Numba's ``np.dot`` uses), with alpha, beta and
transposes, so there are no temporary products or extra additions.

Precision: float32 and float64 are computed in their own dtype (float32 with a vectorisable
degree-7 ``exp2``, relative error ~1e-7, since Numba has no vector exp without SVML); float16 and
bfloat16 inputs are computed in float32 and returned in the input dtype.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import math
import os
import threading

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.linalg import check_blas_return, ensure_blas

from ..layout import BlockLayout

BLOCK_SIZE = 64
_PANEL_KEYS = 1024  # keys (or queries, in the backward) per score panel
_LANES = 16  # running maxima per row in _row_max: one AVX-512 float32 vector
_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)
# No 'nnan'/'ninf': -inf marks masked scores and empty rows, and must survive.
_FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}
_HALF = (torch.float16, torch.bfloat16)


def available() -> tuple[bool, str]:
    try:
        ensure_blas()                                    # the kernels' matmuls call scipy's BLAS
    except ImportError as error:
        return False, f"backend='numba' needs scipy (its BLAS): {error}"
    return True, f"numba {numba.__version__}, {numba.get_num_threads()} threads"


def check(q, k, v, layout: BlockLayout) -> None:
    """Raise a ValueError if these inputs cannot run on this backend, saying what to do."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cpu":
            raise ValueError(f"backend='numba' runs on CPU tensors, got {name} on {t.device}; "
                             f"use backend='triton' for CUDA tensors or move the inputs with .cpu()")
    if layout.device.type != "cpu":
        raise ValueError(f"backend='numba' needs a CPU BlockLayout, got one on {layout.device}; use layout.to('cpu')")


def attention(q, k, v, layout: BlockLayout, scale: float):
    """out (B, Hq, Nq, D) in q's dtype, lse (B, Hq, Nq) float32 (float64 for float64 inputs)."""
    dtype = q.dtype
    if dtype in _HALF:
        q, k, v = q.float(), k.float(), v.float()
    out, lse = numba_attention(q, k, v, *_layout_tensors(layout), layout.block_size, scale)
    return out.to(dtype), lse


def _layout_tensors(layout: BlockLayout) -> list[torch.Tensor]:
    return [getattr(layout, name) for name in BlockLayout._TENSORS]


@functools.cache
def _scipy_openblas():
    """scipy's OpenBLAS (the BLAS Numba's np.dot calls), or None where scipy uses another BLAS."""
    import scipy

    for path in glob.glob(os.path.join(os.path.dirname(scipy.__file__), os.pardir, "scipy.libs", "libscipy_openblas*")):
        lib = ctypes.CDLL(path)
        if hasattr(lib, "scipy_openblas_set_num_threads") and hasattr(lib, "scipy_openblas_get_num_threads"):
            return lib
    return None


def _layer_is_threadsafe() -> bool:
    """Whether Numba's threading layer takes parallel launches from several threads at once: omp
    and tbb do; workqueue aborts the process; before the first launch the layer is not chosen yet."""
    try:
        return numba.threading_layer() != "workqueue"
    except ValueError:                                   # no parallel launch yet
        return False


class _KernelSection:
    """``with _KERNELS.running():`` around the parallel kernels of one call; safe from several threads.

    - The kernels call BLAS from every worker thread: a BLAS that also threads each call would
      oversubscribe the cores (and OpenBLAS warns "Detect OpenMP Loop"), so scipy's OpenBLAS runs
      on one thread while any call is inside. Its thread count is process-wide: the first call in
      saves it and sets 1, the last one out restores it (a count under a lock).
    - Numba's workqueue threading layer aborts the process when two threads launch parallel
      kernels at once: under it (and for the launch that picks the layer) calls run one at a time.
    """

    def __init__(self):
        self._lock = threading.Lock()                    # guards _inside and _blas_threads
        self._inside = 0
        self._blas_threads = 0
        self._one_at_a_time = threading.Lock()

    @contextlib.contextmanager
    def running(self):
        with contextlib.nullcontext() if _layer_is_threadsafe() else self._one_at_a_time:
            self._enter()
            try:
                yield
            finally:
                self._leave()

    def _enter(self):
        lib = _scipy_openblas()
        with self._lock:
            if self._inside == 0 and lib is not None:
                self._blas_threads = lib.scipy_openblas_get_num_threads()
                lib.scipy_openblas_set_num_threads(1)
            self._inside += 1

    def _leave(self):
        lib = _scipy_openblas()
        with self._lock:
            self._inside -= 1
            if self._inside == 0 and lib is not None:
                lib.scipy_openblas_set_num_threads(self._blas_threads)


_KERNELS = _KernelSection()


# ------------------------------------------------------------------------------------------------
# torch custom ops: autograd, torch.compile and opcheck see the kernels as two opaque ops
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("sparse_attn::numba_attention", mutates_args=())
def numba_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    full_ptr: torch.Tensor, full_idx: torch.Tensor, part_ptr: torch.Tensor, part_idx: torch.Tensor,
                    part_mask: torch.Tensor, masks: torch.Tensor, full_t_ptr: torch.Tensor,
                    full_t_idx: torch.Tensor, part_t_ptr: torch.Tensor, part_t_idx: torch.Tensor,
                    part_t_mask: torch.Tensor, block_size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward kernel on float32/float64 CPU tensors: (out, lse)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)                                                    # (B, Hq, Nq, D)
    lse = q.new_empty(q.shape[:3])                                               # (B, Hq, Nq)
    order = _heaviest_first(_task_costs(full_ptr, part_ptr, q.shape[0], q.shape[1]))
    with _KERNELS.running():
        _forward(q.numpy(), k.numpy(), v.numpy(), full_ptr.numpy(), full_idx.numpy(), part_ptr.numpy(),
                 part_idx.numpy(), part_mask.numpy(), masks.numpy(), _tile_spans(masks, 1), order,
                 numba.get_num_threads(), block_size,
                 _panel_blocks(block_size), _as(q, scale * _LOG2E), out.numpy(), lse.numpy())
    return out, lse


@numba_attention.register_fake
def _(q, k, v, *layout_and_args):
    return torch.empty_like(q), q.new_empty(q.shape[:3])


@torch.library.custom_op("sparse_attn::numba_attention_backward", mutates_args=())
def numba_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor,
                             full_ptr: torch.Tensor, full_idx: torch.Tensor, part_ptr: torch.Tensor,
                             part_idx: torch.Tensor, part_mask: torch.Tensor, masks: torch.Tensor,
                             full_t_ptr: torch.Tensor, full_t_idx: torch.Tensor, part_t_ptr: torch.Tensor,
                             part_t_idx: torch.Tensor, part_t_mask: torch.Tensor, block_size: int,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward kernel: (dq, dk, dv) from dout and dlse, the gradients of out and lse."""
    dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))
    batch, heads, n_q, dim = q.shape
    workers = numba.get_num_threads()
    costs = _task_costs(full_t_ptr, part_t_ptr, batch, heads, k.shape[1])
    ptr, tasks = _static_schedule(_heaviest_first(costs), costs, workers)
    # Written (and zeroed, worker by worker) inside the kernels: no serial memset of fresh pages.
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)                   # (B, Hq, Nq)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dq_parts = q.new_empty((workers - 1, *q.shape))                              # (W-1, B, Hq, Nq, D)
    rows = batch * heads * n_q
    with _KERNELS.running():
        _delta_lse2(out.view(rows, dim).numpy(), dout.view(rows, dim).numpy(), lse.contiguous().view(rows).numpy(),
                    dlse.contiguous().view(rows).numpy(), _as(q, _LOG2E), delta.view(rows).numpy(),
                    lse2.view(rows).numpy())
        _backward_kernel(q.numpy(), k.numpy(), v.numpy(), dout.numpy(), lse2.numpy(), delta.numpy(),
                         full_t_ptr.numpy(), full_t_idx.numpy(), part_t_ptr.numpy(), part_t_idx.numpy(),
                         part_t_mask.numpy(), masks.numpy(), _tile_spans(masks, 0), ptr, tasks, block_size,
                         _panel_blocks(block_size),
                         _as(q, scale * _LOG2E), _as(q, scale), dq.numpy(), dq_parts.numpy(), dk.numpy(), dv.numpy())
        _sum_parts(dq.view(rows, dim).numpy(), dq_parts.view(workers - 1, rows, dim).numpy())
    return dq, dk, dv


@numba_attention_backward.register_fake
def _(dout, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *layout, block_size, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *layout)
    ctx.block_size, ctx.scale = block_size, scale


def _autograd_backward(ctx, dout, dlse):
    q, k, v, out, lse, *layout = ctx.saved_tensors  # autograd passes zeros for an unused lse, never None
    dq, dk, dv = numba_attention_backward(dout, q, k, v, out, lse, dlse, *layout, ctx.block_size, ctx.scale)
    return (dq, dk, dv) + (None,) * (len(layout) + 2)


numba_attention.register_autograd(_autograd_backward, setup_context=_setup_context)


def _tile_spans(masks: torch.Tensor, axis: int) -> np.ndarray:
    """(n_masks, 2) int64: the [first, last + 1) query rows (axis 0) or key columns (axis 1) of each
    tile with at least one allowed pair; a block alone in its run is computed only on that span
    (the global column's tile of a Longformer band row has 16 of 64 keys)."""
    active = masks.numpy().any(axis=2 - axis)                                   # (n_masks, bs)
    first = np.where(active.any(1), active.argmax(1), 0)
    last = np.where(active.any(1), active.shape[1] - active[:, ::-1].argmax(1), 0)
    return np.stack([first, last], 1).astype(np.int64)


def _as(t: torch.Tensor, x: float):
    """x as a numpy scalar of t's dtype, so the kernels stay in float32 for float32 inputs."""
    return np.float32(x) if t.dtype == torch.float32 else np.float64(x)


def _panel_blocks(block_size: int) -> int:
    return max(1, _PANEL_KEYS // block_size)


def _task_costs(ptr: torch.Tensor, part_ptr: torch.Tensor, batch: int, heads: int,
                kv_heads: int | None = None) -> np.ndarray:
    """Block count of every task (example, head, block), flat in task-id order.

    With ``kv_heads`` the tasks are (example, kv head, block) and a task sums the heads of its group.
    """
    counts = np.diff(ptr.numpy(), axis=-1) + np.diff(part_ptr.numpy(), axis=-1)  # (Bl, Hl, n_blocks)
    counts = np.broadcast_to(counts, (batch, heads, counts.shape[-1]))
    if kv_heads is not None:
        counts = counts.reshape(batch, kv_heads, heads // kv_heads, -1).sum(2)
    return counts.reshape(-1).astype(np.int64)


def _heaviest_first(costs: np.ndarray) -> np.ndarray:
    """Task ids sorted by cost, heaviest first (stable)."""
    return np.argsort(-costs, kind="stable").astype(np.int64)


# ------------------------------------------------------------------------------------------------
# Numba building blocks
# ------------------------------------------------------------------------------------------------
@intrinsic
def _fetch_add(typingctx, counter):
    """counter[0] += 1 atomically; returns the old value (the next task to run)."""
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", array.data, ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(counter), codegen


@intrinsic
def _int_bits_as_float32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _xxgemm(typingctx, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Column-major BLAS ?gemm, c = alpha op(a) op(b) + beta c, through the binding Numba's np.dot
    uses (``numba_xxgemm``: scipy's BLAS, found by name, so cached kernels stay valid)."""
    def codegen(context, builder, signature, args):
        ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc = args
        dtype = signature.args[11].dtype
        char, void_p, intp = ir.IntType(8), ir.IntType(8).as_pointer(), context.get_value_type(types.intp)
        fnty = ir.FunctionType(ir.IntType(32), [char, char, char, intp, intp, intp, void_p, void_p, intp,
                                                void_p, intp, void_p, void_p, intp])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "numba_xxgemm")

        def scalar(value, ty):
            slot = cgutils.alloca_once_value(builder, context.cast(builder, value, ty, dtype))
            return builder.bitcast(slot, void_p)

        def data(value, ty):
            return builder.bitcast(context.make_array(ty)(context, builder, value).data, void_p)

        kind = ir.Constant(char, ord("s" if dtype == types.float32 else "d"))
        sig = signature.args
        res = builder.call(fn, (kind, builder.trunc(ta, char), builder.trunc(tb, char), m, n, k,
                                scalar(alpha, sig[5]), data(a, sig[6]), lda, data(b, sig[8]), ldb,
                                scalar(beta, sig[10]), data(c, sig[11]), ldc))
        check_blas_return(context, builder, res)
        return context.get_dummy_value()
    return types.void(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc), codegen


_N, _T = ord("n"), ord("t")


@njit(cache=True)
def _gemm(alpha, a, trans_a, b, trans_b, beta, c):
    """c (m, n) = alpha * op(a) @ op(b) + beta * c, op(x) = x.T if trans_x else x. a, b, c are
    row-major with unit column stride (row slices of C-contiguous arrays, any row stride). BLAS is
    column-major, where a row-major x reads as x.T: it computes c.T = op(b).T @ op(a).T."""
    m, n = c.shape
    inner = a.shape[0] if trans_a else a.shape[1]
    if m == 0 or n == 0:
        return
    _xxgemm(_T if trans_b else _N, _T if trans_a else _N, n, m, inner, alpha,
            b, max(1, b.strides[0] // b.itemsize), a, max(1, a.strides[0] // a.itemsize),
            beta, c, max(1, c.strides[0] // c.itemsize))


def _exp2(x):
    """2 ** x; vectorisable in float32 (no libm call), exactly 0 below 2 ** -126."""


_EXP2_COEFFS = tuple(np.float32(_LN2 ** i / math.factorial(i)) for i in range(8))
_C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7 = _EXP2_COEFFS
_F32_MIN_EXP, _HALF_F32, _ZERO_F32 = np.float32(-126.0), np.float32(0.5), np.float32(0.0)


@overload(_exp2, fastmath=_FASTMATH)
def _exp2_impl(x):
    if x == types.float32:
        def exp2_f32(x):
            xc = max(x, _F32_MIN_EXP)                    # finite, so the int conversion is defined
            n = np.floor(xc + _HALF_F32)                 # x = n + f, |f| <= 1/2
            f = xc - n
            p = _C0 + f * (_C1 + f * (_C2 + f * (_C3 + f * (_C4 + f * (_C5 + f * (_C6 + f * _C7))))))
            scale = _int_bits_as_float32((np.int32(n) + np.int32(127)) << np.int32(23))  # 2 ** n
            return p * scale if x >= _F32_MIN_EXP else _ZERO_F32
        return exp2_f32
    if x == types.float64:
        return lambda x: np.exp2(x)


@njit(cache=True, fastmath=_FASTMATH)
def _next_panel(idx, a, b, p_idx, p_tile, pa, pb, max_blocks, blocks, tiles):
    """The next (up to ``max_blocks``) blocks of two sorted CSR segments (full ``idx[a:b]`` and
    partial ``p_idx[pa:pb]``), merged in order: ``blocks[i]`` gets the panel's i-th block and
    ``tiles[i]`` its mask tile (-1: full). Returns (block count, new a, new pa)."""
    count = 0
    while count < max_blocks and (a < b or pa < pb):
        take_full = pa >= pb or (a < b and idx[a] < p_idx[pa])
        if take_full:
            blocks[count], tiles[count] = idx[a], -1
            a += 1
        else:
            blocks[count], tiles[count] = p_idx[pa], p_tile[pa]
            pa += 1
        count += 1
    return count, a, pa


@njit(cache=True, fastmath=_FASTMATH)
def _run(blocks, t0, count, block_size, n):
    """The run of consecutive blocks starting at panel position t0: (end position t1, first token,
    token count), clipped to the sequence length n. Its columns in the panel start at t0 * block_size."""
    t1 = t0 + 1
    while t1 < count and blocks[t1] == blocks[t1 - 1] + 1:
        t1 += 1
    start = blocks[t0] * block_size
    return t1, start, min(blocks[t1 - 1] * block_size + block_size, n) - start


@njit(cache=True, fastmath=_FASTMATH)
def _run_span(t0, t1, n, tiles, spans):
    """[lo, hi) of a run's n tokens to compute: a single partial block's tile span, else all."""
    if t1 == t0 + 1 and tiles[t0] >= 0:
        return spans[tiles[t0], 0], min(spans[tiles[t0], 1], n)
    return 0, n


@njit(cache=True, fastmath=_FASTMATH)
def _panel_width(blocks, count, block_size, n):
    """Columns of a panel of ``count`` blocks: only the sequence's last block may be short (and it
    comes last)."""
    return (count - 1) * block_size + min(block_size, n - blocks[count - 1] * block_size)


@njit(cache=True, fastmath=_FASTMATH)
def _mask_panel(s, tiles, count, block_size, masks, transposed):
    """-inf where a partial block's tile is False. s: (rows, W) scores of the panel's blocks
    along columns; ``transposed``: s is (cols of one key block, W) with the panel's blocks being
    query blocks, so tile[i, j] applies to s[j, offset + i]."""
    rows, width = s.shape
    for t in range(count):
        tile_id = tiles[t]
        if tile_id < 0:
            continue
        tile = masks[tile_id]
        off = t * block_size
        n = min(block_size, width - off)
        if transposed:
            for j in range(rows):
                for i in range(n):
                    s[j, off + i] = s[j, off + i] if tile[i, j] else -np.inf
        else:
            for i in range(rows):
                for j in range(n):
                    s[i, off + j] = s[i, off + j] if tile[i, j] else -np.inf


@njit(cache=True, fastmath=_FASTMATH | {"nnan"})
def _row_max(row, start, lanes):
    """max(start, row) of a 1-D row, with ``lanes`` (a scratch array, (_LANES,)) holding
    running maxima of the row's columns mod _LANES: this loop vectorises, a single running max
    does not (LLVM only vectorises float max reductions under function-level no-NaN attributes)."""
    n = row.size
    lanes[:] = start
    for j0 in range(0, n - _LANES + 1, _LANES):
        for u in range(_LANES):
            x = row[j0 + u]
            lanes[u] = x if x > lanes[u] else lanes[u]
    best = start
    for u in range(_LANES):
        best = lanes[u] if lanes[u] > best else best
    for j in range(n - n % _LANES, n):
        best = row[j] if row[j] > best else best
    return best


@njit(cache=True, fastmath=_FASTMATH)
def _online_softmax(s, m, l, acc, lanes):
    """s (rows, W) base-2 scores -> probabilities relative to the updated running max m;
    rescales the running sum l and the output accumulator acc (rows, D) accordingly."""
    rows, width = s.shape
    for i in range(rows):
        row = s[i]
        m_new = _row_max(row, m[i], lanes)
        if m_new == -np.inf:                             # nothing allowed yet in this row
            row[:] = 0
            continue
        alpha = _exp2(m[i] - m_new)
        total = l[i] - l[i]                              # a zero of the dtype (l is finite)
        for j in range(width):
            p = _exp2(row[j] - m_new)
            row[j] = p
            total += p
        l[i] = l[i] * alpha + total
        for d in range(acc.shape[1]):
            acc[i, d] *= alpha
        m[i] = m_new


@njit(cache=True, fastmath=_FASTMATH)
def _grad_scores_t(st, dpt, lse2, delta, c):
    """In: st = S.T raw scores (-inf where masked), dpt = dP.T, both (cols, W); lse2, delta (W,)
    per query. Out: dpt <- P.T = exp2(st * c - lse2) (0 where masked or lse2 = +inf: empty rows)
    and st <- dS.T = P.T * (dP.T - delta)."""
    cols, width = st.shape
    for j in range(cols):
        for i in range(width):
            p = _exp2(st[j, i] * c - lse2[i])
            st[j, i] = p * (dpt[j, i] - delta[i])
            dpt[j, i] = p


@njit(cache=True, fastmath=_FASTMATH)
def _panel(buffer, rows, width):
    """A (rows, width) C-contiguous view of a flat scratch buffer."""
    return buffer[:rows * width].reshape((rows, width))


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------
@njit(cache=True, fastmath=_FASTMATH)
def _forward_row(q, k, v, n_k, idx, a, b, p_idx, p_tile, pa, pb, masks, spans, block_size, max_blocks, qscale,
                 scores, acc, m, l, lanes, blocks, tiles, out, lse):
    """One query block: q (rows, D); k, v (Nk, D) of its kv head; writes out (rows, D) and lse (rows,)."""
    rows, dim = q.shape
    m[:rows] = -np.inf
    l[:rows] = 0
    acc[:rows] = 0
    zero, one = qscale - qscale, qscale / qscale
    while a < b or pa < pb:
        count, a, pa = _next_panel(idx, a, b, p_idx, p_tile, pa, pb, max_blocks, blocks, tiles)
        s = _panel(scores, rows, _panel_width(blocks, count, block_size, n_k))  # (rows, W)
        t = 0
        while t < count:                                                         # base-2 scores, run by run
            end, j0, n = _run(blocks, t, count, block_size, n_k)
            lo, hi = _run_span(t, end, n, tiles, spans)                          # the mask sets the rest
            off = t * block_size
            _gemm(qscale, q, False, k[j0 + lo:j0 + hi], True, zero, s[:, off + lo:off + hi])
            t = end
        _mask_panel(s, tiles, count, block_size, masks, False)
        _online_softmax(s, m, l, acc[:rows], lanes)
        t = 0
        while t < count:                                                         # acc += P @ v
            end, j0, n = _run(blocks, t, count, block_size, n_k)
            lo, hi = _run_span(t, end, n, tiles, spans)
            off = t * block_size
            _gemm(one, s[:, off + lo:off + hi], False, v[j0 + lo:j0 + hi], False, one, acc[:rows])
            t = end
    for i in range(rows):
        if l[i] > 0:
            inv = 1 / l[i]
            for d in range(dim):
                out[i, d] = acc[i, d] * inv
            lse[i] = (m[i] + np.log2(l[i])) * _LN2
        else:                                                                    # no allowed key
            out[i] = 0
            lse[i] = -np.inf


@njit(cache=True, fastmath=_FASTMATH, parallel=True)
def _forward(q, k, v, full_ptr, full_idx, part_ptr, part_idx, part_mask, masks, spans, order, n_workers, block_size,
             max_blocks, qscale, out, lse):
    batch, heads, n_q, dim = q.shape
    group = heads // k.shape[1]
    n_k = k.shape[2]
    n_qb = full_ptr.shape[2] - 1
    shared_b, shared_h = full_ptr.shape[0] == 1, full_ptr.shape[1] == 1
    counter = np.zeros(1, np.int64)
    for _ in prange(n_workers):
        scores = np.empty(block_size * max_blocks * block_size, q.dtype)
        acc = np.empty((block_size, dim), q.dtype)
        m = np.empty(block_size, q.dtype)
        l = np.empty(block_size, q.dtype)
        lanes = np.empty(_LANES, q.dtype)
        blocks = np.empty(max_blocks, np.int64)
        tiles = np.empty(max_blocks, np.int64)
        while True:
            t = _fetch_add(counter)
            if t >= order.size:
                break
            task = order[t]
            b, h, r = task // (heads * n_qb), task // n_qb % heads, task % n_qb
            lb, lh = 0 if shared_b else b, 0 if shared_h else h
            i0 = r * block_size
            rows = min(block_size, n_q - i0)
            _forward_row(q[b, h, i0:i0 + rows], k[b, h // group], v[b, h // group], n_k,
                         full_idx, full_ptr[lb, lh, r], full_ptr[lb, lh, r + 1],
                         part_idx, part_mask, part_ptr[lb, lh, r], part_ptr[lb, lh, r + 1], masks, spans,
                         block_size, max_blocks, qscale, scores, acc, m, l, lanes, blocks, tiles,
                         out[b, h, i0:i0 + rows], lse[b, h, i0:i0 + rows])


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------
@njit(cache=True)
def _static_schedule(order, costs, n_workers):
    """Tasks of ``order`` (heaviest first) dealt to the least-loaded worker so far (LPT, ties to
    the lowest worker): worker w runs ``tasks[ptr[w]:ptr[w + 1]]`` in that order. Depends only on
    the layout and n_workers, so the dQ sums of every worker's buffer are reproducible."""
    load = np.zeros(n_workers, np.int64)
    owner = np.empty(order.size, np.int64)
    ptr = np.zeros(n_workers + 1, np.int64)
    for t in range(order.size):
        w = np.argmin(load)
        owner[t] = w
        load[w] += costs[order[t]] + 1                                           # +1: a task's fixed cost
        ptr[w + 1] += 1
    ptr = np.cumsum(ptr)
    tasks = np.empty(order.size, np.int64)
    fill = ptr[:-1].copy()
    for t in range(order.size):
        tasks[fill[owner[t]]] = order[t]
        fill[owner[t]] += 1
    return ptr, tasks


@njit(cache=True, fastmath=_FASTMATH)
def _backward_head(kc, vc, q, do, lse2, delta, n_q, idx, a, b, p_idx, p_tile, pa, pb, masks, spans, block_size,
                   max_blocks, qscale, scale, scores, dscores, lse2_p, delta_p, blocks, tiles, dk, dv, dq):
    """One key block against one query head: adds to dk, dv (cols, D) and to that head's
    dq (Nq, D). kc, vc (cols, D); q, do (Nq, D) and lse2, delta (Nq,) of the query head."""
    cols, dim = kc.shape
    zero, one = scale - scale, scale / scale
    while a < b or pa < pb:
        count, a, pa = _next_panel(idx, a, b, p_idx, p_tile, pa, pb, max_blocks, blocks, tiles)
        width = _panel_width(blocks, count, block_size, n_q)
        st = _panel(scores, cols, width)                                         # (cols, W) = S.T
        dpt = _panel(dscores, cols, width)                                       # (cols, W) = dP.T
        t = 0
        while t < count:                                                         # run by run of query blocks
            end, i0, n = _run(blocks, t, count, block_size, n_q)
            lo, hi = _run_span(t, end, n, tiles, spans)                          # the mask sets st elsewhere
            off = t * block_size
            _gemm(one, kc, False, q[i0 + lo:i0 + hi], True, zero, st[:, off + lo:off + hi])
            _gemm(one, vc, False, do[i0 + lo:i0 + hi], True, zero, dpt[:, off + lo:off + hi])
            dpt[:, off:off + lo] = 0                                             # finite, so dS = 0 * (0 - delta)
            dpt[:, off + hi:off + n] = 0
            lse2_p[off:off + n] = lse2[i0:i0 + n]
            delta_p[off:off + n] = delta[i0:i0 + n]
            t = end
        _mask_panel(st, tiles, count, block_size, masks, True)
        _grad_scores_t(st, dpt, lse2_p[:width], delta_p[:width], qscale)         # st = dS.T, dpt = P.T
        t = 0
        while t < count:
            end, i0, n = _run(blocks, t, count, block_size, n_q)
            lo, hi = _run_span(t, end, n, tiles, spans)
            a0, a1, c0, c1 = i0 + lo, i0 + hi, t * block_size + lo, t * block_size + hi
            _gemm(one, dpt[:, c0:c1], False, do[a0:a1], False, one, dv)             # dv += P.T @ dO
            _gemm(scale, st[:, c0:c1], False, q[a0:a1], False, one, dk)             # dk += dS.T @ q
            _gemm(scale, st[:, c0:c1], True, kc, False, one, dq[a0:a1])             # dq += dS @ k
            t = end


@njit(cache=True, fastmath=_FASTMATH, parallel=True)
def _backward_kernel(q, k, v, dout, lse2, delta, full_t_ptr, full_t_idx, part_t_ptr, part_t_idx, part_t_mask,
                     masks, spans, ptr, tasks, block_size, max_blocks, qscale, scale, dq, dq_parts, dk, dv):
    """One pass over key blocks. Worker w runs its static share ``tasks[ptr[w]:ptr[w + 1]]``; each
    task zeroes and then accumulates its own rows of dk and dv, and adds its dQ terms to worker w's
    buffer (dq itself for w = 0, dq_parts[w - 1] otherwise), which the worker zeroes first."""
    batch, heads, n_q, dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    n_kb = full_t_ptr.shape[2] - 1
    shared_b, shared_h = full_t_ptr.shape[0] == 1, full_t_ptr.shape[1] == 1
    for w in prange(ptr.size - 1):
        scores = np.empty(block_size * max_blocks * block_size, q.dtype)
        dscores = np.empty(block_size * max_blocks * block_size, q.dtype)
        lse2_p = np.empty(max_blocks * block_size, q.dtype)
        delta_p = np.empty(max_blocks * block_size, q.dtype)
        blocks = np.empty(max_blocks, np.int64)
        tiles = np.empty(max_blocks, np.int64)
        buffer = dq if w == 0 else dq_parts[w - 1]
        buffer.reshape(-1)[:] = 0
        for t in range(ptr[w], ptr[w + 1]):
            task = tasks[t]
            b, g, c = task // (kv_heads * n_kb), task // n_kb % kv_heads, task % n_kb
            j0 = c * block_size
            cols = min(block_size, n_k - j0)
            lb = 0 if shared_b else b
            dk[b, g, j0:j0 + cols] = 0
            dv[b, g, j0:j0 + cols] = 0
            for h in range(g * group, (g + 1) * group):
                lh = 0 if shared_h else h
                _backward_head(k[b, g, j0:j0 + cols], v[b, g, j0:j0 + cols], q[b, h], dout[b, h], lse2[b, h],
                               delta[b, h], n_q, full_t_idx, full_t_ptr[lb, lh, c], full_t_ptr[lb, lh, c + 1],
                               part_t_idx, part_t_mask, part_t_ptr[lb, lh, c], part_t_ptr[lb, lh, c + 1], masks, spans,
                               block_size, max_blocks, qscale, scale, scores, dscores, lse2_p, delta_p, blocks, tiles,
                               dk[b, g, j0:j0 + cols], dv[b, g, j0:j0 + cols], buffer[b, h])


@njit(cache=True, fastmath=_FASTMATH, parallel=True)
def _delta_lse2(out, dout, lse, dlse, log2e, delta, lse2):
    """Per query row: delta = rowsum(dout * out) - dlse, and lse2 = lse * log2(e) in base 2 with
    +inf for empty rows (lse = -inf), so that their P = exp2(S - lse2) is exactly 0.
    out, dout (R, D); lse, dlse, delta, lse2 (R,)."""
    rows, dim = out.shape
    for i in prange(rows):
        total = log2e - log2e                            # a zero of the dtype
        for d in range(dim):
            total += dout[i, d] * out[i, d]
        delta[i] = total - dlse[i]
        lse2[i] = np.inf if lse[i] == -np.inf else lse[i] * log2e


@njit(cache=True, fastmath=_FASTMATH, parallel=True)
def _sum_parts(dq, dq_parts):
    """dq += dq_parts[0] + dq_parts[1] + ..., in that order. dq (R, D), dq_parts (P, R, D)."""
    rows, dim = dq.shape
    for i in prange(rows):
        for p in range(dq_parts.shape[0]):
            for d in range(dim):
                dq[i, d] += dq_parts[p, i, d]
