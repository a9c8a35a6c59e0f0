"""The named bundles of arrays the Numba kernels pass around, and the layout's index as they walk it.

>>> import sparse_attn as sa
>>> from sparse_attn.backends.numba.bundles import block_index, segment
>>> lay = (sa.Local(64) | sa.Global(first=4)).layout(256, block_size=64)      # 4 blocks a side
>>> rows = block_index(*lay.index[:6], transposed=False)
>>> segment(rows, 0, 0, 2)                         # query block 2 of example 0, head 0: its key blocks
Segment(full=array([2], dtype=int32), partial=array([0, 1, 3], dtype=int32), tiles=array([1, 2, 0], dtype=int32))
>>> rows.spans[1].tolist()                         # tile 1 (key block 0, the global column): keys 0-3 only
[0, 4]

Numba jit functions take tuples and namedtuples of arrays like any argument, and LLVM sees the
arrays they hold as it sees separate ones; the bundles keep kernel signatures short and say what
travels together. Fields are numpy arrays (views of the torch tensors) and numpy scalars.

One rule: where bundles are in reach, the body of a ``prange`` loop only calls a function (a
worker) and writes nothing itself. Numba's parallel passes drop writes made in a prange body to an
array reached through a tuple's field (numba/numba#7135, open): they do not see that array as one
the loop may modify. Inside a called function they are ordinary writes.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from numba import njit


class BlockIndex(NamedTuple):
    """One direction of a layout's CSR index: per (example, head, block), the blocks it meets.

    Row index (the forward): a query block's key blocks, ``spans`` the keys each tile allows;
    transposed (the backward): a key block's query blocks, ``spans`` the queries. Shapes as in
    ``BlockLayout``: ``Bl``, ``Hl`` are 1 where examples or heads share the layout.
    """

    full_ptr: np.ndarray   # (Bl, Hl, n_blocks + 1) int32
    full_idx: np.ndarray   # (n_full,) int32, sorted within a block
    part_ptr: np.ndarray   # (Bl, Hl, n_blocks + 1) int32
    part_idx: np.ndarray   # (n_part,) int32, sorted within a block
    part_tile: np.ndarray  # (n_part,) int32: each partial block's tile in masks
    masks: np.ndarray      # (n_masks, rows, columns) bool: tile[query, key]; transposed, tile[key, query]
    spans: np.ndarray      # (n_masks, 2) int64: [first, last + 1) of each tile's allowed keys (or queries)
    row_spans: np.ndarray  # (n_masks, 2) int64: the same of its allowed queries (or keys): the walking block's rows


def block_index(full_ptr: torch.Tensor, full_idx: torch.Tensor, part_ptr: torch.Tensor, part_idx: torch.Tensor,
                part_tile: torch.Tensor, masks: torch.Tensor, transposed: bool) -> BlockIndex:
    """The BlockIndex of a layout's row index tensors (``transposed=False``) or transposed ones. Its masks
    have the walking block's tokens as rows (a transposed copy of the layout's for the transposed index), so
    that the kernels read a row of a tile contiguously in either direction."""
    walking = masks.transpose(1, 2).contiguous() if transposed else masks                 # (n_masks, rows, columns)
    return BlockIndex(full_ptr.numpy(), full_idx.numpy(), part_ptr.numpy(), part_idx.numpy(), part_tile.numpy(),
                      walking.numpy(), _tile_spans(walking, 1), _tile_spans(walking, 0))


def _tile_spans(masks: torch.Tensor, axis: int) -> np.ndarray:
    """(n_masks, 2) int64: the [first, last + 1) rows (axis 0) or columns (axis 1) of each tile with at
    least one allowed pair; a block alone in its run is computed only on that span (the global column's
    tile of a Longformer band row has 16 of 64 keys)."""
    active = np.asarray(masks.numpy().any(axis=2 - axis))                       # (n_masks, rows or columns)
    first = np.where(active.any(1), active.argmax(1), 0)
    last = np.where(active.any(1), active.shape[1] - active[:, ::-1].argmax(1), 0)
    return np.stack([first, last], 1).astype(np.int64)


class Segment(NamedTuple):
    """The blocks one block meets (views into a BlockIndex), each list sorted."""

    full: np.ndarray       # blocks with every pair allowed: no mask
    partial: np.ndarray    # blocks with a tile ...
    tiles: np.ndarray      # ... and the tile of each, in masks


@njit(cache=True)
def segment(index, b, h, block):
    """The Segment of block ``block`` of example ``b``, head ``h`` in a BlockIndex."""
    lb = 0 if index.full_ptr.shape[0] == 1 else b                               # the layout may be shared
    lh = 0 if index.full_ptr.shape[1] == 1 else h
    full_begin, full_end = index.full_ptr[lb, lh, block], index.full_ptr[lb, lh, block + 1]
    part_begin, part_end = index.part_ptr[lb, lh, block], index.part_ptr[lb, lh, block + 1]
    return Segment(index.full_idx[full_begin:full_end], index.part_idx[part_begin:part_end],
                   index.part_tile[part_begin:part_end])


@njit(cache=True)
def kv_example(b, kv_batch):
    """The example of k, v that query example ``b`` reads: ``b``, or 0 where k, v have batch 1 (one k, v
    shared by every example, never copied)."""
    return 0 if kv_batch == 1 else b


@njit(cache=True)
def query_examples(e, batch, kv_batch):
    """[start, stop) of the query examples that read example ``e`` of k, v: every one where k, v have batch 1."""
    return (0, batch) if kv_batch == 1 else (e, e + 1)


class Config(NamedTuple):
    """The sizes and scales of a call."""

    block_size: int
    panel_blocks: int      # blocks per panel (the backend's panel size in keys, or queries, // block_size)
    scale: np.floating     # the softmax scale, in the dtype computed in
    base2_scale: np.floating  # scale * log2(e): scores in base 2, for exp2
    softcap: np.float64          # mods.ScoreModifiers: the softcap c (0: none) ...
    slopes: np.ndarray           # ... ALiBi's (B or 1, Hq) slopes ((1, 0): none) ...
    shift: int                   # ... and n_k - n_q, query row i's offset to its key position


class ForwardResult(NamedTuple):
    """What the forward writes per query row, and the backward reads: (B, Hq, Nq, ...) arrays, or
    the rows of one query block (the leading dimensions indexed away)."""

    out: np.ndarray        # (..., Nq, D) in q's dtype (bf16: its bits, uint16)
    lse: np.ndarray        # (..., Nq) natural-log log-sum-exp; -inf for a row with no key
    row_max: np.ndarray    # (..., Nq) base-2 score maximum m; +inf for a row with no key
    log2_sum: np.ndarray   # (..., Nq) log2 of the row's sum of exp2(S - m)
    argmax: np.ndarray     # (..., Nq) int64: the key holding m; -1 for none


class Incoming(NamedTuple):
    """The gradient arriving at the forward's outputs: (B, Hq, Nq, ...) arrays, or one head's."""

    dout: np.ndarray       # (..., Nq, D) in q's dtype (bf16: its bits, uint16)
    dlse: np.ndarray       # (..., Nq)
    delta: np.ndarray      # (..., Nq) rowsum(dout * out) - dlse; 0 for a row with no key


class Gradients(NamedTuple):
    """What the backward writes. Worker w adds its dq terms to dq (w = 0) or dq_parts[w - 1]."""

    dq: np.ndarray         # (B, Hq, Nq, D)
    dq_parts: np.ndarray   # (workers - 1, B, Hq, Nq, D)
    dk: np.ndarray         # (Bkv, Hkv, Nk, D), Bkv = B or 1, in q's dtype (bf16: its bits, uint16)
    dv: np.ndarray         # (Bkv, Hkv, Nk, D), as dk


class KeyBlock(NamedTuple):
    """One key block of a kv head in the backward: its keys and values and the sums of its dk, dv."""

    start: int             # its first key
    k: np.ndarray          # (cols, D)
    v: np.ndarray          # (cols, D)
    dk: np.ndarray         # (cols, D) in the dtype computed in
    dv: np.ndarray         # (cols, D)


class Panel(NamedTuple):
    """Scratch for one panel: up to panel_blocks blocks of a Segment, merged in order."""

    blocks: np.ndarray     # (panel_blocks,) int64: the panel's blocks
    tiles: np.ndarray      # (panel_blocks,) int64: the tile of each, -1 for a full block


class ForwardScratch(NamedTuple):
    """A forward worker's buffers, sized by what a block and a panel can hold in this sequence."""

    scores: np.ndarray     # (rows * width,) the score panel S, then P
    acc: np.ndarray        # (rows, D) running output sum
    m: np.ndarray          # (rows,) running base-2 maximum
    l: np.ndarray          # (rows,) running sum of exp2(S - m)
    hits: np.ndarray       # (width,) int64: a row's columns that get exact scores (large logits)
    panel: Panel


class BackwardScratch(NamedTuple):
    """A backward worker's buffers: a key block against a panel of ``width`` queries."""

    scores: np.ndarray     # (cols * width,) S.T, then dS.T
    dscores: np.ndarray    # (cols * width,) dP.T, then P.T
    dcap: np.ndarray       # (cols * width,) with softcap: its derivative 1 - tanh^2 at S.T
    row_max: np.ndarray    # (width,) of the panel's queries, gathered from ForwardResult ...
    log2_sum: np.ndarray   # (width,)
    delta: np.ndarray      # (width,) ... and from Incoming
    lows: np.ndarray       # (width,) per query the lowest score made exact (+inf: none; large logits) ...
    hits: np.ndarray       # (width,) int64: ... and a row's columns that reach it
    pins: np.ndarray       # (2, width) int64: (panel column, query) of the rows whose maximum is in the block
    panel: Panel
