"""Walking a block's Segment in panels: the pieces the forward and the backward kernels share.

A *panel* is up to ``config.panel_blocks`` blocks of a query block's key blocks (or, in the backward, of a
key block's query blocks), full and partial merged in order; a *run* is a stretch of consecutive blocks
in it, one matmul. Also the workers' shared scratch pieces and a finiteness check.

>>> from sparse_attn.backends.numba.panels import panel_capacity
>>> panel_capacity(64, 5000), panel_capacity(64, 100)
(2048, 100)
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .bundles import ForwardResult, Panel, Segment
from .lowlevel import FASTMATH

PANEL_KEYS = 2048  # keys (or queries, in the backward) per score panel: a causal window of 1024 keys in one panel


def panel_capacity(block_size: int, n: int) -> int:
    """The most columns a panel of a sequence of n tokens holds (as the kernels size their scratch)."""
    return min(max(1, PANEL_KEYS // block_size) * block_size, n)


@njit(cache=True, fastmath=FASTMATH)
def next_panel(blocks, panel, panel_blocks):
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
def has_blocks(blocks):
    """Whether a Segment has a block left."""
    return blocks.full.size > 0 or blocks.partial.size > 0


@njit(cache=True, fastmath=FASTMATH)
def run_at(blocks, t0, count, block_size, n):
    """The run of consecutive blocks starting at panel position t0: (end position t1, first token,
    token count), clipped to the sequence length n. Its columns in the panel start at t0 * block_size."""
    t1 = t0 + 1
    while t1 < count and blocks[t1] == blocks[t1 - 1] + 1:
        t1 += 1
    start = blocks[t0] * block_size
    return t1, start, min(blocks[t1 - 1] * block_size + block_size, n) - start


@njit(cache=True, fastmath=FASTMATH)
def run_span(t0, t1, n, tiles, spans):
    """[lo, hi) of a run's n tokens to compute: a single partial block's tile span, else all."""
    if t1 == t0 + 1 and tiles[t0] >= 0:
        return spans[tiles[t0], 0], min(spans[tiles[t0], 1], n)
    return 0, n


@njit(cache=True, fastmath=FASTMATH)
def panel_rows(tiles, count, row_spans, rows):
    """[r0, r1) of a block's ``rows`` rows that a panel's blocks allow any key to: all of them if one block is
    full, else the union of its tiles' row spans (past the band, the panels of a Longformer query block that
    holds global tokens allow only those rows); r0 >= r1 if no tile allows anything."""
    r0, r1 = rows, 0
    for t in range(count):
        tile = tiles[t]
        if tile < 0:
            return 0, rows
        if row_spans[tile, 1] > row_spans[tile, 0]:
            r0 = min(r0, row_spans[tile, 0])
            r1 = max(r1, row_spans[tile, 1])
    return r0, min(r1, rows)


@njit(cache=True, fastmath=FASTMATH)
def panel_width(blocks, count, block_size, n):
    """Columns of a panel of ``count`` blocks: only the sequence's last block may be short (and it
    comes last)."""
    return (count - 1) * block_size + min(block_size, n - blocks[count - 1] * block_size)


@njit(cache=True, fastmath=FASTMATH)
def panel_view(buffer, rows, width):
    """A (rows, width) C-contiguous view of a flat scratch buffer."""
    return buffer[:rows * width].reshape((rows, width))


@njit(cache=True, fastmath=FASTMATH)
def mask_panel(s, tiles, count, block_size, masks, row0):
    """-inf where a partial block's tile is False. s: (rows, W) scores of the panel's blocks along columns,
    for the walking block's rows from ``row0`` on (queries of a query block, or keys of a key block in the
    backward); masks: the BlockIndex's, rows first, so tile[row0 + i, j] applies to s[i, offset + j]."""
    rows, width = s.shape
    for t in range(count):
        tile_id = tiles[t]
        if tile_id < 0:
            continue
        tile = masks[tile_id]
        off = t * block_size
        n = min(block_size, width - off)
        for i in range(rows):
            s_row, allowed = s[i, off:off + n], tile[row0 + i, :n]          # 1-D slices: the loop vectorises
            for j in range(n):
                s_row[j] = s_row[j] if allowed[j] else -np.inf




@njit(cache=True)
def panel_scratch(config):
    """A Panel for up to config.panel_blocks blocks."""
    return Panel(np.empty(config.panel_blocks, np.int64), np.empty(config.panel_blocks, np.int64))


@njit(cache=True)
def result_rows(result, b, h, rows):
    """The ForwardResult of example b, head h, rows ``rows`` (a slice)."""
    return ForwardResult(result.out[b, h, rows], result.lse[b, h, rows], result.row_max[b, h, rows],
                         result.log2_sum[b, h, rows], result.argmax[b, h, rows])



@njit(cache=True, fastmath=False)
def all_finite(x):
    """Whether no value of the 2-D array x is NaN or inf (false for both in the comparison; no early
    exit, so the loop vectorises)."""
    finite = True
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            finite &= abs(x[i, j]) < np.inf
    return finite
