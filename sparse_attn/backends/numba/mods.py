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
i' = i + (n_k - n_q). Without modifiers the Config's softcap and slopes are None, ``head_modifiers`` gives
None, and every function here is a no-op that Numba compiles away (the kernels specialise on the types),
so the unmodified kernels are the ones without this module; softcap alone and ALiBi alone are their own
specialisations too.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from numba import types
from numba.extending import overload

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

    softcap: np.float64 | None   # c > 0; None: no softcap
    slopes: np.ndarray | None    # (B or 1, Hq) ALiBi slopes in the dtype computed in; None: no ALiBi
    shift: int                   # n_k - n_q: query row i sits at key position i + shift


class HeadModifiers(NamedTuple):
    """The modifiers of one (example, query head): natural units in float64 for the exact path, base-2
    units in the dtype computed in for the panels."""

    softcap: tuple | None        # (c, ln 2 / c, c log2(e)): x <- c log2(e) tanh(x ln 2 / c); None: no softcap
    slope: tuple | None          # (slope in float64, log2(e) slope); None: no ALiBi
    first: int                   # the key-sequence position of row 0 of the query array the kernel holds


def call_modifiers(softcap: float, slopes: torch.Tensor | None, dtype: torch.dtype, n_q: int,
                   n_k: int) -> ScoreModifiers:
    """The kernels' ScoreModifiers of a call computed in ``dtype`` (float32 or float64); without modifiers
    (softcap 0, no slopes) both are None and the kernels compile as if modifiers did not exist. The softcap
    is clipped to ``_SOFTCAP_RANGE`` of the dtype."""
    low, high = _SOFTCAP_RANGE[dtype]
    return ScoreModifiers(np.float64(min(max(softcap, low), high)) if softcap else None,
                          None if slopes is None else slopes.to(dtype).contiguous().numpy(), n_k - n_q)


def head_modifiers(config, b, h, first):
    """The HeadModifiers of example b, query head h, for a query array whose row 0 is query ``first``, from
    a ``bundles.Config``; None without modifiers."""


@overload(head_modifiers)
def _head_modifiers(config, b, h, first):
    if all(isinstance(_field(config, name), types.NoneType) for name in ("softcap", "slopes")):
        return lambda config, b, h, first: None
    return lambda config, b, h, first: HeadModifiers(_head_softcap(config.softcap, config.scale),
                                                     _head_slope(config.slopes, config.scale, b, h),
                                                     first + config.shift)


def shifted(head, rows):
    """The HeadModifiers of the same query array from its row ``rows`` on (None stays None)."""


@overload(shifted)
def _shifted(head, rows):
    if isinstance(head, types.NoneType):
        return lambda head, rows: None
    return lambda head, rows: HeadModifiers(head.softcap, head.slope, head.first + rows)


def _field(tuple_type, name):
    """The type of field ``name`` of a NamedTuple type (typing time, for the overloads)."""
    return tuple_type.types[tuple_type.fields.index(name)]


def _head_softcap(softcap, template):
    """(c, ln 2 / c, c log2(e)), the last two in template's dtype, or None."""


@overload(_head_softcap)
def _head_softcap_impl(softcap, template):
    if isinstance(softcap, types.NoneType):
        return lambda softcap, template: None
    return lambda softcap, template: (softcap, like(template, _LN2 / softcap), like(template, softcap * _LOG2E))


def _head_slope(slopes, template, b, h):
    """(slopes[b or 0, h] in float64, log2(e) times it in template's dtype), or None."""


@overload(_head_slope)
def _head_slope_impl(slopes, template, b, h):
    if isinstance(slopes, types.NoneType):
        return lambda slopes, template, b, h: None

    def impl(slopes, template, b, h):
        slope = np.float64(slopes[0 if slopes.shape[0] == 1 else b, h])
        return slope, like(template, slope * _LOG2E)
    return impl


def _has_softcap(head_type) -> bool:
    """Whether a HeadModifiers type (or None's) holds a softcap: typing time, for the overloads."""
    return not isinstance(head_type, types.NoneType) and not isinstance(_field(head_type, "softcap"), types.NoneType)


# ------------------------------------------------------------------------------------------------
# Panels of the fast path
# ------------------------------------------------------------------------------------------------
def modify(head, s, c0, c1, key0):
    """Forward: the modifiers on columns [c0, c1) of s (rows, W) base-2 scores, in place: row r of the
    head's query array (at key position head.first + r) against key key0 + (c - c0). No-op for head None.
    (Column bounds rather than a column slice of the panel: a slice of a C-contiguous row keeps unit stride,
    so the loop over it vectorises.)"""


@overload(modify, fastmath=FASTMATH)  # type: ignore[call-arg]  # numba: jit options as **kwargs
def _modify(head, s, c0, c1, key0):
    if isinstance(head, types.NoneType):
        return lambda head, s, c0, c1, key0: None

    def impl(head, s, c0, c1, key0):
        for r in range(s.shape[0]):
            row = s[r, c0:c1]
            offset = head.first + r - key0                   # distance to row[c]: |offset - c|
            for c in range(row.size):
                row[c] = modified(head, row[c], offset - c)
    return impl


def modify_t(head, st, c0, c1, key0, query0, dcap):
    """Backward: the modifiers on columns [c0, c1) of st (cols, W) = S.T, in place: key key0 + r against
    row query0 + (c - c0) of the head's query array; with softcap, dcap (cols, W) gets the softcap's
    derivative 1 - tanh^2 there (column bounds: as modify)."""


@overload(modify_t, fastmath=FASTMATH)  # type: ignore[call-arg]  # numba: jit options as **kwargs
def _modify_t(head, st, c0, c1, key0, query0, dcap):
    if isinstance(head, types.NoneType):
        return lambda head, st, c0, c1, key0, query0, dcap: None

    def impl(head, st, c0, c1, key0, query0, dcap):
        for r in range(st.shape[0]):
            row, row_dcap = st[r, c0:c1], dcap[r, c0:c1]
            offset = head.first + query0 - key0 - r           # distance to row[c]: |offset + c|
            for c in range(row.size):
                row[c] = _modified_t(head.softcap, head.slope, row[c], offset + c, row_dcap, c)
    return impl


def modified(head, x, distance):
    """One base-2 score x with the modifiers of ``head`` (x itself for None), at the signed query - key
    ``distance``: the panels' formula, in x's dtype."""


@overload(modified, fastmath=FASTMATH)  # type: ignore[call-arg]  # numba: jit options as **kwargs
def _modified(head, x, distance):
    if isinstance(head, types.NoneType):
        return lambda head, x, distance: x
    return lambda head, x, distance: _alibi(head.slope, _capped(head.softcap, x), distance)


def position(head, row):
    """The key-sequence position of row ``row`` of the head's query array (0 for None: no modifier reads it)."""


@overload(position)
def _position(head, row):
    if isinstance(head, types.NoneType):
        return lambda head, row: 0
    return lambda head, row: head.first + row


def _modified_t(softcap, slope, x, distance, dcap, c):
    """modified(), writing dcap[c] = 1 - tanh^2 with softcap."""


@overload(_modified_t, fastmath=FASTMATH)  # type: ignore[call-arg]  # numba: jit options as **kwargs
def _modified_t_impl(softcap, slope, x, distance, dcap, c):
    if isinstance(softcap, types.NoneType):
        return lambda softcap, slope, x, distance, dcap, c: _alibi(slope, x, distance)

    def impl(softcap, slope, x, distance, dcap, c):
        t = tanh(x * softcap[1])
        dcap[c] = 1 - t * t
        return _alibi(slope, softcap[2] * t, distance)
    return impl


def _capped(softcap, x):
    """c log2(e) tanh(x ln 2 / c), or x without softcap."""


@overload(_capped, fastmath=FASTMATH)  # type: ignore[call-arg]  # numba: jit options as **kwargs
def _capped_impl(softcap, x):
    if isinstance(softcap, types.NoneType):
        return lambda softcap, x: x
    return lambda softcap, x: softcap[2] * tanh(x * softcap[1])


def _alibi(slope, x, distance):
    """x - slope |distance|, or x without ALiBi."""


@overload(_alibi, fastmath=FASTMATH)  # type: ignore[call-arg]  # numba: jit options as **kwargs
def _alibi_impl(slope, x, distance):
    if isinstance(slope, types.NoneType):
        return lambda slope, x, distance: x
    return lambda slope, x, distance: x - slope[1] * like(x, abs(np.int32(distance)))  # int32: AVX2 converts it


def chain_softcap(head, ds, dcap):
    """Backward: ds (cols, n) of the capped scores -> of the raw scores, ds * (1 - tanh^2) from modify_t's
    dcap; a zero stays zero (masked pairs, whatever dcap holds there). No-op without softcap."""


@overload(chain_softcap, fastmath=FASTMATH)  # type: ignore[call-arg]  # numba: jit options as **kwargs
def _chain_softcap(head, ds, dcap):
    if not _has_softcap(head):
        return lambda head, ds, dcap: None

    def impl(head, ds, dcap):
        cols, n = ds.shape
        for r in range(cols):
            for c in range(n):
                x = ds[r, c]
                ds[r, c] = x * dcap[r, c] if x != 0 else x
    return impl


# ------------------------------------------------------------------------------------------------
# Single scores of the exact path (float64, natural units)
# ------------------------------------------------------------------------------------------------
def exact_modified(head, s, distance):
    """A natural-units score s (float64) with the modifiers of ``head``, in float64: softcap
    ``c tanh(s / c)``, then ``- slope |distance|`` (distance: query position - key position)."""


@overload(exact_modified)
def _exact_modified(head, s, distance):
    if isinstance(head, types.NoneType):
        return lambda head, s, distance: s
    return lambda head, s, distance: _exact_alibi(head.slope, _exact_capped(head.softcap, s), distance)


def exact_softcap_grad(head, s):
    """d softcap / d s at the natural-units score s, 1 - tanh(s / c)^2 in float64; 1 without softcap."""


@overload(exact_softcap_grad)
def _exact_softcap_grad(head, s):
    if not _has_softcap(head):
        return lambda head, s: 1.0

    def impl(head, s):
        t = np.tanh(s / head.softcap[0])
        return 1.0 - t * t
    return impl


def _exact_capped(softcap, s):
    """c tanh(s / c) in float64, or s."""


@overload(_exact_capped)
def _exact_capped_impl(softcap, s):
    if isinstance(softcap, types.NoneType):
        return lambda softcap, s: s
    return lambda softcap, s: softcap[0] * np.tanh(s / softcap[0])


def _exact_alibi(slope, s, distance):
    """s - slope |distance| in float64, or s."""


@overload(_exact_alibi)
def _exact_alibi_impl(slope, s, distance):
    if isinstance(slope, types.NoneType):
        return lambda slope, s, distance: s
    return lambda slope, s, distance: s - slope[0] * abs(distance)
