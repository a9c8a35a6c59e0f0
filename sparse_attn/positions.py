"""A pattern compiled at chosen positions of a sequence: the token mask and the layout of queries and keys
at any positions (a cache's new queries over its held keys, a left-padded batch whose positions count from each
example's start). Built from the token mask, in time and memory O(rows x keys).

>>> import sparse_attn as sa
>>> allowed_at_positions(sa.Local(1), Context(2, 10, 0), np.array([8, 9]), np.array([0, 8, 9])).astype(int).tolist()
[[[[0, 1, 1], [0, 1, 1]]]]
"""
from __future__ import annotations

import numpy as np
import torch

from .assembly import assemble_layout, distinct_tiles
from .blocks import ceil_div
from .checks import check_int, check_token_mask
from .layout import BlockLayout
from .rules import Context, resolve


def allowed_at_positions(pattern, context: Context, query_positions: np.ndarray, key_positions: np.ndarray,
                         heads: int = 1, key_padding_mask=None, starts=None) -> np.ndarray:
    """The token mask (B or 1, H or 1, rows, keys) of :func:`layout_at_positions`."""
    heads = check_int("heads", heads, 1)
    pattern.check_heads(heads)
    i, j = np.asarray(query_positions, dtype=np.int64)[:, None], np.asarray(key_positions, dtype=np.int64)[None, :]
    if starts is None:
        mask = _allowed(pattern, context, i, j, heads)[None]                          # (1, H or 1, rows, keys)
    else:
        starts = check_starts(starts, None)
        mask = np.zeros((len(starts), heads if pattern.head_dependent else 1, i.size, j.size), dtype=bool)
        for start in np.unique(starts):                    # each example's positions count from its start
            n_k = context.n_k - int(start)
            if n_k > 0:
                shifted = Context(max(1, min(context.n_q, n_k)), n_k, 0)
                mask[starts == start] = _allowed(pattern, shifted, i - start, j - start, heads)
    if key_padding_mask is not None:
        check_token_mask("key_padding_mask", key_padding_mask, None, j.size)
        padding = np.asarray(torch.as_tensor(key_padding_mask).cpu())                  # (B, keys)
        mask = mask & ~padding[:, None, None, :]                                        # (B, H or 1, rows, keys)
    return mask


def _allowed(pattern, context: Context, i: np.ndarray, j: np.ndarray, heads: int) -> np.ndarray:
    """(H or 1, rows, keys): the pattern at query positions i (rows, 1) and key positions j (1, keys); a
    negative position (padding before an example's start) is never allowed."""
    real = (i >= 0) & (j >= 0)
    return np.stack([resolve(pattern, context._replace(head=h)).allows(i, j) & real
                     for h in range(heads if pattern.head_dependent else 1)])


def check_starts(starts, batch: int | None) -> np.ndarray:
    """Each example's first token, (B,) int64 numpy; ``batch`` (None: any) is B.

    >>> check_starts([0, 3], 2).tolist()
    [0, 3]
    """
    if isinstance(starts, torch.Tensor):
        starts = starts.cpu().numpy()
    array = np.asarray(starts)
    shape = "(batch,)" if batch is None else f"({batch},)"
    if array.dtype.kind not in "iu" or array.ndim != 1 or len(array) == 0 or batch not in (None, len(array)) or \
            (array < 0).any():
        raise ValueError(f"starts must be ints >= 0 of shape {shape}, one per example (its first token's position), "
                         f"got {starts!r}")
    return array.astype(np.int64)


def layout_at_positions(pattern, context: Context, query_positions: np.ndarray, key_positions: np.ndarray,
                        heads: int = 1, block_size: int = 64, key_padding_mask=None, starts=None) -> BlockLayout:
    """The layout of queries and keys at chosen positions of a sequence: row r is the query at
    ``query_positions[r]``, column c the key at ``key_positions[c]`` (any order, gaps allowed), and a pair
    is allowed iff ``pattern``, resolved for ``context`` (the whole sequence's n_q and n_k), allows those
    positions (and ``key_padding_mask``, (B, keys) bool, True = padding, does not mask the key); with
    ``starts``, (B,) ints, example b's positions count from ``starts[b]`` (a left-padded batch). Built from
    the token mask, in time and memory O(rows x keys): for a cache's new queries over its held keys.

    >>> import sparse_attn as sa
    >>> lay = layout_at_positions(sa.Local(2, 0) | sa.Sink(first=1), Context(1, 100, 0), np.array([99]),
    ...                           np.array([0, 97, 98, 99, 50]), block_size=4)
    >>> lay.to_dense()[0, 0].int().tolist()
    [[1, 1, 1, 1, 0]]
    """
    heads, block_size = check_int("heads", heads, 1), check_int("block_size", block_size, 1)
    mask = allowed_at_positions(pattern, context, query_positions, key_positions, heads, key_padding_mask, starts)
    return layout_of_mask(mask, heads, block_size, pattern)


def layout_of_mask(mask: np.ndarray, heads: int, block_size: int, pattern) -> BlockLayout:
    """The BlockLayout of a token mask (Bl, Hl, n_q, n_k): blocks with every pair allowed are full, the
    others with any pair are partial with their own tile (equal tiles stored once)."""
    n_groups, (n_q, n_k), bs = mask.shape[0] * mask.shape[1], mask.shape[2:], block_size
    n_qb, n_kb, tq, tk = ceil_div(n_q, bs), ceil_div(n_k, bs), min(bs, n_q), min(bs, n_k)
    padded = np.zeros((n_groups, n_qb * tq, n_kb * tk), dtype=bool)
    padded[:, :n_q, :n_k] = mask.reshape(n_groups, n_q, n_k)
    tiles = padded.reshape(n_groups, n_qb, tq, n_kb, tk).swapaxes(2, 3)                  # (G, n_qb, n_kb, tq, tk)
    count = tiles.sum((3, 4))
    rows_in = np.minimum(tq, n_q - np.arange(n_qb) * tq)
    area = rows_in[:, None] * np.minimum(tk, n_k - np.arange(n_kb) * tk)[None, :]          # (n_qb, n_kb)
    full, part = count == area, (count > 0) & (count < area)
    part_tiles = tiles[part]                                                             # (n_part, tq, tk)
    masks, tile_of = distinct_tiles(part_tiles)
    g, r, c = np.nonzero(full | part)                                                    # sorted by (g, r, c)
    return assemble_layout(pattern, n_q=n_q, n_k=n_k, heads=heads, block_size=block_size, causal=False,
                           shape=mask.shape[:2], blocks_per_side=(n_qb, n_kb), group=g, rows=r, cols=c,
                           full=full[g, r, c], part_tile=tile_of, masks=masks)
