"""What the Numba kernels stand on: BLAS ?gemm without temporaries (MKL from torch, else scipy's BLAS), a
vectorisable float32 ``exp2`` and ``tanh``, row maxima in vector registers, an atomic task counter, fastmath
flags, and BLAS kept to one thread per worker while kernels run.

>>> import numpy as np
>>> from sparse_attn.backends.numba.lowlevel import gemm
>>> a, b = np.ones((2, 3), np.float32), np.ones((4, 3), np.float32)
>>> c = np.ones((2, 4), np.float32)
>>> gemm(np.float32(2), a, False, b, True, np.float32(1), c)                  # c = 2 a @ b.T + c
>>> c.tolist()
[[7.0, 7.0, 7.0, 7.0], [7.0, 7.0, 7.0, 7.0]]

Nothing here knows about attention; the kernels import it.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
import threading
from typing import NamedTuple, cast

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.core import cgutils
from numba.extending import get_cython_function_address, intrinsic, overload

# No 'nnan'/'ninf': -inf marks masked scores and empty rows, and NaN and inf in the inputs must
# propagate. Code that tests for NaN/inf says fastmath=False: a function without its own flags
# inherits its caller's, and under 'reassoc' x - x folds to 0, which is how Numba writes isfinite.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}


# ------------------------------------------------------------------------------------------------
# Matmuls: BLAS ?gemm with alpha, beta and transposes
# ------------------------------------------------------------------------------------------------
# The kernels call these names; Numba's linker resolves them to the BLAS ``matmul_blas`` chose, registered
# at import, before any kernel links. Cached kernels name only these, so they stay valid whichever BLAS a
# later process takes.
_SGEMM, _DGEMM, _THREADS_LOCAL = "sparse_attn_sgemm", "sparse_attn_dgemm", "sparse_attn_blas_threads_local"
BLAS_VARIABLE = "SPARSE_ATTN_NUMBA_BLAS"
MKL_BLAS, SCIPY_BLAS = "MKL (from torch)", "scipy's BLAS"                   # the names matmul_blas gives them


class Blas(NamedTuple):
    """A BLAS for the kernels' float32/float64 matmuls: its name, the addresses of its Fortran ``sgemm``
    and ``dgemm`` (every argument by pointer, 32-bit ints), and of ``int threads_local(int n)``, which sets
    the calling thread's BLAS thread count (0: the process's) and returns the previous one."""
    name: str
    sgemm: int
    dgemm: int
    threads_local: int


@functools.cache
def torch_cpu_library() -> ctypes.CDLL | None:
    """torch's CPU library (``libtorch_cpu``, already loaded by ``import torch``), or None where its file has
    another name."""
    import torch

    for file in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        try:
            return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", file))
        except OSError:
            continue
    return None


def torch_cpu_exports(*names: str) -> dict[str, int] | None:
    """The addresses of these symbols in torch's CPU library, or None where it does not export them all."""
    lib = torch_cpu_library()
    if lib is None or not all(hasattr(lib, name) for name in names):
        return None
    return {name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names}  # type: ignore[misc]


def _threads_unchanged(n):
    """The thread-local setter for a BLAS without one (scipy's: KernelSection sets its thread count); compiled
    by ``matmul_blas`` only where it is needed (a cfunc costs import time even when cached)."""
    return 0


@functools.cache
def matmul_blas() -> Blas:
    """The BLAS the kernels' float32/float64 matmuls call: MKL where torch's CPU library exports it (Linux
    x86-64 wheels; up to 1.6x OpenBLAS on the kernels' 64 x 64 x W products, docs/backend-numba.md), else
    scipy's BLAS (OpenBLAS in its wheels). ``SPARSE_ATTN_NUMBA_BLAS=scipy`` (or ``torch``) picks one.
    Raises ValueError for another value or a BLAS that is missing.

    >>> blas = matmul_blas()
    >>> blas.name in (MKL_BLAS, SCIPY_BLAS) and blas.sgemm != 0
    True
    """
    wanted = os.environ.get(BLAS_VARIABLE, "")
    if wanted not in ("", "torch", "scipy"):
        raise ValueError(f"{BLAS_VARIABLE}={wanted!r} is not a BLAS for the numba backend: set it to 'torch' "
                         f"(MKL from torch's CPU library) or 'scipy' (scipy's BLAS), or unset it")
    if wanted != "scipy":            # MKL_Set_Num_Threads_Local takes n by value; mkl_set_num_threads_local by pointer
        mkl = torch_cpu_exports("sgemm_", "dgemm_", "MKL_Set_Num_Threads_Local")
        if mkl is not None:
            return Blas(MKL_BLAS, mkl["sgemm_"], mkl["dgemm_"], mkl["MKL_Set_Num_Threads_Local"])
        if wanted == "torch":
            raise ValueError(f"{BLAS_VARIABLE}=torch, but this torch's CPU library exports no MKL sgemm_: "
                             f"unset it to use scipy's BLAS")
    try:
        sgemm, dgemm = (get_cython_function_address("scipy.linalg.cython_blas", name) for name in ("sgemm", "dgemm"))
    except ImportError as error:
        raise ValueError(f"the numba backend's matmuls need scipy's BLAS here (torch exports none): {error}") from None
    unchanged = cfunc(types.int32(types.int32), cache=True)(_threads_unchanged)
    return Blas(SCIPY_BLAS, sgemm, dgemm, cast(int, unchanged.address))


def _register_blas() -> None:
    """Point the kernels' BLAS names at ``matmul_blas()``; without one, ``backend.available()`` says why."""
    try:
        blas = matmul_blas()
    except ValueError:
        return
    for name, address in ((_SGEMM, blas.sgemm), (_DGEMM, blas.dgemm), (_THREADS_LOCAL, blas.threads_local)):
        llvm.add_symbol(name, address)


_register_blas()


@intrinsic
def _xxgemm(typingctx, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Column-major BLAS ?gemm, c = alpha op(a) op(b) + beta c, in the Fortran convention: every
    argument by pointer (values in stack slots), ints as 32 bits."""
    def codegen(context, builder, signature, args):
        ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc = args
        sig = signature.args
        dtype = sig[11].dtype
        void_p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [void_p] * 13)
        fn = cgutils.get_or_insert_function(builder.module, fnty, _SGEMM if dtype == types.float32 else _DGEMM)

        def pointer_to(value):
            return builder.bitcast(cgutils.alloca_once_value(builder, value), void_p)

        def char(value):
            return pointer_to(builder.trunc(value, ir.IntType(8)))

        def int32(value):
            return pointer_to(builder.trunc(value, ir.IntType(32)))

        def scalar(value, ty):
            return pointer_to(context.cast(builder, value, ty, dtype))

        def data(value, ty):
            return builder.bitcast(context.make_array(ty)(context, builder, value).data, void_p)

        builder.call(fn, (char(ta), char(tb), int32(m), int32(n), int32(k), scalar(alpha, sig[5]), data(a, sig[6]),
                          int32(lda), data(b, sig[8]), int32(ldb), scalar(beta, sig[10]), data(c, sig[11]), int32(ldc)))
        return context.get_dummy_value()
    return types.void(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc), codegen


@intrinsic
def set_blas_threads_local(typingctx, n):
    """Sets the calling thread's BLAS thread count to n (an int32; 0: the process's) and returns the previous
    setting: workers call it with 1 around their matmuls (see KernelSection). A no-op for scipy's BLAS."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i32]), _THREADS_LOCAL)
        return builder.call(fn, (args[0],))
    return types.int32(types.int32), codegen


_N, _T = ord("n"), ord("t")


@njit(cache=True)
def gemm(alpha, a, trans_a, b, trans_b, beta, c):
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


# ------------------------------------------------------------------------------------------------
# Scalars: exp2, tanh, dtype conversion
# ------------------------------------------------------------------------------------------------
def exp2(x):
    """2 ** x for x <= 127 or NaN (the kernels pass a score minus a maximum: x <= 0); vectorisable in
    float32 (no libm call): exactly 0 below -126 (-inf too), NaN for NaN; libm's in float64. Above 127 the
    float32 form is undefined: no clamp there keeps the loop two selects shorter."""


@intrinsic
def _int_bits_as_float32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


# 2 ** f on |f| <= 1/2 by a degree-6 polynomial: a least-squares fit of the relative error against float64 on
# Chebyshev nodes, reweighted towards minimax (1.9e-9 in float64, 9.6e-8 evaluated in float32)
_EXP2_COEFFS = tuple(np.float32(c) for c in (1.0000000005545249, 0.6931472057360487, 0.2402264688797573,
                                             0.055503287789285795, 0.009618489244923131, 0.0013399930588659688,
                                             0.00015345734571100417))
_C0, _C1, _C2, _C3, _C4, _C5, _C6 = _EXP2_COEFFS
_F32_MIN_EXP, _F32_ZERO_EXP = np.float32(-126.0), np.float32(-127.0)     # 2 ** -127 as bits: 0
_HALF_F32 = np.float32(0.5)


@overload(exp2, fastmath=FASTMATH)  # type: ignore[call-arg]  # numba: jit options as **kwargs
def _exp2_impl(x):
    if x == types.float32:
        def exp2_f32(x):
            xc = x if x >= _F32_MIN_EXP else _F32_ZERO_EXP  # finite (NaN too), so the int conversion is defined
            n = np.floor(xc + _HALF_F32)                 # x = n + f, |f| <= 1/2
            f = xc - n
            p = _C0 + f * (_C1 + f * (_C2 + f * (_C3 + f * (_C4 + f * (_C5 + f * _C6)))))
            scale = _int_bits_as_float32((np.int32(n) + np.int32(127)) << np.int32(23))  # 2 ** n; 0 for n = -127
            return p * scale if x == x else x
        return exp2_f32
    if x == types.float64:
        return lambda x: np.exp2(x)


# tanh(x) = x P(x^2) / Q(x^2) on |x| <= 8, P of degree 5 and Q of degree 3 in x^2: a least-squares fit of the relative
# error against float64 tanh on Chebyshev nodes, reweighted towards minimax (2.7e-7 relative in float32, |tanh| <= 1)
_P0, _P1, _P2, _P3, _P4, _P5 = (np.float32(c) for c in (1.0, 0.12979212403297424, 0.002985849976539612,
                                                        9.878544005914591e-06, -1.470386479240915e-08,
                                                        2.350772181081151e-11))
_Q0, _Q1, _Q2, _Q3 = (np.float32(c) for c in (1.0, 0.4631252884864807, 0.024027876555919647, 0.00023720152967143804))
_TANH_END = np.float32(8.0)  # x clamped to [-8, 8]: tanh(8) = 1 - 2.3e-7, within the fit's error of 1


def tanh(x):
    """tanh(x); vectorisable in float32 (a rational function: two selects, one division, no libm call, no
    branch): within 2.7e-7 relative, at most 1 in magnitude, NaN for NaN. float64: libm's."""


# error_model numpy: no zero-division check (a branch per call, which keeps the caller's loop from vectorising)
@overload(tanh, jit_options={"fastmath": FASTMATH, "error_model": "numpy"})
def _tanh_impl(x):
    if x == types.float32:
        def tanh_f32(x):
            y = _TANH_END if x > _TANH_END else x            # selects, false for NaN: it stays NaN
            y = -_TANH_END if y < -_TANH_END else y
            z = y * y
            p = _P0 + z * (_P1 + z * (_P2 + z * (_P3 + z * (_P4 + z * _P5))))
            q = _Q0 + z * (_Q1 + z * (_Q2 + z * _Q3))
            return y * p / q
        return tanh_f32
    if x == types.float64:
        return lambda x: np.tanh(x)


# ------------------------------------------------------------------------------------------------
# Row maxima in vector registers
# ------------------------------------------------------------------------------------------------
LANES = 16          # lane_maximum's lanes: one vector of 16 (float32), or two of 8 (float64)
_CHAINS = 4         # running vectors in its loop: a select waits for its vector's last one only every fourth
                    # vector, so the loop runs at the rate of loads, not of the compare's latency


@intrinsic
def lane_maximum(typingctx, row, start):
    """(best, lane): best = the largest of start and the row's first ``row.size - row.size % 16`` columns,
    NaN skipped (the comparison x > best is false for it); lane = the smallest u whose columns u, u + 16,
    u + 32, ... hold best (where best > start; 0 when no lane equals best: a NaN start). row: a
    C-contiguous 1-D float32 or float64 array, start a scalar of its dtype.

    Written as vector selects: LLVM leaves the same loop in Numba scalar (a select of a compare is a max only
    without NaN, which the flags keep). Four running vectors take groups of 64 columns in turn (column
    64 g + 16 c + u in vector c's lane u), the groups of 16 left over go to the first; the four are merged
    lane by lane, the 16 lanes halved four times, and the lane is the lowest set bit of the lanes equal to best.
    """
    if not (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C"
            and row.dtype in (types.float32, types.float64) and start == row.dtype):
        return None

    def codegen(context, builder, signature, args):
        row_array = context.make_array(signature.args[0])(context, builder, args[0])
        element = context.get_data_type(signature.args[0].dtype)
        vector = ir.VectorType(element, LANES)
        align = signature.args[0].dtype.bitwidth // 8
        index, i32 = ir.IntType(64), ir.IntType(32)
        rows_v = builder.bitcast(row_array.data, vector.as_pointer())

        def larger(x, best):                                    # x where x > best (false for NaN), else best
            return builder.select(builder.fcmp_ordered(">", x, best), x, best)

        def step(best, group):                                  # best = larger(row's vector ``group``, best)
            x = builder.load(builder.gep(rows_v, [group]), align=align)
            builder.store(larger(x, builder.load(best)), best)

        def splat(x):
            lanes = builder.insert_element(ir.Constant(vector, ir.Undefined), x, ir.Constant(i32, 0))
            return builder.shuffle_vector(lanes, lanes, ir.Constant(ir.VectorType(i32, LANES), [0] * LANES))

        start = splat(args[1])
        chains = [cgutils.alloca_once_value(builder, start) for _ in range(_CHAINS)]
        groups = builder.sdiv(builder.extract_value(row_array.shape, 0), ir.Constant(index, LANES))
        rounds = builder.sdiv(groups, ir.Constant(index, _CHAINS))
        with cgutils.for_range(builder, rounds) as loop:                   # 64 columns a round
            first = builder.mul(loop.index, ir.Constant(index, _CHAINS))
            for c, best in enumerate(chains):
                step(best, builder.add(first, ir.Constant(index, c)))
        done = builder.mul(rounds, ir.Constant(index, _CHAINS))
        with cgutils.for_range(builder, builder.sub(groups, done)) as loop:  # the groups of 16 left
            step(chains[0], builder.add(done, loop.index))
        merged = builder.load(chains[0])
        for best in chains[1:]:
            merged = larger(builder.load(best), merged)
        best, width = merged, LANES                               # halve: lane u against lane u + width / 2
        while width > 1:
            width //= 2
            upper = [u + width if u < width else u for u in range(LANES)]
            best = larger(builder.shuffle_vector(best, best, ir.Constant(ir.VectorType(i32, LANES), upper)), best)
        best = builder.extract_element(best, ir.Constant(i32, 0))
        equal = builder.fcmp_ordered("==", merged, splat(best))            # (16,) i1: the lanes holding best
        bits = builder.zext(builder.bitcast(equal, ir.IntType(LANES)), i32)
        lane = builder.cttz(builder.or_(bits, ir.Constant(i32, 1 << LANES)), ir.Constant(ir.IntType(1), 0))
        lane = builder.select(builder.icmp_unsigned("==", lane, ir.Constant(i32, LANES)), ir.Constant(i32, 0), lane)
        return context.make_tuple(builder, signature.return_type, [best, builder.sext(lane, index)])
    sig = types.Tuple((row.dtype, types.int64))(row, start)
    return sig, codegen


@njit(cache=True)
def copy_into(dst, src):
    """dst[:] = src for 1-D arrays of one size, converted to dst's dtype, as a loop. An array assigned to a
    slice compiles Numba's shape-mismatch error (its message formatting: string code) into every kernel that
    assigns one, seconds of each cold compile for a copy."""
    for i in range(dst.size):
        dst[i] = src[i]


def like(template, x):
    """x converted to the float type of ``template`` (a float32 or float64 scalar)."""


@overload(like)
def _like_impl(template, x):
    if template == types.float32:
        return lambda template, x: np.float32(x)
    return lambda template, x: np.float64(x)


# ------------------------------------------------------------------------------------------------
# Threads: a shared task counter, and BLAS kept to one thread while kernels run
# ------------------------------------------------------------------------------------------------
@intrinsic
def fetch_add(typingctx, counter):
    """counter[0] += 1 atomically (counter: a 1-element int64 array); returns the old value."""
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", array.data, ir.Constant(ir.IntType(64), 1), "monotonic")
    return types.int64(counter), codegen


@functools.cache
def scipy_openblas():
    """scipy's OpenBLAS (the BLAS Numba's np.dot calls), or None where scipy uses another BLAS."""
    import scipy

    for path in glob.glob(os.path.join(os.path.dirname(scipy.__file__), os.pardir, "scipy.libs", "libscipy_openblas*")):
        lib = ctypes.CDLL(path)
        if hasattr(lib, "scipy_openblas_set_num_threads") and hasattr(lib, "scipy_openblas_get_num_threads"):
            return lib
    return None


def _process_wide_blas():
    """scipy's OpenBLAS where the kernels call it (its thread count is process-wide), else None."""
    return scipy_openblas() if matmul_blas().name == SCIPY_BLAS else None


def _layer_is_threadsafe() -> bool:
    """Whether Numba's threading layer takes parallel launches from several threads at once: omp
    and tbb do; workqueue aborts the process; before the first launch the layer is not chosen yet."""
    try:
        return numba.threading_layer() != "workqueue"
    except ValueError:                                   # no parallel launch yet
        return False


class KernelSection:
    """``with KERNELS.running():`` around the parallel kernels of one call; safe from several threads.

    - The kernels call BLAS from every worker thread: a BLAS that also threads each call would
      oversubscribe the cores. MKL's count is set per thread: each worker sets 1 and restores it
      (``set_blas_threads_local``; inside Numba's omp layer MKL also sees the parallel region).
      scipy's OpenBLAS has only a process-wide count (and warns "Detect OpenMP Loop"): when the
      kernels call it, it runs on one thread while any call is inside: the first call in saves
      its count and sets 1, the last one out restores it (a count under a lock).
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
        lib = _process_wide_blas()
        with self._lock:
            if self._inside == 0 and lib is not None:
                self._blas_threads = lib.scipy_openblas_get_num_threads()
                lib.scipy_openblas_set_num_threads(1)
            self._inside += 1

    def _leave(self):
        lib = _process_wide_blas()
        with self._lock:
            self._inside -= 1
            if self._inside == 0 and lib is not None:
                lib.scipy_openblas_set_num_threads(self._blas_threads)


KERNELS = KernelSection()
