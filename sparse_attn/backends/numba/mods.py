"""Score modifiers inside the Numba kernels: softcap, then ALiBi, on panels of base-2 scores, the softcap's
derivative for the backward, and the same formulas on single scores for the exact path.

>>> import numpy as np, torch
>>> from numba import njit
>>> from sparse_attn.backends.numba.mods import call_modifiers, head_modifiers, modify
>>> from sparse_attn.backends.numba.bundles import Config
>>> @njit
... def modified_panel(config, s):                 # rows 0.. of query head 0 of example 0, keys 0..
...     modify(head_modifiers(config, 0, 0, 0), s, 0, s.shape[1], 0)
>>> mods = call_modifiers(50.0, torch.tensor([[0.5]]), torch.float64, n_q=2, n_k=3)   # rows at positions 1, 2
>>> config = Config(64, 16, np.float64(1.0), np.float64(np.log2(np.e)), *mods)
>>> s = np.array([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])                  # base 2: log2(e) (scale q . k)
>>> modified_panel(config, s)
>>> np.round(s / np.log2(np.e), 4).tolist()                            # natural units: 50 tanh(s / 50) - 0.5 |i' - j|
[[-0.5, 0.6931, 0.8859], [-1.0, 0.1931, 1.3859]]

The kernels hold scores in base 2 with the scale folded in, ``x = log2(e) scale q . k``. With
``s = x ln 2``: softcap gives ``c log2(e) tanh(x ln2 / c)``, then ALiBi subtracts ``log2(e) slope |i' - j|``,
i' = i + (n_k - n_q).

Every call carries both modifiers, each neutral when the call has none: a softcap of 0 is no softcap, and a
slope of 0 (or no slopes at all) is no ALiBi. So each dtype compiles one forward and one backward whatever the
call's modifiers: the panel loops test the head's modifiers once per run of scores and skip what is neutral,
which costs nothing next to the run's matmul, where a specialisation per combination cost a cold compile
each (35-43 s of CPU on a 2-core AMD EPYC for a forward and its backward).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from numba import njit

from .lowlevel import FASTMATH, like, tanh

_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)
# The softcaps the kernels run, per dtype computed in: ln 2 / c and c log2(e) must be normal numbers of the dtype (a
# softcap of 1e-45 or 1e300 overflowed one of them in float32, and 0 * inf made NaN). Outside the range the dtype
# gives the same capped scores: about 0 for every pair below it (exp of them is 1), the scores themselves above it.
_SOFTCAP_RANGE = {torch.float32: (1e-30, 1e36), torch.float64: (1e-300, 1e300)}


class ScoreModifiers(NamedTuple):
    """A call's softcap and ALiBi as the host hands them to the kernels (``call_modifiers``): the last three
    fields of ``bundles.Config`` (flat there: Numba's parallel loops take a tuple's arrays only one level
    deep)."""

    softcap: np.float64          # c > 0; 0: no softcap
    slopes: np.ndarray           # (B or 1, Hq) ALiBi slopes in the dtype computed in; (1, 0): no ALiBi
    shift: int                   # n_k - n_q: query row i sits at key position i + shift


class HeadModifiers(NamedTuple):
    """The modifiers of one (example, query head): natural units in float64 for the exact path, base-2
    units in the dtype computed in for the panels."""

    softcap: tuple               # (c, ln 2 / c, c log2(e)): x <- c log2(e) tanh(x ln 2 / c); c = 0: none (all 0)
    slope: tuple                 # (slope in float64, log2(e) slope); 0: no ALiBi
    first: int                   # the key-sequence position of row 0 of the query array the kernel holds


def call_modifiers(softcap: float, slopes: torch.Tensor | None, dtype: torch.dtype, n_q: int,
                   n_k: int) -> ScoreModifiers:
    """The kernels' ScoreModifiers of a call computed in ``dtype`` (float32 or float64): softcap 0 and slopes of
    shape (1, 0) where the call has none. The softcap is clipped to ``_SOFTCAP_RANGE`` of the dtype."""
    low, high = _SOFTCAP_RANGE[dtype]
    numpy_dtype = np.float32 if dtype == torch.float32 else np.float64
    return ScoreModifiers(np.float64(min(max(softcap, low), high) if softcap else 0.0),
                          np.zeros((1, 0), numpy_dtype) if slopes is None else slopes.to(dtype).contiguous().numpy(),
                          n_k - n_q)


@njit(cache=True)
def head_modifiers(config, b, h, first):
    """The HeadModifiers of example b, query head h, for a query array whose row 0 is query ``first``, from
    a ``bundles.Config``."""
    c, template, slopes = config.softcap, config.scale, config.slopes
    softcap = (c, like(template, _LN2 / c), like(template, c * _LOG2E)) if c > 0 else \
        (c, like(template, 0.0), like(template, 0.0))
    slope = np.float64(slopes[0 if slopes.shape[0] == 1 else b, h]) if slopes.shape[1] > 0 else 0.0
    return HeadModifiers(softcap, (slope, like(template, slope * _LOG2E)), first + config.shift)


@njit(cache=True)
def shifted(head, rows):
    """The HeadModifiers of the same query array from its row ``rows`` on."""
    return HeadModifiers(head.softcap, head.slope, head.first + rows)


@njit(cache=True)
def position(head, row):
    """The key-sequence position of row ``row`` of the head's query array."""
    return head.first + row


# ------------------------------------------------------------------------------------------------
# Panels of the fast path
# ------------------------------------------------------------------------------------------------
@njit(cache=True, fastmath=FASTMATH)
def modify(head, s, c0, c1, key0):
    """Forward: the modifiers on columns [c0, c1) of s (rows, W) base-2 scores, in place: row r of the
    head's query array (at key position head.first + r) against key key0 + (c - c0). Each modifier the head has
    is one pass over the row, none without modifiers. (Column bounds rather than a column slice of the panel: a
    slice of a C-contiguous row keeps unit stride, so the loops over it vectorise.)"""
    capped, sloped = head.softcap[0] > 0, head.slope[0] != 0
    if not (capped or sloped):
        return
    for r in range(s.shape[0]):
        row = s[r, c0:c1]
        if capped:
            for c in range(row.size):
                row[c] = head.softcap[2] * tanh(row[c] * head.softcap[1])
        if sloped:
            _alibi_row(row, head.slope, head.first + r - key0, -1)     # distance to row[c]: offset - c


@njit(cache=True, fastmath=FASTMATH)
def modify_t(head, st, c0, c1, key0, query0, dcap):
    """Backward: the modifiers on columns [c0, c1) of st (cols, W) = S.T, in place: key key0 + r against
    row query0 + (c - c0) of the head's query array; with softcap, dcap (cols, W) gets the softcap's
    derivative 1 - tanh^2 there (column bounds: as modify)."""
    capped, sloped = head.softcap[0] > 0, head.slope[0] != 0
    if not (capped or sloped):
        return
    for r in range(st.shape[0]):
        row = st[r, c0:c1]
        if capped:
            row_dcap = dcap[r, c0:c1]
            for c in range(row.size):
                t = tanh(row[c] * head.softcap[1])
                row_dcap[c] = 1 - t * t
                row[c] = head.softcap[2] * t
        if sloped:
            _alibi_row(row, head.slope, head.first + query0 - key0 - r, 1)  # distance to row[c]: offset + c


@njit(cache=True, fastmath=FASTMATH)
def _alibi_row(row, slope, offset, step):
    """row[c] -= log2(e) slope |offset + step c|: ALiBi along a row whose distances move by ``step`` a column."""
    for c in range(row.size):
        row[c] = _alibi(slope, row[c], offset + step * c)


@njit(cache=True, fastmath=FASTMATH)
def modified(head, x, distance):
    """One base-2 score x with the modifiers of ``head``, at the signed query - key ``distance``: the panels'
    formula, in x's dtype."""
    return _alibi(head.slope, _capped(head.softcap, x) if head.softcap[0] > 0 else x, distance)


@njit(cache=True, fastmath=FASTMATH)
def _capped(softcap, x):
    """c log2(e) tanh(x ln 2 / c) (softcap: HeadModifiers.softcap, c > 0)."""
    return softcap[2] * tanh(x * softcap[1])


@njit(cache=True, fastmath=FASTMATH)
def _alibi(slope, x, distance):
    """x - slope |distance|: x itself for slope 0."""
    return x - slope[1] * like(x, abs(np.int32(distance)))  # int32: AVX2 converts it


@njit(cache=True, fastmath=FASTMATH)
def chain_softcap(head, ds, dcap):
    """Backward: ds (cols, n) of the capped scores -> of the raw scores, ds * (1 - tanh^2) from modify_t's
    dcap; a zero stays zero (masked pairs, whatever dcap holds there). Nothing to do without softcap."""
    if head.softcap[0] > 0:
        cols, n = ds.shape
        for r in range(cols):
            for c in range(n):
                x = ds[r, c]
                ds[r, c] = x * dcap[r, c] if x != 0 else x


# ------------------------------------------------------------------------------------------------
# Single scores of the exact path (float64, natural units)
# ------------------------------------------------------------------------------------------------
@njit(cache=True)
def exact_modified(head, s, distance):
    """A natural-units score s (float64) with the modifiers of ``head``, in float64: softcap
    ``c tanh(s / c)``, then ``- slope |distance|`` (distance: query position - key position)."""
    c, slope = head.softcap[0], head.slope[0]
    return (c * np.tanh(s / c) if c > 0 else s) - slope * abs(distance)


@njit(cache=True)
def exact_softcap_grad(head, s):
    """d softcap / d s at the natural-units score s, 1 - tanh(s / c)^2 in float64; 1 without softcap."""
    c = head.softcap[0]
    if c > 0:
        t = np.tanh(s / c)
        return 1.0 - t * t
    return 1.0
