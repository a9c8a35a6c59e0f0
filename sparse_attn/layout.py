"""BlockLayout: a pattern compiled for (n_q, n_k, heads, block_size), the form kernels run.

>>> import sparse_attn as sa
>>> lay = (sa.Local(64) | sa.Global(first=1)).layout(512, heads=4, block_size=64)
>>> lay.nnz_blocks, round(lay.density, 3)
(136, 0.239)

The sequence is cut into blocks of ``block_size`` tokens (the last block may be shorter). Each
computed block (query block r, key block c) is either

- **full**: every pair in it is allowed, the kernel runs it without any mask, or
- **partial**: the kernel applies ``masks[m]``, a (block_size, block_size) bool tile that is exact
  at token level and False outside the sequence. Blocks with the same tile share one entry, so
  ``masks`` stays small (a Longformer layout at 1M tokens has a handful). A sequence shorter than
  ``block_size`` is one block, and its tiles are only as large as the sequence: building and storing
  a layout costs what the sequence needs, however large ``block_size`` is.

Blocks that are neither are never touched. Indices are CSR per (example, head, query block), and
transposed per (example, head, key block) for the dK/dV pass of the backward.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from ._host import host_only
from .checks import check_bool, check_int
from .pattern import Pattern, _check_lengths, check_pattern, _Ctx, _n_blocks, block_table, with_call_data

_GRID_MAX_BLOCKS = 64  # __str__ draws the block grid up to this many blocks a side
_TILE_ELEMENTS = 1 << 20  # token pairs evaluated at once when building tiles
_INT32_MAX = 2**31 - 1


class KernelIndex(NamedTuple):
    """The kernel ABI: a layout's tensors, in the order every backend takes them (``layout.index``).

    Field meanings, shapes and dtypes are in the table of :class:`BlockLayout`; a backend's custom op
    takes them as ``*layout.index``.
    """

    full_ptr: torch.Tensor
    full_idx: torch.Tensor
    part_ptr: torch.Tensor
    part_idx: torch.Tensor
    part_mask: torch.Tensor
    masks: torch.Tensor
    full_t_ptr: torch.Tensor
    full_t_idx: torch.Tensor
    part_t_ptr: torch.Tensor
    part_t_idx: torch.Tensor
    part_t_mask: torch.Tensor


class BlockLayout:
    """Kernel-ready block-sparse form of a pattern. Build with ``pattern.layout(...)``.

    Tensors (int32 unless noted), with ``Bl`` = 1 when all examples share the layout (else the
    batch size) and ``Hl`` = 1 when all heads share it (else ``heads``):

    ============== ====================== =================================================
    full_ptr       (Bl, Hl, n_q_blocks+1) row r's full key blocks are
                                          ``full_idx[full_ptr[b, h, r]:full_ptr[b, h, r+1]]``;
                                          each (b, h) starts where the previous one ends
    full_idx       (n_full,)              key-block indices, sorted within a row
    part_ptr       (Bl, Hl, n_q_blocks+1) the same for partial blocks ...
    part_idx       (n_part,)
    part_mask      (n_part,)              ... and the index of each one's tile in ``masks``
    masks          (n_masks, tq, tk) bool token mask of a partial block, False outside the
                                          sequence; tq = min(block_size, n_q) and
                                          tk = min(block_size, n_k)
    full_t_ptr     (Bl, Hl, n_k_blocks+1) transposed: key block c's full query blocks
    full_t_idx     (n_full,)
    part_t_ptr     (Bl, Hl, n_k_blocks+1) transposed partial blocks
    part_t_idx     (n_part,)
    part_t_mask    (n_part,)
    ============== ====================== =================================================

    ``pattern.layout(...)`` builds consistent layouts and skips every check. The constructor, for
    layouts built by hand (say from another library's block layout), checks what the kernels rely
    on and raises a ValueError/TypeError naming the field: dtypes and shapes above, one device,
    row pointers non-decreasing from 0 to the index length, block indices in range, sorted and
    without duplicates within a row, no block both full and partial, tile ids in range, tiles
    False outside the sequence, and the transposed index exactly the transpose of the row index.
    ``pattern`` (shown by ``print``) may be None.
    """

    def __init__(self, *, pattern: Pattern | None, n_q: int, n_k: int, heads: int, block_size: int, causal: bool,
                 **tensors: torch.Tensor):
        if pattern is not None:
            check_pattern("BlockLayout pattern", pattern)
        n_q, n_k = _check_lengths(n_q, n_k)
        names = set(tensors)
        if names != set(KernelIndex._fields):
            raise TypeError(f"BlockLayout needs the tensors {list(KernelIndex._fields)}; missing "
                            f"{sorted(set(KernelIndex._fields) - names)}, unexpected {sorted(names - set(KernelIndex._fields))}")
        self._set(pattern, n_q, n_k, check_int("heads", heads, 1), check_int("block_size", block_size, 1),
                  check_bool("causal", causal), tensors)
        _check_tensors(self)

    @classmethod
    def _trusted(cls, pattern, n_q, n_k, heads, block_size, causal, tensors) -> BlockLayout:
        """A layout from the builder (or a copy of a checked one): consistent by construction, not re-checked."""
        layout = cls.__new__(cls)
        layout._set(pattern, n_q, n_k, heads, block_size, causal, tensors)
        return layout

    def _set(self, pattern, n_q, n_k, heads, block_size, causal, tensors) -> None:
        self.pattern, self.n_q, self.n_k, self.heads = pattern, n_q, n_k, heads
        self.block_size, self.causal = block_size, causal
        for name in KernelIndex._fields:
            setattr(self, name, tensors[name])
        self._on_device: dict[torch.device, BlockLayout] = {}

    @property
    def index(self) -> KernelIndex:
        """The tensors kernels read, in the ABI's order (see :class:`KernelIndex`)."""
        return KernelIndex(*(getattr(self, name) for name in KernelIndex._fields))

    # --- shape ---------------------------------------------------------------------------------
    @property
    def n_q_blocks(self) -> int:
        return _n_blocks(self.n_q, self.block_size)

    @property
    def n_k_blocks(self) -> int:
        return _n_blocks(self.n_k, self.block_size)

    @property
    def tile_shape(self) -> tuple[int, int]:
        """(tq, tk) of every tile in ``masks``: ``block_size``, or the sequence where it is shorter.
        Blocks start every tq query rows and every tk keys."""
        return min(self.block_size, self.n_q), min(self.block_size, self.n_k)

    @property
    def batch(self) -> int:
        """1 when every example shares the layout, else the batch size it was built for."""
        return self.full_ptr.shape[0]

    @property
    def shared_heads(self) -> bool:
        return self.full_ptr.shape[1] == 1

    @property
    def device(self) -> torch.device:
        return self.full_idx.device

    def to(self, device) -> BlockLayout:
        """This layout with its tensors on ``device`` (cached, so it moves once)."""
        device = torch.device(device)
        if device == self.device:
            return self
        if self.device.type == "meta":
            raise ValueError(f"this BlockLayout is on the meta device, which holds no values to move to {device}; "
                             f"build it there with pattern.layout(...).to({str(device)!r})")
        if device not in self._on_device:
            moved = {name: getattr(self, name).to(device) for name in KernelIndex._fields}
            self._on_device[device] = BlockLayout._trusted(self.pattern, self.n_q, self.n_k, self.heads, self.block_size,
                                                           self.causal, moved)
        return self._on_device[device]

    # --- counts --------------------------------------------------------------------------------
    def _per_head_factor(self) -> int:
        return self.heads if self.shared_heads else 1

    def _block_areas(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        tq, tk = self.tile_shape
        return (np.minimum((rows + 1) * tq, self.n_q) - rows * tq) * (np.minimum((cols + 1) * tk, self.n_k) - cols * tk)

    def _rows_of(self, ptr: torch.Tensor) -> np.ndarray:
        """Query-block index of every entry of a CSR index with row pointers ``ptr``."""
        counts = np.diff(ptr.cpu().numpy().reshape(-1, ptr.shape[-1]), axis=1).reshape(-1)
        return np.repeat(np.tile(np.arange(ptr.shape[-1] - 1), ptr.shape[0] * ptr.shape[1]), counts)

    @property
    def nnz_blocks(self) -> int:
        """Computed (head, query block, key block) triples, summed over heads and stored examples."""
        return (self.full_idx.numel() + self.part_idx.numel()) * self._per_head_factor()

    def _entry_areas(self, ptr: torch.Tensor, idx: torch.Tensor) -> np.ndarray:
        """Valid token pairs (inside the sequence) of every block of a CSR index."""
        return self._block_areas(self._rows_of(ptr), idx.cpu().numpy())

    def _tile_counts(self) -> np.ndarray:
        """Allowed pairs of each tile in ``masks``."""
        return self.masks.flatten(1).sum(1).cpu().numpy()

    def computed_pairs(self) -> int:
        """Token pairs inside computed blocks (what a kernel multiplies), over heads and examples."""
        full = self._entry_areas(self.full_ptr, self.full_idx).sum()
        part = self._entry_areas(self.part_ptr, self.part_idx).sum()
        return int(full + part) * self._per_head_factor()

    def allowed_pairs(self) -> int:
        """Token pairs the pattern allows, over heads and stored examples (exact)."""
        full = self._entry_areas(self.full_ptr, self.full_idx).sum()
        part = self._tile_counts()[self.part_mask.cpu().numpy()].sum()
        return int(full + part) * self._per_head_factor()

    @property
    def density(self) -> float:
        """Fraction of the n_q x n_k token pairs that are allowed (averaged over heads, examples)."""
        return self.allowed_pairs() / (self.n_q * self.n_k * self.heads * self.batch)

    @property
    def block_density(self) -> float:
        """Fraction of all blocks that are computed."""
        return self.nnz_blocks / (self.n_q_blocks * self.n_k_blocks * self.heads * self.batch)

    def flops(self, head_dim: int) -> int:
        """Forward FLOPs on computed blocks: 2 matmuls (QK^T, PV) of 2*head_dim per pair.

        Backward is conventionally 2.5x this (5 matmuls with recomputation).
        """
        check_int("head_dim", head_dim, 1)
        return 4 * head_dim * self.computed_pairs()

    def dense_flops(self, head_dim: int) -> int:
        """Forward FLOPs of dense attention at the same shape (every pair, every head and example).

        >>> import sparse_attn as sa
        >>> lay = sa.Local(64).layout(1024, heads=2)
        >>> lay.dense_flops(64), round(lay.flops(64) / lay.dense_flops(64), 3)
        (536870912, 0.18)
        """
        check_int("head_dim", head_dim, 1)
        return 4 * head_dim * self.n_q * self.n_k * self.heads * self.batch

    # --- dense views (small N) -----------------------------------------------------------------
    def row_mask(self, r0: int, r1: int) -> torch.Tensor:
        """Token mask of query blocks r0..r1-1: bool (Bl, Hl, rows, n_k), rows clipped to n_q."""
        r0, r1 = check_int("r0", r0, 0), check_int("r1", r1)
        if not r0 < r1 <= self.n_q_blocks:
            raise ValueError(f"row_mask needs 0 <= r0 < r1 <= n_q_blocks={self.n_q_blocks}, got r0={r0}, r1={r1}")
        (tq, tk), n_kb = self.tile_shape, self.n_k_blocks
        bl, hl = self.full_ptr.shape[:2]
        out = torch.zeros(bl * hl, r1 - r0, tq, n_kb, tk, dtype=torch.bool, device=self.device)
        for g, (full_ptr, part_ptr) in enumerate(zip(self.full_ptr.reshape(bl * hl, -1),
                                                     self.part_ptr.reshape(bl * hl, -1))):
            for ptr, idx, tiles in ((full_ptr, self.full_idx, None), (part_ptr, self.part_idx, self.part_mask)):
                lo, hi = int(ptr[r0]), int(ptr[r1])
                rows = torch.searchsorted(ptr[r0:r1 + 1], torch.arange(lo, hi, device=self.device), right=True) - 1
                cols = idx[lo:hi].long()
                if tiles is None:
                    out[g, rows, :, cols, :] = True
                else:
                    out[g, rows, :, cols, :] = self.masks[tiles[lo:hi].long()]
        rows_valid = min(r1 * tq, self.n_q) - r0 * tq
        return out.reshape(bl, hl, (r1 - r0) * tq, n_kb * tk)[:, :, :rows_valid, :self.n_k]

    def to_dense(self) -> torch.Tensor:
        """Token mask, bool (batch, heads, n_q, n_k): what the kernels compute. Small N only."""
        mask = self.row_mask(0, self.n_q_blocks)
        return mask.expand(self.batch, self.heads, self.n_q, self.n_k) if self.shared_heads else mask

    def to_scipy(self, batch: int = 0, head: int = 0, level: str = "block"):
        """``scipy.sparse.csr_array`` for one (example, head).

        ``level="block"``: (n_q_blocks, n_k_blocks), entry = allowed pairs in the block.
        ``level="token"``: (n_q, n_k) booleans of the allowed pairs (as large as the pattern).
        """
        import scipy.sparse

        if level not in ("block", "token"):
            raise ValueError(f"level must be 'block' or 'token', got {level!r}")
        b, h = self.check_example_head(batch, head)
        if level == "token":
            rows, cols = [], []
            for r0 in range(0, self.n_q_blocks, 16):
                mask = self.row_mask(r0, min(r0 + 16, self.n_q_blocks))[b, h]
                nz = mask.nonzero().cpu().numpy()
                rows.append(nz[:, 0] + r0 * self.tile_shape[0])
                cols.append(nz[:, 1])
            rows, cols = np.concatenate(rows), np.concatenate(cols)
            return scipy.sparse.csr_array((np.ones(rows.size, dtype=bool), (rows, cols)), shape=(self.n_q, self.n_k))
        per_tile = self._tile_counts()
        entries = []
        for ptr, idx, tiles in ((self.full_ptr, self.full_idx, None), (self.part_ptr, self.part_idx, self.part_mask)):
            p = ptr[b, h].cpu().numpy()
            rows = np.repeat(np.arange(self.n_q_blocks), np.diff(p))
            cols = idx[p[0]:p[-1]].cpu().numpy()
            data = self._block_areas(rows, cols) if tiles is None else per_tile[tiles[p[0]:p[-1]].cpu().numpy()]
            entries.append((rows, cols, data))
        rows, cols, data = (np.concatenate(x) for x in zip(*entries))
        return scipy.sparse.csr_array((data, (rows, cols)), shape=(self.n_q_blocks, self.n_k_blocks))

    def bin_factor(self, max_side: int | None = None) -> int:
        """Blocks per grid cell so that neither side of ``block_grid(max_side=...)`` exceeds ``max_side``."""
        if max_side is None:
            return 1
        return max(1, -(-max(self.n_q_blocks, self.n_k_blocks) // check_int("max_side", max_side, 1)))

    def block_grid(self, batch: int = 0, head: int = 0, max_side: int | None = None) -> np.ndarray:
        """Block states of one (example, head): 0 skipped, 1 partial, 2 full, as an int8 grid.

        With ``max_side`` the grid is binned by ``bin_factor(max_side)``; a cell shows its
        most-computed block.

        >>> import sparse_attn as sa
        >>> sa.Local(64).layout(256, block_size=64).block_grid().tolist()
        [[2, 1, 0, 0], [1, 2, 1, 0], [0, 1, 2, 1], [0, 0, 1, 2]]
        """
        blocks = self.to_scipy(batch, head).tocoo()
        state = np.where(blocks.data == self._block_areas(blocks.row, blocks.col), 2, 1).astype(np.int8)
        factor = self.bin_factor(max_side)
        grid = np.zeros((-(-self.n_q_blocks // factor), -(-self.n_k_blocks // factor)), dtype=np.int8)
        np.maximum.at(grid, (blocks.row // factor, blocks.col // factor), state)
        return grid

    def to_block_mask(self):
        """FlexAttention ``BlockMask`` of the same pattern, to run the peer on identical work.

        Its ``mask_mod`` looks tiles up in a (Bl, Hl, n_q_blocks, n_k_blocks) table, which is
        quadratic in the number of blocks: fine at benchmark sizes, not at 1M tokens.
        """
        from torch.nn.attention.flex_attention import BlockMask

        bl, hl = self.full_ptr.shape[:2]
        n_qb, n_kb, (tq, tk) = self.n_q_blocks, self.n_k_blocks, self.tile_shape
        # mask_mod may be evaluated anywhere (eagerly on every pair): tile n_masks is all-True for
        # full blocks, tile n_masks + 1 all-False for absent ones
        n_masks = self.masks.shape[0]
        tiles_ext = torch.cat([self.masks, torch.ones(1, tq, tk, dtype=torch.bool, device=self.device),
                               torch.zeros(1, tq, tk, dtype=torch.bool, device=self.device)])
        tile_of_block = torch.full((bl, hl, n_qb, n_kb), n_masks + 1, dtype=torch.int64, device=self.device)
        kv_num, kv_idx = [], []
        for ptr, idx, tiles in ((self.part_ptr, self.part_idx, self.part_mask),
                                (self.full_ptr, self.full_idx, None)):
            counts = (ptr[..., 1:] - ptr[..., :-1]).to(torch.int32)  # (Bl, Hl, n_qb)
            indices = torch.zeros(bl, hl, n_qb, n_kb, dtype=torch.int32, device=self.device)  # flex infers n_kb
            for b in range(bl):
                for h in range(hl):
                    p = ptr[b, h].long()
                    rows = torch.repeat_interleave(torch.arange(n_qb, device=self.device), counts[b, h].long())
                    slot = torch.arange(int(p[-1] - p[0]), device=self.device) - (p[rows] - p[0])
                    cols = idx[p[0]:p[-1]].long()
                    indices[b, h, rows, slot] = cols.to(torch.int32)
                    tile_of_block[b, h, rows, cols] = n_masks if tiles is None else tiles[p[0]:p[-1]].long()
            kv_num.append(counts)
            kv_idx.append(indices)

        def mask_mod(b, h, q_idx, kv_idx):
            return tiles_ext[tile_of_block[b % bl, h % hl, q_idx // tq, kv_idx // tk], q_idx % tq, kv_idx % tk]

        return BlockMask.from_kv_blocks(kv_num[0], kv_idx[0], kv_num[1], kv_idx[1], BLOCK_SIZE=self.block_size,
                                        mask_mod=mask_mod, seq_lengths=(self.n_q, self.n_k))

    def check_example_head(self, batch: int, head: int) -> tuple[int, int]:
        batch, head = check_int("batch", batch), check_int("head", head)
        if not 0 <= batch < self.batch:
            raise ValueError(f"batch must be in [0, {self.batch}), got {batch}")
        if not 0 <= head < self.heads:
            raise ValueError(f"head must be in [0, {self.heads}), got {head}")
        return batch, 0 if self.shared_heads else head

    # --- text ----------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"BlockLayout(n_q={self.n_q}, n_k={self.n_k}, heads={self.heads}, block_size={self.block_size}, "
                f"batch={self.batch}, nnz_blocks={self.nnz_blocks})")

    def __str__(self) -> str:
        full = self.full_idx.numel() * self._per_head_factor()
        lines = [
            f"BlockLayout of {self.pattern!r}" + (" & causal" if self.causal else ""),
            f"  tokens {self.n_q} x {self.n_k}, heads {self.heads} ({'shared' if self.shared_heads else 'per head'}),"
            f" examples {self.batch}, block {self.block_size}",
            f"  blocks {self.n_q_blocks} x {self.n_k_blocks}: {self.nnz_blocks} computed"
            f" ({self.block_density:.1%}), {full} full, {self.nnz_blocks - full} partial,"
            f" {self.masks.shape[0]} distinct tiles",
            f"  token density {self.density:.2%}",
        ]
        if max(self.n_q_blocks, self.n_k_blocks) <= _GRID_MAX_BLOCKS:
            lines.append("  head 0 ('#' full, '+' partial, '.' skipped):")
            lines += ["  " + "".join(".+#"[state] for state in row) for row in self.block_grid()]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Checking a hand-built layout
# ------------------------------------------------------------------------------------------------
def _check_tensors(layout: BlockLayout) -> None:
    """Everything the kernels rely on, for a layout not built by ``pattern.layout``; see BlockLayout."""
    _check_dtypes_and_device(layout)
    host = {name: getattr(layout, name).cpu().numpy() for name in KernelIndex._fields}
    _check_shapes(layout, host)
    full, part = _checked_entries(layout, host, "full"), _checked_entries(layout, host, "part")
    g, r, c = (np.concatenate([full[i], part[i]]) for i in range(3))
    order = np.lexsort((c, r, g))
    g, r, c = g[order], r[order], c[order]
    if ((g[1:] == g[:-1]) & (r[1:] == r[:-1]) & (c[1:] == c[:-1])).any():
        raise ValueError("BlockLayout lists a block both in full_idx and in part_idx; a block is full or partial")
    _check_tiles_end_with_sequence(layout, host["masks"], *part)


def _check_dtypes_and_device(layout: BlockLayout) -> None:
    tensors = {name: getattr(layout, name) for name in KernelIndex._fields}
    for name, tensor in tensors.items():
        expected = torch.bool if name == "masks" else torch.int32
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != expected:
            raise TypeError(f"BlockLayout {name} must be a {expected} tensor, got "
                            f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
    devices = {tensor.device for tensor in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"BlockLayout tensors must be on one device, got {sorted(map(str, devices))}; move them with .to()")
    for name, tensor in tensors.items():
        setattr(layout, name, tensor.contiguous())  # the kernels read flat memory


def _check_shapes(layout: BlockLayout, host: dict[str, np.ndarray]) -> None:
    groups = host["full_ptr"].shape[:2] if host["full_ptr"].ndim == 3 else None
    if groups is None or groups[0] < 1 or groups[1] not in (1, layout.heads):
        raise ValueError(f"BlockLayout full_ptr must have shape (Bl, Hl, n_q_blocks + 1) with Bl >= 1 and Hl 1 or "
                         f"heads={layout.heads}, got {host['full_ptr'].shape}")
    rows, cols = layout.n_q_blocks + 1, layout.n_k_blocks + 1
    expected = {"full_ptr": (*groups, rows), "part_ptr": (*groups, rows), "full_t_ptr": (*groups, cols),
                "part_t_ptr": (*groups, cols), "masks": (host["masks"].shape[0], *layout.tile_shape),
                "part_mask": host["part_idx"].shape, "part_t_mask": host["part_t_idx"].shape}
    for name, shape in expected.items():
        if host[name].shape != shape:
            raise ValueError(f"BlockLayout {name} must have shape {shape}, got {host[name].shape}")
    for name in ("full_idx", "part_idx", "full_t_idx", "part_t_idx"):
        if host[name].ndim != 1:
            raise ValueError(f"BlockLayout {name} must be one-dimensional, got shape {host[name].shape}")


def _checked_entries(layout: BlockLayout, host: dict[str, np.ndarray], kind: str):
    """(group, query block, key block, tile) of every ``kind`` ("full" or "part") block, in row-index
    order, once both indices are checked and found to be transposes of each other."""
    n_masks, part = len(host["masks"]), kind == "part"
    tile = host["part_mask"] if part else np.full(len(host["full_idx"]), -1)
    tile_t = host["part_t_mask"] if part else np.full(len(host["full_t_idx"]), -1)
    if part and len(tile) and (min(tile.min(), tile_t.min()) < 0 or max(tile.max(), tile_t.max()) >= n_masks):
        raise ValueError(f"BlockLayout part_mask and part_t_mask must hold tile ids in [0, {n_masks}) (the length of masks)")
    g, r = _csr_rows(f"{kind}_ptr", host[f"{kind}_ptr"], f"{kind}_idx", host[f"{kind}_idx"], layout.n_k_blocks)
    g_t, c_t = _csr_rows(f"{kind}_t_ptr", host[f"{kind}_t_ptr"], f"{kind}_t_idx", host[f"{kind}_t_idx"],
                         layout.n_q_blocks)
    r_t = host[f"{kind}_t_idx"]
    order = np.lexsort((c_t, r_t, g_t))  # the transposed entries in row-index order
    entries = (g, r, host[f"{kind}_idx"], tile)
    if len(order) != len(g) or not all(np.array_equal(a, b[order]) for a, b in zip(entries, (g_t, r_t, c_t, tile_t))):
        tiles, tiles_t = ("/part_mask", "/part_t_mask") if part else ("", "")
        raise ValueError(f"BlockLayout {kind}_t_ptr/{kind}_t_idx{tiles_t} must be exactly the transpose of "
                         f"{kind}_ptr/{kind}_idx{tiles}: the same (example, head, query block, key block"
                         f"{', tile' if part else ''}) entries, listed per key block")
    return entries


def _csr_rows(ptr_name: str, ptr: np.ndarray, idx_name: str, idx: np.ndarray, n_cols: int):
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


def _check_tiles_end_with_sequence(layout: BlockLayout, masks: np.ndarray, group, rows, cols, tiles) -> None:
    """Tiles of the last (shorter) block row or column must be False past the sequence end."""
    (tq, tk), last_row, last_col = layout.tile_shape, layout.n_q_blocks - 1, layout.n_k_blocks - 1
    rows_in, cols_in = layout.n_q - last_row * tq, layout.n_k - last_col * tk
    outside = masks[:, rows_in:, :].any((1, 2))[tiles] & (rows == last_row)
    outside |= masks[:, :, cols_in:].any((1, 2))[tiles] & (cols == last_col)
    if outside.any():
        raise ValueError(f"BlockLayout masks[{tiles[outside][0]}] allows pairs outside the sequence (query rows >= "
                         f"{layout.n_q} or keys >= {layout.n_k}) in a block of the last row or column; tiles must be "
                         f"False there")


# ------------------------------------------------------------------------------------------------
# Building
# ------------------------------------------------------------------------------------------------
@host_only  # host-side numpy: under torch.compile a graph break, not a trace
def build_layout(pattern: Pattern, n_q: int, n_k: int | None, heads: int, block_size: int, *,
                 causal: bool = False, global_mask=None, key_padding_mask=None) -> BlockLayout:
    """See :meth:`Pattern.layout`. Layouts are cached, call-time masks by their values, so every layer
    of a model called with the same padding shares one layout.

    Under ``torch.compile`` this is a graph break; for ``fullgraph=True`` build the layout outside
    the compiled function and pass it to ``sparse_attention``.
    """
    check_pattern("pattern", pattern)
    n_q, n_k = _check_lengths(n_q, n_k)
    heads, block_size = check_int("heads", heads, 1), check_int("block_size", block_size, 1)
    causal = check_bool("causal", causal)
    pattern.check_heads(heads)
    batch = None
    if global_mask is not None:
        global_mask = _check_token_mask("global_mask", global_mask, None, n_q)
        if n_q != n_k:
            raise ValueError(f"global_mask needs n_q == n_k (global tokens are rows and columns), "
                             f"got n_q={n_q}, n_k={n_k}")
        batch = global_mask.shape[0]
    if key_padding_mask is not None:
        key_padding_mask = _check_token_mask("key_padding_mask", key_padding_mask, batch, n_k)
    return _cached_layout(pattern, n_q, n_k, heads, block_size, causal, _Mask.of(global_mask),
                          _Mask.of(key_padding_mask))


def _check_token_mask(name: str, mask, batch: int | None, n: int) -> np.ndarray:
    if isinstance(mask, torch.Tensor):
        if mask.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor: its values, which decide the layout, cannot be read; pass "
                             f"a tensor with values (sparse_attention with meta q, k, v needs no layout)")
        mask = mask.detach().cpu().numpy()
    if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:
        raise TypeError(f"{name} must be a bool tensor of shape (batch, {n}), got "
                        f"{getattr(mask, 'dtype', type(mask).__name__)}; convert with .bool()")
    if mask.ndim != 2 or mask.shape[1] != n or mask.shape[0] == 0 or (batch is not None and mask.shape[0] != batch):
        expected = f"(batch, {n}) with batch >= 1" if batch is None else f"({batch}, {n})"
        raise ValueError(f"{name} must have shape {expected}, got {tuple(mask.shape)}")
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
    masks = [None if m is None else m.array() for m in (global_mask, key_padding_mask)]
    batch = next((m.shape[0] for m in masks if m is not None), None)
    return _build(pattern, n_q, n_k, heads, block_size, causal, batch, *masks)


def _build(pattern, n_q, n_k, heads, block_size, causal, batch, global_mask, key_padding_mask) -> BlockLayout:
    # a block_size beyond both lengths means one block a side, as a block of max(n_q, n_k) does: compile
    # with that, so no cost and no intermediate depends on how large block_size is
    step = min(block_size, max(n_q, n_k))
    n_heads = heads if pattern.head_dependent else 1
    tables, tiles = [], []
    for b in range(batch or 1):
        for h in range(n_heads):
            ctx = _Ctx(n_q, n_k, h)
            positions = None if global_mask is None else np.flatnonzero(global_mask[b]).astype(np.int64)
            rule = with_call_data(pattern._resolve(ctx), positions, causal,
                                  None if key_padding_mask is None else key_padding_mask[b])
            keys, full, tile, masks = _compile(rule, ctx, step)
            tables.append((keys, full, np.where(full, -1, tile + sum(len(t) for t in tiles))))
            tiles.append(masks)
    masks, remap = _unique_tiles(np.concatenate(tiles))
    n_kb = _n_blocks(n_k, step)
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
        tensors[f"{kind}_ptr"] = _ptr(g, r, shape, _n_blocks(n_q, step))
        tensors[f"{kind}_idx"] = torch.from_numpy(c.astype(np.int32))
        tensors[f"{kind}_t_ptr"] = _ptr(g[by_col], c[by_col], shape, n_kb)
        tensors[f"{kind}_t_idx"] = torch.from_numpy(r[by_col].astype(np.int32))
        if t is not None:
            tensors["part_mask"] = torch.from_numpy(t.astype(np.int32))
            tensors["part_t_mask"] = torch.from_numpy(t[by_col].astype(np.int32))
    tensors["masks"] = torch.from_numpy(masks)
    return BlockLayout._trusted(pattern, n_q, n_k, heads, block_size, causal, tensors)


def _ptr(group: np.ndarray, row: np.ndarray, shape: tuple[int, int], n_rows: int) -> torch.Tensor:
    """CSR row pointers (shape..., n_rows + 1) for entries sorted by (group, row)."""
    counts = np.bincount(group * n_rows + row, minlength=shape[0] * shape[1] * n_rows).reshape(-1, n_rows)
    ptr = np.zeros((counts.shape[0], n_rows + 1), dtype=np.int64)
    ptr[:, 1:] = np.cumsum(counts, axis=1)
    ptr += np.concatenate([[0], np.cumsum(counts.sum(1))[:-1]])[:, None]
    return torch.from_numpy(ptr.reshape(*shape, n_rows + 1).astype(np.int32))


def _compile(rule: Pattern, ctx: _Ctx, bs: int):
    """Blocks of one (example, head): keys, full flags, tile ids of partial blocks, tiles.

    Partial blocks are grouped by signature (plus whether they are cut by the sequence end); one
    tile per group is evaluated at token level, then tiles that turn out all-allowed promote their
    blocks to full and all-empty ones drop them.
    """
    keys, full, sig = block_table(rule, ctx, bs)
    n_qb, n_kb = _n_blocks(ctx.n_q, bs), _n_blocks(ctx.n_k, bs)
    rows, cols = keys // n_kb, keys % n_kb
    part = np.flatnonzero(~full)
    cut = ((rows[part] == n_qb - 1) & (ctx.n_q % bs != 0)) * 2 + ((cols[part] == n_kb - 1) & (ctx.n_k % bs != 0))
    _, first, group = np.unique(np.column_stack([sig[part], cut]), axis=0, return_index=True, return_inverse=True)
    group = group.reshape(-1)
    tiles = _tiles(rule, ctx, bs, rows[part][first] * bs, cols[part][first] * bs)
    allowed = tiles.sum((1, 2))
    area = (np.minimum(rows[part][first] * bs + bs, ctx.n_q) - rows[part][first] * bs) * \
           (np.minimum(cols[part][first] * bs + bs, ctx.n_k) - cols[part][first] * bs)
    keep_tile = (allowed > 0) & (allowed < area)
    new_id = np.cumsum(keep_tile) - 1
    keep = np.ones(len(keys), dtype=bool)
    keep[part] = allowed[group] > 0
    full = full.copy()
    full[part] = allowed[group] == area[group]
    tile = np.full(len(keys), -1, dtype=np.int64)
    tile[part] = np.where(keep_tile[group], new_id[group], -1)
    return keys[keep], full[keep], tile[keep], tiles[keep_tile]


def _tiles(rule, ctx, bs, i0, j0) -> np.ndarray:
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
        out[s:s + len(row)] = rule._allows(positions, np.minimum(j, ctx.n_k - 1), ctx) & inside
    return out.reshape(len(i0), tq, tk)


def _unique_tiles(tiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Deduplicate tiles across examples and heads: (unique tiles, old index -> new index)."""
    if len(tiles) == 0:
        return tiles, np.zeros(0, dtype=np.int64)
    packed = np.packbits(tiles.reshape(len(tiles), -1), axis=1)
    _, first, inverse = np.unique(packed, axis=0, return_index=True, return_inverse=True)
    return tiles[first], inverse.reshape(-1)

