"""The backward kernels: delta per query row, one pass over key blocks (FlashAttention-2, P recomputed
from the forward's row maxima and sums), and the sum of the workers' dQ buffers (see the package
docstring's algorithm).

>>> import torch, sparse_attn as sa
>>> from sparse_attn.api import sparse_attention
>>> q = torch.randn(1, 1, 100, 16, dtype=torch.float64, requires_grad=True)
>>> sparse_attention(q, q, q, sa.Local(16), backend="numba").sum().backward()
>>> q.grad.shape
torch.Size([1, 1, 100, 16])
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .bf16 import add_grads, grad_operands, head_backward, release_tiles, row_window, scores_t, store, to_float
from .bundles import BackwardScratch, Incoming, KeyBlock, query_examples, segment
from .exact import exact_dk_dv
from .lowlevel import FASTMATH, copy_into, exp2, set_blas_threads_local
from .mods import chain_softcap, head_modifiers, modify_t
from .near_max import exact_near_max_t
from .panels import (
    all_finite,
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


@njit(cache=True, fastmath=FASTMATH, parallel=True)
def delta_rows(out, dout, lse, dlse, zero, delta):
    """Per query row: delta = rowsum(dout * out) - dlse, and 0 for rows with no allowed key
    (lse = -inf: their P is 0 and dlse does not reach the scores, as in the reference).
    out, dout (R, D), bf16 bits read as float32; lse, dlse, delta (R,); zero: 0 in the dtype computed in."""
    rows, dim = out.shape
    for i in prange(rows):
        if lse[i] == -np.inf:
            delta[i] = zero
            continue
        total = zero
        for d in range(dim):
            total += to_float(dout[i, d]) * to_float(out[i, d])
        delta[i] = total - dlse[i]


@njit(cache=True, fastmath=FASTMATH, parallel=True)
def backward_kernel(qkv, ops, result, incoming, maxima, columns, config, schedule, grads):
    """One pass over key blocks: worker w runs its static share of the tasks, ``schedule`` = (ptr,
    tasks): ``tasks[ptr[w]:ptr[w + 1]]``, and adds its dQ terms to its own buffer, grads.dq for
    w = 0 and grads.dq_parts[w - 1] otherwise. ops: the bf16 BackwardOperands, or None; maxima = (ptr,
    queries) from maxima_by_key_block; columns: the transposed BlockIndex; grads: the Gradients to write."""
    worker_ptr, tasks = schedule
    for w in prange(worker_ptr.size - 1):                # prange bodies only call: see bundles
        # w is int64 when Numba types this function and uint64 in the parallel loop it builds: np.int64(w) makes
        # both the same signature, so the worker compiles once instead of twice (one of them never runs)
        _backward_worker(tasks[worker_ptr[w]:worker_ptr[w + 1]], np.int64(w),
                         grads.dq if w == 0 else grads.dq_parts[w - 1],
                         qkv, ops, result, incoming, maxima, columns, config, grads)


@njit(cache=True, fastmath=FASTMATH)
def _backward_worker(tasks, w, dq, qkv, ops, result, incoming, maxima, columns, config, grads):
    """Worker w's tasks, in order. It zeroes its dQ buffer dq (B, Hq, Nq, D) and adds its dQ terms
    there; each task (example e of k, v, kv head g, key block c) sums its keys' dk and dv in the worker's
    (block, D) sums, over every query example that reads them (all B where k, v have batch 1), recomputes by
    the exact path the keys whose result is not finite, and stores the sums in its rows of grads.dk and
    grads.dv (rounded once, for bf16). BLAS runs on one thread; then the worker hands back the AMX tiles it
    may hold and restores the thread's BLAS setting."""
    q, k, v = qkv
    batch, heads, n_q = q.shape[0], q.shape[1], q.shape[2]
    kv_batch, kv_heads, n_k = k.shape[0], k.shape[1], k.shape[2]
    group = heads // kv_heads
    n_kb = columns.full_ptr.shape[2] - 1
    block_size = config.block_size
    maxima_ptr, maxima_queries = maxima
    blas_threads = set_blas_threads_local(np.int32(1))      # BLAS on this thread only: see KernelSection
    scratch = _backward_scratch(grads.dq, min(block_size, n_k), min(config.panel_blocks * block_size, n_q), config)
    dk_sum = np.empty((min(block_size, n_k), q.shape[3]), grads.dq.dtype)        # a key block's dk, dv, summed
    dv_sum = np.empty_like(dk_sum)                                              # in the dtype computed in
    dq.reshape(-1)[:] = 0
    for task in tasks:
        e, g, c = task // (kv_heads * n_kb), task // n_kb % kv_heads, task % n_kb
        j0 = c * block_size
        keys = slice(j0, min(j0 + block_size, n_k))
        cols = keys.stop - j0
        key_block = KeyBlock(j0, k[e, g, keys], v[e, g, keys], dk_sum[:cols], dv_sum[:cols])
        key_block.dk[:] = 0
        key_block.dv[:] = 0
        b0, b1 = query_examples(e, batch, kv_batch)
        for b in range(b0, b1):
            for h in range(g * group, (g + 1) * group):
                _backward_head(key_block, q[b, h], result_rows(result, b, h, slice(0, n_q)),
                               Incoming(incoming.dout[b, h], incoming.dlse[b, h], incoming.delta[b, h]),
                               maxima_queries[b, h, maxima_ptr[b, h, c]:maxima_ptr[b, h, c + 1]],
                               segment(columns, b, h, c), columns, config, scratch, dq[b, h],
                               head_backward(ops, w, b, e, h, g, keys), head_modifiers(config, b, h, 0))
        if not (all_finite(key_block.dk) and all_finite(key_block.dv)):
            for j in range(cols):
                if not (all_finite(key_block.dk[j:j + 1]) and all_finite(key_block.dv[j:j + 1])):
                    dk_j, dv_j = exact_dk_dv(qkv, result, incoming, columns, config, e, g, j0 + j)
                    copy_into(key_block.dk[j], dk_j)
                    copy_into(key_block.dv[j], dv_j)
        store(grads.dk[e, g, keys], key_block.dk)
        store(grads.dv[e, g, keys], key_block.dv)
    release_tiles(ops)
    set_blas_threads_local(blas_threads)


@njit(cache=True, fastmath=FASTMATH)
def _backward_head(key_block, q, result, incoming, maxima, query_blocks, columns, config, scratch, dq, ops, head):
    """One key block against one query head: adds to key_block.dk, .dv (cols, D) and to the head's
    dq (Nq, D). q (Nq, D), result and incoming: the query head's rows; maxima: its queries whose row
    maximum is in this key block; query_blocks: the key block's Segment; ops: the bf16 operands or None;
    head: the query head's HeadModifiers (with softcap, dS of the capped scores times 1 - tanh^2).
    A panel computes only the keys its blocks allow (past the band, the global key block of Longformer
    allows its global keys alone): the KeyBlock of those keys."""
    n_q = q.shape[0]
    block_size, panel, scale = config.block_size, scratch.panel, config.scale
    zero = scale - scale
    e = 0
    rest = query_blocks
    while has_blocks(rest):
        count, rest = next_panel(rest, panel, config.panel_blocks)
        pinned, e = _panel_maxima(panel.blocks, count, block_size, maxima, e, scratch.pins)
        r0, r1 = panel_rows(panel.tiles, count, columns.row_spans, key_block.k.shape[0])    # the keys allowed
        r0, r1 = row_window(ops, r0, r1, key_block.k.shape[0])                 # every key with bf16 operands
        if r0 >= r1:
            continue
        keys = KeyBlock(key_block.start + r0, key_block.k[r0:r1], key_block.v[r0:r1], key_block.dk[r0:r1],
                        key_block.dv[r0:r1])
        cols = r1 - r0
        width = panel_width(panel.blocks, count, block_size, n_q)
        st = panel_view(scratch.scores, cols, width)                                 # (cols, W) = S.T
        dpt = panel_view(scratch.dscores, cols, width)                               # (cols, W) = dP.T
        dcap = panel_view(scratch.dcap, cols, width)                                 # (cols, W): 1 - tanh^2
        t = 0
        while t < count:                                                         # run by run of query blocks
            end, i0, n = run_at(panel.blocks, t, count, block_size, n_q)
            lo, hi = run_span(t, end, n, panel.tiles, columns.spans)            # the mask sets st elsewhere
            off = t * block_size
            q0, q1 = i0 + lo, i0 + hi                                            # S.T with the forward's alpha
            scores_t(ops, config.base2_scale, keys, q, incoming.dout, q0, q1, st[:, off + lo:off + hi],
                     dpt[:, off + lo:off + hi])
            modify_t(head, st, off + lo, off + hi, keys.start, q0, dcap)
            dpt[:, off:off + lo] = 0                                             # masked: P = 0 there
            dpt[:, off + hi:off + n] = 0
            copy_into(scratch.row_max[off:off + n], result.row_max[i0:i0 + n])
            copy_into(scratch.log2_sum[off:off + n], result.log2_sum[i0:i0 + n])
            copy_into(scratch.delta[off:off + n], incoming.delta[i0:i0 + n])
            t = end
        mask_panel(st, panel.tiles, count, block_size, columns.masks, r0)
        exact_near_max_t(st, q, keys.k, panel.blocks, block_size, config.base2_scale, scratch, head, keys.start)
        _pin_maxima(st, scratch.pins, pinned, result.argmax, result.row_max, keys.start)
        _grad_scores_t(st, dpt, scratch.row_max[:width], scratch.log2_sum[:width], scratch.delta[:width],
                       zero)                                                     # st = dS.T, dpt = P.T
        _max_pair_grads(st, dpt, scratch.pins, pinned, result, incoming, keys)
        chain_softcap(head, st, dcap)
        grad_operands(ops, st, dpt, scale)
        t = 0
        while t < count:
            end, i0, n = run_at(panel.blocks, t, count, block_size, n_q)
            lo, hi = run_span(t, end, n, panel.tiles, columns.spans)
            q0, q1, c0, c1 = i0 + lo, i0 + hi, t * block_size + lo, t * block_size + hi
            add_grads(ops, scale, keys, st, dpt, c0, c1, q, incoming.dout, q0, q1, dq)  # dv, dk, dq
            t = end


@njit(cache=True, parallel=True)
def maxima_by_key_block(argmax, block_size, n_kb):
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


@njit(cache=True, fastmath=FASTMATH)
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


@njit(cache=True, fastmath=FASTMATH)
def _pin_maxima(st, pins, count, argmax, row_max, j0):
    """Sets S.T of each query's maximum to the forward's row max, bitwise: BLAS rounds a score
    differently in the backward's matmul shapes, and exp2 would amplify the difference (3 ulps of a
    score of 1e11 makes P 0 instead of 1). st (cols, W): key block j0's scores against a panel of
    queries; pins[:, :count] (panel column, query) from _panel_maxima."""
    for e in range(count):
        i = pins[1, e]
        st[argmax[i] - j0, pins[0, e]] = row_max[i]


@njit(cache=True, fastmath=FASTMATH)
def _grad_scores_t(st, dpt, row_max, log2_sum, delta, zero):
    """In: st = S.T base-2 scores (-inf where masked), dpt = dP.T, both (cols, W); row_max,
    log2_sum, delta (W,) per query. Out: dpt <- P.T = exp2(min(S - row max, 0) - log2 sum) (P <= 1;
    0 where masked and for empty rows, whose row max is +inf) and st <- dS.T = P.T * (dP.T - delta)."""
    cols, width = st.shape
    for j in range(cols):
        for i in range(width):
            x = st[j, i] - row_max[i]
            p = exp2((zero if x > zero else x) - log2_sum[i])                 # NaN stays NaN
            st[j, i] = p * (dpt[j, i] - delta[i])
            dpt[j, i] = p


@njit(cache=True, fastmath=FASTMATH)
def _max_pair_grads(st, dpt, pins, count, result, incoming, key_block):
    """For rows whose softmax is one-hot in the dtype (l = 1: every other term is below an ulp),
    sets dS.T of the maximum to P (dO . (v - out) + dlse), which is P (dP - delta) without
    subtracting two large dot products: out = v there, so this is P dlse, where dP - delta would
    leave a rounding error that dq and dk multiply by scale |k| (torch gets these rows exact too;
    elsewhere its softmax backward cancels as much). st, dpt (cols, W) hold dS.T and P.T of the
    key block; result and incoming: the query head's rows; pins as in _pin_maxima."""
    dout, out, v = incoming.dout, result.out, key_block.v
    for e in range(count):
        c, i = pins[0, e], pins[1, e]
        if result.log2_sum[i] != 0:
            continue
        jj = result.argmax[i] - key_block.start
        total = incoming.dlse[i]
        for d in range(dout.shape[1]):
            total += to_float(dout[i, d]) * (to_float(v[jj, d]) - to_float(out[i, d]))
        st[jj, c] = dpt[jj, c] * total


@njit(cache=True, fastmath=FASTMATH, parallel=True)
def sum_parts(dq, dq_parts, not_finite):
    """dq += dq_parts[0] + dq_parts[1] + ..., in that order; not_finite (R,) marks the rows of the
    sum that hold a NaN or inf. dq (R, D), dq_parts (P, R, D)."""
    rows, dim = dq.shape
    for i in prange(rows):
        for p in range(dq_parts.shape[0]):
            for d in range(dim):
                dq[i, d] += dq_parts[p, i, d]
        not_finite[i] = not all_finite(dq[i:i + 1])



@njit(cache=True)
def _backward_scratch(dq, cols, width, config):
    """A backward worker's BackwardScratch for key blocks of up to ``cols`` keys and panels of up to
    ``width`` queries, in the dtype of ``dq`` (the dtype computed in)."""
    dtype = dq.dtype
    panel = cols * width
    return BackwardScratch(np.empty(panel, dtype), np.empty(panel, dtype), np.empty(panel, dtype),
                           np.empty(width, dtype), np.empty(width, dtype), np.empty(width, dtype),
                           np.empty(width, dtype), np.empty(width, np.int64), np.empty((2, width), np.int64),
                           panel_scratch(config))
