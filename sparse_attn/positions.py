"""A pattern compiled at chosen positions of a sequence: the token mask and the layout of queries and keys
at any positions (a cache's new queries over its held keys, a left-padded batch whose positions count from each
example's start). Built from the token mask, in time and memory O(rows x keys); and, without a mask, a
compiled layout run over only the keys a cache holds (:func:`over_held_keys`, a chunked prefill).

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


def over_held_keys(layout: BlockLayout,
                   key_positions: np.ndarray) -> tuple[BlockLayout, torch.Tensor, torch.Tensor] | None:
    """``layout`` (queries over the keys at positions 0 .. n_k - 1) run over only the keys a cache holds, at
    ``key_positions`` (n_held,), in the time of the layout's blocks: no token mask. Returns the layout with the
    key blocks it uses, renumbered in order, and ``(slots, held)``: compact key slot ``slots[m]`` takes held key
    ``held[m]`` (a position not held leaves its slot zero: no allowed pair reads it). None when the key blocks
    used are fewer than a tile is wide (one cut block: run the token mask instead).

    >>> import sparse_attn as sa
    >>> full = (sa.Local(3, 0) | sa.Sink(first=1)).layout(4, 40, block_size=8)   # 4 new queries, 40 keys
    >>> held = np.array([0, *range(33, 40)])                                      # a sink and the window
    >>> compact, slots, held_index = over_held_keys(full, held)
    >>> compact.n_k, slots.tolist(), held_index.tolist()                          # key blocks 0, 4 of 5
    (16, [0, 9, 10, 11, 12, 13, 14, 15], [0, 1, 2, 3, 4, 5, 6, 7])

    Raises a RuntimeError if an allowed pair needs a key that is not held (a cache that dropped too much).
    """
    bs, index = layout.block_size, layout.index
    used = np.union1d(index.full_idx.cpu().numpy(), index.part_idx.cpu().numpy())    # key blocks some pair reads
    tile_width = index.masks.shape[2]
    n_k = 0 if len(used) == 0 else (len(used) - 1) * bs + min(bs, layout.n_k - int(used[-1]) * bs)
    if n_k < tile_width or n_k <= 0:
        return None
    renumber = np.full(ceil_div(layout.n_k, bs), -1, dtype=np.int64)
    renumber[used] = np.arange(len(used))
    blocks = renumber[key_positions // bs]
    held = np.flatnonzero(blocks >= 0)                                               # held keys in used blocks
    slots = blocks[held] * bs + key_positions[held] % bs
    _check_held(layout, renumber, slots, len(used))
    ptr = {name: _kept_columns(getattr(index, name), used) for name in ("full_t_ptr", "part_t_ptr")}
    compact = BlockLayout.trusted(
        pattern=layout.pattern, n_q=layout.n_q, n_k=n_k, heads=layout.heads, block_size=bs, causal=layout.causal,
        **(index._asdict() | ptr | {name: torch.from_numpy(renumber[getattr(index, name).cpu().numpy()]).to(
            torch.int32) for name in ("full_idx", "part_idx")}))
    return compact, torch.from_numpy(slots), torch.from_numpy(held)


def _kept_columns(ptr: torch.Tensor, used: np.ndarray) -> torch.Tensor:
    """A transposed row pointer (Bl, Hl, n_kb + 1) with only the key blocks ``used`` (the others are empty)."""
    values = ptr.cpu().numpy()
    return torch.from_numpy(np.concatenate([values[..., used], values[..., -1:]], axis=-1))


def _check_held(layout: BlockLayout, renumber: np.ndarray, slots: np.ndarray, n_used: int) -> None:
    """Every key an allowed pair reads is held: full blocks wholly (up to the sequence's end), partial blocks
    in every column a tile allows."""
    bs, index = layout.block_size, layout.index
    in_slot = np.zeros(n_used * bs, dtype=bool)
    in_slot[slots] = True
    held = in_slot.reshape(n_used, bs)                                               # (used blocks, bs)
    last_width = layout.n_k - (np.flatnonzero(renumber >= 0)[-1] * bs)
    held[-1, last_width:] = True                                                     # past the end: no key
    full = renumber[index.full_idx.cpu().numpy()]
    read = np.asarray(index.masks.cpu().numpy().any(1))                              # (n_masks, tk) columns read
    tiles = read[index.part_mask.cpu().numpy()]                                       # (n_part, tk)
    part = held[renumber[index.part_idx.cpu().numpy()], :tiles.shape[1]]
    if not held[full].all() or (tiles & ~part).any():
        raise RuntimeError("a layout over held keys reads a key the cache no longer holds: the pattern's "
                           "retention dropped too much (please report this with the pattern)")
