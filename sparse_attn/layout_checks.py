"""The checks of a hand-built :class:`~sparse_attn.layout.BlockLayout`: everything the kernels rely on.

>>> import sparse_attn as sa
>>> tensors = sa.Local(1).layout(4, block_size=2).index._asdict()
>>> checked = checked_tensors(tensors, n_q=4, n_k=4, heads=1, block_size=2)
>>> sorted(checked) == sorted(tensors), all(t.is_contiguous() for t in checked.values())
(True, True)
>>> checked_tensors({**tensors, "full_idx": tensors["full_idx"].long()}, n_q=4, n_k=4, heads=1, block_size=2)
Traceback (most recent call last):
...
TypeError: BlockLayout full_idx must be a torch.int32 tensor, got torch.int64

Each check raises a ValueError/TypeError naming the field, and returns values: nothing here changes a
layout. ``BlockLayout``'s constructor runs them; ``pattern.layout(...)`` builds consistent layouts and
skips them. This module imports neither ``layout`` nor any pattern module, so both can use it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np
import torch

from .blocks import ceil_div


class _Grid(NamedTuple):
    """The sizes a layout's tensors are checked against (``BlockLayout``'s properties of the same names)."""

    n_q: int
    n_k: int
    heads: int
    n_q_blocks: int
    n_k_blocks: int
    tile_shape: tuple[int, int]


class _Entries(NamedTuple):
    """(example * Hl + head, query block, key block, tile; -1 for a full block) of every block of one kind."""

    group: np.ndarray
    row: np.ndarray
    col: np.ndarray
    tile: np.ndarray


def check_pattern_like(pattern: object) -> None:
    """A layout keeps its pattern only to print it. ``layout`` sits below the pattern modules (the compiler
    imports it), so this checks for the Pattern interface rather than the class."""
    if pattern is not None and not all(callable(getattr(pattern, name, None)) for name in ("layout", "to_dict")):
        raise TypeError(f"BlockLayout pattern must be a sparse_attn Pattern, got {type(pattern).__name__}: {pattern!r}")


def check_tensor_names(tensors: Mapping[str, object], fields: Iterable[str]) -> None:
    """``tensors`` are named exactly ``fields`` (the kernel ABI's, in any order)."""
    names, fields = set(tensors), list(fields)
    if names != set(fields):
        raise TypeError(f"BlockLayout needs the tensors {fields}; missing "
                        f"{sorted(set(fields) - names)}, unexpected {sorted(names - set(fields))}")


def checked_tensors(tensors: Mapping[str, object], *, n_q: int, n_k: int, heads: int,
                    block_size: int) -> dict[str, torch.Tensor]:
    """``tensors`` (the 11 named in ``KernelIndex``) made contiguous, once everything the kernels rely on holds
    for a layout of these checked sizes; see ``BlockLayout``."""
    grid = _Grid(n_q, n_k, heads, ceil_div(n_q, block_size), ceil_div(n_k, block_size),
                 (min(block_size, n_q), min(block_size, n_k)))
    contiguous = _contiguous_on_one_device(tensors)
    host = {name: tensor.cpu().numpy() for name, tensor in contiguous.items()}
    _check_shapes(grid, host)
    full, part = _checked_entries(grid, host, "full"), _checked_entries(grid, host, "part")
    _check_full_and_partial_apart(full, part)
    _check_tiles_end_with_sequence(grid, host["masks"], part)
    return contiguous


def _contiguous_on_one_device(tensors: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """The tensors, contiguous (the kernels read flat memory), once their dtypes and device are right."""
    checked: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        expected = torch.bool if name == "masks" else torch.int32
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != expected:
            raise TypeError(f"BlockLayout {name} must be a {expected} tensor, got "
                            f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        checked[name] = tensor
    devices = {tensor.device for tensor in checked.values()}
    if len(devices) > 1:
        raise ValueError(f"BlockLayout tensors must be on one device, got {sorted(map(str, devices))}; "
                         "move them with .to()")
    return {name: tensor.contiguous() for name, tensor in checked.items()}


def _check_shapes(grid: _Grid, host: dict[str, np.ndarray]) -> None:
    groups = host["full_ptr"].shape[:2] if host["full_ptr"].ndim == 3 else None
    if groups is None or groups[0] < 1 or groups[1] not in (1, grid.heads):
        raise ValueError(f"BlockLayout full_ptr must have shape (Bl, Hl, n_q_blocks + 1) with Bl >= 1 and Hl 1 or "
                         f"heads={grid.heads}, got {host['full_ptr'].shape}")
    rows, cols = grid.n_q_blocks + 1, grid.n_k_blocks + 1
    expected = {"full_ptr": (*groups, rows), "part_ptr": (*groups, rows), "full_t_ptr": (*groups, cols),
                "part_t_ptr": (*groups, cols), "masks": (host["masks"].shape[0], *grid.tile_shape),
                "part_mask": host["part_idx"].shape, "part_t_mask": host["part_t_idx"].shape}
    for name, shape in expected.items():
        if host[name].shape != shape:
            raise ValueError(f"BlockLayout {name} must have shape {shape}, got {host[name].shape}")
    for name in ("full_idx", "part_idx", "full_t_idx", "part_t_idx"):
        if host[name].ndim != 1:
            raise ValueError(f"BlockLayout {name} must be one-dimensional, got shape {host[name].shape}")


def _checked_entries(grid: _Grid, host: dict[str, np.ndarray], kind: str) -> _Entries:
    """The ``kind`` ("full" or "part") blocks in row-index order, once both indices are checked and found to be
    transposes of each other."""
    n_masks, part = len(host["masks"]), kind == "part"
    tile = host["part_mask"] if part else np.full(len(host["full_idx"]), -1)
    tile_t = host["part_t_mask"] if part else np.full(len(host["full_t_idx"]), -1)
    if part and len(tile) and (min(tile.min(), tile_t.min()) < 0 or max(tile.max(), tile_t.max()) >= n_masks):
        raise ValueError(f"BlockLayout part_mask and part_t_mask must hold tile ids in [0, {n_masks}) "
                         "(the length of masks)")
    g, r = _csr_rows(f"{kind}_ptr", host[f"{kind}_ptr"], f"{kind}_idx", host[f"{kind}_idx"], grid.n_k_blocks)
    g_t, c_t = _csr_rows(f"{kind}_t_ptr", host[f"{kind}_t_ptr"], f"{kind}_t_idx", host[f"{kind}_t_idx"],
                         grid.n_q_blocks)
    r_t = host[f"{kind}_t_idx"]
    order = np.lexsort((c_t, r_t, g_t))  # the transposed entries in row-index order
    entries = _Entries(g, r, host[f"{kind}_idx"], tile)
    if len(order) != len(g) or not all(np.array_equal(a, b[order]) for a, b in zip(entries, (g_t, r_t, c_t, tile_t))):
        tiles, tiles_t = ("/part_mask", "/part_t_mask") if part else ("", "")
        raise ValueError(f"BlockLayout {kind}_t_ptr/{kind}_t_idx{tiles_t} must be exactly the transpose of "
                         f"{kind}_ptr/{kind}_idx{tiles}: the same (example, head, query block, key block"
                         f"{', tile' if part else ''}) entries, listed per key block")
    return entries


def _csr_rows(ptr_name: str, ptr: np.ndarray, idx_name: str, idx: np.ndarray,
              n_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(group, row) of every entry of a checked CSR index: groups are the flattened (example, head)."""
    flat = ptr.reshape(-1, ptr.shape[-1]).astype(np.int64)                     # (groups, n_rows + 1)
    chained = flat[0, 0] == 0 and np.array_equal(flat[1:, 0], flat[:-1, -1]) and flat[-1, -1] == len(idx)
    if not chained or (np.diff(flat, axis=1) < 0).any():
        raise ValueError(f"BlockLayout {ptr_name} must be non-decreasing row pointers into {idx_name}, from 0 to its "
                         f"length {len(idx)}, each (example, head) starting where the previous one ends")
    if len(idx) and (idx.min() < 0 or idx.max() >= n_cols):
        raise ValueError(f"BlockLayout {idx_name} must hold block indices in [0, {n_cols}), got values in "
                         f"[{idx.min()}, {idx.max()}]")
    n_rows = flat.shape[1] - 1
    row = np.repeat(np.arange(flat.shape[0] * n_rows), np.diff(flat, axis=1).reshape(-1))
    if ((row[1:] == row[:-1]) & (idx[1:] <= idx[:-1])).any():
        raise ValueError(f"BlockLayout {idx_name} must be sorted and without duplicates within each row")
    return row // n_rows, row % n_rows


def _check_full_and_partial_apart(full: _Entries, part: _Entries) -> None:
    """No (group, query block, key block) is listed both as a full and as a partial block."""
    g, r, c = (np.concatenate([a, b]) for a, b in zip(full[:3], part[:3]))
    order = np.lexsort((c, r, g))
    g, r, c = g[order], r[order], c[order]
    if ((g[1:] == g[:-1]) & (r[1:] == r[:-1]) & (c[1:] == c[:-1])).any():
        raise ValueError("BlockLayout lists a block both in full_idx and in part_idx; a block is full or partial")


def _check_tiles_end_with_sequence(grid: _Grid, masks: np.ndarray, part: _Entries) -> None:
    """Tiles of the last (shorter) block row or column must be False past the sequence end."""
    (tq, tk), last_row, last_col = grid.tile_shape, grid.n_q_blocks - 1, grid.n_k_blocks - 1
    rows_in, cols_in = grid.n_q - last_row * tq, grid.n_k - last_col * tk
    rows_outside = np.asarray(masks[:, rows_in:, :].any(axis=(1, 2)))                  # (n_masks,) per tile
    cols_outside = np.asarray(masks[:, :, cols_in:].any(axis=(1, 2)))
    outside = (rows_outside[part.tile] & (part.row == last_row)) | (cols_outside[part.tile] & (part.col == last_col))
    if outside.any():
        raise ValueError(f"BlockLayout masks[{part.tile[outside][0]}] allows pairs outside the sequence (query rows >= "
                         f"{grid.n_q} or keys >= {grid.n_k}) in a block of the last row or column; tiles must be "
                         f"False there")
