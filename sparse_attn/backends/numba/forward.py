"""The forward kernel: every (example, head, query block) task, FlashAttention's online softmax over the
block's key blocks in panels of runs (steps 1-3 of the package docstring's algorithm).

>>> import torch, sparse_attn as sa
>>> from sparse_attn.api import sparse_attention
>>> q = k = v = torch.randn(1, 1, 100, 16)
>>> out = sparse_attention(q, k, v, sa.Local(16), backend="numba")
>>> bool(torch.allclose(out, sparse_attention(q, k, v, sa.Local(16), backend="reference"), atol=1e-5))
True
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .bf16 import add_pv, head_forward, probabilities, release_tiles, row_window, scores, store, stored_as
from .bundles import ForwardScratch, kv_example, segment
from .exact import exact_row
from .lowlevel import FASTMATH, LANES, exp2, fetch_add, lane_maximum, set_blas_threads_local
from .mods import head_modifiers, modify, position, shifted
from .near_max import exact_near_max, large_logits
from .panels import (
    has_blocks,
    mask_panel,
    next_panel,
    panel_rows,
    panel_scratch,
    panel_view,
    panel_width,
    result_rows,
    run_at,
    run_span,
)

_LN2 = math.log(2.0)


@njit(cache=True, fastmath=FASTMATH, parallel=True)
def forward_kernel(qkv, ops, index, config, order, n_workers, result):
    """Every forward task, taken in ``order`` (heaviest first) from a shared counter by n_workers
    workers. qkv: q (B, Hq, Nq, D), k, v (B or 1, Hkv, Nk, D); ops: their bf16 ForwardOperands for bf16
    matmuls, or None; index: the row BlockIndex; result: the ForwardResult (B, Hq, Nq, ...) to write."""
    counter = np.zeros(1, np.int64)
    for w in prange(n_workers):      # prange bodies only call (see bundles); w as int64: see backward_kernel
        _forward_worker(counter, np.int64(w), qkv, ops, index, config, order, result)


@njit(cache=True, fastmath=FASTMATH)
def _forward_worker(counter, w, qkv, ops, index, config, order, result):
    """Worker w: takes the next task from the counter until none is left. Task (example b, head h,
    query block r) is _forward_block on those rows, with BLAS on one thread. Then it hands back the AMX
    tiles it may hold and restores the thread's BLAS setting."""
    q, k, v = qkv
    heads, n_q = q.shape[1], q.shape[2]
    group, n_k = heads // k.shape[1], k.shape[2]
    n_qb = index.full_ptr.shape[2] - 1
    block_size = config.block_size
    blas_threads = set_blas_threads_local(np.int32(1))      # BLAS on this thread only: see KernelSection
    scratch = _forward_scratch(result.lse, q.shape[3], min(block_size, n_q), min(config.panel_blocks * block_size, n_k),
                               config)
    while True:
        t = fetch_add(counter)
        if t >= order.size:
            break
        task = order[t]
        b, h, r = task // (heads * n_qb), task // n_qb % heads, task % n_qb
        rows = slice(r * block_size, min(r * block_size + block_size, n_q))
        e = kv_example(b, k.shape[0])
        _forward_block(q[b, h, rows], k[e, h // group], v[e, h // group],
                       head_forward(ops, w, b, e, h, h // group, rows), segment(index, b, h, r), index, config,
                       scratch, result_rows(result, b, h, rows), head_modifiers(config, b, h, rows.start))
    release_tiles(ops)
    set_blas_threads_local(blas_threads)


@njit(cache=True, fastmath=FASTMATH)
def _forward_block(q, k, v, ops, key_blocks, index, config, scratch, result, head):
    """One query block: q (rows, D); k, v (Nk, D) of its kv head; ops: their bf16 operands or None;
    key_blocks its Segment; head: the block's HeadModifiers. Steps 1-3 of
    the algorithm, each run's scores modified right after their matmul; writes result (the block's
    rows of the ForwardResult)."""
    rows = q.shape[0]
    n_k = k.shape[0]
    block_size, panel = config.block_size, scratch.panel
    m, l, acc = scratch.m[:rows], scratch.l[:rows], scratch.acc[:rows]              # (rows,), (rows,), (rows, D)
    m[:] = -np.inf
    l[:] = 0
    acc[:] = 0
    rest = key_blocks
    while has_blocks(rest):                                                     # 1. panel by panel
        count, rest = next_panel(rest, panel, config.panel_blocks)
        r0, r1 = panel_rows(panel.tiles, count, index.row_spans, rows)            # the rows any block allows
        r0, r1 = row_window(ops, r0, r1, rows)
        if r0 >= r1:
            continue
        q_r, head_r = q[r0:r1], shifted(head, r0)                                # (r1 - r0, D): those rows
        s = panel_view(scratch.scores, r1 - r0, panel_width(panel.blocks, count, block_size, n_k))  # (r1 - r0, W)
        t = 0
        while t < count:                                                         # 2. base-2 scores, run by run
            end, j0, n = run_at(panel.blocks, t, count, block_size, n_k)
            lo, hi = run_span(t, end, n, panel.tiles, index.spans)              # the mask sets the rest
            off = t * block_size
            scores(ops, config.base2_scale, q_r, k, j0 + lo, j0 + hi, s[:, off + lo:off + hi])
            modify(head_r, s, off + lo, off + hi, j0 + lo)
            t = end
        mask_panel(s, panel.tiles, count, block_size, index.masks, r0)
        _online_softmax(s, m[r0:r1], l[r0:r1], acc[r0:r1], scratch, panel.blocks, block_size, result.argmax[r0:r1],
                        q_r, k, config, head_r)
        probabilities(ops, s)
        t = 0
        while t < count:                                                         # acc += P @ v
            end, j0, n = run_at(panel.blocks, t, count, block_size, n_k)
            lo, hi = run_span(t, end, n, panel.tiles, index.spans)
            off = t * block_size
            add_pv(ops, s, off + lo, off + hi, v, j0 + lo, j0 + hi, acc[r0:r1])
            t = end
    _finish_rows(q, k, v, key_blocks, index.masks, config, m, l, acc, result, head)  # 3.


@njit(cache=True, fastmath=FASTMATH)
def _finish_rows(q, k, v, key_blocks, masks, config, m, l, acc, result, head):
    """Step 3: out = acc / l and the row statistics, from a block's running m, l, acc (rows, ...);
    a row with no allowed key gets 0, -inf; a row whose result is not finite goes to the exact path.
    out is stored in its own dtype (bf16 bits for bf16 inputs: rounded once, from the computed dtype).
    The rare rows are left with lse NaN for _finish_other_rows, outside this loop (in it, their code
    slowed every row)."""
    rows, dim = acc.shape
    out = result.out
    others = 0
    for i in range(rows):
        finite = l[i] > 0                                # out = acc / l; every value finite?
        if finite:                                       # (a comparison false for NaN and inf: no
            inv = 1 / l[i]                               # fastmath flag assumes them away)
            for d in range(dim):
                value = acc[i, d] * inv
                out[i, d] = stored_as(out, value)
                finite &= abs(value) < np.inf
        if finite:
            log2_l = np.log2(l[i])
            result.lse[i] = (np.float64(m[i]) + np.float64(log2_l)) * _LN2       # rounded once
            result.row_max[i] = m[i]
            result.log2_sum[i] = log2_l
        else:
            result.lse[i] = np.nan
            others += 1
    if others:
        _finish_other_rows(q, k, v, key_blocks, masks, config, l, acc, result, head)


@njit(cache=True, fastmath=False)
def _finish_other_rows(q, k, v, key_blocks, masks, config, l, acc, result, head):
    """The rows _finish_rows left with lse NaN: 0 and -inf for a row with no allowed key, else the exact path
    (NaN or inf met, an overflow, or every score underflowed to -inf)."""
    out = result.out
    for i in range(acc.shape[0]):
        if not np.isnan(result.lse[i]):
            continue
        if l[i] == 0 and not _row_has_key(i, key_blocks, masks):                 # no allowed key
            out[i] = 0
            result.lse[i], result.row_max[i], result.log2_sum[i], result.argmax[i] = -np.inf, np.inf, 0, -1
        else:
            result.lse[i], result.row_max[i], result.log2_sum[i], result.argmax[i] = exact_row(
                i, q[i], k, v, key_blocks, masks, config, acc[i], head)            # into acc's row, then out's
            store(out[i:i + 1], acc[i:i + 1])


@njit(cache=True, fastmath=FASTMATH)
def _online_softmax(s, m, l, acc, scratch, blocks, block_size, argmax, q, k, config, head):
    """s (rows, W) base-2 scores -> probabilities relative to the updated running max m;
    rescales the running sum l and the output accumulator acc (rows, D) accordingly, and keeps
    in argmax the key of each row's maximum. A NaN score makes l NaN (no hiding in the max).
    Rows with large logits first get exact scores near their maximum (``exact_near_max``, from
    q (rows, D) and k (Nk, D), modified by head); scratch: the worker's ForwardScratch."""
    rows, width = s.shape
    for i in range(rows):
        row = s[i]
        m_new, where = _row_max(row, m[i])
        exact_column = -1
        if large_logits(m_new):
            exact_max, exact_column = exact_near_max(row, m_new, q[i], k, blocks, block_size, config.base2_scale,
                                                      scratch.hits, head, position(head, i))
            m_new = max(m[i], exact_max)
        if m_new == -np.inf:                             # nothing allowed yet in this row, or NaN
            if _has_nan(row):
                l[i] = np.nan
            row[:] = 0
            continue
        if m_new > m[i]:                                 # a new max: its key (panel position t holds
            j = exact_column if exact_column >= 0 else _column_of(row, m_new, where)  # key block blocks[t]
            argmax[i] = blocks[j // block_size] * block_size + j % block_size         # from column t * block_size)
        alpha = exp2(m[i] - m_new)                       # NaN for m = m_new = +inf: l becomes NaN
        total = l[i] - l[i]                              # a zero of the dtype
        for j in range(width):
            p = exp2(row[j] - m_new)
            row[j] = p
            total += p
        l[i] = l[i] * alpha + total
        for d in range(acc.shape[1]):
            acc[i, d] *= alpha
        m[i] = m_new



@njit(cache=True, fastmath=FASTMATH)
def _row_max(row, start):
    """(max(start, row), where) of a 1-D row, skipping NaN: ``lane_maximum`` over the whole groups of LANES
    columns (vector selects, as x86 max instructions are, NaN included), then the tail. Where the max exceeds
    start, ``where`` tells _column_of where it is: a lane (columns where, where + LANES, ...) or a tail column."""
    n = row.size
    best, where = lane_maximum(row, start)
    for j in range(n - n % LANES, n):
        more = row[j] > best
        best, where = (row[j], j) if more else (best, where)
    return best, where


@njit(cache=True, fastmath=FASTMATH)
def _column_of(row, value, where):
    """A column of the row holding ``value``, the maximum _row_max found with ``where``: that column of the
    tail, or the first of lane where's columns where, where + LANES, ... that holds it (an early exit: half
    the lane's columns on average, for one mispredicted branch). Any key of the maximum serves the backward."""
    groups = row.size - row.size % LANES
    if where >= groups:
        return where
    for j in range(where, groups, LANES):
        if row[j] == value:
            return j
    return groups                                        # not reached: the lane holds value


@njit(cache=True, fastmath=FASTMATH)
def _has_nan(row):
    """Whether a row whose maximum (without NaN) is -inf holds a NaN: any entry other than -inf."""
    for x in row:
        if x != -np.inf:
            return True
    return False


@njit(cache=True, fastmath=False)
def _row_has_key(i, key_blocks, masks):
    """Whether row i of a query block whose key blocks are the Segment ``key_blocks`` may attend any key."""
    if key_blocks.full.size > 0:
        return True
    for tile in key_blocks.tiles:
        if masks[tile, i].any():
            return True
    return False


@njit(cache=True)
def _forward_scratch(lse, dim, rows, width, config):
    """A forward worker's ForwardScratch for blocks of up to ``rows`` queries of head dim ``dim`` and panels of
    up to ``width`` keys, in the dtype of ``lse`` (the dtype computed in)."""
    dtype = lse.dtype
    return ForwardScratch(np.empty(rows * width, dtype), np.empty((rows, dim), dtype), np.empty(rows, dtype),
                          np.empty(rows, dtype), np.empty(width, np.int64),
                          panel_scratch(config))
