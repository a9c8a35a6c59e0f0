"""Work items for a block-sparse grid: each row of a layout (or column, for dK/dV) as one or more pieces,
longest first, so that no program runs far longer than the rest.

>>> import numpy as np
>>> counts = np.array([[[2, 9, 3]]])          # (Bl, Hl, n_rows): computed blocks of each row
>>> plan = split_rows(counts, piece=4)
>>> plan.items.tolist()                       # (row, start, end, slot, b, h), longest first
[[1, 0, 3, 0, 0, 0], [1, 3, 6, 1, 0, 0], [1, 6, 9, 2, 0, 0], [2, 0, 3, -1, 0, 0], [0, 0, 2, -1, 0, 0]]
>>> plan.splits.tolist()                      # (row, first slot, pieces, b, h) of each split row
[[1, 0, 3, 0, 0]]

Why: a program walks one row's key blocks. In a Longformer layout most rows hold ~10 blocks but the
rows of global tokens hold every block (512 at 32K tokens, 16K at 1M), and a grid is only as fast
as its slowest program: one 512-block row takes as long as the whole rest of the pass. Here a row
longer than ``piece`` blocks becomes near-equal pieces; each piece writes a partial result into its
``slot`` of a scratch buffer and a second, small kernel merges the pieces of each split row (by
log-sum-exp for the forward output, by summing for gradients), in a fixed order: deterministic.
Items are sorted by length, longest first (stable, so equal rows keep their order and neighbouring
programs share key blocks in cache): the long pieces start at once, the short rows fill in behind.

A row's blocks are its full blocks then its partial ones; an item's ``[start, end)`` counts in that
order. ``b`` and ``h`` are the layout's example and head (0 where the layout shares them); a kernel
adds the example and head of the program's place in the broadcast (``fanout``) to them.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

MIN_PIECE_BLOCKS = 16   # no row is cut into pieces shorter than this: a piece pays a write and a merge


class WorkPlan(NamedTuple):
    items: np.ndarray    # (n_items, 6) int32: row, start, end, slot (-1: the row is a single piece), b, h
    splits: np.ndarray   # (n_split_rows, 5) int32: row, first slot, number of pieces (slots first..), b, h
    n_slots: int         # scratch slots: pieces of split rows


def piece_length(counts: np.ndarray, fanout: int, programs: int) -> int:
    """Blocks per piece for a pass over ``counts`` (Bl, Hl, n) repeated ``fanout`` times on a GPU that
    keeps about ``programs`` programs busy: the pass's work spread over that many programs, never under
    ``MIN_PIECE_BLOCKS``. A long row then costs at most a small share of the pass, and short passes
    (a decode step: one query row over thousands of keys) are split until they fill the GPU.

    >>> piece_length(np.full((1, 1, 512), 10), fanout=16, programs=1056)   # Longformer-like, 32K tokens
    78
    """
    work = int(counts.sum()) * fanout
    return max(MIN_PIECE_BLOCKS, -(-work // programs))


def split_rows(counts: np.ndarray, piece: int) -> WorkPlan:
    """The work items of a pass over ``counts`` (Bl, Hl, n): blocks per (example, head, row); rows with
    more than ``piece`` blocks are cut into near-equal pieces. Every row has at least one item (a row
    without blocks still writes its zero output)."""
    groups, heads, n = counts.shape
    count = counts.reshape(-1).astype(np.int64)                                   # (Bl * Hl * n,)
    pieces = np.maximum(1, -(-count // piece))
    owner = np.repeat(np.arange(count.size), pieces)                              # (n_items,) row of each item
    first_item = np.cumsum(pieces) - pieces
    k = np.arange(owner.size) - first_item[owner]                                 # piece number within its row
    start = k * count[owner] // pieces[owner]
    end = (k + 1) * count[owner] // pieces[owner]
    split = pieces[owner] > 1
    slot = np.full(owner.size, -1, dtype=np.int64)
    slot[split] = np.arange(int(split.sum()))                                     # a split row's slots are consecutive
    example, head, row = owner // (heads * n), owner // n % heads, owner % n
    items = np.stack([row, start, end, slot, example, head], 1)
    items = items[np.argsort(-(end - start), kind="stable")]
    split_rows = np.flatnonzero(pieces > 1)
    first_slot = np.cumsum(pieces[split_rows]) - pieces[split_rows]
    splits = np.stack([split_rows % n, first_slot, pieces[split_rows], split_rows // (heads * n),
                       split_rows // n % heads], 1)
    return WorkPlan(items.astype(np.int32), splits.astype(np.int32).reshape(-1, 5), int(split.sum()))


def column_counts(full_t_ptr: np.ndarray, part_t_ptr: np.ndarray, groups: int) -> np.ndarray:
    """Blocks per (example, kv head, key block) of the dK/dV pass, whose program for a kv head walks the
    transposed index of each of its ``groups`` query heads in turn: (Bl, 1, n_k_blocks) where the layout
    shares heads (each kv head walks the one list ``groups`` times), else (Bl, Hkv, n_k_blocks).

    >>> ptr = np.array([[[0, 2, 3], [3, 3, 4]]])        # (Bl=1, Hl=2, n_k_blocks + 1)
    >>> column_counts(ptr, np.zeros_like(ptr), groups=2).tolist()
    [[[2, 2]]]
    """
    counts = np.diff(full_t_ptr, axis=-1) + np.diff(part_t_ptr, axis=-1)           # (Bl, Hl, n_k_blocks)
    if counts.shape[1] == 1:
        return counts * groups
    return counts.reshape(counts.shape[0], -1, groups, counts.shape[2]).sum(2)


def row_counts(full_ptr: np.ndarray, part_ptr: np.ndarray) -> np.ndarray:
    """Blocks per (example, head, query block): (Bl, Hl, n_q_blocks)."""
    return np.diff(full_ptr, axis=-1) + np.diff(part_ptr, axis=-1)
