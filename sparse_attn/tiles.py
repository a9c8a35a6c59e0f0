"""The tile core of the compiler: a rule's blocks for one (example, head), with one token tile evaluated per
signature, and tiles as packed bits.

>>> import sparse_attn as sa
>>> from sparse_attn.rules import Context, resolve
>>> ctx = Context(8, 8, 0)
>>> keys, full, tile, packed, cut = blocks_and_tiles(resolve(sa.Local(1), ctx), ctx, 4, (4, 4))
>>> keys.tolist(), full.tolist(), tile.tolist(), packed.shape          # 2 x 2 blocks of 4: all partial, 2 tiles
([0, 1, 2, 3], [False, False, False, False], [0, 2, 1, 0], (3, 4, 1))
"""
from __future__ import annotations

import numpy as np

from .blocks import block_areas, ceil_div, unique_rows
from .rules import Context, Rule, block_table

_TILE_ELEMENTS = 1 << 20  # token pairs evaluated at once when building tiles
_POPCOUNT = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(1)  # set bits of each byte


def blocks_and_tiles(rule: Rule, ctx: Context, bs: int, tile_shape: tuple[int, int], offset: int = 0,
                      keep_cut: bool = False):
    """Blocks of one (example, head): keys, full flags, tile ids of partial blocks, tiles (bits packed along
    the keys, as ``np.packbits(tile, axis=-1)``), and which blocks are cut (reach past the sequence's start
    or end).

    Partial blocks are grouped by signature (plus how they are cut by the sequence ends); one tile per
    group is evaluated at token level, then tiles that turn out all-allowed promote their blocks to full
    and all-empty ones drop them. ``offset``: the grid starts that many tokens before position 0 (a
    packed document, see :meth:`~sparse_attn.rules.BlockRanges.at`); ``keep_cut``: cut blocks keep their tile,
    never full, for a caller that merges them with the rest of their block.
    """
    keys, full, sig = block_table(rule, ctx, bs, offset)
    n_qb, n_kb = ceil_div(ctx.n_q + offset, bs), ceil_div(ctx.n_k + offset, bs)
    rows, cols = keys // n_kb, keys % n_kb
    cut = (((rows == 0) & (offset > 0)) * 8 + ((rows == n_qb - 1) & ((ctx.n_q + offset) % bs != 0)) * 4
           + ((cols == 0) & (offset > 0)) * 2 + ((cols == n_kb - 1) & ((ctx.n_k + offset) % bs != 0)))
    part = np.flatnonzero(~full | (keep_cut & (cut > 0)))
    first, group = unique_rows(np.column_stack([sig[part], cut[part]]))
    starts = rows[part][first] * bs - offset, cols[part][first] * bs - offset
    tiles = _tiles(rule, ctx, tile_shape, *starts)
    allowed = tiles.sum((1, 2))
    area = (np.minimum(starts[0] + bs, ctx.n_q) - np.maximum(starts[0], 0)) * (
        np.minimum(starts[1] + bs, ctx.n_k) - np.maximum(starts[1], 0))
    promote = (allowed == area) & ~(keep_cut & (cut[part][first] > 0))
    keep_tile = (allowed > 0) & ~promote
    new_id = np.cumsum(keep_tile) - 1
    keep = np.ones(len(keys), dtype=bool)
    keep[part] = allowed[group] > 0
    full = full.copy()
    full[part] = promote[group]
    tile = np.full(len(keys), -1, dtype=np.int64)
    tile[part] = np.where(keep_tile[group], new_id[group], -1)
    return keys[keep], full[keep], tile[keep], np.packbits(tiles[keep_tile], axis=-1), cut[keep] > 0


def _tiles(rule: Rule, ctx: Context, tile_shape: tuple[int, int], i0: np.ndarray, j0: np.ndarray) -> np.ndarray:
    """Token masks (n, tq, tk) of blocks starting at query row i0 and key j0 (negative before the sequence's
    start), False outside the sequence. Evaluated a few tile rows at a time, in bounded memory."""
    tq, tk = tile_shape
    out = np.zeros((len(i0) * tq, tk), dtype=bool)                      # every tile row, stacked
    cols = np.arange(tk, dtype=np.int64)
    rows_per_chunk = max(1, _TILE_ELEMENTS // tk)
    for s in range(0, len(out), rows_per_chunk):
        row = np.arange(s, min(s + rows_per_chunk, len(out)), dtype=np.int64)
        i = (i0[row // tq] + row % tq)[:, None]                        # (rows, 1) query rows
        j = j0[row // tq][:, None] + cols[None, :]                     # (rows, tk) keys
        inside = (i >= 0) & (i < ctx.n_q) & (j >= 0) & (j < ctx.n_k)
        positions = np.clip(i, 0, ctx.n_q - 1) + ctx.shift
        out[s:s + len(row)] = rule.allows(positions, np.clip(j, 0, ctx.n_k - 1)) & inside
    return out.reshape(len(i0), tq, tk)


def distinct_packed_tiles(packed: np.ndarray, tk: int) -> tuple[np.ndarray, np.ndarray]:
    """Deduplicate packed tiles (n, tq, ceil(tk / 8)) across examples and heads: (unique tiles as bool
    (m, tq, tk), old index -> new index)."""
    first, inverse = unique_rows(packed.reshape(len(packed), packed[0].size if len(packed) else 0))
    return np.unpackbits(packed[first], axis=-1, count=tk).astype(bool), inverse




def allowed_counts(packed: np.ndarray) -> np.ndarray:
    """The allowed pairs of each packed tile (n, tq, ceil(tk / 8)): (n,) int."""
    return _POPCOUNT[packed].sum((1, 2))


def allowed_pairs(rule: Rule, ctx: Context, block_size: int) -> int:
    """The token pairs ``rule`` allows for ``ctx`` (one example, one head), counted from its blocks and tiles as
    the compiler makes them (full blocks' areas, partial tiles' set bits): what the layout's ``allowed_pairs``
    counts, without building one (numpy only, no torch).

    >>> from sparse_attn.rules import resolve
    >>> import sparse_attn as sa
    >>> ctx = Context(100, 100, 0)
    >>> allowed_pairs(resolve(sa.Local(3), ctx), ctx, 16) == sa.Local(3).layout(100, block_size=16).allowed_pairs()
    True
    """
    step = min(block_size, max(ctx.n_q, ctx.n_k))                     # as the compiler compiles it
    tile_shape = (min(step, ctx.n_q), min(step, ctx.n_k))
    keys, full, tile, packed, _ = blocks_and_tiles(rule, ctx, step, tile_shape)
    n_kb = ceil_div(ctx.n_k, step)
    areas = block_areas(keys[full] // n_kb, keys[full] % n_kb, (step, step), (ctx.n_q, ctx.n_k))
    return int(areas.sum()) + int(allowed_counts(packed)[tile[~full]].sum())
