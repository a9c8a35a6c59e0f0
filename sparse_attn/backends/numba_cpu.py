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
   ``m'`` (16 running lanes, so the reduction vectorises) and the key holding it, ``P = exp2(S - m')``,
   ``l = l * exp2(m - m') + sum(P)``, ``acc = acc * exp2(m - m') + P @ v[run]`` per run (the gemm
   accumulates into acc: beta = 1). A partial block alone in its run is computed only on its
   tile's span of allowed keys (a Longformer band row's global-column block: 16 of 64 keys); the
   mask sets the rest of its columns to ``-inf``.
3. ``out = acc / l``, ``lse = (m + log2 l) * ln 2`` (in float64, rounded once); the backward also
   gets ``m``, ``log2 l`` and the key of ``m``. A row with no allowed key keeps ``l = 0`` and
   returns 0 and ``lse = -inf``.

The last block may be shorter than ``block_size``: panels are clipped to ``n_k`` and the query
block to ``n_q``, so full blocks need no mask; partial tiles are already False outside.

Backward (FlashAttention-2, recomputing ``P = exp2(min(S - m, 0) - log2 l)`` from q, k and the
forward's ``m`` and ``log2 l``; ``m = +inf`` for empty rows, so their ``P`` is exactly 0): one pass
over key blocks, 5 matmuls per computed block. A parallel prologue computes, per query row,
``delta = rowsum(dO * O) - dlse`` (0 for empty rows). A task (key block ``c`` of kv head ``g``)
walks, for every query head of its GQA group, its query blocks (transposed CSR) in panels of runs,
as the forward does, and computes ``S.T = (scale log2(e)) k[c] @ q[run].T`` and
``dP.T = v[c] @ dO[run].T`` per run, ``P.T`` and ``dS.T = P.T * (dP.T - delta)`` over the panel,
then per run ``dV[c] += P.T @ dO[run]``, ``dK[c] += scale dS.T @ q[run]`` (rows the task owns) and
``dQ[run] += scale dS @ k[c]``; a partial block alone in its run is computed only on its tile's
span of allowed queries (the global rows' block: 16 of 64 queries).

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

Memory beyond inputs, outputs and gradients: O(N) (lse, m, log2 l and the key of m per row, delta,
task lists), per-worker scratch of two ``block x _PANEL_KEYS`` panels, and ``threads - 1``
dQ-sized buffers in the backward: O(threads x N x D). Gradients and dQ buffers are zeroed inside
the kernel by the worker that owns them.

Matmuls call BLAS ?gemm directly (the binding Numba's ``np.dot`` uses), with alpha, beta and
transposes, so there are no temporary products or extra additions.

Precision: float32 and float64 are computed in their own dtype (float32 with a vectorisable
degree-7 ``exp2``, relative error ~1e-7, since Numba has no vector exp without SVML); float16 and
bfloat16 inputs are computed in float32 and returned in the input dtype. Recomputing P is what
large logits punish: BLAS rounds a score a few ulps differently in the backward's matmul shapes
than in the forward's (float32; float64 agrees here), and ``exp2`` turns an absolute error of the
score into a relative error of P (with scale=1e10, 3 ulps turned P = 1 into 0). So the backward
computes S with the forward's alpha, takes ``S - m`` against the forward's exact ``m`` and
``log2 l`` separately (no rounded lse in between), sets the score of each row's maximum to ``m``
exactly (``_pin_maxima``: that P is then the forward's ``1 / l``), caps ``P`` at ``1 / l``, and,
for rows whose softmax is one-hot in the dtype (``l = 1``), forms that pair's ``dP - delta`` as
``dO . (v - out) + dlse`` (``_max_pair_grads``: exactly ``dlse``, where two large dot products
would cancel to a rounding error that dq and dk multiply by ``scale |k|``). Other pairs keep the
errors torch's own float32 softmax has.

Non-finite inputs: the result is the reference's restricted to the allowed pairs: a NaN or inf in
q, k or v reaches exactly the outputs and gradients of the pairs that meet it; an empty row stays 0,
-inf and zero gradients. The fast path cannot guarantee that alone (a masked pair inside a
computed tile multiplies 0 by the NaN in a matmul), so rows whose fast result is not finite are
recomputed by an exact path (``_exact_row``, ``_exact_dk_dv``, ``_exact_dq_rows``): the reference's
formulas over the row's (or key's) allowed pairs in float64, with scores rounded to the inputs'
dtype so they overflow where torch's do. Finite inputs never take it unless a value overflows.
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
# No 'nnan'/'ninf': -inf marks masked scores and empty rows, and NaN and inf in the inputs must
# propagate. Code that tests for NaN/inf says fastmath=False: a function without its own flags
# inherits its caller's, and under 'reassoc' x - x folds to 0, which is how Numba writes isfinite.
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
    out, lse, _, _ = numba_attention(q, k, v, *layout.index, layout.block_size, scale)
    return out.to(dtype), lse


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
                    part_t_mask: torch.Tensor, block_size: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward kernel on float32/float64 CPU tensors: (out, lse, stats, argmax).

    ``stats`` (2, B, Hq, Nq) in q's dtype and ``argmax`` (B, Hq, Nq) int64 are for the backward:
    each row's base-2 score maximum and log2 of its sum, and the key holding the maximum."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)                                                    # (B, Hq, Nq, D)
    lse = q.new_empty(q.shape[:3])                                               # (B, Hq, Nq)
    stats = q.new_empty((2, *q.shape[:3]))                                       # (2, B, Hq, Nq)
    argmax = torch.empty(q.shape[:3], dtype=torch.int64)                         # (B, Hq, Nq)
    order = _heaviest_first(_task_costs(full_ptr, part_ptr, q.shape[0], q.shape[1]))
    with _KERNELS.running():
        _forward(q.numpy(), k.numpy(), v.numpy(), full_ptr.numpy(), full_idx.numpy(), part_ptr.numpy(),
                 part_idx.numpy(), part_mask.numpy(), masks.numpy(), _tile_spans(masks, 1), order,
                 numba.get_num_threads(), block_size, _panel_blocks(block_size), _as(q, scale),
                 _as(q, scale * _LOG2E), out.numpy(), lse.numpy(), stats[0].numpy(), stats[1].numpy(), argmax.numpy())
    return out, lse, stats, argmax


@numba_attention.register_fake
def _(q, k, v, *layout_and_args):
    rows = q.shape[:3]
    return torch.empty_like(q), q.new_empty(rows), q.new_empty((2, *rows)), q.new_empty(rows, dtype=torch.int64)


@torch.library.custom_op("sparse_attn::numba_attention_backward", mutates_args=())
def numba_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, stats: torch.Tensor, argmax: torch.Tensor,
                             dlse: torch.Tensor, full_ptr: torch.Tensor, full_idx: torch.Tensor,
                             part_ptr: torch.Tensor, part_idx: torch.Tensor, part_mask: torch.Tensor,
                             masks: torch.Tensor, full_t_ptr: torch.Tensor, full_t_idx: torch.Tensor,
                             part_t_ptr: torch.Tensor, part_t_idx: torch.Tensor, part_t_mask: torch.Tensor,
                             block_size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward kernel: (dq, dk, dv) from dout and dlse, the gradients of out and lse; lse, stats
    and argmax are the forward's."""
    dout, q, k, v, out, lse, dlse = (t.contiguous() for t in (dout, q, k, v, out, lse, dlse))
    batch, heads, n_q, dim = q.shape
    workers = numba.get_num_threads()
    costs = _task_costs(full_t_ptr, part_t_ptr, batch, heads, k.shape[1])
    ptr, tasks = _static_schedule(_heaviest_first(costs), costs, workers)
    # Written (and zeroed, worker by worker) inside the kernels: no serial memset of fresh pages.
    delta = torch.empty_like(lse)                                                # (B, Hq, Nq)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dq_parts = q.new_empty((workers - 1, *q.shape))                              # (W-1, B, Hq, Nq, D)
    rows = batch * heads * n_q
    not_finite = np.empty(rows, np.bool_)                                        # dq rows to recompute exactly
    qkv = (q.numpy(), k.numpy(), v.numpy(), dout.numpy())
    per_row = (lse.numpy(), *stats.contiguous().numpy(), argmax.contiguous().numpy(), delta.numpy())  # (B, Hq, Nq)
    scales = (_as(q, scale * _LOG2E), _as(q, scale))
    with _KERNELS.running():
        _delta(out.view(rows, dim).numpy(), dout.view(rows, dim).numpy(), lse.view(rows).numpy(),
               dlse.view(rows).numpy(), _as(q, 0), delta.view(rows).numpy())
        maxima = _maxima_by_key_block(per_row[3], block_size, full_t_ptr.shape[2] - 1)
        _backward_kernel(*qkv, out.numpy(), dlse.numpy(), *per_row, *maxima, full_t_ptr.numpy(), full_t_idx.numpy(),
                         part_t_ptr.numpy(), part_t_idx.numpy(), part_t_mask.numpy(), masks.numpy(),
                         _tile_spans(masks, 0), ptr, tasks, block_size, _panel_blocks(block_size), *scales, dq.numpy(),
                         dq_parts.numpy(), dk.numpy(), dv.numpy())
        _sum_parts(dq.view(rows, dim).numpy(), dq_parts.view(workers - 1, rows, dim).numpy(), not_finite)
        if not_finite.any():
            _exact_dq_rows(np.flatnonzero(not_finite), *qkv, *per_row, full_ptr.numpy(), full_idx.numpy(),
                           part_ptr.numpy(), part_idx.numpy(), part_mask.numpy(), masks.numpy(), block_size, *scales,
                           dq.numpy())
    return dq, dk, dv


@numba_attention_backward.register_fake
def _(dout, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *layout, block_size, scale = inputs
    out, lse, stats, argmax = output
    ctx.mark_non_differentiable(stats, argmax)
    ctx.save_for_backward(q, k, v, out, lse, stats, argmax, *layout)
    ctx.block_size, ctx.scale = block_size, scale


def _autograd_backward(ctx, dout, dlse, _dstats, _dargmax):
    q, k, v, out, lse, stats, argmax, *layout = ctx.saved_tensors  # an unused lse gets zeros, never None
    dq, dk, dv = numba_attention_backward(dout, q, k, v, out, lse, stats, argmax, dlse, *layout, ctx.block_size,
                                          ctx.scale)
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
    """2 ** x; vectorisable in float32 (no libm call): exactly 0 below 2 ** -126, inf above
    2 ** 127, NaN for NaN (as libm's, which float64 uses)."""


_EXP2_COEFFS = tuple(np.float32(_LN2 ** i / math.factorial(i)) for i in range(8))
_C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7 = _EXP2_COEFFS
_F32_MIN_EXP, _F32_MAX_EXP = np.float32(-126.0), np.float32(127.0)
_HALF_F32, _ZERO_F32, _INF_F32 = np.float32(0.5), np.float32(0.0), np.float32(np.inf)


@overload(_exp2, fastmath=_FASTMATH)
def _exp2_impl(x):
    if x == types.float32:
        def exp2_f32(x):
            normal = (x >= _F32_MIN_EXP) & (x <= _F32_MAX_EXP)                  # False for NaN
            xc = x if normal else _ZERO_F32              # finite, so the int conversion is defined
            n = np.floor(xc + _HALF_F32)                 # x = n + f, |f| <= 1/2
            f = xc - n
            p = _C0 + f * (_C1 + f * (_C2 + f * (_C3 + f * (_C4 + f * (_C5 + f * (_C6 + f * _C7))))))
            scale = _int_bits_as_float32((np.int32(n) + np.int32(127)) << np.int32(23))  # 2 ** n
            return p * scale if normal else (_ZERO_F32 if x < _F32_MIN_EXP else x * _INF_F32)  # NaN * inf = NaN
        return exp2_f32
    if x == types.float64:
        return lambda x: np.exp2(x)


def _like(template, x):
    """x converted to the float type of ``template`` (a float32 or float64 scalar)."""


@overload(_like)
def _like_impl(template, x):
    if template == types.float32:
        return lambda template, x: np.float32(x)
    return lambda template, x: np.float64(x)


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


@njit(cache=True, fastmath=_FASTMATH)
def _row_max(row, start, lanes):
    """(max(start, row), where) of a 1-D row, skipping NaN, with ``lanes`` (a scratch array,
    (_LANES,)) holding running maxima of the row's columns mod _LANES: this loop vectorises (x86
    max instructions are this select, NaN included), a single running max does not (LLVM
    vectorises float max reductions only under no-NaN flags, which would make a NaN score
    undefined). Where the max exceeds start, ``where`` tells _column_of where it is."""
    n = row.size
    lanes[:] = start
    for j0 in range(0, n - _LANES + 1, _LANES):
        for u in range(_LANES):
            x = row[j0 + u]
            lanes[u] = x if x > lanes[u] else lanes[u]
    best, where = start, 0
    for u in range(_LANES):
        more = lanes[u] > best
        best, where = (lanes[u], u) if more else (best, where)
    for j in range(n - n % _LANES, n):
        more = row[j] > best
        best, where = (row[j], j) if more else (best, where)
    return best, where


@njit(cache=True, fastmath=_FASTMATH)
def _column_of(row, value, where):
    """The first column of the row holding ``value``, the maximum _row_max found with ``where``: a
    column of the tail, or a lane (columns where, where + _LANES, ...; selects over a fixed count
    rather than an early exit, which would be a mispredicted branch per row)."""
    groups = row.size - row.size % _LANES
    if where >= groups:
        return where
    j = groups
    for j0 in range(groups - _LANES + where, -1, -_LANES):
        j = j0 if row[j0] == value else j
    return j


@njit(cache=True, fastmath=_FASTMATH)
def _has_nan(row):
    """Whether a row whose maximum (without NaN) is -inf holds a NaN: any entry other than -inf."""
    for x in row:
        if x != -np.inf:
            return True
    return False


@njit(cache=True, fastmath=_FASTMATH)
def _online_softmax(s, m, l, acc, lanes, blocks, block_size, argmax):
    """s (rows, W) base-2 scores -> probabilities relative to the updated running max m;
    rescales the running sum l and the output accumulator acc (rows, D) accordingly, and keeps
    in argmax the key of each row's maximum. A NaN score makes l NaN (no hiding in the max)."""
    rows, width = s.shape
    for i in range(rows):
        row = s[i]
        m_new, where = _row_max(row, m[i], lanes)
        if m_new == -np.inf:                             # nothing allowed yet in this row, or NaN
            if _has_nan(row):
                l[i] = np.nan
            row[:] = 0
            continue
        if m_new > m[i]:                                 # a new max: its key (panel position t holds
            j = _column_of(row, m_new, where)            # key block blocks[t] from column t * block_size)
            argmax[i] = blocks[j // block_size] * block_size + j % block_size
        alpha = _exp2(m[i] - m_new)                      # NaN for m = m_new = +inf: l becomes NaN
        total = l[i] - l[i]                              # a zero of the dtype
        for j in range(width):
            p = _exp2(row[j] - m_new)
            row[j] = p
            total += p
        l[i] = l[i] * alpha + total
        for d in range(acc.shape[1]):
            acc[i, d] *= alpha
        m[i] = m_new


@njit(cache=True, parallel=True)
def _maxima_by_key_block(argmax, block_size, n_kb):
    """The queries whose row maximum is in each key block, ascending: queries[b, h, ptr[b, h, c]:
    ptr[b, h, c + 1]] for key block c (CSR, built by counting). argmax (B, H, Nq), -1 for none."""
    batch, heads, n_q = argmax.shape
    ptr = np.zeros((batch, heads, n_kb + 1), np.int64)
    queries = np.empty((batch, heads, n_q), np.int64)
    for bh in prange(batch * heads):
        b, h = bh // heads, bh % heads
        for i in range(n_q):
            if argmax[b, h, i] >= 0:
                ptr[b, h, argmax[b, h, i] // block_size + 1] += 1
        for c in range(n_kb):
            ptr[b, h, c + 1] += ptr[b, h, c]
        fill = ptr[b, h, :n_kb].copy()
        for i in range(n_q):
            if argmax[b, h, i] >= 0:
                c = argmax[b, h, i] // block_size
                queries[b, h, fill[c]] = i
                fill[c] += 1
    return ptr, queries


@njit(cache=True, fastmath=_FASTMATH)
def _panel_maxima(blocks, count, block_size, maxima, e, pins):
    """Writes into pins (2, capacity) the (panel column, query) of the queries maxima[e:] (ascending:
    those whose row maximum is in the task's key block) that fall in the panel's query blocks
    blocks[:count]; returns (how many, the next e). Panels come in block order, so one merge."""
    n = 0
    for t in range(count):
        start = blocks[t] * block_size
        while e < maxima.size and maxima[e] < start + block_size:
            pins[0, n] = t * block_size + maxima[e] - start
            pins[1, n] = maxima[e]
            n += 1
            e += 1
    return n, e


@njit(cache=True, fastmath=_FASTMATH)
def _pin_maxima(st, pins, count, argmax, row_max, j0):
    """Sets S.T of each query's maximum to the forward's row max, bitwise: BLAS rounds a score
    differently in the backward's matmul shapes, and exp2 would amplify the difference (3 ulps of a
    score of 1e11 makes P 0 instead of 1). st (cols, W): key block j0's scores against a panel of
    queries; pins[:, :count] (panel column, query) from _panel_maxima."""
    for e in range(count):
        i = pins[1, e]
        st[argmax[i] - j0, pins[0, e]] = row_max[i]


@njit(cache=True, fastmath=_FASTMATH)
def _max_pair_grads(st, dpt, pins, count, argmax, log2_sum, do, out, dlse, vc, j0):
    """For rows whose softmax is one-hot in the dtype (l = 1: every other term is below an ulp),
    sets dS.T of the maximum to P (dO . (v - out) + dlse), which is P (dP - delta) without
    subtracting two large dot products: out = v there, so this is P dlse, where dP - delta would
    leave a rounding error that dq and dk multiply by scale |k| (torch gets these rows exact too;
    elsewhere its softmax backward cancels as much). st, dpt (cols, W) hold dS.T and P.T of key
    block j0's keys vc (cols, D); do, out (Nq, D), log2_sum and dlse (Nq,) of the query head; pins
    as in _pin_maxima."""
    for e in range(count):
        c, i = pins[0, e], pins[1, e]
        if log2_sum[i] != 0:
            continue
        jj = argmax[i] - j0
        total = dlse[i]
        for d in range(do.shape[1]):
            total += do[i, d] * (vc[jj, d] - out[i, d])
        st[jj, c] = dpt[jj, c] * total


@njit(cache=True, fastmath=_FASTMATH)
def _grad_scores_t(st, dpt, row_max, log2_sum, delta, zero):
    """In: st = S.T base-2 scores (-inf where masked), dpt = dP.T, both (cols, W); row_max,
    log2_sum, delta (W,) per query. Out: dpt <- P.T = exp2(min(S - row max, 0) - log2 sum) (P <= 1;
    0 where masked and for empty rows, whose row max is +inf) and st <- dS.T = P.T * (dP.T - delta)."""
    cols, width = st.shape
    for j in range(cols):
        for i in range(width):
            x = st[j, i] - row_max[i]
            p = _exp2((zero if x > zero else x) - log2_sum[i])                # NaN stays NaN
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
def _forward_row(q, k, v, n_k, idx, a, b, p_idx, p_tile, pa, pb, masks, spans, block_size, max_blocks, scale, qscale,
                 scores, acc, m, l, lanes, blocks, tiles, out, lse, row_max, log2_sum, argmax):
    """One query block: q (rows, D); k, v (Nk, D) of its kv head; writes out (rows, D) and lse,
    row_max, log2_sum, argmax (rows,)."""
    rows, dim = q.shape
    m[:rows] = -np.inf
    l[:rows] = 0
    acc[:rows] = 0
    zero, one = qscale - qscale, qscale / qscale
    full_blocks, a0, pa0 = b - a, a, pa
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
        _online_softmax(s, m, l, acc[:rows], lanes, blocks, block_size, argmax)
        t = 0
        while t < count:                                                         # acc += P @ v
            end, j0, n = _run(blocks, t, count, block_size, n_k)
            lo, hi = _run_span(t, end, n, tiles, spans)
            off = t * block_size
            _gemm(one, s[:, off + lo:off + hi], False, v[j0 + lo:j0 + hi], False, one, acc[:rows])
            t = end
    for i in range(rows):
        finite = l[i] > 0                                # out = acc / l; every value finite?
        if finite:                                       # (a comparison false for NaN and inf: no
            inv = 1 / l[i]                               # fastmath flag assumes them away)
            for d in range(dim):
                out[i, d] = acc[i, d] * inv
                finite &= abs(out[i, d]) < np.inf
        if finite:
            log2_l = np.log2(l[i])
            lse[i] = (np.float64(m[i]) + np.float64(log2_l)) * _LN2              # rounded once
            row_max[i] = m[i]
            log2_sum[i] = log2_l
        elif l[i] == 0 and not _row_has_key(i, full_blocks, p_tile, pa0, pb, masks):  # no allowed key
            out[i] = 0
            lse[i], row_max[i], log2_sum[i], argmax[i] = -np.inf, np.inf, 0, -1
        else:                  # NaN or inf met, an overflow, or every score underflowed to -inf
            lse[i], row_max[i], log2_sum[i], argmax[i] = _exact_row(
                i, q[i], k, v, idx, a0, b, p_idx, p_tile, pa0, pb, masks, block_size, scale, qscale, out[i])


@njit(cache=True, fastmath=False)
def _finite(x):
    """Whether no value of the 2-D array x is NaN or inf (false for both in the comparison; no early
    exit, so the loop vectorises)."""
    finite = True
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            finite &= abs(x[i, j]) < np.inf
    return finite


@njit(cache=True, fastmath=False)
def _row_has_key(i, full_blocks, p_tile, pa, pb, masks):
    """Whether row i of a query block with ``full_blocks`` full blocks and partial blocks
    ``p_tile[pa:pb]`` may attend any key."""
    if full_blocks > 0:
        return True
    for e in range(pa, pb):
        if masks[p_tile[e], i].any():
            return True
    return False


@njit(cache=True, fastmath=_FASTMATH, parallel=True)
def _forward(q, k, v, full_ptr, full_idx, part_ptr, part_idx, part_mask, masks, spans, order, n_workers, block_size,
             max_blocks, scale, qscale, out, lse, row_max, log2_sum, argmax):
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
            rows_of = slice(i0, i0 + rows)
            _forward_row(q[b, h, rows_of], k[b, h // group], v[b, h // group], n_k,
                         full_idx, full_ptr[lb, lh, r], full_ptr[lb, lh, r + 1],
                         part_idx, part_mask, part_ptr[lb, lh, r], part_ptr[lb, lh, r + 1], masks, spans,
                         block_size, max_blocks, scale, qscale, scores, acc, m, l, lanes, blocks, tiles,
                         out[b, h, rows_of], lse[b, h, rows_of], row_max[b, h, rows_of], log2_sum[b, h, rows_of],
                         argmax[b, h, rows_of])


# ------------------------------------------------------------------------------------------------
# The exact path: rows whose fast result is not finite, by the reference's formulas, in float64
# ------------------------------------------------------------------------------------------------
@njit(cache=True, fastmath=False)
def _allowed(pos, idx, a, b, p_idx, p_tile, pa, pb, masks, block_size, n, transposed, tokens):
    """Writes into ``tokens`` the tokens that token ``pos`` of its block pairs with, ascending, and
    returns their count. Row index (transposed False): pos is a query's offset in its query block,
    the blocks ``idx[a:b]`` (full) and ``p_idx[pa:pb]`` (partial, tiles p_tile) are key blocks;
    transposed: pos is a key's offset in its key block and the blocks are query blocks."""
    count = 0
    while a < b or pa < pb:
        full = pa >= pb or (a < b and idx[a] < p_idx[pa])
        start = (idx[a] if full else p_idx[pa]) * block_size
        for t in range(start, min(start + block_size, n)):
            if full or (masks[p_tile[pa], t - start, pos] if transposed else masks[p_tile[pa], pos, t - start]):
                tokens[count] = t
                count += 1
        if full:
            a += 1
        else:
            pa += 1
    return count


@njit(cache=True, fastmath=False)
def _score(x, y, scale):
    """scale * (x . y) rounded as torch rounds it in the inputs' dtype (the dot product, then the
    product), so that it overflows where the reference's does; summed in float64, returned as float64."""
    dot = 0.0
    for d in range(x.size):
        dot += np.float64(x[d]) * np.float64(y[d])
    return np.float64(_like(scale, _like(scale, dot) * scale))


@njit(cache=True, fastmath=False)
def _exact_row(i, q_i, k, v, idx, a, b, p_idx, p_tile, pa, pb, masks, block_size, scale, qscale, out_i):
    """Row i of a query block as the reference computes it over the row's allowed keys, in
    float64: shift = the max score (NaN if a score is NaN, 0 if it is infinite), w = exp(s - shift),
    out = sum(w / sum(w) * v), lse = shift + log(sum(w)); no key with w > 0: out 0 @ v, lse -inf.
    Writes out_i; returns lse and the row's base-2 max, log2 sum and argmax for the backward: for a
    row with no key (lse -inf) +inf, so that P = 0; for lse NaN or +inf, NaN, so that every pair of
    the row goes to the exact backward (_exact_grads)."""
    keys = np.empty(k.shape[0], np.int64)
    n = _allowed(i, idx, a, b, p_idx, p_tile, pa, pb, masks, block_size, k.shape[0], False, keys)
    shift, arg, nan = -np.inf, -1, False
    for t in range(n):
        s = _score(q_i, k[keys[t]], scale)
        if s != s:
            nan = True
        elif s > shift:
            shift, arg = s, keys[t]
    shift = np.nan if nan else (0.0 if np.isinf(shift) else shift)
    total = 0.0
    for t in range(n):
        total += np.exp(_score(q_i, k[keys[t]], scale) - shift)
    norm = total if total != 0 else 1.0
    acc = np.zeros(out_i.size)
    for t in range(n):
        w = np.exp(_score(q_i, k[keys[t]], scale) - shift) / norm
        for d in range(out_i.size):
            acc[d] += w * v[keys[t], d]
    out_i[:] = acc
    if total == 0:
        return -np.inf, np.inf, 0.0, -1
    lse = shift + np.log(total)
    if not np.isfinite(lse):
        return lse, np.nan, 0.0, -1
    return lse, _score(q_i, k[arg], qscale), np.log2(total), arg


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
def _backward_head(kc, vc, j0, q, do, out, dlse, row_max, log2_sum, argmax, delta, maxima, n_q, idx, a, b, p_idx, p_tile,
                   pa, pb, masks, spans, block_size, max_blocks, qscale, scale, scores, dscores, row_max_p, log2_sum_p,
                   delta_p, pins, blocks, tiles, dk, dv, dq):
    """One key block (its first key j0) against one query head: adds to dk, dv (cols, D) and to
    that head's dq (Nq, D). kc, vc (cols, D); q, do, out (Nq, D) and dlse, row_max, log2_sum,
    argmax, delta (Nq,) of the query head; maxima: its queries whose row maximum is in this block."""
    cols, dim = kc.shape
    zero, one = scale - scale, scale / scale
    e = 0
    while a < b or pa < pb:
        count, a, pa = _next_panel(idx, a, b, p_idx, p_tile, pa, pb, max_blocks, blocks, tiles)
        width = _panel_width(blocks, count, block_size, n_q)
        st = _panel(scores, cols, width)                                         # (cols, W) = S.T
        dpt = _panel(dscores, cols, width)                                       # (cols, W) = dP.T
        pinned, e = _panel_maxima(blocks, count, block_size, maxima, e, pins)
        t = 0
        while t < count:                                                         # run by run of query blocks
            end, i0, n = _run(blocks, t, count, block_size, n_q)
            lo, hi = _run_span(t, end, n, tiles, spans)                          # the mask sets st elsewhere
            off = t * block_size
            a0, a1 = i0 + lo, i0 + hi
            _gemm(qscale, kc, False, q[a0:a1], True, zero, st[:, off + lo:off + hi])   # as the forward: alpha
            _gemm(one, vc, False, do[a0:a1], True, zero, dpt[:, off + lo:off + hi])
            dpt[:, off:off + lo] = 0                                             # masked: P = 0 there
            dpt[:, off + hi:off + n] = 0
            row_max_p[off:off + n] = row_max[i0:i0 + n]
            log2_sum_p[off:off + n] = log2_sum[i0:i0 + n]
            delta_p[off:off + n] = delta[i0:i0 + n]
            t = end
        _pin_maxima(st, pins, pinned, argmax, row_max, j0)
        _mask_panel(st, tiles, count, block_size, masks, True)
        _grad_scores_t(st, dpt, row_max_p[:width], log2_sum_p[:width], delta_p[:width], zero)  # st = dS.T, dpt = P.T
        _max_pair_grads(st, dpt, pins, pinned, argmax, log2_sum, do, out, dlse, vc, j0)
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
def _backward_kernel(q, k, v, dout, out, dlse, lse, row_max, log2_sum, argmax, delta, maxima_ptr, maxima,
                     full_t_ptr, full_t_idx, part_t_ptr, part_t_idx, part_t_mask, masks, spans, ptr, tasks, block_size,
                     max_blocks, qscale, scale, dq, dq_parts, dk, dv):
    """One pass over key blocks. Worker w runs its static share ``tasks[ptr[w]:ptr[w + 1]]``; each
    task zeroes and then accumulates its own rows of dk and dv (recomputing by the exact path the
    rows that are not finite), and adds its dQ terms to worker w's buffer (dq itself for w = 0,
    dq_parts[w - 1] otherwise), which the worker zeroes first."""
    batch, heads, n_q, dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    n_kb = full_t_ptr.shape[2] - 1
    shared_b, shared_h = full_t_ptr.shape[0] == 1, full_t_ptr.shape[1] == 1
    for w in prange(ptr.size - 1):
        scores = np.empty(block_size * max_blocks * block_size, q.dtype)
        dscores = np.empty(block_size * max_blocks * block_size, q.dtype)
        row_max_p = np.empty(max_blocks * block_size, q.dtype)
        log2_sum_p = np.empty(max_blocks * block_size, q.dtype)
        delta_p = np.empty(max_blocks * block_size, q.dtype)
        pins = np.empty((2, max_blocks * block_size), np.int64)
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
                _backward_head(k[b, g, j0:j0 + cols], v[b, g, j0:j0 + cols], j0, q[b, h], dout[b, h], out[b, h],
                               dlse[b, h], row_max[b, h], log2_sum[b, h], argmax[b, h], delta[b, h],
                               maxima[b, h, maxima_ptr[b, h, c]:maxima_ptr[b, h, c + 1]], n_q, full_t_idx,
                               full_t_ptr[lb, lh, c], full_t_ptr[lb, lh, c + 1], part_t_idx, part_t_mask,
                               part_t_ptr[lb, lh, c], part_t_ptr[lb, lh, c + 1], masks, spans, block_size, max_blocks,
                               qscale, scale, scores, dscores, row_max_p, log2_sum_p, delta_p, pins, blocks, tiles,
                               dk[b, g, j0:j0 + cols], dv[b, g, j0:j0 + cols], buffer[b, h])
            if _finite(dk[b, g, j0:j0 + cols]) and _finite(dv[b, g, j0:j0 + cols]):
                continue
            for j in range(j0, j0 + cols):
                if not (_finite(dk[b, g, j:j + 1]) and _finite(dv[b, g, j:j + 1])):
                    _exact_dk_dv(b, g, j, q, k, v, dout, lse, row_max, log2_sum, argmax, delta, full_t_ptr, full_t_idx,
                                 part_t_ptr, part_t_idx, part_t_mask, masks, block_size, qscale, scale, dk[b, g, j],
                                 dv[b, g, j])


@njit(cache=True, fastmath=_FASTMATH, parallel=True)
def _delta(out, dout, lse, dlse, zero, delta):
    """Per query row: delta = rowsum(dout * out) - dlse, and 0 for rows with no allowed key
    (lse = -inf: their P is 0 and dlse does not reach the scores, as in the reference).
    out, dout (R, D); lse, dlse, delta (R,); zero: 0 in the dtype."""
    rows, dim = out.shape
    for i in prange(rows):
        if lse[i] == -np.inf:
            delta[i] = zero
            continue
        total = zero
        for d in range(dim):
            total += dout[i, d] * out[i, d]
        delta[i] = total - dlse[i]


@njit(cache=True, fastmath=_FASTMATH, parallel=True)
def _sum_parts(dq, dq_parts, not_finite):
    """dq += dq_parts[0] + dq_parts[1] + ..., in that order; not_finite (R,) marks the rows of the
    sum that hold a NaN or inf. dq (R, D), dq_parts (P, R, D)."""
    rows, dim = dq.shape
    for i in prange(rows):
        for p in range(dq_parts.shape[0]):
            for d in range(dim):
                dq[i, d] += dq_parts[p, i, d]
        not_finite[i] = not _finite(dq[i:i + 1])


@njit(cache=True, fastmath=False)
def _exact_grads(q_i, k_j, v_j, do_i, lse, row_max, log2_sum, is_max, delta, scale, qscale):
    """(P, dS) of one allowed pair in float64, as the fast backward forms them:
    P = 2 ** (min(S - row max, 0) - log2 sum), with S - row max = 0 for the row's maximum,
    and dS = P (dO . v - delta). A row with a +inf score (lse +inf) has P = exp(s) / inf, as the
    reference forms it (its shift is 0): NaN where exp(s) overflows in the inputs' dtype, else 0."""
    if lse == np.inf:
        p = np.float64(_like(scale, np.exp(_score(q_i, k_j, scale)))) / np.inf
    else:
        x = 0.0 if is_max else _score(q_i, k_j, qscale) - row_max
        p = np.exp2((0.0 if x > 0 else x) - log2_sum)
    dp = 0.0
    for d in range(do_i.size):
        dp += np.float64(do_i[d]) * np.float64(v_j[d])
    return p, p * (dp - delta)


@njit(cache=True, fastmath=False)
def _exact_dk_dv(b, g, j, q, k, v, dout, lse, row_max, log2_sum, argmax, delta, full_t_ptr, full_t_idx, part_t_ptr,
                 part_t_idx, part_t_mask, masks, block_size, qscale, scale, dk_j, dv_j):
    """dk_j and dv_j (D,) of key j of kv head g in example b by the exact path: over the query heads
    of the group and their queries allowed to see j."""
    heads, n_q, dim = q.shape[1], q.shape[2], q.shape[3]
    group = heads // k.shape[1]
    lb = 0 if full_t_ptr.shape[0] == 1 else b
    c = j // block_size
    queries = np.empty(n_q, np.int64)
    acc_k, acc_v = np.zeros(dim), np.zeros(dim)
    for h in range(g * group, (g + 1) * group):
        lh = 0 if full_t_ptr.shape[1] == 1 else h
        n = _allowed(j % block_size, full_t_idx, full_t_ptr[lb, lh, c], full_t_ptr[lb, lh, c + 1], part_t_idx,
                     part_t_mask, part_t_ptr[lb, lh, c], part_t_ptr[lb, lh, c + 1], masks, block_size, n_q, True,
                     queries)
        for e in range(n):
            i = queries[e]
            p, ds = _exact_grads(q[b, h, i], k[b, g, j], v[b, g, j], dout[b, h, i], lse[b, h, i], row_max[b, h, i],
                                 log2_sum[b, h, i], argmax[b, h, i] == j, delta[b, h, i], scale, qscale)
            for d in range(dim):
                acc_v[d] += p * dout[b, h, i, d]
                acc_k[d] += ds * q[b, h, i, d]
    dk_j[:] = scale * acc_k
    dv_j[:] = acc_v


@njit(cache=True, fastmath=False, parallel=True)
def _exact_dq_rows(rows, q, k, v, dout, lse, row_max, log2_sum, argmax, delta, full_ptr, full_idx, part_ptr, part_idx,
                   part_mask, masks, block_size, qscale, scale, dq):
    """dq of the given rows (flat (example, head, query) indices) by the exact path."""
    heads, n_q, dim = q.shape[1], q.shape[2], q.shape[3]
    group, n_k = heads // k.shape[1], k.shape[2]
    for e in prange(rows.size):
        b, h, i = rows[e] // (heads * n_q), rows[e] // n_q % heads, rows[e] % n_q
        lb, lh = 0 if full_ptr.shape[0] == 1 else b, 0 if full_ptr.shape[1] == 1 else h
        r, g = i // block_size, h // group
        keys = np.empty(n_k, np.int64)
        n = _allowed(i % block_size, full_idx, full_ptr[lb, lh, r], full_ptr[lb, lh, r + 1], part_idx, part_mask,
                     part_ptr[lb, lh, r], part_ptr[lb, lh, r + 1], masks, block_size, n_k, False, keys)
        acc = np.zeros(dim)
        for t in range(n):
            j = keys[t]
            _, ds = _exact_grads(q[b, h, i], k[b, g, j], v[b, g, j], dout[b, h, i], lse[b, h, i], row_max[b, h, i],
                                 log2_sum[b, h, i], argmax[b, h, i] == j, delta[b, h, i], scale, qscale)
            for d in range(dim):
                acc[d] += ds * k[b, g, j, d]
        dq[b, h, i] = scale * acc
