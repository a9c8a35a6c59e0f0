"""bfloat16 matmuls for the Numba kernels: oneDNN's brgemm micro-kernel (through torch), bf16 operands
packed the way it reads them, and float32 -> bf16 rounding inside the kernels; and the same brgemm for
float32 on CPUs with AVX-512 (``float32_brgemm``), where it runs the kernels' products at about twice
MKL's rate.

>>> import torch
>>> from sparse_attn.backends.numba.bf16 import pairs, to_float
>>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.bfloat16)       # (K=3, N=2)
>>> b = pairs(x)                                 # rows in pairs, the odd one padded with zeros: (K/2, N, 2)
>>> b.shape, [to_float(b[0, 1, i]) for i in range(2)]                           # rows 0 and 1 of column 1
((2, 2, 2), [2.0, 4.0])

Why brgemm: torch's CPU flash attention calls it, and libtorch_cpu exports it
(``at::native::cpublas::brgemm`` for bf16 A, B and a float32 C); on AVX512-BF16 (and AMX) it runs
``vdpbf16ps``: 300-440 GFLOP/s on one core for the kernels' panel shapes, against 80-150 for
OpenBLAS sgemm (scipy's OpenBLAS exports no sbgemm) and about 100 for MKL's cblas_gemm_bf16bf16f32,
which does not use the bf16 instructions on AMD (docs/backend-numba.md has the table). Its B
operand is "VNNI" packed: rows in pairs, (K/2, N, 2), so a bf16 pair of B is one 32-bit lane.

The kernels reach these matmuls through the overloaded functions below: with ``ops = None`` they are
the float32/float64 BLAS calls, with a bundle of packed bf16 (uint16) or float32 operands the brgemm
calls, so the kernels have one body for all three. float32 operands are plain: B row-major, K^T (and
Q^T, dO^T) transposed copies, a trailing axis of 1 where bf16 has its pairs.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import llvmlite.binding as llvm
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import workspace
from .lowlevel import FASTMATH, gemm, torch_cpu_exports

# at::native::cpublas::brgemm(M, N, K, ld_a, ld_b, ld_c, add_C, const BFloat16* A, const BFloat16* B,
#                             float* C, bool is_vnni): C (M, N) (+)= A (M, K) @ B, B packed (K/2, ld_b, 2)
_BRGEMM = "_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb"
# at::native::cpublas::brgemm_release(bool is_vnni): on AMX, releases the thread's tile configuration and
# forgets which kernel configured it. brgemm configures the tiles only when the thread's kernel changes, so
# after any other AMX user on the thread (a oneDNN bf16 matmul of torch releases the tiles when it ends) a
# brgemm without this release first runs tile instructions unconfigured: SIGILL. Every worker releases when
# its share of a kernel is done, as torch's own CPU flash attention does.
_BRGEMM_RELEASE = "_ZN2at6native7cpublas14brgemm_releaseEb"
# The same for float32 A, B and C (is_vnni must be false): oneDNN's AVX-512 kernels where the CPU has them
_BRGEMM_F32 = "_ZN2at6native7cpublas6brgemmEllllllbPKfS3_Pfb"
ROW_MULTIPLE = 256  # pairs_t's and transposed's rows are padded to a multiple of this
SKEW = 16           # and by this many more: a power-of-two leading dimension maps B's rows onto the same cache
                    # sets (float32 S = Q K^T at 576 keys: 188 GFLOP/s at ld 4096, 205 at 4112)
FLOAT32_VARIABLE = "SPARSE_ATTN_NUMBA_FLOAT32"  # "brgemm" or "blas": which float32 matmuls; unset: by the CPU


@functools.cache
def _addresses() -> dict[str, int] | None:
    """The addresses of torch's bf16 brgemm and brgemm_release, or None where this torch does not export them."""
    return torch_cpu_exports(_BRGEMM, _BRGEMM_RELEASE)


@functools.cache
def _cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 dot products (AVX512-BF16 or AMX-BF16), as LLVM reads its features."""
    features = llvm.get_host_cpu_features()
    return bool(features.get("avx512bf16") or features.get("amx-bf16"))


@functools.cache
def _cpu_has_avx512() -> bool:
    """Whether this CPU has AVX-512 (LLVM's ``avx512f``): asked once, as LLVM's answer takes about 0.1 ms."""
    return bool(llvm.get_host_cpu_features().get("avx512f"))


@functools.cache
def _float32_address() -> dict[str, int] | None:
    """The address of torch's float32 brgemm (and brgemm_release), or None where this torch does not export them."""
    return torch_cpu_exports(_BRGEMM_F32, _BRGEMM_RELEASE)


def float32_brgemm() -> tuple[bool, str]:
    """(whether float32 inputs run their matmuls on oneDNN's brgemm rather than the BLAS, why). By default on
    a CPU with AVX-512 (LLVM's ``avx512f``): on an AMD Zen 5 oneDNN ran the kernels' 64-row products at about
    twice the rate of MKL's sgemm (docs/backend-numba.md); on a Zen 3 without AVX-512 it was no faster.
    ``SPARSE_ATTN_NUMBA_FLOAT32=brgemm`` or ``=blas`` picks one. Needs torch's float32 brgemm and oneDNN enabled.

    >>> isinstance(float32_brgemm()[0], bool)
    True
    """
    wanted = os.environ.get(FLOAT32_VARIABLE, "")
    if wanted not in ("", "brgemm", "blas"):
        raise ValueError(f"{FLOAT32_VARIABLE}={wanted!r} is not a float32 matmul route for the numba backend: set "
                         f"it to 'brgemm' (oneDNN through torch) or 'blas' (the BLAS's sgemm), or unset it")
    if wanted == "blas":
        return False, f"{FLOAT32_VARIABLE}=blas"
    if _float32_address() is None:
        return False, f"this torch ({torch.__version__}) exports no float32 brgemm"
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False, "oneDNN is disabled (torch.backends.mkldnn.enabled)"
    if wanted == "brgemm":
        return True, f"{FLOAT32_VARIABLE}=brgemm"
    if not _cpu_has_avx512():
        return False, "no AVX-512 on this CPU (the BLAS's sgemm is faster there)"
    return True, "oneDNN brgemm (AVX-512)"


def native() -> tuple[bool, str]:
    """(whether bf16 inputs run on bf16 matmuls here, why or why not). Needs a CPU with native bf16
    dot products (AVX512-BF16 or AMX-BF16: elsewhere oneDNN would emulate them, slower than float32),
    torch's brgemm, and oneDNN enabled (torch raises inside brgemm otherwise)."""
    if not _cpu_has_bf16():
        return False, "no native bf16 dot products on this CPU (AVX512-BF16 or AMX-BF16)"
    if _addresses() is None:
        return False, f"this torch ({torch.__version__}) exports no bf16 brgemm and brgemm_release"
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False, "oneDNN is disabled (torch.backends.mkldnn.enabled)"
    if os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"):
        return False, "ONEDNN_MAX_CPU_ISA is set"
    return True, "bf16 matmuls on oneDNN brgemm (native bf16 dot products)"


def _add_symbols() -> None:
    """Let Numba's linker resolve the torch functions, before any cached kernel that calls them links."""
    for name, address in {**(_addresses() or {}), **(_float32_address() or {})}.items():
        llvm.add_symbol(name, address)


_add_symbols()


# ------------------------------------------------------------------------------------------------
# Host side: bf16 bits and packing
# ------------------------------------------------------------------------------------------------
def bits(t: torch.Tensor) -> np.ndarray:
    """The bf16 values of t as a C-contiguous uint16 numpy array (the bits, shared with a bf16 tensor)."""
    return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def pairs(t: torch.Tensor, buffer: str | None = None) -> np.ndarray:
    """t (..., N, D) as brgemm's B for a product over N: (..., ceil(N/2), D, 2) uint16, row 2r + i of t
    at [..., r, :, i], a zero row after an odd N. Written into the calling thread's ``workspace`` buffer of
    that name, or (None) a fresh array."""
    rows = t.to(torch.bfloat16).contiguous().view(torch.int16)                                    # (..., N, D)
    *lead, n, dim = rows.shape
    words = _empty(buffer, (*lead, -(-n // 2), dim), torch.int32)                          # (..., ceil(N/2), D)
    _pair_rows(rows.reshape(-1, n, dim).numpy().view(np.uint16),
               words.view(-1, *words.shape[-2:]).numpy().view(np.uint32))
    return words.numpy().view(np.uint16).reshape(*words.shape, 2)


@njit(cache=True, parallel=True)
def _pair_rows(x, out):
    """out (G, ceil(N/2), D) uint32 words, each of rows 2r and 2r + 1 of x (G, N, D) uint16 at [g, r, d]: the
    first in the low half (the first in memory, little-endian as x86 and Arm run), 0 in the high half of the
    last word after an odd N."""
    groups, n, dim = x.shape
    full = n // 2
    for t in prange(groups * full):
        g, r = t // full, t % full
        for d in range(dim):
            out[g, r, d] = np.uint32(x[g, 2 * r, d]) | np.uint32(x[g, 2 * r + 1, d]) << np.uint32(16)
    if n % 2:
        for g in range(groups):
            for d in range(dim):
                out[g, full, d] = np.uint32(x[g, n - 1, d])


def pairs_t(t: torch.Tensor, buffer: str | None = None) -> np.ndarray:
    """t (..., N, D), D even, as brgemm's B for a product over D (t.T): (..., D/2, N', 2) uint16, N' = N
    rounded up to a multiple of ``ROW_MULTIPLE``, plus ``SKEW`` (zeros after N), in ``buffer`` as ``pairs``
    writes. N' is brgemm's ld_b, part of the key of the kernels oneDNN generates and caches (per thread, never
    evicted): rounded, a KV cache that grows by one key per decode step reuses them instead of adding kernels
    at every length."""
    words = t.to(torch.bfloat16).contiguous().view(torch.int32)                                   # (..., N, D/2)
    *lead, n, half = words.shape
    packed = _empty(buffer, (*lead, half, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE + SKEW), torch.int32)  # (..., D/2, N')
    _transpose_scaled(words.reshape(-1, n, half).numpy().view(np.uint32), np.uint32(1),
                      packed.view(-1, *packed.shape[-2:]).numpy().view(np.uint32))
    return packed.numpy().view(np.uint16).reshape(*packed.shape, 2)


def transposed(t: torch.Tensor, alpha: float, buffer: str | None = None) -> np.ndarray:
    """alpha t, t (..., N, D) float32 contiguous, as brgemm's B for a product over D (t.T): (..., D, N', 1)
    float32, N' = N rounded up to a multiple of ``ROW_MULTIPLE``, plus ``SKEW`` (zeros after N): ``pairs_t``
    for float32, with the product's scale (brgemm has no alpha) folded in; in ``buffer`` as ``pairs`` writes."""
    *lead, n, dim = t.shape
    packed = _empty(buffer, (*lead, dim, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE + SKEW), torch.float32)  # (..., D, N')
    _transpose_scaled(t.reshape(-1, n, dim).numpy(), np.float32(alpha), packed.view(-1, *packed.shape[-2:]).numpy())
    return packed.unsqueeze(-1).numpy()


def _empty(buffer: str | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous uninitialised tensor: the calling thread's workspace buffer ``buffer``, or a fresh one."""
    return torch.empty(shape, dtype=dtype) if buffer is None else workspace.empty(buffer, tuple(shape), dtype)


_TILE = 16  # the transposes' tiles: 16 keys (_transpose_scaled), or 16 columns of 8 rows (transpose)
_TILE_ROWS = 8


@njit(cache=True, parallel=True, fastmath=FASTMATH)
def _transpose_scaled(x, alpha, out):
    """out (G, D, N') = alpha x.T for x (G, N, D), N <= N', columns N.. of out 0. Any dtype: bf16 words
    (uint32, alpha 1) too. A task is a tile of 16 keys: each of out's rows gets 16 values in a row (one cache
    line of float32), read down a column of x (16 rows of x, in cache after the first column)."""
    groups, n, dim = x.shape
    tiles = n // _TILE
    for t in prange(groups * tiles):
        g, j0 = t // tiles, t % tiles * _TILE
        for d in range(dim):
            for i in range(_TILE):
                out[g, d, j0 + i] = alpha * x[g, j0 + i, d]
    for g in prange(groups):                                                  # the keys' ragged end, the zeros
        for d in range(dim):
            for j in range(tiles * _TILE, n):
                out[g, d, j] = alpha * x[g, j, d]
        out[g, :, n:] = 0


def singles(t: torch.Tensor) -> np.ndarray:
    """t (..., N, D) float32, contiguous, as brgemm's B for a product over N: (..., N, D, 1), a view (``pairs``
    for float32: one row per "pair")."""
    return t.unsqueeze(-1).numpy()


# ------------------------------------------------------------------------------------------------
# Kernel side: brgemm, rounding
# ------------------------------------------------------------------------------------------------
@intrinsic
def _call_brgemm(typingctx, m, n, k, ld_a, ld_b, ld_c, add, a, b, c):
    """torch's brgemm on the data of arrays a, b (uint16: bf16 bits, b packed; or float32) and c (float32)."""
    symbol, vnni = (_BRGEMM_F32, 0) if a.dtype == types.float32 else (_BRGEMM, 1)  # float32 refuses is_vnni

    def codegen(context, builder, signature, args):
        i64, i32, void_p = ir.IntType(64), ir.IntType(32), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i64] * 6 + [i32, void_p, void_p, void_p, i32])  # bools as int
        fn = cgutils.get_or_insert_function(builder.module, fnty, symbol)

        def data(value, ty):
            return builder.bitcast(context.make_array(ty)(context, builder, value).data, void_p)

        sig = signature.args
        sizes = [context.cast(builder, v, t, types.int64) for v, t in zip(args[:6], sig[:6])]
        builder.call(fn, [*sizes, builder.zext(args[6], i32), data(args[7], sig[7]), data(args[8], sig[8]),
                          data(args[9], sig[9]), ir.Constant(i32, vnni)])
        return context.get_dummy_value()
    return types.void(m, n, k, ld_a, ld_b, ld_c, add, a, b, c), codegen


@njit(cache=True)
def brgemm(a, b, ld_b, c, add):
    """c (M, N) (+)= a (M, K) @ B, B (K/2, ld_b, 2) packed by ``pairs`` and read from the start of the
    flat uint16 array b, or for float32 a and b, B (K, ld_b) row-major. a, c: row slices with unit column
    stride (any row stride); K = a's columns, even for bf16 (on AMX an odd K reads and writes out of bounds)."""
    m, n = c.shape
    if _unpaired(a):
        raise ValueError("brgemm: a must have an even number of columns (B is packed in pairs of rows)")
    if m == 0 or n == 0 or a.shape[1] == 0:
        if not add:
            c[:] = 0
        return
    _call_brgemm(m, n, a.shape[1], a.strides[0] // a.itemsize, ld_b, c.strides[0] // 4, add, a, b, c)


def _unpaired(a):
    """Whether bf16 a (uint16) has an odd number of columns; never for float32."""


@overload(_unpaired)
def _unpaired_impl(a):
    if a.dtype == types.uint16:
        return lambda a: a.shape[1] % 2 == 1
    return lambda a: False


@intrinsic
def _call_brgemm_release(typingctx):
    """torch's brgemm_release(is_vnni=True)."""
    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32)])                       # the bool as int, as above
        fn = cgutils.get_or_insert_function(builder.module, fnty, _BRGEMM_RELEASE)
        builder.call(fn, [ir.Constant(ir.IntType(32), 1)])
        return context.get_dummy_value()
    return types.void(), codegen


def release_tiles(ops):
    """After a worker's last matmul of a kernel: hand the AMX tiles back (bf16 operands; nothing for None or
    float32, which uses no tiles)."""


@overload(release_tiles)
def _release_tiles(ops):
    if isinstance(ops, types.NoneType) or _float32(ops):
        return lambda ops: None
    return lambda ops: _call_brgemm_release()


@intrinsic
def _float32_bits(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _bits_float32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


def _as_float(x):
    """to_float's typed implementations."""


@overload(_as_float)
def _as_float_impl(x):
    if x == types.uint16:
        return lambda x: _bits_float32(np.uint32(x) << np.uint32(16))
    return lambda x: x


@njit(cache=True)
def to_float(x):
    """A scalar as a float: bf16 bits (uint16) as float32, float32 and float64 as they are."""
    return _as_float(x)


def stored_as(array, x):
    """The float x as an element of ``array``: the bits of the nearest bf16 for bf16 bits (uint16), x itself
    (converted on assignment) for float32 and float64 arrays."""


@overload(stored_as)
def _stored_as_impl(array, x):
    if array.dtype == types.uint16:
        return lambda array, x: round_bf16(np.float32(x))
    return lambda array, x: x


@njit(cache=True, fastmath=FASTMATH)
def store(dst, src):
    """dst (R, C) = src (R, C) of floats, each value ``stored_as`` dst's dtype (bf16 bits: rounded once)."""
    for i in range(src.shape[0]):
        for j in range(src.shape[1]):
            dst[i, j] = stored_as(dst, src[i, j])


@njit(cache=True, fastmath=FASTMATH)
def round_bf16(x):
    """float32 -> the bits of the nearest bfloat16 (ties to even; NaN stays NaN)."""
    u = _float32_bits(x)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.uint16(np.uint32(0x7FC0) if nan else rounded)


@njit(cache=True, fastmath=FASTMATH)
def to_bf16(x, scale, out, width):
    """out[:, :width] = bf16(scale * x) for x (rows, W) float32, W <= width; columns W..width are 0."""
    rows, cols = x.shape
    for i in range(rows):
        for j in range(cols):
            out[i, j] = round_bf16(scale * x[i, j])
        for j in range(cols, width):
            out[i, j] = 0


@njit(cache=True, fastmath=FASTMATH)
def transpose(x, out):
    """out (W, R') = x.T for x (R, W), R <= R'; columns R..R' of out are 0. (Converting first and then
    moving 16-bit values reads and writes 3x faster than converting in transposed order.) In tiles of 8 rows
    and ``_TILE`` columns of x, each column of a tile one row of out: a tile reads 8 cache lines. (Whole
    columns of x at once read one line per row, and the rows of a panel whose width is a power of two, 512,
    1024 or 2048 as the backward's panels of 8, 16 or 32 query blocks are, fall on a few cache sets and evict
    each other before the next column reads them.)"""
    rows, cols = x.shape
    whole_rows, whole_cols = rows - rows % _TILE_ROWS, cols - cols % _TILE
    for j0 in range(0, whole_cols, _TILE):
        for i0 in range(0, whole_rows, _TILE_ROWS):
            for j in range(j0, j0 + _TILE):
                column, row = x[i0:i0 + _TILE_ROWS, j], out[j, i0:i0 + _TILE_ROWS]      # 1-D slices
                for i in range(_TILE_ROWS):
                    row[i] = column[i]
        for i in range(whole_rows, rows):
            for j in range(j0, j0 + _TILE):
                out[j, i] = x[i, j]
    for j in range(whole_cols, cols):
        for i in range(rows):
            out[j, i] = x[i, j]
    for j in range(cols):
        for i in range(rows, out.shape[1]):
            out[j, i] = 0


@njit(cache=True)
def even(n):
    """n rounded up to even."""
    return n + (n & 1)


# ------------------------------------------------------------------------------------------------
# The kernels' matmuls: BLAS ?gemm (ops = None), or brgemm on packed operands (ops: bf16 or float32 ones)
# ------------------------------------------------------------------------------------------------
class ForwardOperands(NamedTuple):
    """brgemm operands of the forward (from ``forward_operands``), or one query block's (``head_forward``):
    bf16 (uint16) packed in pairs, or float32 (the trailing axis 1)."""

    q: np.ndarray          # (B, Hq, Nq, D) uint16; float32: q itself (unused: the kernel's own rows are A)
    kt: np.ndarray         # (Bkv, Hkv, D/2, Nk', 2) k.T packed; float32 (Bkv, Hkv, D, Nk', 1): alpha k.T
    v: np.ndarray          # (Bkv, Hkv, ceil(Nk/2), D, 2) v packed; float32 (Bkv, Hkv, Nk, D, 1), a view
    p: np.ndarray          # (workers, rows * even(width)) scratch: P in bf16; float32: (workers, 0), unused


def forward_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, workers: int, rows: int,
                     width: int, alpha: float) -> ForwardOperands:
    """The brgemm operands of a forward of contiguous q, k, v, and scratch for ``workers`` panels of rows x
    width: bf16 ones for bf16 inputs, float32 ones for float32 (k.T scaled by the scores' alpha). The copies
    go to the thread's ``workspace`` buffers named after the product they feed, which the backward's share."""
    if q.dtype == torch.float32:
        return ForwardOperands(q.numpy(), transposed(k, alpha, "S"), singles(v), np.empty((workers, 0), np.float32))
    return ForwardOperands(bits(q), pairs_t(k, "S"), pairs(v, "PV"), np.empty((workers, rows * even(width)), np.uint16))


class BackwardOperands(NamedTuple):
    """brgemm operands of the backward (from ``backward_operands``), or one (key block, query head)'s: bf16
    as below, or float32 with k, v as they are, the trailing axis 1 for the pairs, and ``halves`` (workers,
    1, cols * width): scale dS, transposed; qt holds alpha q.T."""

    k: np.ndarray          # (Bkv, Hkv, Nk, D) uint16
    v: np.ndarray          # (Bkv, Hkv, Nk, D)
    k_pairs: np.ndarray    # (Bkv, Hkv, ceil(Nk/2), D, 2) k packed: dq += dS @ k
    qt: np.ndarray         # (B, Hq, D/2, Nq, 2) q.T packed: S.T = k @ q.T
    doutt: np.ndarray      # (B, Hq, D/2, Nq, 2) dout.T packed: dP.T = v @ dout.T
    q_pairs: np.ndarray    # (B, Hq, ceil(Nq/2), D, 2) q packed: dk += dS.T @ q
    dout_pairs: np.ndarray  # (B, Hq, ceil(Nq/2), D, 2) dout packed: dv += P.T @ dout
    halves: np.ndarray     # (workers, 3, even(cols) * even(width)) scratch: P.T, dS.T and dS in bf16


def backward_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, workers: int,
                      cols: int, width: int, alpha: float) -> BackwardOperands:
    """The brgemm operands of a backward of contiguous q, k, v and dout, and scratch for ``workers`` panels
    of cols x width: bf16 ones for bf16 inputs, float32 ones for float32 (q.T scaled by the scores' alpha); the
    copies in ``workspace`` buffers as ``forward_operands`` puts them."""
    if q.dtype == torch.float32:
        return BackwardOperands(k.numpy(), v.numpy(), singles(k), transposed(q, alpha, "S"), transposed(dout, 1, "dP"),
                                singles(q), singles(dout), np.empty((workers, 1, cols * width), np.float32))
    dout = dout.to(torch.bfloat16)
    return BackwardOperands(bits(k), bits(v), pairs(k, "dQ"), pairs_t(q, "S"), pairs_t(dout, "dP"), pairs(q, "dK"),
                            pairs(dout, "dV"),
                            np.empty((workers, 3, even(cols) * even(width)), np.uint16))


def head_forward(ops, w, b, e, h, g, rows):
    """Worker w's operands for query block ``rows`` of head h of example b (kv head g of example e)."""


@overload(head_forward)
def _head_forward(ops, w, b, e, h, g, rows):
    if isinstance(ops, types.NoneType):
        return lambda ops, w, b, e, h, g, rows: None
    return lambda ops, w, b, e, h, g, rows: ForwardOperands(ops.q[b, h, rows], ops.kt[e, g], ops.v[e, g], ops.p[w])


def head_backward(ops, w, b, e, h, g, keys):
    """Worker w's operands for key block ``keys`` of kv head g of example e against query head h of b."""


@overload(head_backward)
def _head_backward(ops, w, b, e, h, g, keys):
    if isinstance(ops, types.NoneType):
        return lambda ops, w, b, e, h, g, keys: None
    return lambda ops, w, b, e, h, g, keys: BackwardOperands(
        ops.k[e, g, keys], ops.v[e, g, keys], ops.k_pairs[e, g], ops.qt[b, h], ops.doutt[b, h], ops.q_pairs[b, h],
        ops.dout_pairs[b, h], ops.halves[w])


def _float32(ops):
    """Whether ops are float32 brgemm operands (not None, not bf16): typing only, for the overloads below."""
    return isinstance(ops, types.BaseNamedTuple) and ops.types[1].dtype == types.float32


@njit(cache=True, fastmath=FASTMATH)
def _nt(a, bt, lo, alpha, out):
    """out (rows, n) = alpha a @ x[lo:lo + n].T, x.T packed in bt (D/2, N', 2), or (D, N', 1) for float32."""
    brgemm(a, bt.reshape(-1)[lo * bt.shape[2]:], bt.shape[1], out, False)
    if alpha == 1:
        return
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] *= alpha


@njit(cache=True, fastmath=FASTMATH)
def _nn_add(a, c0, c1, b_pairs, lo, hi, out):
    """out (rows, D) += a[:, c0:c1] @ x[lo:hi], x packed in pairs of rows in b_pairs (ceil(N/2), D, 2), or
    row-major in float32 b_pairs (N, D, 1). For pairs the row range widens to even bounds: a's extra columns
    must hold 0 (masked pairs of the same block, or the zero column after the sequence's last row)."""
    pair, dim = b_pairs.shape[2], out.shape[1]
    shift, tail = lo % pair, hi % pair
    brgemm(a[:, c0 - shift:c1 + tail], b_pairs.reshape(-1)[(lo - shift) * dim:], dim, out, True)


def scores(ops, alpha, q, k, lo, hi, s):
    """Forward: s (rows, hi - lo) = alpha q @ k[lo:hi].T, q (rows, D), k (Nk, D)."""


@overload(scores)
def _scores(ops, alpha, q, k, lo, hi, s):
    if isinstance(ops, types.NoneType):
        return lambda ops, alpha, q, k, lo, hi, s: gemm(alpha, q, False, k[lo:hi], True, alpha - alpha, s)
    if _float32(ops):                                    # alpha is in ops.kt
        return lambda ops, alpha, q, k, lo, hi, s: _nt(q, ops.kt, lo, np.float32(1), s)
    return lambda ops, alpha, q, k, lo, hi, s: _nt(ops.q, ops.kt, lo, alpha, s)


def row_window(ops, r0, r1, rows):
    """The rows [r0, r1) of a block that a panel computes (the forward's queries, the backward's keys): as given
    in float32/float64; all ``rows`` with bf16 operands (packed for the whole block)."""


@overload(row_window)
def _row_window(ops, r0, r1, rows):
    if isinstance(ops, types.NoneType) or _float32(ops):
        return lambda ops, r0, r1, rows: (r0, r1)
    return lambda ops, r0, r1, rows: (0, rows) if r0 < r1 else (r0, r1)


def probabilities(ops, p):
    """Forward, before ``add_pv``: P (rows, W) in the matmul dtype (bf16: into ops.p)."""


@overload(probabilities)
def _probabilities(ops, p):
    if isinstance(ops, types.NoneType) or _float32(ops):
        return lambda ops, p: None
    return lambda ops, p: to_bf16(p, np.float32(1), _view(ops.p, p.shape[0], even(p.shape[1])), even(p.shape[1]))


def add_pv(ops, p, c0, c1, v, lo, hi, acc):
    """Forward: acc (rows, D) += P[:, c0:c1] @ v[lo:hi], P (rows, W) after ``probabilities``."""


@overload(add_pv)
def _add_pv(ops, p, c0, c1, v, lo, hi, acc):
    if isinstance(ops, types.NoneType):
        def blas(ops, p, c0, c1, v, lo, hi, acc):
            one = p.dtype.type(1)
            gemm(one, p[:, c0:c1], False, v[lo:hi], False, one, acc)
        return blas
    if _float32(ops):
        return lambda ops, p, c0, c1, v, lo, hi, acc: _nn_add(p, c0, c1, ops.v, lo, hi, acc)
    return lambda ops, p, c0, c1, v, lo, hi, acc: _nn_add(_view(ops.p, p.shape[0], even(p.shape[1])), c0, c1,
                                                          ops.v, lo, hi, acc)


def scores_t(ops, alpha, key_block, q, dout, lo, hi, st, dpt):
    """Backward: st (cols, n) = alpha k @ q[lo:hi].T and dpt (cols, n) = v @ dout[lo:hi].T, k and v
    the key block's (cols, D)."""


@overload(scores_t)
def _scores_t(ops, alpha, key_block, q, dout, lo, hi, st, dpt):
    if isinstance(ops, types.NoneType):
        def blas(ops, alpha, key_block, q, dout, lo, hi, st, dpt):
            zero, one = alpha - alpha, alpha / alpha
            gemm(alpha, key_block.k, False, q[lo:hi], True, zero, st)
            gemm(one, key_block.v, False, dout[lo:hi], True, zero, dpt)
        return blas
    if _float32(ops):
        def float32(ops, alpha, key_block, q, dout, lo, hi, st, dpt):
            _nt(key_block.k, ops.qt, lo, np.float32(1), st)                   # alpha is in ops.qt
            _nt(key_block.v, ops.doutt, lo, np.float32(1), dpt)
        return float32

    def bf16(ops, alpha, key_block, q, dout, lo, hi, st, dpt):
        _nt(ops.k, ops.qt, lo, alpha, st)
        _nt(ops.v, ops.doutt, lo, np.float32(1), dpt)
    return bf16


def grad_operands(ops, st, dpt, scale):
    """Backward, before ``add_grads``: dS.T and P.T (cols, W) in the matmul dtype (bf16: scale dS.T,
    its transpose and P.T into ops.halves; float32: st scaled in place, its transpose into ops.halves)."""


@overload(grad_operands)
def _grad_operands(ops, st, dpt, scale):
    if isinstance(ops, types.NoneType):
        return lambda ops, st, dpt, scale: None
    if _float32(ops):
        def float32(ops, st, dpt, scale):
            cols, width = st.shape
            for i in range(cols):
                for j in range(width):
                    st[i, j] *= scale
            transpose(st, _view(ops.halves[0], width, cols))
        return float32

    def bf16(ops, st, dpt, scale):
        cols, width = st.shape
        pt, dst, ds = _halves(ops, cols, width)
        to_bf16(dpt, np.float32(1), pt, even(width))
        to_bf16(st, scale, dst, even(width))
        transpose(dst, ds)
    return bf16


@njit(cache=True)
def _halves(ops, cols, width):
    """(P.T, scale dS.T, scale dS) views of a worker's bf16 scratch: (cols, even(W)) twice, (even(W), even(cols))."""
    return (_view(ops.halves[0], cols, even(width)), _view(ops.halves[1], cols, even(width)),
            _view(ops.halves[2], even(width), even(cols)))


def add_grads(ops, scale, key_block, st, dpt, c0, c1, q, dout, q0, q1, dq):
    """Backward: dv += P.T[:, c0:c1] @ dout[q0:q1], dk += scale dS.T[:, c0:c1] @ q[q0:q1] (the key
    block's rows) and dq[q0:q1] += scale dS[c0:c1] @ k, from st = dS.T and dpt = P.T (cols, W)."""


@overload(add_grads)
def _add_grads(ops, scale, key_block, st, dpt, c0, c1, q, dout, q0, q1, dq):
    if isinstance(ops, types.NoneType):
        def blas(ops, scale, key_block, st, dpt, c0, c1, q, dout, q0, q1, dq):
            one = scale / scale
            gemm(one, dpt[:, c0:c1], False, dout[q0:q1], False, one, key_block.dv)
            gemm(scale, st[:, c0:c1], False, q[q0:q1], False, one, key_block.dk)
            gemm(scale, st[:, c0:c1], True, key_block.k, False, one, dq[q0:q1])
        return blas
    if _float32(ops):
        def float32(ops, scale, key_block, st, dpt, c0, c1, q, dout, q0, q1, dq):
            cols, width = st.shape                               # st: scale dS.T, after grad_operands
            ds = _view(ops.halves[0], width, cols)
            _nn_add(dpt, c0, c1, ops.dout_pairs, q0, q1, key_block.dv)
            _nn_add(st, c0, c1, ops.q_pairs, q0, q1, key_block.dk)
            brgemm(ds[c0:c1], ops.k_pairs.reshape(-1)[key_block.start * q.shape[1]:], q.shape[1], dq[q0:q1], True)
        return float32

    def bf16(ops, scale, key_block, st, dpt, c0, c1, q, dout, q0, q1, dq):
        cols, width = st.shape
        pt, dst, ds = _halves(ops, cols, width)
        _nn_add(pt, c0, c1, ops.dout_pairs, q0, q1, key_block.dv)
        _nn_add(dst, c0, c1, ops.q_pairs, q0, q1, key_block.dk)
        brgemm(ds[c0:c1], ops.k_pairs.reshape(-1)[key_block.start * q.shape[1]:], q.shape[1], dq[q0:q1], True)
    return bf16


@njit(cache=True)
def _view(buffer, rows, width):
    """A (rows, width) C-contiguous view of the start of a flat scratch buffer."""
    return buffer[:rows * width].reshape((rows, width))
