"""The layout compiler: a pattern, its sizes and call-time masks -> a :class:`~sparse_attn.layout.BlockLayout`.

>>> import sparse_attn as sa
>>> lay = build_layout(sa.Local(16) | sa.Global(first=1), 256, heads=2, block_size=64)
>>> lay.nnz_blocks, lay.masks.shape[0]                # blocks over both heads, distinct tiles
(28, 8)
>>> lay is (sa.Local(16) | sa.Global(first=1)).layout(256, heads=2)       # cached: what .layout returns
True

For each (example, head) the pattern is resolved into a rule (``sparse_attn.rules``) with that
example's call-time data; the rule lists its nonempty blocks with full flags and signatures; one
token tile per signature is evaluated, tiles that turn out all-allowed promote their blocks to full
and all-empty ones drop them; the tiles of every example and head are deduplicated, and the blocks
are assembled into the CSR index and its transpose. Work and memory follow the number of computed
blocks, never N x N.

Imports run one way: ``Pattern.layout`` imports this module lazily (it imports torch, which
``import sparse_attn`` must not); this module imports ``rules`` and ``layout`` and never ``pattern``:
it takes any spec the rules resolve and calls only its public ``check_heads`` and ``head_dependent``.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from ._host import host_only
from .blocks import block_areas, ceil_div, check_lengths
from .checks import check_bool, check_int, check_token_mask
from .layout import BlockLayout
from .rules import Context, Rule, block_table, resolve, with_call_data

_TILE_ELEMENTS = 1 << 20  # token pairs evaluated at once when building tiles
_INT32_MAX = 2**31 - 1


@host_only  # host-side numpy: under torch.compile a graph break, not a trace
def build_layout(pattern, n_q: int, n_k: int | None = None, heads: int = 1, block_size: int = 64, *,
                 causal: bool = False, global_mask=None, key_padding_mask=None, cache: bool = True) -> BlockLayout:
    """What :meth:`Pattern.layout` returns. Layouts are cached, call-time masks by their values, so every
    layer of a model called with the same padding shares one layout; ``cache=False`` builds anew (what
    a benchmark of the build times).

    Under ``torch.compile`` this is a graph break; for ``fullgraph=True`` build the layout outside
    the compiled function and pass it to ``sparse_attention``.
    """
    n_q, n_k = check_lengths(n_q, n_k)
    heads, block_size = check_int("heads", heads, 1), check_int("block_size", block_size, 1)
    causal = check_bool("causal", causal)
    pattern.check_heads(heads)
    check_call_masks(n_q, n_k, global_mask, key_padding_mask)
    global_mask, key_padding_mask = _mask_values("global_mask", global_mask), _mask_values("key_padding_mask",
                                                                                            key_padding_mask)
    if not cache:
        return _compile(pattern, n_q, n_k, heads, block_size, causal, global_mask, key_padding_mask)
    return _cached_layout(pattern, n_q, n_k, heads, block_size, causal, _Mask.of(global_mask),
                          _Mask.of(key_padding_mask))


def check_call_masks(n_q: int, n_k: int, global_mask, key_padding_mask, batch: int | None = None) -> None:
    """The call-time masks' types and shapes (``batch=None``: any batch, the same for both).

    >>> check_call_masks(4, 3, torch.zeros(1, 4, dtype=torch.bool), None)
    Traceback (most recent call last):
    ...
    ValueError: global_mask needs n_q == n_k (global tokens are rows and columns), got n_q=4, n_k=3
    """
    if global_mask is not None:
        check_token_mask("global_mask", global_mask, batch, n_q)
        if n_q != n_k:
            raise ValueError(f"global_mask needs n_q == n_k (global tokens are rows and columns), "
                             f"got n_q={n_q}, n_k={n_k}")
        batch = global_mask.shape[0]
    if key_padding_mask is not None:
        check_token_mask("key_padding_mask", key_padding_mask, batch, n_k)


def _mask_values(name: str, mask) -> np.ndarray | None:
    """A checked call-time mask as the numpy array its layout is built from."""
    if isinstance(mask, torch.Tensor):
        if mask.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor: its values, which decide the layout, cannot be read; pass "
                             f"a tensor with values (sparse_attention with meta q, k, v needs no layout)")
        mask = mask.detach().cpu().numpy()
    return mask


class _Mask(NamedTuple):
    """A call-time bool mask as a hashable value (its shape and packed bits), for the layout cache."""

    shape: tuple[int, int]
    bits: bytes

    @staticmethod
    def of(mask: np.ndarray | None) -> _Mask | None:
        return None if mask is None else _Mask(mask.shape, np.packbits(mask).tobytes())

    def array(self) -> np.ndarray:
        n = self.shape[0] * self.shape[1]
        return np.unpackbits(np.frombuffer(self.bits, np.uint8), count=n).astype(bool).reshape(self.shape)


@functools.lru_cache(maxsize=64)
def _cached_layout(pattern, n_q, n_k, heads, block_size, causal, global_mask: _Mask | None,
                   key_padding_mask: _Mask | None) -> BlockLayout:
    return _compile(pattern, n_q, n_k, heads, block_size, causal,
                    *(None if m is None else m.array() for m in (global_mask, key_padding_mask)))


def _compile(pattern, n_q, n_k, heads, block_size, causal, global_mask, key_padding_mask) -> BlockLayout:
    """The layout of checked arguments; the masks are bool numpy arrays (batch, n) or None."""
    # a block_size beyond both lengths means one block a side, as a block of max(n_q, n_k) does: compile
    # with that, so no cost and no intermediate depends on how large block_size is
    step = min(block_size, max(n_q, n_k))
    batch = next((m.shape[0] for m in (global_mask, key_padding_mask) if m is not None), None)
    n_heads = heads if pattern.head_dependent else 1
    tables, tiles = [], []
    for b in range(batch or 1):
        for h in range(n_heads):
            ctx = Context(n_q, n_k, h)
            positions = None if global_mask is None else np.flatnonzero(global_mask[b]).astype(np.int64)
            rule = with_call_data(resolve(pattern, ctx), positions, causal,
                                  None if key_padding_mask is None else key_padding_mask[b])
            keys, full, tile, masks = _blocks_and_tiles(rule, ctx, step)
            tables.append((keys, full, np.where(full, -1, tile + sum(len(t) for t in tiles))))
            tiles.append(masks)
    masks, remap = _unique_tiles(np.concatenate(tiles))
    n_kb = ceil_div(n_k, step)
    shape = (batch or 1, n_heads)
    group = np.concatenate([np.full(len(t[0]), g, dtype=np.int64) for g, t in enumerate(tables)])
    keys, full, tile = (np.concatenate(column) for column in zip(*tables))
    if len(keys) > _INT32_MAX:
        raise ValueError(f"the layout has {len(keys)} (example, head, block) entries, more than its int32 indices "
                         f"hold ({_INT32_MAX}); use a larger block_size (got {block_size})")
    rows, cols = keys // n_kb, keys % n_kb
    tensors = {}
    for kind, sel in (("full", full), ("part", ~full)):
        g, r, c = group[sel], rows[sel], cols[sel]
        t = remap[tile[sel]] if kind == "part" else None
        by_col = np.lexsort((r, c, g))
        tensors[f"{kind}_ptr"] = _ptr(g, r, shape, ceil_div(n_q, step))
        tensors[f"{kind}_idx"] = torch.from_numpy(c.astype(np.int32))
        tensors[f"{kind}_t_ptr"] = _ptr(g[by_col], c[by_col], shape, n_kb)
        tensors[f"{kind}_t_idx"] = torch.from_numpy(r[by_col].astype(np.int32))
        if t is not None:
            tensors["part_mask"] = torch.from_numpy(t.astype(np.int32))
            tensors["part_t_mask"] = torch.from_numpy(t[by_col].astype(np.int32))
    tensors["masks"] = torch.from_numpy(masks)
    return BlockLayout.trusted(pattern=pattern, n_q=n_q, n_k=n_k, heads=heads, block_size=block_size, causal=causal,
                               **tensors)


def _ptr(group: np.ndarray, row: np.ndarray, shape: tuple[int, int], n_rows: int) -> torch.Tensor:
    """CSR row pointers (shape..., n_rows + 1) for entries sorted by (group, row)."""
    counts = np.bincount(group * n_rows + row, minlength=shape[0] * shape[1] * n_rows).reshape(-1, n_rows)
    ptr = np.zeros((counts.shape[0], n_rows + 1), dtype=np.int64)
    ptr[:, 1:] = np.cumsum(counts, axis=1)
    ptr += np.concatenate([[0], np.cumsum(counts.sum(1))[:-1]])[:, None]
    return torch.from_numpy(ptr.reshape(*shape, n_rows + 1).astype(np.int32))


def _blocks_and_tiles(rule: Rule, ctx: Context, bs: int):
    """Blocks of one (example, head): keys, full flags, tile ids of partial blocks, tiles.

    Partial blocks are grouped by signature (plus whether they are cut by the sequence end); one
    tile per group is evaluated at token level, then tiles that turn out all-allowed promote their
    blocks to full and all-empty ones drop them.
    """
    keys, full, sig = block_table(rule, ctx, bs)
    n_qb, n_kb = ceil_div(ctx.n_q, bs), ceil_div(ctx.n_k, bs)
    rows, cols = keys // n_kb, keys % n_kb
    part = np.flatnonzero(~full)
    cut = ((rows[part] == n_qb - 1) & (ctx.n_q % bs != 0)) * 2 + ((cols[part] == n_kb - 1) & (ctx.n_k % bs != 0))
    _, first, group = np.unique(np.column_stack([sig[part], cut]), axis=0, return_index=True, return_inverse=True)
    group = group.reshape(-1)
    tiles = _tiles(rule, ctx, bs, rows[part][first] * bs, cols[part][first] * bs)
    allowed = tiles.sum((1, 2))
    area = block_areas(rows[part][first], cols[part][first], (bs, bs), (ctx.n_q, ctx.n_k))
    keep_tile = (allowed > 0) & (allowed < area)
    new_id = np.cumsum(keep_tile) - 1
    keep = np.ones(len(keys), dtype=bool)
    keep[part] = allowed[group] > 0
    full = full.copy()
    full[part] = allowed[group] == area[group]
    tile = np.full(len(keys), -1, dtype=np.int64)
    tile[part] = np.where(keep_tile[group], new_id[group], -1)
    return keys[keep], full[keep], tile[keep], tiles[keep_tile]


def _tiles(rule: Rule, ctx: Context, bs: int, i0: np.ndarray, j0: np.ndarray) -> np.ndarray:
    """Token masks (n, tq, tk) of blocks starting at query row i0 and key j0, False outside the sequence;
    tq = min(bs, n_q), tk = min(bs, n_k). Evaluated a few tile rows at a time, in bounded memory."""
    tq, tk = min(bs, ctx.n_q), min(bs, ctx.n_k)
    out = np.zeros((len(i0) * tq, tk), dtype=bool)                      # every tile row, stacked
    cols = np.arange(tk, dtype=np.int64)
    rows_per_chunk = max(1, _TILE_ELEMENTS // tk)
    for s in range(0, len(out), rows_per_chunk):
        row = np.arange(s, min(s + rows_per_chunk, len(out)), dtype=np.int64)
        i = (i0[row // tq] + row % tq)[:, None]                        # (rows, 1) query rows
        j = j0[row // tq][:, None] + cols[None, :]                     # (rows, tk) keys
        inside = (i < ctx.n_q) & (j < ctx.n_k)
        positions = np.minimum(i, ctx.n_q - 1) + ctx.shift
        out[s:s + len(row)] = rule.allows(positions, np.minimum(j, ctx.n_k - 1)) & inside
    return out.reshape(len(i0), tq, tk)


def _unique_tiles(tiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Deduplicate tiles across examples and heads: (unique tiles, old index -> new index)."""
    if len(tiles) == 0:
        return tiles, np.zeros(0, dtype=np.int64)
    packed = np.packbits(tiles.reshape(len(tiles), -1), axis=1)
    _, first, inverse = np.unique(packed, axis=0, return_index=True, return_inverse=True)
    return tiles[first], inverse.reshape(-1)
