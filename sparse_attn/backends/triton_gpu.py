"""The Triton backend: fused block-sparse FlashAttention, forward and backward.

>>> import torch, sparse_attn as sa
>>> from sparse_attn.api import sparse_attention
>>> q = k = v = torch.randn(1, 16, 8192, 64, device="cuda", dtype=torch.bfloat16)   # doctest: +SKIP
>>> sparse_attention(q, k, v, sa.Local(256) | sa.Global(first=16), backend="triton")  # doctest: +SKIP

The kernels follow Triton's fused-attention tutorial; what changes is *which* key blocks a query
block visits. A ``BlockLayout`` lists them per (example, head, query block) as two CSR indices:
**full** blocks (every pair allowed: no mask at all) and **partial** blocks (a (BLOCK, BLOCK) bool
tile from ``layout.masks``, already False outside the sequence). Tiles are BLOCK x BLOCK with
BLOCK = ``layout.block_size`` (a sequence shorter than a block has smaller tiles, padded with False
on the host); scores never leave on-chip memory, so memory is O(N), not O(N^2).

Forward, one program per work item x (batch x head) (``work_split``: a query block's list of key
blocks, or a piece of a long one), longest items first:
    for each key block c of the row (full blocks, then partial ones):
        s   = q @ k_c^T                                # fp32 accumulation
        s   = where(tile, s, -inf)                     # partial blocks only
        t   = scale * log2(e)                          # scores in log2 units: exp2 is cheaper than exp
        m'  = max(m, t * rowmax(s));  p = exp2(t * s - m')   # online softmax, one FFMA a score
        l   = l * exp2(m - m') + rowsum(p)
        acc = acc * exp2(m - m') + p @ v_c
    out = acc / l;  lse = (m + log2(l)) * ln(2)        # natural-log lse, saved for the backward
With score modifiers (``ScoreMods``: softcap, ALiBi; compile-time switches, so the kernels above are unchanged
without them) each score is computed in log2 units before the same online softmax:
``t = log2(e) * (c * tanh(scale * s / c) - slope * |i' - j|)``, the max taken on t; the backward recomputes t and
multiplies dS by 1 - tanh^2. tanh is the GPU's ``tanh.approx.f32`` for half-precision (and TF32) inputs, one
special-function operation beside the softmax's exp2, and exp2-based for exact float32 (``_tanh``). Sinks never
enter the kernels (``score_mods.add_sink``).
Rows with no allowed key keep m = -inf and l = 0: their output is 0 and their lse is -inf. A row cut
into pieces (the rows of global tokens, which hold every key block) has each piece write its (out, lse)
to a float32 scratch slot; ``_merge_kernel`` combines them by log-sum-exp. The backward cuts rows (dQ)
and key-block columns (dK/dV) the same way, and ``_sum_kernel`` adds the pieces' gradients, in a fixed
order: no atomics anywhere.

Backward (recomputes P from q, k and lse instead of storing it; no atomics, so deterministic):
1. preprocess, per query block: ``delta = rowsum(dO * O) - dlse`` and ``lse2 = lse * log2(e)``,
   with +inf for empty rows so that their recomputed probabilities are exactly 0;
2. dK/dV, one program per (key block or piece of one, batch x kv head): walks the *transposed* index of every
   query head that reads this kv head (GQA), accumulating
   ``dV += P^T dO`` and ``dK += scale * dS^T Q`` with ``dS = P * (dO V^T - delta)``;
3. dQ, one program per (query block or piece, batch x head): walks the row index, ``dQ += scale * dS K``.

K and V of batch 1 (one K, V read by every example of q) are never copied: the forward and dQ kernels
read them with batch stride 0. The dK/dV programs still run per (key block, example x kv head), into a
float32 (B, Hkv, Nk, D) buffer each for dK and dV that is then summed over the batch: 8 B Hkv Nk D bytes
during the backward (what per-example float32 dK, dV would take), and still no atomics.

CPU tensors run in Triton's interpreter when ``TRITON_INTERPRET=1`` is set before Triton is first
imported: slow, for tests only. The kernels are registered as ``torch.library`` custom ops with
fake and autograd implementations, so ``torch.compile(fullgraph=True)`` traces them forward and
backward.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from ..layout import BlockLayout, KernelIndex
from ..score_mods import NO_MODS, ScoreMods
from . import work_split

BLOCK_SIZE = 64
MAX_HEAD_DIM = 128
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): scores in log2 units for exp2; constexpr, so kernels read it
_TANH_NEAR = tl.constexpr(0.25)            # below: tanh's odd polynomial; above: 1 - 2 / (exp(2x) + 1)
_TANH_C3 = tl.constexpr(-0.3333326)        # tanh(x) = x + x^3 (C3 + x^2 (C5 + x^2 C7)) on |x| < 0.25,
_TANH_C5 = tl.constexpr(0.13325404)        # fitted to float64 tanh: 6e-8 relative in float32
_TANH_C7 = tl.constexpr(-0.05158631)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
@triton.jit
def _matrix(base, b, h, stride_b, stride_h):
    """Pointer to the (N, D) matrix of example ``b``, head ``h`` in a (B, H, N, D) tensor (64-bit offsets)."""
    return base + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _load_tile(base, rows, stride_n, stride_d, n, dims, HEAD_DIM: tl.constexpr, EVEN_ROWS: tl.constexpr):
    """A (len(rows), BLOCK_D) tile of a (n, HEAD_DIM) matrix, zero past the sequence and head_dim."""
    ptrs = base + rows[:, None] * stride_n + dims[None, :] * stride_d
    if EVEN_ROWS and HEAD_DIM == dims.shape[0]:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=(rows[:, None] < n) & (dims[None, :] < HEAD_DIM), other=0.0)
    return tile


@triton.jit
def _load_mask(masks, tile_id, BLOCK: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Tile ``masks[tile_id]`` as a (BLOCK, BLOCK) bool block, transposed (keys x queries) on request."""
    offs = tl.arange(0, BLOCK)
    base = masks + tile_id.to(tl.int64) * BLOCK * BLOCK
    if TRANSPOSE:
        bits = tl.load(base + offs[None, :] * BLOCK + offs[:, None])
    else:
        bits = tl.load(base + offs[:, None] * BLOCK + offs[None, :])
    return bits != 0


@triton.jit
def _tanh(x, HARDWARE: tl.constexpr):
    """tanh(x) in float32. HARDWARE: the GPU's ``tanh.approx.f32``, one special-function operation, 2^-11 relative
    at most: for half-precision and TF32 inputs, whose scores carry more rounding than that (FlashAttention's
    softcap does the same). Else from exp2 and a fast division (tl.math has no tanh on every Triton version):
    5.3e-7 relative at most with an exact exp2 (the interpreter's; tests allow 1e-6), exactly +-1 for large
    |x|, NaN for NaN; near 0, where 1 - 2 / (exp(2x) + 1) loses digits to cancellation, an odd polynomial."""
    if HARDWARE:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    far = 1.0 - tl.fdiv(2.0, tl.exp2(x * (2.0 * _LOG2E)) + 1.0)     # exp2 -> inf or 0 for large |x|: +-1
    x2 = x * x
    near = x + x * x2 * (_TANH_C3 + x2 * (_TANH_C5 + x2 * _TANH_C7))
    return tl.where(tl.abs(x) < _TANH_NEAR, near, far)


@triton.jit
def _distance(q_first, k_first, BLOCK: tl.constexpr, TRANSPOSED: tl.constexpr):
    """|i' - j| in a tile whose queries sit at positions q_first + arange(BLOCK) and keys at k_first +
    arange(BLOCK): (queries, keys), or (keys, queries) if TRANSPOSED; float32, exact below 2**24."""
    offs = tl.arange(0, BLOCK).to(tl.float32)
    shifted = (q_first - k_first).to(tl.float32) + offs                  # queries relative to the first key
    if TRANSPOSED:
        d = offs[:, None] - shifted[None, :]
    else:
        d = shifted[:, None] - offs[None, :]
    return tl.abs(d)


@triton.jit
def _modified_scores(s, qk_scale, cap_in_scale, cap_out_scale, slope2, q_first, k_first, BLOCK: tl.constexpr,
                     PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                     TRANSPOSED: tl.constexpr):
    """Dot products ``s`` (unscaled) -> the modified scores in log2 units, and tanh(scale * s / softcap) (whose
    1 - tanh^2 is the softcap's derivative; ``s`` itself without softcap):
    ``log2(e) * (softcap * tanh(scale * s / softcap) - slope * |i' - j|)``; cap_in_scale = scale / softcap,
    cap_out_scale = softcap * log2(e), slope2 = slope * log2(e). The hardware tanh where the dot products are not
    exact float32 (PRECISION) and the kernels are compiled (the interpreter runs no PTX)."""
    if HAS_SOFTCAP:
        th = _tanh(s * cap_in_scale, PRECISION != "ieee" and _COMPILED)
        t = th * cap_out_scale
    else:
        th = s
        t = s * qk_scale
    if HAS_ALIBI:
        t = t - slope2 * _distance(q_first, k_first, BLOCK, TRANSPOSED)
    return t, th


@triton.jit
def _fwd_block(acc, l_i, m_i, q, k_base, v_base, col, stride_kn, stride_kd, stride_vn, stride_vd, n_k,
               tile, qk_scale, cap_in_scale, cap_out_scale, slope2, q_first, dims, HEAD_DIM: tl.constexpr,
               BLOCK: tl.constexpr, EVEN_K: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """One online-softmax step of a query block over key block ``col``; ``tile`` masks if MASKED."""
    keys = col * BLOCK + tl.arange(0, BLOCK)
    k = _load_tile(k_base, keys, stride_kn, stride_kd, n_k, dims, HEAD_DIM, EVEN_K)   # (BLOCK_N, BLOCK_D)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)                             # (BLOCK_M, BLOCK_N) unscaled
    if HAS_SOFTCAP or HAS_ALIBI:  # the modified scores, in log2 units: no scale left to fold into exp2
        s, _ = _modified_scores(s, qk_scale, cap_in_scale, cap_out_scale, slope2, q_first, col * BLOCK, BLOCK,
                                PRECISION, HAS_SOFTCAP, HAS_ALIBI, False)
        unit = 1.0
    else:         # the "FFMA softmax": the max on unscaled scores, the scale folded into exp2's argument
        unit = qk_scale
    if MASKED:
        s = tl.where(tile, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * unit)                                       # (BLOCK_M,) log2 units
    if MASKED:  # a row with nothing allowed yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s * unit - m_shift[:, None])                                           # one FFMA a score
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(v_base, keys, stride_vn, stride_vd, n_k, dims, HEAD_DIM, EVEN_K)   # (BLOCK_N, BLOCK_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _work_item(Items, fanout, head_fanout):
    """This program's work item (see ``work_split``): (block, start, end, slot, b, h), its example and head
    being the item's plus the program's place ``f`` in the broadcast over examples and heads."""
    pid = tl.program_id(0)
    item = Items + (pid // fanout) * 6
    f = pid % fanout
    return (tl.load(item), tl.load(item + 1), tl.load(item + 2), tl.load(item + 3),
            tl.load(item + 4) + f // head_fanout, tl.load(item + 5) + f % head_fanout, f)


@triton.jit
def _piece(FullPtr, PartPtr, ptr, start, end):
    """Entries [start, end) of a row's list (its full blocks, then its partial ones) as ranges of the full
    and the partial index, and the list's length; start and end are clipped to the list."""
    full_lo = tl.load(FullPtr + ptr)
    n_full = tl.load(FullPtr + ptr + 1) - full_lo
    part_lo = tl.load(PartPtr + ptr)
    total = n_full + tl.load(PartPtr + ptr + 1) - part_lo
    start = tl.minimum(tl.maximum(start, 0), total)
    end = tl.minimum(tl.maximum(end, 0), total)
    return (full_lo + tl.minimum(start, n_full), full_lo + tl.minimum(end, n_full),
            part_lo + tl.maximum(start - n_full, 0), part_lo + tl.maximum(end - n_full, 0), total)


@triton.jit
def _slope2(Slopes, b, h, stride_sb, HAS_ALIBI: tl.constexpr):
    """ALiBi's slope of example ``b``, head ``h`` in log2 units (0 without ALiBi): Slopes is (B or 1, Hq)."""
    if HAS_ALIBI:
        slope2 = tl.load(Slopes + b * stride_sb + h) * _LOG2E
    else:
        slope2 = 0.0
    return slope2


@triton.jit
def _fwd_kernel(Q, K, V, Out, Lse, PieceOut, PieceLse, Items,
                FullPtr, FullIdx, PartPtr, PartIdx, PartMask, Masks, Slopes,
                stride_qb, stride_qh, stride_qn, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_ob, stride_oh, stride_on, stride_od,
                stride_pb, stride_ph, stride_sb,
                qk_scale, cap_in_scale, cap_out_scale, n_q, n_k, heads, groups, fanout, head_fanout,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
                EVEN_Q: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    row, start, end, slot, b, h, f = _work_item(Items, fanout, head_fanout)
    kvh = h // groups
    slope2 = _slope2(Slopes, b, h, stride_sb, HAS_ALIBI)
    q_first = row * BLOCK + n_k - n_q                                     # i' of the block's first query
    queries = row * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, BLOCK_D)
    q_base = _matrix(Q, b, h, stride_qb, stride_qh)
    k_base = _matrix(K, b, kvh, stride_kb, stride_kh)
    v_base = _matrix(V, b, kvh, stride_vb, stride_vh)
    q = _load_tile(q_base, queries, stride_qn, stride_qd, n_q, dims, HEAD_DIM, EVEN_Q)  # (BLOCK_M, BLOCK_D)

    m_i = tl.full((BLOCK,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK,), tl.float32)
    acc = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    full_lo, full_hi, part_lo, part_hi, _ = _piece(FullPtr, PartPtr, b * stride_pb + h * stride_ph + row, start, end)
    # Full blocks: no mask, except the sequence end when n_k is not a multiple of BLOCK.
    in_keys = (tl.arange(0, BLOCK) < BLOCK)[None, :]
    for i in range(full_lo, full_hi):
        col = tl.load(FullIdx + i)
        if not EVEN_K:
            in_keys = (col * BLOCK + tl.arange(0, BLOCK) < n_k)[None, :]
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_base, v_base, col, stride_kn, stride_kd, stride_vn,
                                   stride_vd, n_k, in_keys, qk_scale, cap_in_scale, cap_out_scale, slope2, q_first,
                                   dims, HEAD_DIM, BLOCK, EVEN_K, not EVEN_K, PRECISION, HAS_SOFTCAP, HAS_ALIBI)
    # Partial blocks: the exact token tile.
    for i in range(part_lo, part_hi):
        col = tl.load(PartIdx + i)
        tile = _load_mask(Masks, tl.load(PartMask + i), BLOCK, False)
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_base, v_base, col, stride_kn, stride_kd, stride_vn,
                                   stride_vd, n_k, tile, qk_scale, cap_in_scale, cap_out_scale, slope2, q_first,
                                   dims, HEAD_DIM, BLOCK, EVEN_K, True, PRECISION, HAS_SOFTCAP, HAS_ALIBI)

    empty = l_i == 0.0                                                    # rows with no allowed key (so far)
    l_i = tl.where(empty, 1.0, l_i)
    out = acc / l_i[:, None]                                              # (BLOCK_M, BLOCK_D)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_i)) / _LOG2E)
    if slot < 0:                                                          # the whole row: the result
        o_ptrs = _matrix(Out, b, h, stride_ob, stride_oh) + queries[:, None] * stride_on \
            + dims[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(queries[:, None] < n_q) & (dims[None, :] < HEAD_DIM))
        tl.store(Lse + (b * heads + h).to(tl.int64) * n_q + queries, lse, mask=queries < n_q)
    else:                                                                 # a piece: merged by _merge_kernel
        piece = (slot * fanout + f).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(PieceOut + piece[:, None] * BLOCK_D + dims[None, :], out)
        tl.store(PieceLse + piece, lse)


@triton.jit
def _split_row(Splits, fanout, head_fanout):
    """This program's split row or column (see ``work_split``): (block, first slot, pieces, b, h, f)."""
    pid = tl.program_id(0)
    split = Splits + (pid // fanout) * 5
    f = pid % fanout
    return (tl.load(split), tl.load(split + 1), tl.load(split + 2), tl.load(split + 3) + f // head_fanout,
            tl.load(split + 4) + f % head_fanout, f)


@triton.jit
def _merge_kernel(PieceOut, PieceLse, Out, Lse, Splits,
                  stride_ob, stride_oh, stride_on, stride_od,
                  n_q, heads, fanout, head_fanout,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
    """The forward output of a split row from its pieces: out = sum_p w_p out_p / sum_p w_p, w_p = exp(lse_p - m)."""
    row, first, count, b, h, f = _split_row(Splits, fanout, head_fanout)
    offs = tl.arange(0, BLOCK)
    dims = tl.arange(0, BLOCK_D)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    for s in range(first, first + count):
        m = tl.maximum(m, tl.load(PieceLse + (s * fanout + f).to(tl.int64) * BLOCK + offs))
    m = tl.where(m == float("-inf"), 0.0, m)                              # every piece empty: weights 0, not NaN
    total = tl.zeros((BLOCK,), tl.float32)
    acc = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    for s in range(first, first + count):
        piece = (s * fanout + f).to(tl.int64) * BLOCK + offs
        weight = tl.exp(tl.load(PieceLse + piece) - m)                    # (BLOCK_M,)
        total += weight
        acc += weight[:, None] * tl.load(PieceOut + piece[:, None] * BLOCK_D + dims[None, :])
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
    queries = row * BLOCK + offs
    o_ptrs = _matrix(Out, b, h, stride_ob, stride_oh) + queries[:, None] * stride_on + dims[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(queries[:, None] < n_q) & (dims[None, :] < HEAD_DIM))
    tl.store(Lse + (b * heads + h).to(tl.int64) * n_q + queries, lse, mask=queries < n_q)


@triton.jit
def _sum_kernel(Pieces, Out, Splits, scale, n, heads, fanout, head_fanout,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
    """A gradient block of a split row (dQ) or column (dK, dV): the sum of its pieces, in slot order, times
    ``scale``, into the contiguous (B, H, n, HEAD_DIM) ``Out``."""
    blk, first, count, b, h, f = _split_row(Splits, fanout, head_fanout)
    offs = tl.arange(0, BLOCK)
    dims = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    for s in range(first, first + count):
        piece = (s * fanout + f).to(tl.int64) * BLOCK + offs
        acc += tl.load(Pieces + piece[:, None] * BLOCK_D + dims[None, :])
    rows = blk * BLOCK + offs
    out = (b * heads + h).to(tl.int64) * n * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
    tl.store(Out + out, (acc * scale).to(Out.dtype.element_ty), mask=(rows[:, None] < n) & (dims[None, :] < HEAD_DIM))


@triton.jit
def _bwd_preprocess_kernel(Out, DOut, Lse, DLse, Delta, Lse2,
                           stride_ob, stride_oh, stride_on, stride_od,
                           stride_db, stride_dh, stride_dn, stride_dd,
                           n_q, heads, HAS_DLSE: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
    """delta = rowsum(dO * O) - dlse; lse2 = lse * log2(e), +inf for empty rows (so P = 0 there)."""
    row = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    queries = row * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, BLOCK_D)
    o = _load_tile(_matrix(Out, b, h, stride_ob, stride_oh), queries, stride_on, stride_od, n_q, dims, HEAD_DIM,
                   False).to(tl.float32)                                            # (BLOCK_M, BLOCK_D)
    do = _load_tile(_matrix(DOut, b, h, stride_db, stride_dh), queries, stride_dn, stride_dd, n_q, dims, HEAD_DIM,
                    False).to(tl.float32)
    delta = tl.sum(o * do, 1)                                                        # (BLOCK_M,)
    rows = bh.to(tl.int64) * n_q + queries
    if HAS_DLSE:
        delta -= tl.load(DLse + rows, mask=queries < n_q, other=0.0)
    lse = tl.load(Lse + rows, mask=queries < n_q, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    tl.store(Delta + rows, delta, mask=queries < n_q)
    tl.store(Lse2 + rows, lse2, mask=queries < n_q)


@triton.jit
def _bwd_kv_block(dk, dv, k, v, q_base, do_base, Lse2, Delta, row, stride_qn, stride_qd, stride_dn, stride_dd,
                  n_q, tile_t, qk_scale, cap_in_scale, cap_out_scale, slope2, k_first, shift, dims,
                  HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, EVEN_Q: tl.constexpr, MASKED: tl.constexpr,
                  PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """dK/dV contributions of query block ``row`` to one key block (everything transposed: keys x queries)."""
    queries = row * BLOCK + tl.arange(0, BLOCK)
    q = _load_tile(q_base, queries, stride_qn, stride_qd, n_q, dims, HEAD_DIM, EVEN_Q)      # (BLOCK_M, BLOCK_D)
    do = _load_tile(do_base, queries, stride_dn, stride_dd, n_q, dims, HEAD_DIM, EVEN_Q)    # (BLOCK_M, BLOCK_D)
    lse2 = tl.load(Lse2 + queries, mask=queries < n_q, other=float("inf"))                 # rows past n_q: P = 0
    delta = tl.load(Delta + queries, mask=queries < n_q, other=0.0)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)                                # (BLOCK_N, BLOCK_M)
    if HAS_SOFTCAP or HAS_ALIBI:
        s_t, tanh_t = _modified_scores(s_t, qk_scale, cap_in_scale, cap_out_scale, slope2, row * BLOCK + shift,
                                       k_first, BLOCK, PRECISION, HAS_SOFTCAP, HAS_ALIBI, True)
    else:
        s_t = s_t * qk_scale
    p_t = tl.exp2(s_t - lse2[None, :])
    if MASKED:
        p_t = tl.where(tile_t, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)                          # (BLOCK_N, BLOCK_D)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)                              # (BLOCK_N, BLOCK_M)
    ds_t = p_t * (dp_t - delta[None, :])
    if HAS_SOFTCAP:                                                                         # d softcap / d score
        ds_t = ds_t * (1.0 - tanh_t * tanh_t)
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)                           # (BLOCK_N, BLOCK_D)
    return dk, dv


@triton.jit
def _bwd_kv_kernel(Q, K, V, DOut, Lse2, Delta, DK, DV, PieceDK, PieceDV, Items,
                   FullTPtr, FullTIdx, PartTPtr, PartTIdx, PartTMask, Masks, Slopes,
                   stride_qb, stride_qh, stride_qn, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_db, stride_dh, stride_dn, stride_dd,
                   stride_pb, stride_ph, stride_sb,
                   scale, qk_scale, cap_in_scale, cap_out_scale, n_q, n_k, heads, kv_heads, groups, fanout,
                   head_fanout, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
                   EVEN_Q: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    col, start, end, slot, b, kvh, f = _work_item(Items, fanout, head_fanout)
    keys = col * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, BLOCK_D)
    k = _load_tile(_matrix(K, b, kvh, stride_kb, stride_kh), keys, stride_kn, stride_kd, n_k, dims, HEAD_DIM,
                   EVEN_K)                                                                  # (BLOCK_N, BLOCK_D)
    v = _load_tile(_matrix(V, b, kvh, stride_vb, stride_vh), keys, stride_vn, stride_vd, n_k, dims, HEAD_DIM,
                   EVEN_K)
    dk = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    no_mask = (tl.arange(0, BLOCK) < BLOCK)[:, None]
    # The item's [start, end) counts along the query heads' lists one after the other (work_split.column_counts).
    before = 0
    for g in range(groups):  # every query head that reads this kv head, in a fixed order
        h = kvh * groups + g
        slope2 = _slope2(Slopes, b, h, stride_sb, HAS_ALIBI)
        q_base = _matrix(Q, b, h, stride_qb, stride_qh)
        do_base = _matrix(DOut, b, h, stride_db, stride_dh)
        stats = (b * heads + h).to(tl.int64) * n_q
        full_lo, full_hi, part_lo, part_hi, total = _piece(FullTPtr, PartTPtr, b * stride_pb + h * stride_ph + col,
                                                           start - before, end - before)
        before += total
        for i in range(full_lo, full_hi):
            dk, dv = _bwd_kv_block(dk, dv, k, v, q_base, do_base, Lse2 + stats, Delta + stats, tl.load(FullTIdx + i),
                                   stride_qn, stride_qd, stride_dn, stride_dd, n_q, no_mask, qk_scale, cap_in_scale,
                                   cap_out_scale, slope2, col * BLOCK, n_k - n_q, dims, HEAD_DIM, BLOCK, EVEN_Q,
                                   False, PRECISION, HAS_SOFTCAP, HAS_ALIBI)
        for i in range(part_lo, part_hi):
            tile_t = _load_mask(Masks, tl.load(PartTMask + i), BLOCK, True)                  # (BLOCK_N, BLOCK_M)
            dk, dv = _bwd_kv_block(dk, dv, k, v, q_base, do_base, Lse2 + stats, Delta + stats, tl.load(PartTIdx + i),
                                   stride_qn, stride_qd, stride_dn, stride_dd, n_q, tile_t, qk_scale, cap_in_scale,
                                   cap_out_scale, slope2, col * BLOCK, n_k - n_q, dims, HEAD_DIM, BLOCK, EVEN_Q,
                                   True, PRECISION, HAS_SOFTCAP, HAS_ALIBI)
    if slot < 0:  # the whole column; dK/dV are contiguous (B, Hkv, Nk, D)
        out = (b * kv_heads + kvh).to(tl.int64) * n_k * HEAD_DIM + keys[:, None] * HEAD_DIM + dims[None, :]
        inside = (keys[:, None] < n_k) & (dims[None, :] < HEAD_DIM)
        tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=inside)
        tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=inside)
    else:         # a piece: summed by _sum_kernel
        piece = ((slot * fanout + f).to(tl.int64) * BLOCK + tl.arange(0, BLOCK))[:, None] * BLOCK_D + dims[None, :]
        tl.store(PieceDK + piece, dk)
        tl.store(PieceDV + piece, dv)


@triton.jit
def _bwd_q_block(dq, q, do, lse2, delta, k_base, v_base, col, stride_kn, stride_kd, stride_vn, stride_vd, n_k,
                 tile, qk_scale, cap_in_scale, cap_out_scale, slope2, q_first, dims, HEAD_DIM: tl.constexpr,
                 BLOCK: tl.constexpr, EVEN_K: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """dQ contribution of key block ``col`` to one query block."""
    keys = col * BLOCK + tl.arange(0, BLOCK)
    k = _load_tile(k_base, keys, stride_kn, stride_kd, n_k, dims, HEAD_DIM, EVEN_K)         # (BLOCK_N, BLOCK_D)
    v = _load_tile(v_base, keys, stride_vn, stride_vd, n_k, dims, HEAD_DIM, EVEN_K)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)                                   # (BLOCK_M, BLOCK_N)
    if HAS_SOFTCAP or HAS_ALIBI:
        s, tanh_s = _modified_scores(s, qk_scale, cap_in_scale, cap_out_scale, slope2, q_first, col * BLOCK, BLOCK,
                                     PRECISION, HAS_SOFTCAP, HAS_ALIBI, False)
    else:
        s = s * qk_scale
    p = tl.exp2(s - lse2[:, None])
    if MASKED:
        p = tl.where(tile, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                                 # (BLOCK_M, BLOCK_N)
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:                                                                         # d softcap / d score
        ds = ds * (1.0 - tanh_s * tanh_s)
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)                       # (BLOCK_M, BLOCK_D)


@triton.jit
def _bwd_q_kernel(Q, K, V, DOut, Lse2, Delta, DQ, PieceDQ, Items,
                  FullPtr, FullIdx, PartPtr, PartIdx, PartMask, Masks, Slopes,
                  stride_qb, stride_qh, stride_qn, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  stride_db, stride_dh, stride_dn, stride_dd,
                  stride_pb, stride_ph, stride_sb,
                  scale, qk_scale, cap_in_scale, cap_out_scale, n_q, n_k, heads, groups, fanout, head_fanout,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
                  EVEN_Q: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    row, start, end, slot, b, h, f = _work_item(Items, fanout, head_fanout)
    kvh = h // groups
    slope2 = _slope2(Slopes, b, h, stride_sb, HAS_ALIBI)
    q_first = row * BLOCK + n_k - n_q                                     # i' of the block's first query
    queries = row * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, BLOCK_D)
    q = _load_tile(_matrix(Q, b, h, stride_qb, stride_qh), queries, stride_qn, stride_qd, n_q, dims, HEAD_DIM,
                   EVEN_Q)                                                                   # (BLOCK_M, BLOCK_D)
    do = _load_tile(_matrix(DOut, b, h, stride_db, stride_dh), queries, stride_dn, stride_dd, n_q, dims, HEAD_DIM,
                    EVEN_Q)
    stats = (b * heads + h).to(tl.int64) * n_q + queries
    lse2 = tl.load(Lse2 + stats, mask=queries < n_q, other=float("inf"))
    delta = tl.load(Delta + stats, mask=queries < n_q, other=0.0)
    k_base = _matrix(K, b, kvh, stride_kb, stride_kh)
    v_base = _matrix(V, b, kvh, stride_vb, stride_vh)
    dq = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    full_lo, full_hi, part_lo, part_hi, _ = _piece(FullPtr, PartPtr, b * stride_pb + h * stride_ph + row, start, end)
    in_keys = (tl.arange(0, BLOCK) < BLOCK)[None, :]
    for i in range(full_lo, full_hi):
        col = tl.load(FullIdx + i)
        if not EVEN_K:
            in_keys = (col * BLOCK + tl.arange(0, BLOCK) < n_k)[None, :]
        dq = _bwd_q_block(dq, q, do, lse2, delta, k_base, v_base, col, stride_kn, stride_kd, stride_vn, stride_vd,
                          n_k, in_keys, qk_scale, cap_in_scale, cap_out_scale, slope2, q_first, dims, HEAD_DIM, BLOCK,
                          EVEN_K, not EVEN_K, PRECISION, HAS_SOFTCAP, HAS_ALIBI)
    for i in range(part_lo, part_hi):
        tile = _load_mask(Masks, tl.load(PartMask + i), BLOCK, False)
        dq = _bwd_q_block(dq, q, do, lse2, delta, k_base, v_base, tl.load(PartIdx + i), stride_kn, stride_kd,
                          stride_vn, stride_vd, n_k, tile, qk_scale, cap_in_scale, cap_out_scale, slope2, q_first,
                          dims, HEAD_DIM, BLOCK, EVEN_K, True, PRECISION, HAS_SOFTCAP, HAS_ALIBI)
    if slot < 0:  # the whole row; dQ is contiguous (B, Hq, Nq, D)
        out = (b * heads + h).to(tl.int64) * n_q * HEAD_DIM + queries[:, None] * HEAD_DIM + dims[None, :]
        tl.store(DQ + out, (dq * scale).to(DQ.dtype.element_ty),
                 mask=(queries[:, None] < n_q) & (dims[None, :] < HEAD_DIM))
    else:         # a piece: summed by _sum_kernel
        piece = ((slot * fanout + f).to(tl.int64) * BLOCK + tl.arange(0, BLOCK))[:, None] * BLOCK_D + dims[None, :]
        tl.store(PieceDQ + piece, dq)


# Triton picks compiled or interpreted functions when each @triton.jit runs, with TRITON_INTERPRET as
# it is then: for our kernels at this import, for Triton's own (tl.zeros, tl.sum) at `import triton`.
_INTERPRETED = not isinstance(_fwd_kernel, triton.runtime.JITFunction)
_MIXED_MODES = _INTERPRETED != (not isinstance(tl.zeros, triton.runtime.JITFunction))
_COMPILED = tl.constexpr(not _INTERPRETED)  # read by the kernels: PTX (the hardware tanh) only when compiled


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


# Triton's interpreter before 3.7 takes int() of 1-element arrays for loop bounds, an error since numpy 2.4.
_INTERPRETER_NUMPY_CLASH = _version(triton.__version__) < (3, 7) and _version(np.__version__) >= (2, 4)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def _kv_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides of k or v (Bkv, Hkv, Nk, D), the batch stride 0 where Bkv = 1: every example reads the one k, v."""
    return (t.stride(0) if t.shape[0] > 1 else 0, *t.stride()[1:])


def _layout_strides(ptr: torch.Tensor) -> tuple[int, int]:
    """Strides of a (Bl, Hl, n + 1) ptr tensor, 0 along a broadcast (size-1) dimension."""
    return (ptr.stride(0) if ptr.shape[0] > 1 else 0), (ptr.stride(1) if ptr.shape[1] > 1 else 0)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs: exact ("ieee") unless torch allows TF32 matmuls; half inputs use tensor cores."""
    exact = dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    return "ieee" if exact else "tf32"


def padded_head_dim(head_dim: int) -> int:
    """The tile width along head_dim: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


# Measured launch settings, written by benchmarks/triton_tune.py (which prints this literal) on an H100:
# (pass, block, BLOCK_D, dtype) -> (num_warps, num_stages), pass "forward" or "backward" (the dK/dV and dQ
# kernels share it; the preprocess kernel keeps PREPROCESS_LAUNCH). float32 entries were timed with exact
# matmuls, so they do not apply while TF32 is allowed. A missing key uses the rule in launch_settings.
# Measured on an H100 80GB HBM3 (benchmarks/results/triton_tune.md: bf16 at D 64 and 128, fp16 at D 64;
# Longformer, N=32K): at D=128 the rule's 8 warps lose to 4 (forward 1.40x, backward 1.72x faster).
LAUNCH_TABLE: dict[tuple[str, int, int, torch.dtype], tuple[int, int]] = {
    ('forward', 64, 64, torch.bfloat16): (4, 4),
    ('backward', 64, 64, torch.bfloat16): (4, 2),
    ('forward', 128, 64, torch.bfloat16): (4, 4),
    ('backward', 128, 64, torch.bfloat16): (8, 2),
    ('forward', 64, 128, torch.bfloat16): (4, 3),
    ('backward', 64, 128, torch.bfloat16): (4, 4),
    ('forward', 128, 128, torch.bfloat16): (8, 3),
    ('backward', 128, 128, torch.bfloat16): (8, 1),
    ('forward', 64, 64, torch.float16): (4, 4),
    ('backward', 64, 64, torch.float16): (4, 2),
    ('forward', 128, 64, torch.float16): (4, 3),
    ('backward', 128, 64, torch.float16): (4, 2),
}


def launch_settings(head_dim: int, dtype: torch.dtype, shared_memory: int, backward: bool, block: int,
                    precision: str) -> dict:
    """num_warps and num_stages (software-pipelining depth of the key-block loops) for ``block`` x ``block``
    tiles of ``dtype`` inputs whose matmuls run at ``precision`` (``dot_precision``), on a GPU whose blocks
    may use ``shared_memory`` bytes.

    >>> launch_settings(64, torch.bfloat16, 227 * 1024, backward=True, block=64, precision="tf32")
    {'num_warps': 4, 'num_stages': 2}

    The setting measured in ``LAUNCH_TABLE`` if there is one, else a rule chosen from the kernels lowered
    for sm_90 (``benchmarks/triton_resources.py``): 8 warps where 4 would spill registers (head_dim > 64;
    float32, whose exact matmuls run on FMA units, from head_dim 64), 3 stages in the forward and 2 in the
    backward. Either way one stage fewer at head_dim > 64 on GPUs with under 128 KB of shared memory per
    block (sm_86/89): table entries are measured on sm_90 (227 KB), where deeper pipelines fit.
    """
    measured = LAUNCH_TABLE.get(("backward" if backward else "forward", block, padded_head_dim(head_dim), dtype))
    if measured is None or (dtype == torch.float32 and precision == "tf32"):
        warps, stages = _launch_rule(head_dim, dtype, backward)
    else:
        warps, stages = measured
    if head_dim > 64 and shared_memory < 128 * 1024:
        stages = max(1, stages - 1)
    return dict(num_warps=warps, num_stages=stages)


def _launch_rule(head_dim: int, dtype: torch.dtype, backward: bool) -> tuple[int, int]:
    """(num_warps, num_stages) on sm_90 without a measurement: from compiler resource reports, never timed.

    >>> _launch_rule(128, torch.bfloat16, backward=True)
    (8, 2)
    """
    wide = head_dim > 64 or (dtype == torch.float32 and head_dim > 32)
    return 8 if wide else 4, 2 if backward else 3


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Shared memory a block may use on ``device`` (bytes); unlimited for the interpreter."""
    if device.type != "cuda" or _INTERPRETED:
        return 1 << 30
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 1 << 30)


def kernel_constants(head_dim: int, dtype: torch.dtype, n_q: int, n_k: int, block: int,
                     mods: ScoreMods = NO_MODS) -> dict:
    """Compile-time constants of the attention kernels for (B, H, n_q / n_k, head_dim) inputs of ``dtype`` with
    score modifiers ``mods`` (without them the kernels compile as if the modifiers did not exist)."""
    return dict(HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), BLOCK=block,
                EVEN_Q=n_q % block == 0, EVEN_K=n_k % block == 0, PRECISION=dot_precision(dtype),
                HAS_SOFTCAP=mods.softcap > 0, HAS_ALIBI=mods.alibi_slopes is not None)


def _meta(q: torch.Tensor, k: torch.Tensor, block: int, mods: ScoreMods) -> dict:
    return kernel_constants(q.shape[-1], q.dtype, q.shape[2], k.shape[2], block, mods)


# The softcaps the kernels run: float32 must hold scale / softcap and softcap * log2(e) (a softcap of 1e-45 or 1e300
# overflowed one of them, and 0 * inf made NaN). Outside this range float32 gives the same capped scores: about 0
# for every pair below it (exp2 of them is 1), the scores themselves above it (tanh(x) = x below |x| = 4e-4).
_SOFTCAP_RANGE = (1e-30, 1e36)


def _mod_args(mods: ScoreMods, scale: float, fallback: torch.Tensor) -> tuple:
    """The kernels' modifier arguments: Slopes (``fallback``, never read, without ALiBi), its example stride
    (0: one row of slopes for every example), cap_in_scale = scale / softcap, cap_out_scale = softcap * log2(e)."""
    slopes = mods.alibi_slopes
    if mods.softcap > 0:
        cap = min(max(mods.softcap, _SOFTCAP_RANGE[0]), _SOFTCAP_RANGE[1])
        cap_in_scale, cap_out_scale = scale / cap, cap * _LOG2E.value
    else:
        cap_in_scale, cap_out_scale = 0.0, 0.0
    if slopes is None:
        return fallback, 0, cap_in_scale, cap_out_scale
    return slopes, (slopes.shape[1] if slopes.shape[0] > 1 else 0), cap_in_scale, cap_out_scale


PREPROCESS_LAUNCH = dict(num_warps=4, num_stages=1)   # one pass over a (BLOCK, D) tile: nothing to pipeline
MERGE_LAUNCH = dict(num_warps=4, num_stages=1)        # the merge of split rows' pieces: a few tiles each


def launch_for(q: torch.Tensor, block: int, backward: bool) -> dict:
    """The launch settings the attention kernels get for ``q`` (B, H, N, D) on its device with ``block`` tiles."""
    return launch_settings(q.shape[-1], q.dtype, _shared_memory(q.device), backward, block, dot_precision(q.dtype))


class _Plan(NamedTuple):
    """A pass's work items on the GPU (``work_split.WorkPlan``) and its broadcast ``fanout``."""
    items: torch.Tensor       # (n_items, 6) int32
    splits: torch.Tensor      # (n_split, 5) int32
    n_slots: int
    fanout: int               # programs per item: the examples and heads the layout shares
    head_fanout: int          # heads among them (the innermost)


_PLANS = WeakIdKeyDictionary()   # a layout's row pointers (full_ptr or full_t_ptr) -> {key: _Plan}


def _plan(ptrs: tuple[torch.Tensor, torch.Tensor], batch: int, heads: int, groups: int, columns: bool) -> _Plan:
    """The work plan of a pass over the rows of ``ptrs`` = (full_ptr, part_ptr), or with ``columns`` over the
    key blocks of (full_t_ptr, part_t_ptr), for ``batch`` examples x ``heads`` heads (kv heads for columns,
    each walking ``groups`` query heads). Built on the host once per layout and kept with it (the layout's
    tensors are the key, so a layout reused across layers and steps pays once)."""
    full_ptr, part_ptr = ptrs
    plans = _PLANS.setdefault(full_ptr, {})
    key = (batch, heads, groups, columns, work_split.MIN_PIECE_BLOCKS)
    if key not in plans:
        full, part = full_ptr.cpu().numpy(), part_ptr.cpu().numpy()
        counts = work_split.column_counts(full, part, groups) if columns else work_split.row_counts(full, part)
        head_fanout = heads if counts.shape[1] == 1 else 1
        fanout = (batch if counts.shape[0] == 1 else 1) * head_fanout
        plan = work_split.split_rows(counts, work_split.piece_length(counts, fanout, _programs(full_ptr.device)))
        plans[key] = _Plan(torch.from_numpy(plan.items).to(full_ptr.device),
                           torch.from_numpy(plan.splits).to(full_ptr.device), plan.n_slots, fanout, head_fanout)
    return plans[key]


@functools.cache
def _programs(device: torch.device) -> int:
    """Programs that keep ``device`` busy: 8 a multiprocessor (the interpreter: a small GPU's worth)."""
    if device.type != "cuda" or _INTERPRETED:
        return 64
    return 8 * torch.cuda.get_device_properties(device).multi_processor_count


def _scratch(plan: _Plan, block: int, width: int, device: torch.device, count: int = 1) -> list[torch.Tensor]:
    """``count`` float32 buffers of (slots, fanout, block, width) for the pieces of split rows (one element
    when nothing is split: the kernels take a pointer either way)."""
    shape = (plan.n_slots, plan.fanout, block, width) if plan.n_slots else (1,)
    return [torch.empty(shape, dtype=torch.float32, device=device) for _ in range(count)]


def _grid(plan: _Plan, rows: torch.Tensor) -> tuple[int]:
    return (rows.shape[0] * plan.fanout,)


def _forward(q, k, v, index: list[torch.Tensor], block: int, scale: float, mods: ScoreMods):
    full_ptr, full_idx, part_ptr, part_idx, part_mask, masks = index[:6]
    batch, heads, n_q, _ = q.shape
    meta = _meta(q, k, block, mods)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)                  # (B, Hq, Nq, D)
    lse = torch.empty(batch, heads, n_q, dtype=torch.float32, device=q.device)   # (B, Hq, Nq)
    plan = _plan((full_ptr, part_ptr), batch, heads, 1, columns=False)
    piece_out, = _scratch(plan, block, meta["BLOCK_D"], q.device)               # (slots, fanout, BLOCK, BLOCK_D)
    piece_lse, = _scratch(plan, block, 1, q.device)
    slopes, stride_sb, cap_in_scale, cap_out_scale = _mod_args(mods, scale, lse)
    _fwd_kernel[_grid(plan, plan.items)](
        q, k, v, out, lse, piece_out, piece_lse, plan.items, full_ptr, full_idx, part_ptr, part_idx, part_mask, masks,
        slopes, *_strides(q), *_kv_strides(k), *_kv_strides(v), *_strides(out), *_layout_strides(full_ptr), stride_sb,
        scale * _LOG2E.value, cap_in_scale, cap_out_scale, n_q, k.shape[2], heads, heads // k.shape[1], plan.fanout,
        plan.head_fanout, **launch_for(q, block, backward=False), **meta)
    if plan.n_slots:
        _merge_kernel[_grid(plan, plan.splits)](piece_out, piece_lse, out, lse, plan.splits, *_strides(out), n_q,
                                                heads, plan.fanout, plan.head_fanout, HEAD_DIM=meta["HEAD_DIM"],
                                                BLOCK_D=meta["BLOCK_D"], BLOCK=block, **MERGE_LAUNCH)
    return out, lse


def _sum_pieces(plan: _Plan, pieces: torch.Tensor, out: torch.Tensor, scale: float, block: int, meta: dict) -> None:
    """Write the split blocks of the contiguous (B, H, n, D) gradient ``out`` from their pieces."""
    if plan.n_slots:
        _sum_kernel[_grid(plan, plan.splits)](pieces, out, plan.splits, scale, out.shape[2], out.shape[1],
                                              plan.fanout, plan.head_fanout, HEAD_DIM=meta["HEAD_DIM"],
                                              BLOCK_D=meta["BLOCK_D"], BLOCK=block, **MERGE_LAUNCH)


def _backward(dout, q, k, v, out, lse, dlse, index: list[torch.Tensor], block: int, scale: float, mods: ScoreMods):
    full_ptr, full_idx, part_ptr, part_idx, part_mask, masks, full_t_ptr, full_t_idx, part_t_ptr, part_t_idx, \
        part_t_mask = index
    batch, heads, n_q, head_dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    meta, launch = _meta(q, k, block, mods), launch_for(q, block, backward=True)
    delta = torch.empty_like(lse)                                                # (B, Hq, Nq) fp32
    lse2 = torch.empty_like(lse)
    _bwd_preprocess_kernel[(triton.cdiv(n_q, block), batch * heads)](
        out, dout, lse, dlse if dlse is not None else lse, delta, lse2, *_strides(out), *_strides(dout), n_q, heads,
        dlse is not None, HEAD_DIM=head_dim, BLOCK_D=meta["BLOCK_D"], BLOCK=block, **PREPROCESS_LAUNCH)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)                   # (B, Hq, Nq, D)
    # dK/dV per query example: k, v of batch 1 get a float32 (B, Hkv, Nk, D) buffer each, summed below
    shared_kv = k.shape[0] < batch
    dk = torch.empty((batch, *k.shape[1:]), dtype=torch.float32 if shared_kv else k.dtype, device=k.device)
    dv = torch.empty_like(dk)                                                   # (B, Hkv, Nk, D)
    common = (*_strides(q), *_kv_strides(k), *_kv_strides(v), *_strides(dout))
    slopes, stride_sb, cap_in_scale, cap_out_scale = _mod_args(mods, scale, lse)
    columns = _plan((full_t_ptr, part_t_ptr), batch, kv_heads, heads // kv_heads, columns=True)
    piece_dk, piece_dv = _scratch(columns, block, meta["BLOCK_D"], q.device, count=2)
    _bwd_kv_kernel[_grid(columns, columns.items)](
        q, k, v, dout, lse2, delta, dk, dv, piece_dk, piece_dv, columns.items,
        full_t_ptr, full_t_idx, part_t_ptr, part_t_idx, part_t_mask, masks, slopes, *common,
        *_layout_strides(full_t_ptr), stride_sb, scale, scale * _LOG2E.value, cap_in_scale, cap_out_scale, n_q, n_k,
        heads, kv_heads, heads // kv_heads, columns.fanout, columns.head_fanout, **launch, **meta)
    _sum_pieces(columns, piece_dk, dk, scale, block, meta)
    _sum_pieces(columns, piece_dv, dv, 1.0, block, meta)
    rows = _plan((full_ptr, part_ptr), batch, heads, 1, columns=False)
    piece_dq, = _scratch(rows, block, meta["BLOCK_D"], q.device)
    _bwd_q_kernel[_grid(rows, rows.items)](
        q, k, v, dout, lse2, delta, dq, piece_dq, rows.items, full_ptr, full_idx, part_ptr, part_idx, part_mask, masks,
        slopes, *common, *_layout_strides(full_ptr), stride_sb, scale, scale * _LOG2E.value, cap_in_scale,
        cap_out_scale, n_q, n_k, heads, heads // kv_heads, rows.fanout, rows.head_fanout, **launch, **meta)
    _sum_pieces(rows, piece_dq, dq, scale, block, meta)
    if shared_kv:
        dk, dv = (d.sum(0, keepdim=True).to(k.dtype) for d in (dk, dv))         # (1, Hkv, Nk, D)
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------
# torch.library registration: custom ops with fake (shape) and autograd implementations
# ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _on_device(q: torch.Tensor, block: int):
    """Run the launches on q's GPU; a kernel too large for this GPU's shared memory says what to change."""
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        try:
            yield
        except triton.runtime.errors.OutOfResources as error:
            raise RuntimeError(
                f"backend='triton': {error} (head_dim={q.shape[-1]}, {q.dtype}, block_size={block}). This GPU has "
                f"too little shared memory for these tiles: use bfloat16/float16 inputs (float32 tiles take twice "
                f"the room; TF32 more), a layout with a smaller block_size, or backend='reference'. "
                f"docs/backend-triton.md lists what each setting needs.") from error


@torch.library.custom_op("sparse_attn::triton_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: list[torch.Tensor], block: int,
                scale: float, softcap: float, alibi_slopes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    with _on_device(q, block):
        return _forward(q, k, v, _with_tile_bytes(index, block), block, scale, ScoreMods(softcap, alibi_slopes))


@_forward_op.register_fake
def _(q, k, v, index, block, scale, softcap, alibi_slopes):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("sparse_attn::triton_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, dlse: torch.Tensor | None, index: list[torch.Tensor], block: int,
                 scale: float, softcap: float,
                 alibi_slopes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with _on_device(q, block):
        return _backward(dout, q, k, v, out, lse, dlse, _with_tile_bytes(index, block), block, scale,
                         ScoreMods(softcap, alibi_slopes))


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, index, block, scale, softcap, alibi_slopes):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _with_tile_bytes(index: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    """``index`` (the ``KernelIndex`` fields) with its bool tiles as the (n_masks, BLOCK, BLOCK) bytes the kernels
    load. Done inside the ops: Inductor cannot lower a bool -> uint8 view (torch.iinfo(torch.bool))."""
    idx = KernelIndex(*index)
    return list(idx._replace(masks=_block_tiles(idx.masks, block).view(torch.uint8)))


def _setup_context(ctx, inputs, output):
    q, k, v, index, block, scale, softcap, alibi_slopes = inputs
    ctx.save_for_backward(q, k, v, *output, alibi_slopes, *index)
    ctx.block, ctx.scale, ctx.softcap = block, scale, softcap


def _backward_autograd(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes, *index = ctx.saved_tensors
    dq, dk, dv = _backward_op(dout, q, k, v, out, lse, dlse, index, ctx.block, ctx.scale, ctx.softcap, alibi_slopes)
    return dq, dk, dv, [None] * len(index), None, None, None, None   # block, scale, softcap, slopes: no gradient


_forward_op.register_autograd(_backward_autograd, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------
# Backend interface
# ------------------------------------------------------------------------------------------------
def available() -> tuple[bool, str]:
    """(usable, reason): a CUDA GPU, or Triton's interpreter for CPU tensors."""
    if torch.cuda.is_available():
        return True, ""
    if _INTERPRETED and not _MIXED_MODES:
        return True, "no CUDA GPU: CPU tensors run in Triton's interpreter (TRITON_INTERPRET=1), slowly"
    return False, "no CUDA GPU; use backend='numba' or 'reference' on CPU"


def check(q, k, v, layout: BlockLayout) -> None:
    """Raise a ValueError/RuntimeError naming the argument and the fix when these inputs cannot run."""
    if q.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("backend='triton' needs CUDA tensors, got q on cpu; move q, k, v to CUDA "
                               "(.cuda()), use backend='numba' or 'reference' on CPU, or for testing set "
                               "TRITON_INTERPRET=1 before importing triton to run the kernels in Triton's "
                               "interpreter")
        if not _INTERPRETED or _MIXED_MODES:
            raise RuntimeError("TRITON_INTERPRET=1 was set after Triton (or sparse_attn's Triton kernels) had been "
                               "imported, e.g. by torch.compile, so the kernels cannot run on CPU; set it before the "
                               "first `import triton` (in the shell: TRITON_INTERPRET=1 python ...)")
        if _INTERPRETER_NUMPY_CLASH:
            raise RuntimeError(f"Triton {triton.__version__}'s interpreter cannot run with numpy {np.__version__} (it "
                               f"calls int() on 1-element arrays, an error since numpy 2.4); pip install "
                               f"'triton>=3.7' or 'numpy<2.4' to run backend='triton' on CPU tensors")
    elif q.device.type != "cuda":
        raise RuntimeError(f"backend='triton' runs CUDA tensors, got q on {q.device}; use backend='reference'")
    if _MIXED_MODES:
        raise RuntimeError("Triton was imported with a different TRITON_INTERPRET than sparse_attn's Triton kernels; "
                           "set (or unset) TRITON_INTERPRET before the first `import triton`")
    if q.dtype == torch.bfloat16 and _INTERPRETED:
        raise ValueError("Triton's interpreter (TRITON_INTERPRET=1) computes tl.dot on bfloat16 wrongly (numpy has "
                         "no bfloat16), got q of dtype torch.bfloat16; test with float16 or float32, or run on CUDA")
    if q.dtype not in _DTYPES:
        raise ValueError(f"backend='triton' supports float16, bfloat16 and float32 inputs, got q of dtype {q.dtype}; "
                         f"cast with .float() or use backend='reference' for float64")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"backend='triton' supports head_dim up to {MAX_HEAD_DIM}, got head_dim={q.shape[-1]}; "
                         f"use backend='reference'")
    bs = layout.block_size
    if bs < 16 or bs > 128 or bs & (bs - 1):
        raise ValueError(f"backend='triton' needs a layout block_size that is a power of two in 16..128 (its "
                         f"tile size for tl.dot), got block_size={bs}; build the layout with "
                         f"pattern.layout(..., block_size={BLOCK_SIZE})")
    if layout.device != q.device:
        raise ValueError(f"the layout is on {layout.device} but q is on {q.device}; use layout.to(q.device)")


def attention(q, k, v, layout: BlockLayout, scale: float, mods: ScoreMods = NO_MODS):
    """out (B, Hq, Nq, D) in q's dtype and lse (B, Hq, Nq) float32; differentiable in q, k, v. ``mods``: softcap,
    then ALiBi, on every allowed score, in the kernels (slopes as ``score_mods.check_mods`` gives them)."""
    _check_slopes(mods.alibi_slopes, q)
    return _forward_op(q, k, v, list(layout.index), layout.block_size, scale, mods.softcap, mods.alibi_slopes)


def _check_slopes(slopes: torch.Tensor | None, q: torch.Tensor) -> None:
    """The kernels read (B or 1, Hq) contiguous float32 slopes on q's device: anything else is refused, not
    misread."""
    if slopes is None:
        return
    batch, heads = q.shape[:2]
    if (slopes.dtype != torch.float32 or slopes.device != q.device or slopes.shape not in ((1, heads), (batch, heads))
            or not slopes.is_contiguous()):
        raise ValueError(f"backend='triton' reads ALiBi slopes as a contiguous float32 (1 or B, Hq) = (1 or {batch}, "
                         f"{heads}) tensor on {q.device}, got {slopes.dtype} {tuple(slopes.shape)} on {slopes.device}, "
                         f"contiguous={slopes.is_contiguous()}; "
                         f"build the modifiers with sparse_attn.score_mods.check_mods(q, softcap, alibi_slopes)")


def _block_tiles(masks: torch.Tensor, bs: int) -> torch.Tensor:
    """``layout.masks`` as the (n_masks, BLOCK, BLOCK) tiles the kernels load: a sequence shorter than a
    block has tiles of its own size, padded here with False (at most 128 x 128 each)."""
    if masks.shape[1:] == (bs, bs):
        return masks
    padded = torch.zeros(masks.shape[0], bs, bs, dtype=torch.bool, device=masks.device)
    padded[:, :masks.shape[1], :masks.shape[2]] = masks
    return padded
