"""Assembling a :class:`~sparse_attn.layout.BlockLayout` from its computed blocks: the one place its CSR
index and the transpose are built.

Three builders list blocks: the compiler (a pattern, ``sparse_attn.compiler``), the KV cache (a mask over the
held keys) and the shard plan (one rank's slice of a layout). Each hands this module its blocks, full or partial,
and the distinct token tiles of the partial ones.

>>> import numpy as np, sparse_attn as sa
>>> tiles, tile_of = distinct_tiles(np.tril(np.ones((2, 2, 2), dtype=bool)))       # two equal tiles: one kept
>>> layout = assemble_layout(sa.Causal(), n_q=4, n_k=4, heads=1, block_size=2, causal=False, shape=(1, 1),
...                          blocks_per_side=(2, 2), group=np.zeros(3, np.int64), rows=np.array([0, 1, 1]),
...                          cols=np.array([0, 0, 1]), full=np.array([False, True, False]), part_tile=tile_of,
...                          masks=tiles)
>>> layout.nnz_blocks, tuple(layout.masks.shape), bool((layout.to_dense() == sa.Causal().mask(4)).all())
(3, (1, 2, 2), True)
"""
from __future__ import annotations

import numpy as np
import torch

from .blocks import unique_rows
from .layout import BlockLayout, CallData

_INT32_MAX = 2**31 - 1


def assemble_layout(pattern, *, n_q: int, n_k: int, heads: int, block_size: int, causal: bool,
                    shape: tuple[int, int], blocks_per_side: tuple[int, int], group: np.ndarray, rows: np.ndarray,
                    cols: np.ndarray, full: np.ndarray, part_tile: np.ndarray, masks: np.ndarray,
                    call_data: CallData | None = None) -> BlockLayout:
    """The layout of computed blocks sorted by (group, row, col): each one's group (example * Hl + head, in a
    ``shape`` = (Bl, Hl) layout), block row and column, whether it is full, and for the partial ones (in the
    same order) their tile's index in ``masks`` (m, tq, tk) bool. ``blocks_per_side``: (query blocks, key
    blocks). The other arguments are the layout's own (see :meth:`BlockLayout.trusted`)."""
    if len(group) > _INT32_MAX:
        raise ValueError(f"the layout has {len(group)} (example, head, block) entries, more than its int32 indices "
                         f"hold ({_INT32_MAX}); use a larger block_size (got {block_size})")
    tensors = _csr_index(group, rows, cols, full, part_tile, shape, *blocks_per_side)
    tensors["masks"] = torch.from_numpy(np.ascontiguousarray(masks))
    return BlockLayout.trusted(pattern=pattern, n_q=n_q, n_k=n_k, heads=heads, block_size=block_size, causal=causal,
                               call_data=call_data, **tensors)


def distinct_tiles(tiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token tiles (n, tq, tk) stored once each: (the distinct tiles, tile -> its distinct tile's index)."""
    first, tile_of = unique_rows(tiles.reshape(len(tiles), tiles.shape[1] * tiles.shape[2]))
    return tiles[first], tile_of


def _csr_index(group: np.ndarray, rows: np.ndarray, cols: np.ndarray, full: np.ndarray, part_tile: np.ndarray,
              shape: tuple[int, int], n_q_blocks: int, n_k_blocks: int) -> dict[str, torch.Tensor]:
    """A BlockLayout's index tensors, all but ``masks`` (the arguments of ``assemble_layout``)."""
    tensors = {}
    for kind, sel in (("full", full), ("part", ~full)):
        g, r, c = group[sel], rows[sel], cols[sel]
        by_col = np.lexsort((r, c, g))
        tensors[f"{kind}_ptr"] = _ptr(g, r, shape, n_q_blocks)
        tensors[f"{kind}_idx"] = torch.from_numpy(c.astype(np.int32))
        tensors[f"{kind}_t_ptr"] = _ptr(g[by_col], c[by_col], shape, n_k_blocks)
        tensors[f"{kind}_t_idx"] = torch.from_numpy(r[by_col].astype(np.int32))
        if kind == "part":
            tensors["part_mask"] = torch.from_numpy(part_tile.astype(np.int32))
            tensors["part_t_mask"] = torch.from_numpy(part_tile[by_col].astype(np.int32))
    return tensors


def _ptr(group: np.ndarray, row: np.ndarray, shape: tuple[int, int], n_rows: int) -> torch.Tensor:
    """CSR row pointers (shape..., n_rows + 1) for entries sorted by (group, row)."""
    counts = np.bincount(group * n_rows + row, minlength=shape[0] * shape[1] * n_rows).reshape(-1, n_rows)
    ptr = np.zeros((counts.shape[0], n_rows + 1), dtype=np.int64)
    ptr[:, 1:] = np.cumsum(counts, axis=1)
    ptr += np.concatenate([[0], np.cumsum(counts.sum(1))[:-1]])[:, None]
    return torch.from_numpy(ptr.reshape(*shape, n_rows + 1).astype(np.int32))
