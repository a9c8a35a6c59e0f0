"""Sequence lengths and block arithmetic, shared by the rules, the compiler and ``BlockLayout``.

>>> ceil_div(100, 16)                                     # blocks of 16 tokens in 100 tokens
7
>>> first, last = block_bounds(np.arange(7), 16, 100)     # the last block is cut at the end
>>> first.tolist(), last.tolist()
([0, 16, 32, 48, 64, 80, 96], [15, 31, 47, 63, 79, 95, 99])

A sequence of ``n`` tokens is cut into blocks of ``size`` tokens; block ``r`` holds tokens
``r * size .. min((r + 1) * size, n) - 1``. Numpy only (no torch), so the pattern modules can use it.
Callers keep ``size`` at most the sequence length (a larger block is one block of the whole
sequence), so every product here stays in int64.
"""
from __future__ import annotations

import numpy as np

from .checks import check_int

MAX_LENGTH = 2**31 - 1  # n_q, n_k: block indices are int32, and positions times block sizes stay in int64


def check_lengths(n_q: int, n_k: int | None) -> tuple[int, int]:
    """``(n_q, n_k)`` as checked Python ints, ``n_k`` defaulting to ``n_q``.

    >>> check_lengths(8, None)
    (8, 8)
    """
    n_q = check_int("n_q", n_q, 1, MAX_LENGTH)
    return n_q, n_q if n_k is None else check_int("n_k", n_k, 1, MAX_LENGTH)


def ceil_div(a, b):
    """``ceil(a / b)`` for ints or int arrays, exactly (no float rounding)."""
    return -(-a // b)


def block_bounds(index, size: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """First and last token (inclusive) of blocks ``index`` of ``size`` tokens in ``n`` tokens."""
    return index * size, np.minimum((index + 1) * size, n) - 1


def block_areas(rows, cols, tile_shape: tuple[int, int], lengths: tuple[int, int]) -> np.ndarray:
    """Token pairs inside blocks (rows[k], cols[k]) of ``tile_shape`` = (tq, tk) tokens, in sequences of
    ``lengths`` = (n_q, n_k): blocks of the last row or column are cut at the sequence ends.

    >>> block_areas(np.array([0, 6]), np.array([6, 6]), (16, 16), (100, 100)).tolist()
    [64, 16]
    """
    (tq, tk), (n_q, n_k) = tile_shape, lengths
    row_first, row_last = block_bounds(rows, tq, n_q)
    col_first, col_last = block_bounds(cols, tk, n_k)
    return (row_last - row_first + 1) * (col_last - col_first + 1)


def unique_rows(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of a 2-D array: (index of each one's first occurrence, row -> its distinct row's number).
    Rows are compared as raw bytes (one sort of byte strings, much faster than ``np.unique(axis=0)``)."""
    matrix = np.ascontiguousarray(matrix)
    rows = matrix.view(np.dtype((np.void, matrix.dtype.itemsize * matrix.shape[1]))).reshape(-1)
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)
