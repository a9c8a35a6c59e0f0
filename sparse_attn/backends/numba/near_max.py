"""Exact scores near the maximum of float32 rows with large logits, in the forward and the backward.

BLAS rounds a score of 1000 a few ulps differently in the forward's and the backward's matmul shapes, and
``exp2`` turns that into a relative error of P. So in float32 rows whose base-2 score maximum has magnitude
``_EXACT_FROM`` or more, the pairs within ``_EXACT_WITHIN`` (base 2) of the maximum get exact scores in
both passes: the products summed in float64, rounded once (see the package docstring, Precision).

>>> import numpy as np
>>> from numba import njit
>>> from sparse_attn.backends.numba.near_max import large_logits
>>> large = njit(lambda row_max: large_logits(row_max))      # kernels' code: called from compiled code
>>> large(np.float32(40.0)), large(np.float32(3.0)), large(40.0)     # float64 rows never
(True, False, False)
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .bf16 import to_float
from .lowlevel import FASTMATH, like
from .mods import modified, position

_EXACT_FROM = 32.0  # float32 rows whose base-2 score max has at least this magnitude get exact scores ...
_EXACT_WITHIN = 12.0  # ... for the keys within this many base-2 units of the max (P >= 2 ** -12 of the max's)
_BLAS_MARGIN = 2.0 ** -10  # and within this fraction of |max| more: room for BLAS's rounding of the scores


def large_logits(row_max):
    """Whether a float32 row whose base-2 score maximum is ``row_max`` has large logits: |max| of
    at least _EXACT_FROM, finite. Always False in float64 (its BLAS rounding is far below the tolerance)."""


@overload(large_logits)
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
def exact_near_max(row, row_max, q_i, k, blocks, block_size, alpha, hits, head, query):
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
def exact_near_max_t(st, q, k, blocks, block_size, alpha, scratch, head, key0):
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
        lows[i] = _near_max(row_max) if large_logits(row_max) else np.inf
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
