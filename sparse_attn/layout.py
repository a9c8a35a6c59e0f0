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

``sparse_attn.compiler`` builds layouts from patterns; this module only holds them. It imports no
pattern module (the compiler imports it), so a layout can be built by hand, say from another
library's block layout, and checked (by ``sparse_attn.layout_checks``).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from .blocks import block_areas, ceil_div, check_lengths
from .checks import check_bool, check_int
from .layout_checks import check_pattern_like, check_tensor_names, checked_tensors

_GRID_MAX_BLOCKS = 64  # __str__ draws the block grid up to this many blocks a side


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


class CallData(NamedTuple):
    """The call-time data a compiled layout was built with (``layout.call_data``), as host arrays, None where
    not given: what ``to_block_mask`` hands to ``pattern.mask_mod`` so its predicate allows what the layout
    allows."""

    documents: np.ndarray | None            # (B, n) int64 document ids, -1 = padding
    key_padding_mask: np.ndarray | None     # (B, n_k) bool, True = padding
    global_mask: np.ndarray | None          # (B, n) bool, True = global token


class BlockLayout:
    """Kernel-ready block-sparse form of a pattern. Build with ``pattern.layout(...)``.

    ``layout.index`` holds its tensors, a :class:`KernelIndex`; each is also a read-only attribute of the
    same name (``layout.full_ptr is layout.index.full_ptr``). Tensors (int32 unless noted), with ``Bl`` = 1
    when all examples share the layout (else the batch size) and ``Hl`` = 1 when all heads share it (else
    ``heads``):

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

    ``call_data``: the :class:`CallData` of a layout the compiler built from ``pattern`` (its exact
    token mask); None for one built by hand, whose pattern is only a label.
    """

    pattern: Any                    # the Pattern it was built from, or None; printed, and asked for mask_mod
    n_q: int
    n_k: int
    heads: int
    block_size: int
    causal: bool
    call_data: CallData | None
    index: KernelIndex              # the tensors kernels read, in the ABI's order (see :class:`KernelIndex`)
    _on_device: dict[torch.device, BlockLayout]

    def __init__(self, *, pattern, n_q: int, n_k: int, heads: int, block_size: int, causal: bool,
                 **tensors: torch.Tensor):
        check_pattern_like(pattern)
        n_q, n_k = check_lengths(n_q, n_k)
        check_tensor_names(tensors, KernelIndex._fields)
        heads, block_size = check_int("heads", heads, 1), check_int("block_size", block_size, 1)
        causal = check_bool("causal", causal)
        in_abi_order = {name: tensors[name] for name in KernelIndex._fields}
        index = KernelIndex(**checked_tensors(in_abi_order, n_q=n_q, n_k=n_k, heads=heads, block_size=block_size))
        self._init(pattern, n_q, n_k, heads, block_size, causal, index, None)

    @classmethod
    def trusted(cls, *, pattern, n_q: int, n_k: int, heads: int, block_size: int, causal: bool,
                call_data: CallData | None = None, **tensors: torch.Tensor) -> BlockLayout:
        """The constructor without its checks, for builders whose layouts are consistent by construction
        (the compiler, and ``to`` copying a layout): checking would cost as much as building. ``call_data``:
        given only by the compiler, for a layout that is exactly ``pattern`` with that data."""
        layout = cls.__new__(cls)
        layout._init(pattern, n_q, n_k, heads, block_size, causal, KernelIndex(**tensors), call_data)
        return layout

    def _init(self, pattern, n_q: int, n_k: int, heads: int, block_size: int, causal: bool, index: KernelIndex,
              call_data: CallData | None) -> None:
        self.pattern, self.n_q, self.n_k, self.heads = pattern, n_q, n_k, heads
        self.block_size, self.causal, self.call_data, self.index = block_size, causal, call_data, index
        self._on_device = {}

    # --- the index's tensors by name (read-only: a layout's index never changes) -------------------
    @property
    def full_ptr(self) -> torch.Tensor:
        return self.index.full_ptr

    @property
    def full_idx(self) -> torch.Tensor:
        return self.index.full_idx

    @property
    def part_ptr(self) -> torch.Tensor:
        return self.index.part_ptr

    @property
    def part_idx(self) -> torch.Tensor:
        return self.index.part_idx

    @property
    def part_mask(self) -> torch.Tensor:
        return self.index.part_mask

    @property
    def masks(self) -> torch.Tensor:
        return self.index.masks

    @property
    def full_t_ptr(self) -> torch.Tensor:
        return self.index.full_t_ptr

    @property
    def full_t_idx(self) -> torch.Tensor:
        return self.index.full_t_idx

    @property
    def part_t_ptr(self) -> torch.Tensor:
        return self.index.part_t_ptr

    @property
    def part_t_idx(self) -> torch.Tensor:
        return self.index.part_t_idx

    @property
    def part_t_mask(self) -> torch.Tensor:
        return self.index.part_t_mask

    # --- shape ---------------------------------------------------------------------------------
    @property
    def n_q_blocks(self) -> int:
        return ceil_div(self.n_q, self.block_size)

    @property
    def n_k_blocks(self) -> int:
        return ceil_div(self.n_k, self.block_size)

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
            moved = {name: tensor.to(device) for name, tensor in self.index._asdict().items()}
            self._on_device[device] = BlockLayout.trusted(pattern=self.pattern, n_q=self.n_q, n_k=self.n_k,
                                                          heads=self.heads, block_size=self.block_size,
                                                          causal=self.causal, call_data=self.call_data, **moved)
        return self._on_device[device]

    # --- counts --------------------------------------------------------------------------------
    def _per_head_factor(self) -> int:
        return self.heads if self.shared_heads else 1

    def _block_areas(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return block_areas(rows, cols, self.tile_shape, (self.n_q, self.n_k))

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

    def query_chunks(self, scores_per_row: int, max_scores: int) -> Iterator[tuple[int, int, slice]]:
        """Query blocks in runs whose scores fit in ``max_scores`` elements, ``scores_per_row`` per query
        row (at least one block a run): ``(r0, r1, rows)``, blocks r0..r1-1 and the query rows they hold.
        How the reference backend and ``attention_weights`` evaluate ``row_mask`` in bounded memory.

        >>> import sparse_attn as sa
        >>> list(sa.Local(1).layout(100, block_size=16).query_chunks(scores_per_row=100, max_scores=4000))
        [(0, 2, slice(0, 32, None)), (2, 4, slice(32, 64, None)), (4, 6, slice(64, 96, None)),
         (6, 7, slice(96, 100, None))]
        """
        tq = self.tile_shape[0]
        blocks_per_chunk = max(1, max_scores // (tq * scores_per_row))
        for r0 in range(0, self.n_q_blocks, blocks_per_chunk):
            r1 = min(r0 + blocks_per_chunk, self.n_q_blocks)
            yield r0, r1, slice(r0 * tq, min(r1 * tq, self.n_q))

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
            row_runs, col_runs = [], []
            for r0 in range(0, self.n_q_blocks, 16):
                mask = self.row_mask(r0, min(r0 + 16, self.n_q_blocks))[b, h]
                nz = mask.nonzero().cpu().numpy()
                row_runs.append(nz[:, 0] + r0 * self.tile_shape[0])
                col_runs.append(nz[:, 1])
            rows, cols = np.concatenate(row_runs), np.concatenate(col_runs)
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
        return max(1, ceil_div(max(self.n_q_blocks, self.n_k_blocks), check_int("max_side", max_side, 1)))

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
        grid = np.zeros((ceil_div(self.n_q_blocks, factor), ceil_div(self.n_k_blocks, factor)), dtype=np.int8)
        np.maximum.at(grid, (blocks.row // factor, blocks.col // factor), state)
        return grid

    def to_block_mask(self):
        """FlexAttention ``BlockMask`` of this layout: FlexAttention runs the same blocks, full and partial.

        >>> import sparse_attn as sa
        >>> block_mask = (sa.Local(256) | sa.Global(first=16)).layout(4096, heads=8, block_size=128).to_block_mask()
        >>> block_mask.shape, block_mask.BLOCK_SIZE             # heads broadcast: the layout shares them
        ((1, 1, 4096, 4096), (128, 128))

        The block lists (``kv_num_blocks``/``kv_indices`` of the partial blocks, ``full_kv_*`` of the full ones,
        and their transposes ``q_*``) are copied from the layout's CSR index, so documents and padding cost
        what the layout cost and nothing is evaluated per pair. ``mask_mod`` is the pattern's own predicate,
        ``pattern.mask_mod(...)`` with the causal flag and call-time data the layout was built with, on the
        layout's device. A layout built by hand (``call_data`` None: its pattern is only a label) gets a
        lookup instead: a block table (n_q_blocks x n_k_blocks per stored head, what ``kv_indices`` holds
        too) whose full blocks need nothing more, and the layout's tiles for its partial blocks.

        ``BLOCK_SIZE`` is the layout's ``block_size`` (a block past both lengths is one block of the whole
        sequence, exported as the smallest multiple of 128 that holds it). FlexAttention's Triton kernels
        split a block in tiles of 16 tokens or more: a CUDA layout whose block size is not a multiple of 16
        raises a ValueError, as does a layout on the meta device.
        """
        from torch.nn.attention.flex_attention import BlockMask

        block = self._flex_block_size()
        n_qb, n_kb = self.n_q_blocks, self.n_k_blocks
        kv_num, kv_idx = _flex_rows(self.part_ptr, self.part_idx, n_kb)
        full_kv_num, full_kv_idx = _flex_rows(self.full_ptr, self.full_idx, n_kb)
        q_num, q_idx = _flex_rows(self.part_t_ptr, self.part_t_idx, n_qb)
        full_q_num, full_q_idx = _flex_rows(self.full_t_ptr, self.full_t_idx, n_qb)
        if self.pattern is not None and self.call_data is not None:
            data = self.call_data
            mask_mod = self.pattern.mask_mod(self.n_q, self.n_k, self.heads, documents=data.documents,
                                             key_padding_mask=data.key_padding_mask, global_mask=data.global_mask,
                                             causal=self.causal, device=self.device)
        else:
            mask_mod = self._lookup_mask_mod()
        return BlockMask(seq_lengths=(self.n_q, self.n_k), kv_num_blocks=kv_num, kv_indices=kv_idx,
                         full_kv_num_blocks=full_kv_num, full_kv_indices=full_kv_idx, q_num_blocks=q_num,
                         q_indices=q_idx, full_q_num_blocks=full_q_num, full_q_indices=full_q_idx,
                         BLOCK_SIZE=(block, block), mask_mod=mask_mod)

    def _flex_block_size(self) -> int:
        """The BLOCK_SIZE FlexAttention gets for this layout, or a ValueError saying why it cannot take it."""
        if self.device.type == "meta":
            raise ValueError("this BlockLayout is on the meta device, which holds no block lists for a FlexAttention "
                             "BlockMask; build the layout with values (pattern.layout(...)) and export that")
        longest = max(self.n_q, self.n_k)
        block = min(self.block_size, ceil_div(longest, 128) * 128)  # past both lengths: one block, any size
        if self.device.type == "cuda" and block % 16:
            raise ValueError(f"FlexAttention's Triton kernels split each block of a BlockMask into tiles of BLOCK_M x "
                             f"BLOCK_N tokens, 16 or more, which must divide the block; this layout's block_size="
                             f"{self.block_size} has none. Build it with a block_size that is a multiple of 16: 128 "
                             f"(FlexAttention's default) or 64 (with kernel_options BLOCK_M=BLOCK_N=64)")
        return block

    def _lookup_mask_mod(self):
        """mask_mod of a hand-built layout: a block table per stored (example, head), n_masks for a full block and
        n_masks + 1 for an absent one, then the layout's tile for a partial block."""
        bl, hl = self.full_ptr.shape[:2]
        n_kb, (tq, tk), n_masks = self.n_k_blocks, self.tile_shape, self.masks.shape[0]
        tiles = torch.cat([self.masks, torch.ones(1, tq, tk, dtype=torch.bool, device=self.device),
                           torch.zeros(1, tq, tk, dtype=torch.bool, device=self.device)])    # (n_masks + 2, tq, tk)
        table = torch.full((bl * hl * self.n_q_blocks, n_kb), n_masks + 1, dtype=torch.int32,
                           device=self.device)                                             # (Bl * Hl * n_qb, n_kb)
        for ptr, idx, tile in ((self.full_ptr, self.full_idx, None), (self.part_ptr, self.part_idx, self.part_mask)):
            rows = _entry_rows(ptr)                                                                        # (nnz,)
            table[rows, idx.long()] = n_masks if tile is None else tile
        table = table.reshape(bl, hl, self.n_q_blocks, n_kb)                                  # (Bl, Hl, n_qb, n_kb)

        def mask_mod(b, h, q_idx, kv_idx):
            return tiles[table[b % bl, h % hl, q_idx // tq, kv_idx // tk], q_idx % tq, kv_idx % tk]

        return mask_mod

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


def _entry_rows(ptr: torch.Tensor) -> torch.Tensor:
    """The flat row (example * Hl + head) * n_rows + row of every entry of a CSR index with pointers ``ptr``
    (Bl, Hl, n_rows + 1), where each (example, head) starts where the previous one ends."""
    counts = (ptr[..., 1:] - ptr[..., :-1]).reshape(-1).long()                           # (Bl * Hl * n_rows,)
    return torch.repeat_interleave(torch.arange(counts.numel(), device=ptr.device), counts,
                                   output_size=int(ptr[-1, -1, -1]))                                  # (nnz,)


def _flex_rows(ptr: torch.Tensor, idx: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A CSR index as FlexAttention's (num_blocks (Bl, Hl, n_rows), indices (Bl, Hl, n_rows, n_cols)) int32: each
    row's blocks first, in order, then zeros (FlexAttention reads ``indices[..., :num_blocks]``)."""
    bl, hl, n_rows = ptr.shape[0], ptr.shape[1], ptr.shape[2] - 1
    num = (ptr[..., 1:] - ptr[..., :-1]).to(torch.int32)                                    # (Bl, Hl, n_rows)
    rows = _entry_rows(ptr)                                                                           # (nnz,)
    slot = torch.arange(rows.numel(), device=ptr.device) - ptr[..., :-1].reshape(-1).long()[rows]     # (nnz,)
    indices = torch.zeros(bl * hl * n_rows, n_cols, dtype=torch.int32, device=ptr.device)  # (Bl*Hl*n_rows, n_cols)
    indices[rows, slot] = idx[:rows.numel()]
    return num, indices.reshape(bl, hl, n_rows, n_cols)
