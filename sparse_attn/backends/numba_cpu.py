"""The Numba CPU backend: block-sparse flash attention on CPU tensors, forward and backward.

>>> import torch, sparse_attn as sa
>>> from sparse_attn.api import sparse_attention
>>> q = k = v = torch.randn(1, 2, 1000, 32)
>>> sparse_attention(q, k, v, sa.Local(64) | sa.Global(first=4), backend="numba").shape
torch.Size([1, 2, 1000, 32])

Algorithm
---------
Work is cut into *tasks*, one per (example, head, query block) in the forward and one per
(example of k and v, kv head, key block) in the backward.

Forward task (query block ``r`` of head ``h``, ``_forward_block``), FlashAttention's online softmax:

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
walks, for every query example that reads it (every example when k and v have batch 1) and every
query head of its GQA group (``_backward_head``), its query blocks (transposed CSR) in panels of
runs, as the forward does, and computes ``S.T = (scale log2(e)) k[c] @ q[run].T``
and ``dP.T = v[c] @ dO[run].T`` per run, ``P.T`` and ``dS.T = P.T * (dP.T - delta)`` over the panel,
then per run ``dV[c] += P.T @ dO[run]``, ``dK[c] += scale dS.T @ q[run]`` (rows the task owns) and
``dQ[run] += scale dS @ k[c]``; a partial block alone in its run is computed only on its tile's
span of allowed queries (the global rows' block: 16 of 64 queries).

Scheduling and determinism:

- Forward: ``prange`` over one worker per thread; workers take tasks from a shared counter (an
  atomic fetch-add: Numba's OpenMP ``prange`` splits iterations statically, which would give one
  thread all the heavy global rows), in heaviest-first order (rows by block count). A task owns
  its output rows, so the result does not depend on which worker ran it.
- Backward: dK and dV rows are owned by their task (k and v of batch 1: the task sums the terms
  of every example into them, so a shared k, v needs no per-example dK/dV buffer and has no
  race), but dQ rows get terms from many key blocks.
  The tasks are dealt *statically* to the workers (heaviest first, each to the least-loaded
  worker so far: a function of the layout and the thread count only); worker ``w`` adds its dQ
  terms, in its fixed task order, into its own dQ-sized buffer (``dq`` itself for worker 0), and
  the buffers are summed in worker order at the end. No atomics on data, no races, and two runs
  with the same thread count are bitwise identical.

Memory beyond inputs, outputs and gradients: O(N) (lse, m, log2 l and the key of m per row, delta,
task lists), per-worker scratch of two panels of ``min(block, n)`` x ``min(_PANEL_KEYS, n)`` (sized by
what a block and a panel can hold in this sequence, however large ``block_size`` is), and
``threads - 1`` dQ-sized buffers in the backward: O(threads x N x D). Gradients and dQ buffers are
zeroed inside the kernel by the worker that owns them.

Matmuls call BLAS ?gemm directly (the binding Numba's ``np.dot`` uses), with alpha, beta and
transposes, so there are no temporary products or extra additions; for bf16 inputs, oneDNN's brgemm
through torch (``numba_bf16``: the kernels call its functions, which are these gemm calls when
their first argument, the bf16 operands, is None).

Precision: float32 and float64 are computed in their own dtype (float32 with a vectorisable
degree-7 ``exp2``, relative error ~1e-7, since Numba has no vector exp without SVML). bfloat16
inputs, where ``bf16_matmuls`` (a CPU with native bf16 dot products, even head dim and block
size), run every matmul above on bf16 operands with float32 accumulation: q, k, v and dO as given,
P and scale * dS rounded to bf16 just before their matmuls (as torch's bf16 attention rounds them);
scores, m, l, acc, lse, delta and the gradient sums stay float32, and out, dq, dk, dv are rounded
to bf16 once, at the end. float16 inputs, and bfloat16 ones elsewhere, are computed in float32
and returned in the input dtype. Recomputing P is what
large logits punish: BLAS rounds a score a few ulps differently in the backward's matmul shapes
than in the forward's (float32; float64 agrees here), and ``exp2`` turns an absolute error of the
score into a relative error of P (with scale=1e10, 3 ulps turned P = 1 into 0). So the backward
computes S with the forward's alpha, takes ``S - m`` against the forward's exact ``m`` and
``log2 l`` separately (no rounded lse in between), sets the score of each row's maximum to ``m``
exactly (``_pin_maxima``: that P is then the forward's ``1 / l``), caps ``P`` at ``1 / l``, and,
for rows whose softmax is one-hot in the dtype (``l = 1``), forms that pair's ``dP - delta`` as
``dO . (v - out) + dlse`` (``_max_pair_grads``: exactly ``dlse``, where two large dot products
would cancel to a rounding error that dq and dk multiply by ``scale |k|``). In float32 rows with
large logits (base-2 max ``|m| >= 32``, scores of 22 and more), the pairs within 12 (base 2) of the
max get *exact* scores in both passes (``_exact_near_max``, ``_exact_near_max_t``: the products summed
in float64, rounded once): BLAS's few ulps of a score of 1000 differ between the forward's and the
backward's matmul shapes, so the backward's P disagreed with the forward's ``out``, ``l`` and delta,
and dq, dk, dv carried both errors (up to 4x torch's against float64 at logits of std 100-500, and
over 2x at std 5-25). Exact scores are also more accurate than torch's float32 ones. Pairs further
below the max weigh under ``2 ** -12`` of it and keep BLAS's scores; rows of ordinary logits never
look (one comparison per row).

Non-finite inputs: the result is the reference's restricted to the allowed pairs: a NaN or inf in
q, k or v reaches exactly the outputs and gradients of the pairs that meet it; an empty row stays 0,
-inf and zero gradients. The fast path cannot guarantee that alone (a masked pair inside a
computed tile multiplies 0 by the NaN in a matmul), so rows whose fast result is not finite are
recomputed by an exact path (``numba_exact``): the reference's formulas over the row's (or key's)
allowed pairs in float64, with scores rounded to the inputs' dtype so they overflow where torch's
do. Finite inputs never take it unless a value overflows.

Score modifiers (``mods``: softcap, then ALiBi; ``numba_mods``): each run's base-2 scores are modified
in place right after their matmul, before the mask, ``x <- c log2(e) tanh(x ln2 / c) - log2(e) slope
|i' - j|``, so the row max, its key, ``m`` and ``log2 l`` are the modified scores', and the large-logit
exact scores are modified the same way. The backward recomputes the modified ``S.T`` so, keeps
``1 - tanh^2`` per pair, and multiplies ``dS`` by it once ``_max_pair_grads`` is done; the exact path
applies them in float64. Without modifiers the Config's softcap and slopes are None and the kernels
are compiled without them (a specialisation of their own, as are softcap alone and ALiBi alone).

Code
----
This module: the kernels in the order above (forward, backward, scheduling), then the host side
(the backend interface and two torch custom ops). Next to it: ``numba_bundles`` (the namedtuples
the kernels pass: the layout's index as they walk it, sizes and scales, results, gradients,
scratch), ``numba_bf16`` (the bf16 matmuls and operands), ``numba_exact`` (the exact path),
``numba_mods`` (softcap and ALiBi on score panels and single scores) and ``numba_lowlevel`` (BLAS
``gemm``, ``exp2``, ``tanh``, the atomic counter, fastmath flags, BLAS threads).
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import overload
from numba.np.linalg import ensure_blas

from ..layout import BlockLayout
from ..score_mods import NO_MODS, ScoreMods
from .numba_bundles import (BackwardScratch, Config, ForwardResult, ForwardScratch, Gradients, Incoming, KeyBlock,
                            Panel, Segment, block_index, kv_example, query_examples, segment)
from .numba_bf16 import (add_grads, add_pv, backward_operands, bits, forward_operands, grad_operands,
                         head_backward, head_forward, probabilities, release_tiles, scores, scores_t, to_float)
from .numba_bf16 import native as native_bf16
from .numba_exact import exact_dk_dv, exact_dq_rows, exact_row
from .numba_lowlevel import FASTMATH, KERNELS, exp2, fetch_add, like
from .numba_mods import call_modifiers, chain_softcap, head_modifiers, modified, modify, modify_t, position

BLOCK_SIZE = 64
_PANEL_KEYS = 1024  # keys (or queries, in the backward) per score panel
_LANES = 16  # running maxima per row in _row_max: one AVX-512 float32 vector
_EXACT_FROM = 32.0  # float32 rows whose base-2 score max has at least this magnitude get exact scores ...
_EXACT_WITHIN = 12.0  # ... for the keys within this many base-2 units of the max (P >= 2 ** -12 of the max's)
_BLAS_MARGIN = 2.0 ** -10  # and within this fraction of |max| more: room for BLAS's rounding of the scores
_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)
_HALF = (torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------
@njit(cache=True, fastmath=FASTMATH, parallel=True)
def _forward(qkv, ops, index, config, order, n_workers, result):
    """Every forward task, taken in ``order`` (heaviest first) from a shared counter by n_workers
    workers. qkv: q (B, Hq, Nq, D), k, v (B or 1, Hkv, Nk, D); ops: their bf16 ForwardOperands for bf16
    matmuls, or None; index: the row BlockIndex; result: the ForwardResult (B, Hq, Nq, ...) to write."""
    counter = np.zeros(1, np.int64)
    for w in prange(n_workers):
        _forward_worker(counter, w, qkv, ops, index, config, order, result)  # prange bodies only call: see numba_bundles


@njit(cache=True, fastmath=FASTMATH)
def _forward_worker(counter, w, qkv, ops, index, config, order, result):
    """Worker w: takes the next task from the counter until none is left. Task (example b, head h,
    query block r) is _forward_block on those rows. Then it hands back the AMX tiles it may hold."""
    q, k, v = qkv
    heads, n_q = q.shape[1], q.shape[2]
    group, n_k = heads // k.shape[1], k.shape[2]
    n_qb = index.full_ptr.shape[2] - 1
    block_size = config.block_size
    scratch = _forward_scratch(result.out, min(block_size, n_q), min(config.panel_blocks * block_size, n_k), config)
    while True:
        t = fetch_add(counter)
        if t >= order.size:
            break
        task = order[t]
        b, h, r = task // (heads * n_qb), task // n_qb % heads, task % n_qb
        rows = slice(r * block_size, min(r * block_size + block_size, n_q))
        e = kv_example(b, k.shape[0])
        _forward_block(q[b, h, rows], k[e, h // group], v[e, h // group], head_forward(ops, w, b, e, h, h // group, rows),
                       segment(index, b, h, r), index, config, scratch, _result_rows(result, b, h, rows),
                       head_modifiers(config, b, h, rows.start))
    release_tiles(ops)


@njit(cache=True, fastmath=FASTMATH)
def _forward_block(q, k, v, ops, key_blocks, index, config, scratch, result, head):
    """One query block: q (rows, D); k, v (Nk, D) of its kv head; ops: their bf16 operands or None;
    key_blocks its Segment; head: the block's HeadModifiers (None without modifiers). Steps 1-3 of
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
    while _has_blocks(rest):                                                     # 1. panel by panel
        count, rest = _next_panel(rest, panel, config.panel_blocks)
        s = _panel(scratch.scores, rows, _panel_width(panel.blocks, count, block_size, n_k))  # (rows, W)
        t = 0
        while t < count:                                                         # 2. base-2 scores, run by run
            end, j0, n = _run(panel.blocks, t, count, block_size, n_k)
            lo, hi = _run_span(t, end, n, panel.tiles, index.spans)              # the mask sets the rest
            off = t * block_size
            scores(ops, config.base2_scale, q, k, j0 + lo, j0 + hi, s[:, off + lo:off + hi])
            modify(head, s[:, off + lo:off + hi], j0 + lo)
            t = end
        _mask_panel(s, panel.tiles, count, block_size, index.masks, False)
        _online_softmax(s, m, l, acc, scratch, panel.blocks, block_size, result.argmax, q, k, config, head)
        probabilities(ops, s)
        t = 0
        while t < count:                                                         # acc += P @ v
            end, j0, n = _run(panel.blocks, t, count, block_size, n_k)
            lo, hi = _run_span(t, end, n, panel.tiles, index.spans)
            off = t * block_size
            add_pv(ops, s, off + lo, off + hi, v, j0 + lo, j0 + hi, acc)
            t = end
    _finish_rows(q, k, v, key_blocks, index.masks, config, m, l, acc, result, head)  # 3.


@njit(cache=True, fastmath=FASTMATH)
def _finish_rows(q, k, v, key_blocks, masks, config, m, l, acc, result, head):
    """Step 3: out = acc / l and the row statistics, from a block's running m, l, acc (rows, ...);
    a row with no allowed key gets 0, -inf; a row whose result is not finite goes to the exact path."""
    rows, dim = acc.shape
    out = result.out
    for i in range(rows):
        finite = l[i] > 0                                # out = acc / l; every value finite?
        if finite:                                       # (a comparison false for NaN and inf: no
            inv = 1 / l[i]                               # fastmath flag assumes them away)
            for d in range(dim):
                out[i, d] = acc[i, d] * inv
                finite &= abs(out[i, d]) < np.inf
        if finite:
            log2_l = np.log2(l[i])
            result.lse[i] = (np.float64(m[i]) + np.float64(log2_l)) * _LN2       # rounded once
            result.row_max[i] = m[i]
            result.log2_sum[i] = log2_l
        elif l[i] == 0 and not _row_has_key(i, key_blocks, masks):             # no allowed key
            out[i] = 0
            result.lse[i], result.row_max[i], result.log2_sum[i], result.argmax[i] = -np.inf, np.inf, 0, -1
        else:                  # NaN or inf met, an overflow, or every score underflowed to -inf
            result.lse[i], result.row_max[i], result.log2_sum[i], result.argmax[i] = exact_row(
                i, q[i], k, v, key_blocks, masks, config, out[i], head)


@njit(cache=True, fastmath=FASTMATH)
def _next_panel(blocks, panel, panel_blocks):
    """The next (up to ``panel_blocks``) blocks of a Segment, full and partial merged in order:
    ``panel.blocks[i]`` gets the panel's i-th block and ``panel.tiles[i]`` its tile (-1: full).
    Returns (block count, the Segment's remaining blocks)."""
    full, partial = blocks.full, blocks.partial
    count, full_at, part_at = 0, 0, 0
    while count < panel_blocks and (full_at < full.size or part_at < partial.size):
        take_full = part_at >= partial.size or (full_at < full.size and full[full_at] < partial[part_at])
        if take_full:
            panel.blocks[count], panel.tiles[count] = full[full_at], -1
            full_at += 1
        else:
            panel.blocks[count], panel.tiles[count] = partial[part_at], blocks.tiles[part_at]
            part_at += 1
        count += 1
    return count, Segment(full[full_at:], partial[part_at:], blocks.tiles[part_at:])


@njit(cache=True, fastmath=FASTMATH)
def _has_blocks(blocks):
    """Whether a Segment has a block left."""
    return blocks.full.size > 0 or blocks.partial.size > 0


@njit(cache=True, fastmath=FASTMATH)
def _run(blocks, t0, count, block_size, n):
    """The run of consecutive blocks starting at panel position t0: (end position t1, first token,
    token count), clipped to the sequence length n. Its columns in the panel start at t0 * block_size."""
    t1 = t0 + 1
    while t1 < count and blocks[t1] == blocks[t1 - 1] + 1:
        t1 += 1
    start = blocks[t0] * block_size
    return t1, start, min(blocks[t1 - 1] * block_size + block_size, n) - start


@njit(cache=True, fastmath=FASTMATH)
def _run_span(t0, t1, n, tiles, spans):
    """[lo, hi) of a run's n tokens to compute: a single partial block's tile span, else all."""
    if t1 == t0 + 1 and tiles[t0] >= 0:
        return spans[tiles[t0], 0], min(spans[tiles[t0], 1], n)
    return 0, n


@njit(cache=True, fastmath=FASTMATH)
def _panel_width(blocks, count, block_size, n):
    """Columns of a panel of ``count`` blocks: only the sequence's last block may be short (and it
    comes last)."""
    return (count - 1) * block_size + min(block_size, n - blocks[count - 1] * block_size)


@njit(cache=True, fastmath=FASTMATH)
def _panel(buffer, rows, width):
    """A (rows, width) C-contiguous view of a flat scratch buffer."""
    return buffer[:rows * width].reshape((rows, width))


@njit(cache=True, fastmath=FASTMATH)
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


@njit(cache=True, fastmath=FASTMATH)
def _online_softmax(s, m, l, acc, scratch, blocks, block_size, argmax, q, k, config, head):
    """s (rows, W) base-2 scores -> probabilities relative to the updated running max m;
    rescales the running sum l and the output accumulator acc (rows, D) accordingly, and keeps
    in argmax the key of each row's maximum. A NaN score makes l NaN (no hiding in the max).
    Rows with large logits first get exact scores near their maximum (``_exact_near_max``, from
    q (rows, D) and k (Nk, D), modified by head); scratch: the worker's ForwardScratch."""
    rows, width = s.shape
    for i in range(rows):
        row = s[i]
        m_new, where = _row_max(row, m[i], scratch.lanes)
        exact_column = -1
        if _large_logits(m_new):
            exact_max, exact_column = _exact_near_max(row, m_new, q[i], k, blocks, block_size, config.base2_scale,
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


def _large_logits(row_max):
    """Whether a float32 row whose base-2 score maximum is ``row_max`` has large logits: |max| of
    at least _EXACT_FROM, finite. Always False in float64 (its BLAS rounding is far below the tolerance)."""


@overload(_large_logits)
def _large_logits_impl(row_max):
    if row_max == types.float32:
        return lambda row_max: abs(row_max) >= _EXACT_FROM and abs(row_max) < np.inf
    return lambda row_max: False


@njit(cache=True, fastmath=FASTMATH)
def _near_max(row_max):
    """The lowest base-2 score of a large-logit row that gets an exact score, in row_max's dtype:
    _EXACT_WITHIN below its max, and lower by a margin for BLAS's rounding of scores that large."""
    return row_max - like(row_max, _EXACT_WITHIN + abs(row_max) * _BLAS_MARGIN)


@njit(cache=True, fastmath=FASTMATH)
def _exact_near_max(row, row_max, q_i, k, blocks, block_size, alpha, hits, head, query):
    """Forward: the scores of a panel row (W,) within _near_max of its max ``row_max`` (from BLAS),
    recomputed by _exact_score and modified by head; q_i (D,) its query at key position ``query``,
    k (Nk, D); panel position t holds key block
    blocks[t]; hits: (W,) scratch. Returns the largest exact score and its column (every score left
    is lower: it was below _near_max)."""
    best, column = like(row_max, -np.inf), -1
    for e in range(_columns_at_least(row, _near_max(row_max), hits)):
        j = hits[e]
        key = blocks[j // block_size] * block_size + j % block_size
        row[j] = modified(head, _exact_score(q_i, k[key], alpha), query - key)
        if row[j] > best:
            best, column = row[j], j
    return best, column


@njit(cache=True, fastmath=FASTMATH)
def _exact_near_max_t(st, q, k, blocks, block_size, alpha, scratch, head, key0):
    """Backward: the scores of st (cols, W) = S.T of a key block k (cols, D) against a panel of
    queries (panel position t holds query block blocks[t]; q (Nq, D)) that the forward made exact:
    those within _near_max of their query's max (scratch.row_max), in large-logit rows. scratch: the
    worker's BackwardScratch (its row_max, lows and hits); head: the query head's HeadModifiers (key
    block starting at key0)."""
    cols, width = st.shape
    lows, hits = scratch.lows[:width], scratch.hits
    large = 0
    for i in range(width):
        row_max = scratch.row_max[i]
        lows[i] = _near_max(row_max) if _large_logits(row_max) else np.inf
        large += lows[i] < np.inf
    if large == 0:
        return
    for j in range(cols):
        for e in range(_columns_at_least(st[j], lows, hits)):
            i = hits[e]
            query = blocks[i // block_size] * block_size + i % block_size
            st[j, i] = modified(head, _exact_score(q[query], k[j], alpha), position(head, query) - key0 - j)


@njit(cache=True, fastmath=FASTMATH)
def _columns_at_least(row, low, hits):
    """How many columns j of a row (W,) have row[j] >= low (a scalar, or (W,) per column); they go
    to hits[:count], ascending (no branch: every column is written, the count moves on a hit)."""
    count = 0
    for j in range(row.size):
        hits[count] = j
        count += row[j] >= _at(low, j)
    return count


def _at(low, j):
    """low[j] for an array, low itself for a scalar."""


@overload(_at)
def _at_impl(low, j):
    if isinstance(low, types.Array):
        return lambda low, j: low[j]
    return lambda low, j: low


@njit(cache=True, fastmath=FASTMATH)
def _exact_score(x, y, alpha):
    """alpha (x . y) for float32 (or bf16 bits) vectors x, y: the products exact and summed in
    float64, rounded to alpha's dtype once. The same bits in the forward and the backward, whatever
    the matmul shapes around them."""
    dot = 0.0
    for d in range(x.size):
        dot += np.float64(to_float(x[d])) * np.float64(to_float(y[d]))
    return like(alpha, np.float64(alpha) * dot)


@njit(cache=True, fastmath=FASTMATH)
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


@njit(cache=True, fastmath=FASTMATH)
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
def _forward_scratch(out, rows, width, config):
    """A forward worker's ForwardScratch for blocks of up to ``rows`` queries and panels of up to
    ``width`` keys, in the dtype of ``out`` (the dtype computed in)."""
    dim, dtype = out.shape[-1], out.dtype
    return ForwardScratch(np.empty(rows * width, dtype), np.empty((rows, dim), dtype), np.empty(rows, dtype),
                          np.empty(rows, dtype), np.empty(_LANES, dtype), np.empty(width, np.int64), _panel_scratch(config))


@njit(cache=True)
def _panel_scratch(config):
    """A Panel for up to config.panel_blocks blocks."""
    return Panel(np.empty(config.panel_blocks, np.int64), np.empty(config.panel_blocks, np.int64))


@njit(cache=True)
def _result_rows(result, b, h, rows):
    """The ForwardResult of example b, head h, rows ``rows`` (a slice)."""
    return ForwardResult(result.out[b, h, rows], result.lse[b, h, rows], result.row_max[b, h, rows],
                         result.log2_sum[b, h, rows], result.argmax[b, h, rows])


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------
@njit(cache=True, fastmath=FASTMATH, parallel=True)
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


@njit(cache=True, fastmath=FASTMATH, parallel=True)
def _backward(qkv, ops, result, incoming, maxima, columns, config, schedule, grads):
    """One pass over key blocks: worker w runs its static share of the tasks, ``schedule`` = (ptr,
    tasks): ``tasks[ptr[w]:ptr[w + 1]]``, and adds its dQ terms to its own buffer, grads.dq for
    w = 0 and grads.dq_parts[w - 1] otherwise. ops: the bf16 BackwardOperands, or None; maxima = (ptr, queries) from _maxima_by_key_block;
    columns: the transposed BlockIndex; grads: the Gradients to write."""
    worker_ptr, tasks = schedule
    for w in prange(worker_ptr.size - 1):                # prange bodies only call: see numba_bundles
        _backward_worker(tasks[worker_ptr[w]:worker_ptr[w + 1]], w, grads.dq if w == 0 else grads.dq_parts[w - 1],
                         qkv, ops, result, incoming, maxima, columns, config, grads)


@njit(cache=True, fastmath=FASTMATH)
def _backward_worker(tasks, w, dq, qkv, ops, result, incoming, maxima, columns, config, grads):
    """Worker w's tasks, in order. It zeroes its dQ buffer dq (B, Hq, Nq, D) and adds its dQ terms
    there; each task (example e of k, v, kv head g, key block c) zeroes and then accumulates its own
    rows of grads.dk and grads.dv, over every query example that reads them (all B where k, v have
    batch 1), and recomputes by the exact path the keys whose result is not finite. Then it hands back
    the AMX tiles it may hold."""
    q, k, v = qkv
    batch, heads, n_q = q.shape[0], q.shape[1], q.shape[2]
    kv_batch, kv_heads, n_k = k.shape[0], k.shape[1], k.shape[2]
    group = heads // kv_heads
    n_kb = columns.full_ptr.shape[2] - 1
    block_size = config.block_size
    maxima_ptr, maxima_queries = maxima
    scratch = _backward_scratch(grads.dq, min(block_size, n_k), min(config.panel_blocks * block_size, n_q), config)
    dq.reshape(-1)[:] = 0
    for task in tasks:
        e, g, c = task // (kv_heads * n_kb), task // n_kb % kv_heads, task % n_kb
        j0 = c * block_size
        keys = slice(j0, min(j0 + block_size, n_k))
        key_block = KeyBlock(j0, k[e, g, keys], v[e, g, keys], grads.dk[e, g, keys], grads.dv[e, g, keys])
        key_block.dk[:] = 0
        key_block.dv[:] = 0
        b0, b1 = query_examples(e, batch, kv_batch)
        for b in range(b0, b1):
            for h in range(g * group, (g + 1) * group):
                _backward_head(key_block, q[b, h], _result_rows(result, b, h, slice(0, n_q)),
                               Incoming(incoming.dout[b, h], incoming.dlse[b, h], incoming.delta[b, h]),
                               maxima_queries[b, h, maxima_ptr[b, h, c]:maxima_ptr[b, h, c + 1]],
                               segment(columns, b, h, c), columns, config, scratch, dq[b, h],
                               head_backward(ops, w, b, e, h, g, keys), head_modifiers(config, b, h, 0))
        if _finite(key_block.dk) and _finite(key_block.dv):
            continue
        for j in range(j0, j0 + key_block.k.shape[0]):
            if not (_finite(grads.dk[e, g, j:j + 1]) and _finite(grads.dv[e, g, j:j + 1])):
                grads.dk[e, g, j], grads.dv[e, g, j] = exact_dk_dv(qkv, result, incoming, columns, config, e, g, j)
    release_tiles(ops)


@njit(cache=True, fastmath=FASTMATH)
def _backward_head(key_block, q, result, incoming, maxima, query_blocks, columns, config, scratch, dq, ops, head):
    """One key block against one query head: adds to key_block.dk, .dv (cols, D) and to the head's
    dq (Nq, D). q (Nq, D), result and incoming: the query head's rows; maxima: its queries whose row
    maximum is in this key block; query_blocks: the key block's Segment; ops: the bf16 operands or None;
    head: the query head's HeadModifiers, or None (with softcap, dS of the capped scores times 1 - tanh^2)."""
    cols = key_block.k.shape[0]
    n_q = q.shape[0]
    block_size, panel, scale = config.block_size, scratch.panel, config.scale
    zero = scale - scale
    e = 0
    rest = query_blocks
    while _has_blocks(rest):
        count, rest = _next_panel(rest, panel, config.panel_blocks)
        width = _panel_width(panel.blocks, count, block_size, n_q)
        st = _panel(scratch.scores, cols, width)                                 # (cols, W) = S.T
        dpt = _panel(scratch.dscores, cols, width)                               # (cols, W) = dP.T
        dcap = _panel(scratch.dcap, cols, width)                                 # (cols, W): 1 - tanh^2
        pinned, e = _panel_maxima(panel.blocks, count, block_size, maxima, e, scratch.pins)
        t = 0
        while t < count:                                                         # run by run of query blocks
            end, i0, n = _run(panel.blocks, t, count, block_size, n_q)
            lo, hi = _run_span(t, end, n, panel.tiles, columns.spans)            # the mask sets st elsewhere
            off = t * block_size
            q0, q1 = i0 + lo, i0 + hi                                            # S.T with the forward's alpha
            scores_t(ops, config.base2_scale, key_block, q, incoming.dout, q0, q1, st[:, off + lo:off + hi],
                     dpt[:, off + lo:off + hi])
            modify_t(head, st[:, off + lo:off + hi], key_block.start, q0, dcap[:, off + lo:off + hi])
            dpt[:, off:off + lo] = 0                                             # masked: P = 0 there
            dpt[:, off + hi:off + n] = 0
            scratch.row_max[off:off + n] = result.row_max[i0:i0 + n]
            scratch.log2_sum[off:off + n] = result.log2_sum[i0:i0 + n]
            scratch.delta[off:off + n] = incoming.delta[i0:i0 + n]
            t = end
        _mask_panel(st, panel.tiles, count, block_size, columns.masks, True)
        _exact_near_max_t(st, q, key_block.k, panel.blocks, block_size, config.base2_scale, scratch, head,
                          key_block.start)
        _pin_maxima(st, scratch.pins, pinned, result.argmax, result.row_max, key_block.start)
        _grad_scores_t(st, dpt, scratch.row_max[:width], scratch.log2_sum[:width], scratch.delta[:width],
                       zero)                                                     # st = dS.T, dpt = P.T
        _max_pair_grads(st, dpt, scratch.pins, pinned, result, incoming, key_block)
        chain_softcap(head, st, dcap)
        grad_operands(ops, st, dpt, scale)
        t = 0
        while t < count:
            end, i0, n = _run(panel.blocks, t, count, block_size, n_q)
            lo, hi = _run_span(t, end, n, panel.tiles, columns.spans)
            q0, q1, c0, c1 = i0 + lo, i0 + hi, t * block_size + lo, t * block_size + hi
            add_grads(ops, scale, key_block, st, dpt, c0, c1, q, incoming.dout, q0, q1, dq)  # dv, dk, dq
            t = end


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
            total += dout[i, d] * (to_float(v[jj, d]) - out[i, d])
        st[jj, c] = dpt[jj, c] * total


@njit(cache=True, fastmath=FASTMATH, parallel=True)
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
def _finite(x):
    """Whether no value of the 2-D array x is NaN or inf (false for both in the comparison; no early
    exit, so the loop vectorises)."""
    finite = True
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            finite &= abs(x[i, j]) < np.inf
    return finite


@njit(cache=True)
def _backward_scratch(dq, cols, width, config):
    """A backward worker's BackwardScratch for key blocks of up to ``cols`` keys and panels of up to
    ``width`` queries, in the dtype of ``dq`` (the dtype computed in)."""
    dtype = dq.dtype
    panel = cols * width
    return BackwardScratch(np.empty(panel, dtype), np.empty(panel, dtype), np.empty(panel, dtype),
                           np.empty(width, dtype), np.empty(width, dtype), np.empty(width, dtype),
                           np.empty(width, dtype), np.empty(width, np.int64), np.empty((2, width), np.int64),
                           _panel_scratch(config))


# ------------------------------------------------------------------------------------------------
# Scheduling
# ------------------------------------------------------------------------------------------------
def _task_costs(ptr: torch.Tensor, part_ptr: torch.Tensor, batch: int, heads: int,
                kv_shape: tuple[int, int] | None = None) -> np.ndarray:
    """Block count of every task (example, head, block), flat in task-id order.

    With ``kv_shape`` = (kv batch, kv heads) the tasks are (kv example, kv head, block) and a task sums
    the query examples that read it (all of them for kv batch 1) and the heads of its group.
    """
    counts = np.diff(ptr.numpy(), axis=-1) + np.diff(part_ptr.numpy(), axis=-1)  # (Bl, Hl, n_blocks)
    counts = np.broadcast_to(counts, (batch, heads, counts.shape[-1]))
    if kv_shape is not None:
        kv_batch, kv_heads = kv_shape
        counts = counts.reshape(kv_batch, batch // kv_batch, kv_heads, heads // kv_heads, -1).sum((1, 3))
    return counts.reshape(-1).astype(np.int64)


def _heaviest_first(costs: np.ndarray) -> np.ndarray:
    """Task ids sorted by cost, heaviest first (stable)."""
    return np.argsort(-costs, kind="stable").astype(np.int64)


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


# ------------------------------------------------------------------------------------------------
# Host side: the backend interface, and torch custom ops (autograd, torch.compile and opcheck see
# the kernels as two opaque ops)
# ------------------------------------------------------------------------------------------------
def available() -> tuple[bool, str]:
    try:
        ensure_blas()                                    # the kernels' matmuls call scipy's BLAS
    except ImportError as error:
        return False, f"backend='numba' needs scipy (its BLAS): {error}"
    bf16, why = native_bf16()
    return True, f"numba {numba.__version__}, {numba.get_num_threads()} threads; bfloat16: " + (
        why if bf16 else f"computed in float32 ({why})")


def check(q, k, v, layout: BlockLayout) -> None:
    """Raise a ValueError if these inputs cannot run on this backend, saying what to do."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cpu":
            raise ValueError(f"backend='numba' runs on CPU tensors, got {name} on {t.device}; "
                             f"use backend='triton' for CUDA tensors or move the inputs with .cpu()")
    if layout.device.type != "cpu":
        raise ValueError(f"backend='numba' needs a CPU BlockLayout, got one on {layout.device}; use layout.to('cpu')")


def attention(q, k, v, layout: BlockLayout, scale: float, mods: ScoreMods = NO_MODS):
    """out (B, Hq, Nq, D) in q's dtype, lse (B, Hq, Nq) float32 (float64 for float64 inputs). ``mods``:
    softcap, then ALiBi, on every allowed score, inside the kernels (slopes as ``score_mods.check_mods``
    gives them: (B or 1, Hq), contiguous)."""
    dtype = q.dtype
    if dtype in _HALF and not bf16_matmuls(q, layout.block_size):
        q, k, v = q.float(), k.float(), v.float()
    out, lse, _, _ = numba_attention(q, k, v, *layout.index, layout.block_size, scale, mods.softcap,
                                     mods.alibi_slopes)
    return out.to(dtype), lse


def bf16_matmuls(q: torch.Tensor, block_size: int) -> bool:
    """Whether the kernels run q's matmuls in bfloat16: q is bf16, the CPU has native bf16 dot products
    (``numba_bf16.native``), and the head dim and block size are even (brgemm reads pairs of rows)."""
    return q.dtype == torch.bfloat16 and q.shape[-1] % 2 == 0 and block_size % 2 == 0 and native_bf16()[0]


@torch.library.custom_op("sparse_attn::numba_attention", mutates_args=())
def numba_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    full_ptr: torch.Tensor, full_idx: torch.Tensor, part_ptr: torch.Tensor, part_idx: torch.Tensor,
                    part_mask: torch.Tensor, masks: torch.Tensor, full_t_ptr: torch.Tensor,
                    full_t_idx: torch.Tensor, part_t_ptr: torch.Tensor, part_t_idx: torch.Tensor,
                    part_t_mask: torch.Tensor, block_size: int, scale: float, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor]:
    """Forward kernel on float32/float64 CPU tensors, or bf16 ones where ``bf16_matmuls``: (out, lse,
    stats, argmax), float32 for bf16. softcap (0: none) and alibi_slopes ((B or 1, Hq), or None) as in
    ``score_mods.ScoreMods``.

    ``stats`` (2, B, Hq, Nq) and ``argmax`` (B, Hq, Nq) int64 are for the backward: each row's base-2
    score maximum and log2 of its sum, and the key holding the maximum."""
    dtype = _computed_in(q)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ops = None if dtype == q.dtype else forward_operands(q, k, v, numba.get_num_threads(), min(block_size, q.shape[2]),
                                                        _panel_capacity(block_size, k.shape[2]))
    out = q.new_empty(q.shape, dtype=dtype)                                      # (B, Hq, Nq, D)
    lse = q.new_empty(q.shape[:3], dtype=dtype)                                  # (B, Hq, Nq)
    stats = q.new_empty((2, *q.shape[:3]), dtype=dtype)                          # (2, B, Hq, Nq)
    argmax = torch.empty(q.shape[:3], dtype=torch.int64)                         # (B, Hq, Nq)
    order = _heaviest_first(_task_costs(full_ptr, part_ptr, q.shape[0], q.shape[1]))
    rows = block_index(full_ptr, full_idx, part_ptr, part_idx, part_mask, masks, transposed=False)
    result = ForwardResult(out.numpy(), lse.numpy(), stats[0].numpy(), stats[1].numpy(), argmax.numpy())
    with KERNELS.running():
        _forward((_array(q), _array(k), _array(v)), ops, rows,
                 _config(dtype, block_size, scale, softcap, alibi_slopes, q.shape[2], k.shape[2]), order,
                 numba.get_num_threads(), result)
    return out, lse, stats, argmax


@numba_attention.register_fake
def _(q, k, v, *layout_and_args):
    """Contiguous outputs whatever q's strides, as the kernel writes them (Inductor checks the strides)."""
    rows, dtype = q.shape[:3], _computed_in(q)
    return (q.new_empty(q.shape, dtype=dtype), q.new_empty(rows, dtype=dtype), q.new_empty((2, *rows), dtype=dtype),
            q.new_empty(rows, dtype=torch.int64))


@torch.library.custom_op("sparse_attn::numba_attention_backward", mutates_args=())
def numba_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, stats: torch.Tensor, argmax: torch.Tensor,
                             dlse: torch.Tensor, full_ptr: torch.Tensor, full_idx: torch.Tensor,
                             part_ptr: torch.Tensor, part_idx: torch.Tensor, part_mask: torch.Tensor,
                             masks: torch.Tensor, full_t_ptr: torch.Tensor, full_t_idx: torch.Tensor,
                             part_t_ptr: torch.Tensor, part_t_idx: torch.Tensor, part_t_mask: torch.Tensor,
                             block_size: int, scale: float, softcap: float = 0.0,
                             alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """Backward kernel: (dq, dk, dv) in q's dtype from dout and dlse, the gradients of out and lse;
    lse, stats and argmax are the forward's (float32 with bf16 q, k, v: bf16 matmuls); softcap and
    alibi_slopes the forward's (the slopes get no gradient)."""
    dtype = _computed_in(q)
    dout, q, k, v, out, lse, dlse = (t.contiguous() for t in (dout, q, k, v, out, lse, dlse))
    batch, heads, n_q, dim = q.shape
    workers = numba.get_num_threads()
    ops = None if dtype == q.dtype else backward_operands(q, k, v, dout, workers, min(block_size, k.shape[2]),
                                                         _panel_capacity(block_size, n_q))
    costs = _task_costs(full_t_ptr, part_t_ptr, batch, heads, k.shape[:2])
    schedule = _static_schedule(_heaviest_first(costs), costs, workers)
    # Written (and zeroed, worker by worker) inside the kernels: no serial memset of fresh pages.
    delta = torch.empty_like(lse)                                                # (B, Hq, Nq)
    dq, dk, dv = (t.new_empty(t.shape, dtype=dtype) for t in (q, k, v))          # contiguous, as the fake
    dq_parts = q.new_empty((workers - 1, *q.shape), dtype=dtype)                 # (W-1, B, Hq, Nq, D)
    rows = batch * heads * n_q
    not_finite = np.empty(rows, np.bool_)                                        # dq rows to recompute exactly
    qkv = (_array(q), _array(k), _array(v))
    result = ForwardResult(out.numpy(), lse.numpy(), *stats.contiguous().numpy(), argmax.contiguous().numpy())
    incoming = Incoming(dout.numpy(), dlse.numpy(), delta.numpy())
    columns = block_index(full_t_ptr, full_t_idx, part_t_ptr, part_t_idx, part_t_mask, masks, transposed=True)
    config = _config(dtype, block_size, scale, softcap, alibi_slopes, n_q, k.shape[2])
    with KERNELS.running():
        _delta(out.view(rows, dim).numpy(), dout.view(rows, dim).numpy(), lse.view(rows).numpy(),
               dlse.view(rows).numpy(), _as(dtype, 0), delta.view(rows).numpy())
        maxima = _maxima_by_key_block(result.argmax, block_size, full_t_ptr.shape[2] - 1)
        _backward(qkv, ops, result, incoming, maxima, columns, config, schedule,
                  Gradients(dq.numpy(), dq_parts.numpy(), dk.numpy(), dv.numpy()))
        _sum_parts(dq.view(rows, dim).numpy(), dq_parts.view(workers - 1, rows, dim).numpy(), not_finite)
        if not_finite.any():
            exact_dq_rows(np.flatnonzero(not_finite), qkv, result, incoming,
                          block_index(full_ptr, full_idx, part_ptr, part_idx, part_mask, masks, transposed=False),
                          config, dq.numpy())
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


@numba_attention_backward.register_fake
def _(dout, q, k, v, *rest):
    """Contiguous gradients whatever the strides of q, k, v, as the kernel writes them."""
    return tuple(t.new_empty(t.shape) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, *layout, block_size, scale, softcap, alibi_slopes = inputs
    out, lse, stats, argmax = output
    ctx.mark_non_differentiable(stats, argmax)
    ctx.save_for_backward(q, k, v, out, lse, stats, argmax, alibi_slopes, *layout)
    ctx.block_size, ctx.scale, ctx.softcap = block_size, scale, softcap


def _autograd_backward(ctx, dout, dlse, _dstats, _dargmax):
    q, k, v, out, lse, stats, argmax, alibi_slopes, *layout = ctx.saved_tensors  # an unused lse gets zeros
    dq, dk, dv = numba_attention_backward(dout, q, k, v, out, lse, stats, argmax, dlse, *layout, ctx.block_size,
                                          ctx.scale, ctx.softcap, alibi_slopes)
    return (dq, dk, dv) + (None,) * (len(layout) + 4)                # layout, block_size, scale, softcap, slopes


numba_attention.register_autograd(_autograd_backward, setup_context=_setup_context)


def _computed_in(q: torch.Tensor) -> torch.dtype:
    """The dtype the kernels compute in for q: its own, float32 for bf16 (bf16 matmuls, float32 softmax)."""
    return torch.float32 if q.dtype == torch.bfloat16 else q.dtype


def _array(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as the kernels read it: a numpy view, bf16 as its bits (uint16)."""
    return bits(t) if t.dtype == torch.bfloat16 else t.numpy()


def _config(dtype: torch.dtype, block_size: int, scale: float, softcap: float, alibi_slopes: torch.Tensor | None,
            n_q: int, n_k: int) -> Config:
    """Sizes, scales and score modifiers of a call of n_q queries over n_k keys, the scales in the dtype
    computed in (float32 stays float32); without modifiers, softcap and slopes None: the kernels' own
    specialisation."""
    return Config(block_size, max(1, _PANEL_KEYS // block_size), _as(dtype, scale), _as(dtype, scale * _LOG2E),
                  *call_modifiers(softcap, alibi_slopes, dtype, n_q, n_k))


def _panel_capacity(block_size: int, n: int) -> int:
    """The most columns a panel of a sequence of n tokens holds (as the kernels size their scratch)."""
    return min(max(1, _PANEL_KEYS // block_size) * block_size, n)


def _as(dtype: torch.dtype, x: float):
    """x as a numpy scalar of a float32 or float64 dtype."""
    return np.float32(x) if dtype == torch.float32 else np.float64(x)
