"""Which keys each rank of a sequence-parallel attention needs from the others: a :class:`ShardPlan`.

>>> import sparse_attn as sa
>>> layout = (sa.Local(16) | sa.Global(first=1)).layout(512)
>>> plan = ShardPlan.build(layout, shard_sizes=(128, 128, 256), kv_heads=1)
>>> plan.kv_rows.tolist()               # [r, p]: key (and value) vectors rank r receives from rank p
[[0, 16, 0], [17, 0, 16], [1, 16, 0]]
>>> plan.shipped_rows.tolist()          # rows of each rank whose partial results are combined by log-sum-exp
[64, 0, 0]

The sequence of n tokens is split into contiguous shards, one per rank in rank order; rank r holds the
queries, keys and values of its shard. The plan is derived from the layout of the whole sequence (the
ground truth: pattern, causal, padding, global tokens and documents are all in it) without any N x N
step, in work proportional to the layout's blocks:

1. Each rank's rows are cut into *segments*, the parts of its query blocks it owns (a block that a
   shard boundary cuts gives a segment to each side).
2. For each segment, the remote keys its rows may attend (outside its rank's shard) are read from
   the layout: all keys of a full block, the OR of the owned rows of a partial block's tile.
3. A segment whose rows need many keys that the other segments of its rank do not (global rows see
   the whole sequence) is cheaper to ship: its queries go to every rank, each rank attends them over
   its own keys, and the owner combines the partial results by their log-sum-exp. It ships when the
   bytes of the key/value vectors it alone would fetch exceed the bytes of its queries sent to every
   other rank and of their partial results coming back (``_choose_shipped`` says how that is counted).
   A sequence of one block never ships: every rank's rows share that block, and fetching moves at most
   its other keys (so any number of ranks can split a sequence shorter than a block, a token or more each).
4. Every other segment is computed where it lives, over the rank's own keys and the remote keys its
   rows need, fetched at token granularity (a Longformer window fetches exactly its halo).

``ShardPlan.build`` does this for every rank (every rank builds the same plan, so no rank has to ask
another what it needs); :meth:`ShardPlan.program` gives one rank what it runs: the index tensors of
its sends and receives and the two BlockLayouts of its kernels. ``sparse_attn.distributed`` runs it.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .assembly import assemble_layout, distinct_tiles
from .blocks import ceil_div, unique_rows
from .layout import BlockLayout
from .score_mods import alibi_alignment


class RankProgram(NamedTuple):
    """What one rank runs (tensors on the CPU; int64 unless noted).

    Keys: the rank's *compact* key buffer (Bk, Hkv, n_compact, D) holds the key blocks (in the layout's
    grid) its kernels read, in order: its own keys and the fetched ones, zeros elsewhere.

    - ``kv_send_index`` (S,): rows of this rank's (Bk * Hkv * n_rank) key/value vectors to send, grouped by
      destination rank, ``kv_send_counts`` (W,) per destination;
    - ``kv_recv_slots`` (R,): where each received vector goes in the flattened compact buffer
      (Bk * Hkv * n_compact), grouped by source rank, ``kv_recv_counts`` (W,);
    - ``own_slots`` (Bk * Hkv * n_rank,): where this rank's own vectors go;
    - ``local_layout``: this rank's rows (``rows_before`` zero rows first, padded to whole blocks) over the
      compact buffer, without the rows it ships;
    - ``shipped_rows`` (n_ship,): this rank's shipped rows (local indices), sent to every rank;
    - ``shipped_recv_counts`` (W,): shipped rows received from each rank, ``shipped_slots`` (sum,): their rows in the
      shipped-query tensor (``shipped_layout.n_q`` rows), grouped by source; the partial results go back in
      the same order;
    - ``shipped_layout``: the shipped-query tensor over this rank's own keys in the compact buffer, or None
      when no rank ships;
    - ``local_calls``, ``shipped_calls``: with ALiBi (``program(rank, alibi=True)``), the backend calls that replace
      ``local_layout`` (one per run of consecutive key blocks in the compact buffer) and ``shipped_layout`` (one per
      shipped segment), so that each call's keys and rows sit at consecutive positions (:class:`AlibiCall`);
      empty without.
    """

    n_compact: int
    own_slots: torch.Tensor
    kv_send_index: torch.Tensor
    kv_send_counts: list[int]
    kv_recv_slots: torch.Tensor
    kv_recv_counts: list[int]
    rows_before: int
    local_layout: BlockLayout
    shipped_rows: torch.Tensor
    shipped_recv_counts: list[int]
    shipped_slots: torch.Tensor
    shipped_layout: BlockLayout | None
    local_calls: tuple[AlibiCall, ...] = ()
    shipped_calls: tuple[AlibiCall, ...] = ()


class AlibiCall(NamedTuple):
    """One backend call of ALiBi attention: rows ``row0 .. row1 - 1`` of the kernel's queries over the compact key
    slots ``key0 .. key1 - 1``, both at consecutive positions of the sequence, with ``pad_rows`` zero rows and
    ``pad_keys`` zero keys appended (never attended) as :func:`~sparse_attn.score_mods.alibi_alignment` says:
    the backend's distance plus ``shift`` is the tokens' distance, so its lse less ``slope * shift`` is the
    true one. ``layout``: those rows and keys, padding included."""

    row0: int
    row1: int
    key0: int
    key1: int
    pad_rows: int
    pad_keys: int
    shift: int
    layout: BlockLayout


class _Needs(NamedTuple):
    """Remote keys needed, one entry per (segment, layout group, key block): the positions of the block (bits
    packed as ``np.packbits(..., axis=-1)``, bit c = position block * step + c) outside the segment's shard."""

    segment: np.ndarray
    group: np.ndarray
    block: np.ndarray
    bits: np.ndarray


class ShardPlan:
    """The exchange and compute plan of a layout over shards (see the module docstring).

    Attributes (W = number of ranks):
        kv_rows: (W, W) int64, ``[r, p]`` = key vectors (one head of one example; each comes with its value
            vector) rank r receives from rank p in the forward pass; in the backward their gradients go back.
        shipped_rows: (W,) rows of each rank shipped to every other rank and combined by log-sum-exp
            (``lse_rows``, its first name, reads it too).
        work: (W,) token-pair blocks each rank's kernels compute (over all examples and heads).
    """

    def __init__(self, layout: BlockLayout, shard_sizes: tuple[int, ...], q_batch: int, kv_batch: int,
                 kv_heads: int, needs: _Needs, shipped: np.ndarray, segments: dict[str, np.ndarray]):
        self.layout, self.shard_sizes = layout, shard_sizes
        self.q_batch, self.kv_batch, self.kv_heads = q_batch, kv_batch, kv_heads
        self.starts = np.concatenate([[0], np.cumsum(shard_sizes)]).astype(np.int64)  # (W + 1,)
        self.step = layout.tile_shape[0]
        self._needs, self._shipped, self._seg = needs, shipped, segments
        self._fetch = self._fetch_table()
        world = len(shard_sizes)
        self.kv_rows = np.zeros((world, world), dtype=np.int64)
        np.add.at(self.kv_rows, (self._fetch["rank"], self._fetch["owner"]), self._fetch["copies"])
        seg_rows = segments["hi"] - segments["lo"]
        self.shipped_rows = np.bincount(segments["rank"][shipped], seg_rows[shipped], minlength=world).astype(np.int64)
        self.work = self._work()

    @property
    def lse_rows(self) -> np.ndarray:
        """``shipped_rows`` by its first name (the shipped rows' results are combined by log-sum-exp)."""
        return self.shipped_rows

    # --- building -------------------------------------------------------------------------------
    @classmethod
    def build(cls, layout: BlockLayout, shard_sizes, *, kv_heads: int, q_batch: int = 1, kv_batch: int = 1,
              itemsize: int = 4) -> ShardPlan:
        """The plan of ``layout`` (built for the whole sequence, ``n_q == n_k == sum(shard_sizes)``) over
        shards of ``shard_sizes`` tokens (rank order), for inputs q (q_batch, layout.heads, ., D) and k, v
        (kv_batch, kv_heads, ., D) of ``itemsize`` bytes per element (which weighs shipping against fetching)."""
        shard_sizes = tuple(int(n) for n in shard_sizes)
        n = sum(shard_sizes)
        if layout.n_q != n or layout.n_k != n:
            raise ValueError(f"the layout must cover the whole sequence: n_q == n_k == sum(shard_sizes) = {n}, got "
                             f"n_q={layout.n_q}, n_k={layout.n_k}; build it with pattern.layout({n}, ...)")
        if min(shard_sizes) < 1:
            raise ValueError(f"every rank needs at least one token, got shard sizes {list(shard_sizes)}")
        if layout.heads % kv_heads or layout.batch not in (1, q_batch) or kv_batch not in (1, q_batch):
            raise ValueError(f"a layout of batch {layout.batch} and {layout.heads} heads does not fit q batch "
                             f"{q_batch} with k, v of batch {kv_batch} and {kv_heads} heads")
        starts = np.concatenate([[0], np.cumsum(shard_sizes)]).astype(np.int64)
        segments = _segments(starts, layout.tile_shape[0])
        needs = _remote_needs(layout, starts, segments)
        # a shipped row moves its query (itemsize per element) and its partial result back (out and lse, in
        # float32, float64 for float64 inputs); a fetched key vector moves a key and a value
        ship_weight = (itemsize + (8 if itemsize == 8 else 4)) / (2 * itemsize)
        if layout.n_q_blocks == 1:                                   # one block: fetch, never ship (step 3)
            shipped = np.zeros(len(segments["block"]), dtype=bool)
        else:
            shipped = _choose_shipped(needs, segments, len(shard_sizes), *_kv_keys(needs.group, layout, kv_batch,
                                      kv_heads), kv_batch, kv_heads, ship_copies=q_batch * layout.heads,
                                      ship_weight=ship_weight)
        return cls(layout, shard_sizes, q_batch, kv_batch, kv_heads, needs, shipped, segments)

    def _fetch_table(self) -> dict[str, np.ndarray]:
        """The distinct fetches: (rank, example key, kv-head key, key block, owner) with the positions fetched
        (packed bits) and the number of key vectors they stand for (``copies``). An example key of -1 means
        every example of k (a layout shared by the batch), a kv-head key of -1 every kv head (a layout shared
        by the heads); a block that shard boundaries cut is split by the rank owning each part."""
        needs, seg, step, n = self._needs, self._seg, self.step, self.layout.n_k
        fetched = ~self._shipped[needs.segment]
        example, head = _kv_keys(needs.group[fetched], self.layout, self.kv_batch, self.kv_heads)
        key = np.column_stack([seg["rank"][needs.segment[fetched]], example, head, needs.block[fetched]])
        key, bits = _or_by_key(key, needs.bits[fetched])
        first_owner = np.searchsorted(self.starts, key[:, 3] * step, side="right") - 1
        last_owner = np.searchsorted(self.starts, np.minimum((key[:, 3] + 1) * step, n) - 1, side="right") - 1
        entry, owner = _ranges(first_owner, last_owner - first_owner + 1)
        key, bits = key[entry], bits[entry].copy()
        split = np.flatnonzero(first_owner[entry] != last_owner[entry])
        positions = key[split, 3][:, None] * step + np.arange(bits.shape[1] * 8)[None, :]
        bits[split] &= np.packbits((positions >= self.starts[owner[split], None])
                                   & (positions < self.starts[owner[split] + 1, None]), axis=1)
        keep = bits.any(1)
        key, bits, owner = key[keep], bits[keep], owner[keep]
        copies = (np.where(key[:, 1] < 0, self.kv_batch, 1) * np.where(key[:, 2] < 0, self.kv_heads, 1)
                  * _popcount(bits))
        return {"rank": key[:, 0], "example": key[:, 1], "head": key[:, 2], "block": key[:, 3], "owner": owner,
                "bits": bits, "copies": copies}

    def _work(self) -> np.ndarray:
        """Computed blocks per rank: its segments' blocks (not shipped) and every shipped segment's blocks
        over the rank's own keys, each counted once per example and head it is computed for."""
        idx, seg = self.layout.index, self._seg
        bl, hl = idx.full_ptr.shape[:2]
        per_group = (self.q_batch // bl) * (self.layout.heads // hl)
        world = len(self.shard_sizes)
        work = np.zeros(world, dtype=np.int64)
        entries = _segment_entries(idx, seg["block"])
        counts = np.bincount(entries.segment, minlength=len(seg["block"]))
        np.add.at(work, seg["rank"][~self._shipped], counts[~self._shipped])
        shipped = np.isin(entries.segment, np.flatnonzero(self._shipped))
        first_key = entries.col[shipped] * self.step                      # each shipped block: the ranks
        last_key = np.minimum(first_key + self.step, self.layout.n_k) - 1    # owning its keys compute it
        spread = np.zeros(world + 1, dtype=np.int64)
        np.add.at(spread, np.searchsorted(self.starts, first_key, side="right") - 1, 1)
        np.add.at(spread, np.searchsorted(self.starts, last_key, side="right"), -1)
        work += np.cumsum(spread)[:world]
        return work * per_group

    # --- one rank's program ---------------------------------------------------------------------
    def program(self, rank: int, alibi: bool = False) -> RankProgram:
        """What ``rank`` runs: its sends, receives, compact key buffer and kernel layouts (and with ``alibi``, the
        calls that keep positions consecutive)."""
        seg, fetch, step = self._seg, self._fetch, self.step
        world, s0, s1 = len(self.shard_sizes), int(self.starts[rank]), int(self.starts[rank + 1])
        bk, hkv = self.kv_batch, self.kv_heads
        mine = fetch["rank"] == rank
        own_blocks = np.arange(s0 // step, (s1 - 1) // step + 1)
        compact = np.union1d(own_blocks, fetch["block"][mine])                             # sorted key blocks
        n_compact = self._block_tokens(compact)

        def slot(token):                                           # position -> slot in the compact buffer
            return np.searchsorted(compact, token // step) * step + token % step

        recv = _expand(_positions(fetch, mine, step), bk, hkv, order=("owner",))
        send = _expand(_positions(fetch, fetch["owner"] == rank, step), bk, hkv, order=("rank",))
        own = np.arange(s0, s1)
        own_slots = ((np.arange(bk * hkv)[:, None] * n_compact) + slot(own)[None, :]).reshape(-1)
        rows_before = s0 - (s0 // step) * step
        local_layout = self._local_layout(rank, compact)
        shipped_layout = self._shipped_layout(rank, compact) if self._shipped.any() else None

        ship = np.flatnonzero(self._shipped)        # segments are in rank order: grouped by owner, as sent
        none = [np.zeros(0, np.int64)]
        shipped_rows = np.concatenate([np.arange(seg["lo"][s], seg["hi"][s]) + seg["block"][s] * step - s0
                                   for s in ship if seg["rank"][s] == rank] + none)
        shipped_slots = np.concatenate([np.arange(seg["lo"][s], seg["hi"][s]) + t * step
                                    for t, s in enumerate(ship)] + none)
        return RankProgram(
            n_compact=int(n_compact),
            own_slots=torch.from_numpy(own_slots),
            kv_send_index=torch.from_numpy((send["example"] * hkv + send["head"]) * (s1 - s0) + send["token"] - s0),
            kv_send_counts=np.bincount(send["rank"], minlength=world).tolist(),
            kv_recv_slots=torch.from_numpy((recv["example"] * hkv + recv["head"]) * n_compact + slot(recv["token"])),
            kv_recv_counts=np.bincount(recv["owner"], minlength=world).tolist(),
            rows_before=int(rows_before), local_layout=local_layout,
            shipped_rows=torch.from_numpy(shipped_rows.astype(np.int64)),
            shipped_recv_counts=np.bincount(seg["rank"][ship], seg["hi"][ship] - seg["lo"][ship],
                                        minlength=world).astype(np.int64).tolist(),
            shipped_slots=torch.from_numpy(shipped_slots.astype(np.int64)),
            shipped_layout=shipped_layout,
            local_calls=self._local_calls(rank, compact, local_layout) if alibi else (),
            shipped_calls=(self._shipped_calls(rank, compact, shipped_layout)
                           if alibi and shipped_layout is not None else ()))

    def _local_layout(self, rank: int, compact: np.ndarray) -> BlockLayout:
        """This rank's block rows (not shipped) over its compact key blocks."""
        seg, idx = self._seg, self.layout.index
        mine = np.flatnonzero((seg["rank"] == rank) & ~self._shipped)
        first_block = seg["block"][seg["rank"] == rank].min()
        n_rows = (seg["block"][seg["rank"] == rank].max() - first_block + 1) * self.step
        e = _segment_entries(idx, seg["block"][mine])
        pos = np.searchsorted(compact, e.col)
        inside = (pos < len(compact)) & (compact[np.minimum(pos, len(compact) - 1)] == e.col)
        e = e.take(inside)
        return self._assemble(e.group, seg["block"][mine][e.segment] - first_block, pos[inside], e.full, e.tile,
                              n_rows, self._block_tokens(compact), self.layout.masks.numpy())

    def _shipped_layout(self, rank: int, compact: np.ndarray) -> BlockLayout:
        """Every shipped segment (one block row each, in segment order) over this rank's own keys."""
        seg, idx, step = self._seg, self.layout.index, self.step
        s0, s1 = int(self.starts[rank]), int(self.starts[rank + 1])
        ship = np.flatnonzero(self._shipped)
        e = _segment_entries(idx, seg["block"][ship])
        e = e.take((e.col * step < s1) & ((e.col + 1) * step > s0))      # key blocks holding own keys
        # a block cut by the shard's ends keeps only the own keys: its tile (all True if full) AND the own
        # columns (and the rows inside the sequence)
        cut = (e.col * step < s0) | (np.minimum((e.col + 1) * step, self.layout.n_k) > s1)
        pool = self.layout.masks.numpy()
        tq, tk = self.layout.tile_shape
        c = np.flatnonzero(cut)
        tiles = np.ones((len(c), tq, tk), dtype=bool)
        tiles[~e.full[c]] = pool[e.tile[c][~e.full[c]]]
        keys = e.col[c][:, None] * step + np.arange(tk)[None, :]                            # (cut, tk)
        rows = seg["block"][ship][e.segment[c]][:, None] * step + np.arange(tq)[None, :]     # (cut, tq)
        tiles &= ((keys >= s0) & (keys < s1))[:, None, :] & (rows < self.layout.n_q)[:, :, None]
        tile = e.tile.copy()
        tile[c] = len(pool) + np.arange(len(c))
        keep = ~cut
        keep[c] = tiles.any((1, 2))
        return self._assemble(e.group[keep], e.segment[keep], np.searchsorted(compact, e.col[keep]),
                              (e.full & ~cut)[keep], tile[keep], len(ship) * step, self._block_tokens(compact),
                              np.concatenate([pool, tiles]))

    # --- ALiBi: calls over consecutive positions ---------------------------------------------------
    def _local_calls(self, rank: int, compact: np.ndarray, local: BlockLayout) -> tuple[AlibiCall, ...]:
        """``local_layout`` as one call per run of consecutive key blocks in the compact buffer, over its rows from
        the rank's first block (at most to the sequence's end)."""
        first = int(self._seg["block"][self._seg["rank"] == rank].min()) * self.step    # position of row 0
        rows = min(local.n_q, self.layout.n_q - first)
        runs = np.split(np.arange(len(compact)), np.flatnonzero(np.diff(compact) != 1) + 1)
        calls = (self._call(local, 0, rows, first, int(run[0]), compact[run]) for run in runs)
        return tuple(call for call in calls if call is not None)

    def _shipped_calls(self, rank: int, compact: np.ndarray, shipped_layout: BlockLayout) -> tuple[AlibiCall, ...]:
        """``shipped_layout`` as one call per shipped segment (its block row, at the segment's position) over this
        rank's own key blocks."""
        step = self.step
        own = np.arange(self.starts[rank] // step, (self.starts[rank + 1] - 1) // step + 1)
        first_own = int(np.searchsorted(compact, own[0]))
        calls = (self._call(shipped_layout, t * step, t * step + min(step, self.layout.n_q - int(block) * step),
                            int(block) * step, first_own, own)
                 for t, block in enumerate(self._seg["block"][self._shipped]))
        return tuple(call for call in calls if call is not None)

    def _call(self, source: BlockLayout, row0: int, row1: int, query_start: int, col0: int,
              blocks: np.ndarray) -> AlibiCall | None:
        """Rows ``row0 .. row1 - 1`` of ``source`` (a block-aligned start, at positions from ``query_start``) over
        its key blocks ``col0 ..`` (the grid's consecutive ``blocks``), padded for ALiBi; None without a block."""
        step = self.step
        n_keys = self._block_tokens(blocks)
        pad_keys, pad_rows, shift = alibi_alignment(query_start, row1 - row0, int(blocks[0]) * step, n_keys)
        e = _segment_entries(source.index, np.arange(row0 // step, ceil_div(row1, step)))
        e = e.take((e.col >= col0) & (e.col < col0 + len(blocks)))
        if len(e.col) == 0:
            return None
        layout = self._assemble(e.group, e.segment, e.col - col0, e.full, e.tile, row1 - row0 + pad_rows,
                                n_keys + pad_keys, source.masks.numpy())
        return AlibiCall(row0, row1, col0 * step, col0 * step + n_keys, pad_rows, pad_keys, shift, layout)

    def _block_tokens(self, blocks: np.ndarray) -> int:
        """Tokens in these key blocks of the grid (sorted): whole blocks but the sequence's last, which may be
        short."""
        return len(blocks) * self.step - max((int(blocks[-1]) + 1) * self.step - self.layout.n_k, 0)

    def _assemble(self, group, rows, cols, full, tile, n_rows: int, n_k: int, pool: np.ndarray) -> BlockLayout:
        """A BlockLayout of blocks (group, row, col, full; ``tile``: the partial ones' tiles in ``pool``) of
        ``n_rows`` query rows and ``n_k`` keys, whole blocks of the source grid but for the last."""
        step = self.step
        order = np.lexsort((cols, rows, group))
        group, rows, cols, full, tile = group[order], rows[order], cols[order], full[order], tile[order]
        tq, tk = min(self.layout.block_size, n_rows), min(self.layout.block_size, n_k)
        used, part_tile = np.unique(tile[~full], return_inverse=True)
        masks, distinct = distinct_tiles(pool[used][:, :tq, :tk])
        return assemble_layout(self.layout.pattern, n_q=n_rows, n_k=n_k, heads=self.layout.heads,
                               block_size=self.layout.block_size, causal=self.layout.causal,
                               shape=(self.layout.index.full_ptr.shape[0], self.layout.index.full_ptr.shape[1]),
                               blocks_per_side=(ceil_div(n_rows, step), ceil_div(n_k, step)), group=group, rows=rows,
                               cols=cols, full=full, part_tile=distinct[part_tile.reshape(-1)], masks=masks)

    # --- traffic ---------------------------------------------------------------------------------
    def bytes_per_rank(self, head_dim: int, itemsize: int, lse_itemsize: int = 4) -> dict[str, np.ndarray]:
        """Bytes each rank sends and receives per call, forward and backward, (W,) each.

        Forward: key+value vectors fetched (2 * head_dim each), shipped query rows (all q heads and
        examples, head_dim each) and their partial results coming back (head_dim + 1, in the lse dtype).
        Backward: the same exchanges reversed (gradients of the fetched keys and values, of the partial
        results, and of the shipped queries)."""
        world = len(self.shard_sizes)
        kv = 2 * head_dim * itemsize
        rows = self.q_batch * self.layout.heads
        q_row, part_row = rows * head_dim * itemsize, rows * (head_dim + 1) * lse_itemsize
        kv_in, kv_out = self.kv_rows.sum(1) * kv, self.kv_rows.sum(0) * kv
        ship_out = self.shipped_rows * (world - 1) * q_row                       # own rows to every other rank
        ship_in = (self.shipped_rows.sum() - self.shipped_rows) * q_row
        part_out = (self.shipped_rows.sum() - self.shipped_rows) * part_row          # partials of others' rows
        part_in = self.shipped_rows * (world - 1) * part_row
        return {"forward_sent": kv_out + ship_out + part_out, "forward_received": kv_in + ship_in + part_in,
                "backward_sent": kv_in + ship_in + part_in, "backward_received": kv_out + ship_out + part_out}


class _Entries(NamedTuple):
    """Layout blocks of some segments: the segment (index into the list asked for), layout group, key block,
    full flag and tile id (-1 for full blocks)."""

    segment: np.ndarray
    group: np.ndarray
    col: np.ndarray
    full: np.ndarray
    tile: np.ndarray

    def take(self, keep: np.ndarray) -> _Entries:
        return _Entries(*(column[keep] for column in self))


def _segments(starts: np.ndarray, step: int) -> dict[str, np.ndarray]:
    """Each rank's parts of its query blocks: rank, block, and the rows [lo, hi) it owns within the block."""
    rank, block, lo, hi = [], [], [], []
    for r in range(len(starts) - 1):
        s0, s1 = int(starts[r]), int(starts[r + 1])
        blocks = np.arange(s0 // step, (s1 - 1) // step + 1)
        rank.append(np.full(len(blocks), r))
        block.append(blocks)
        lo.append(np.maximum(s0 - blocks * step, 0))
        hi.append(np.minimum(s1 - blocks * step, step))
    return {name: np.concatenate(column).astype(np.int64)
            for name, column in (("rank", rank), ("block", block), ("lo", lo), ("hi", hi))}


def _segment_entries(idx, blocks: np.ndarray) -> _Entries:
    """Every layout block of query blocks ``blocks`` (one list entry per segment), over all groups."""
    columns = []
    for kind in ("full", "part"):
        ptr = getattr(idx, f"{kind}_ptr").numpy().astype(np.int64)
        ptr = ptr.reshape(-1, ptr.shape[-1])                                     # (groups, n_qb + 1)
        starts = ptr[:, blocks].T.reshape(-1)                                    # (segments * groups,)
        counts = ptr[:, blocks + 1].T.reshape(-1) - starts
        pair, at = _ranges(starts, counts)
        tile = idx.part_mask.numpy()[at] if kind == "part" else np.full(len(at), -1)
        columns.append((pair // len(ptr), pair % len(ptr), getattr(idx, f"{kind}_idx").numpy()[at].astype(np.int64),
                        np.full(len(at), kind == "full"), tile.astype(np.int64)))
    return _Entries(*(np.concatenate(c) for c in zip(*columns)))


def _ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated ranges [starts[i], starts[i] + counts[i]): (i of each element, the element)."""
    owner = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, starts[owner] + within


def _remote_needs(layout: BlockLayout, starts: np.ndarray, seg: dict[str, np.ndarray]) -> _Needs:
    """The key positions outside its rank's shard that each segment's rows may attend, per layout group and
    key block, as packed bits."""
    idx, n = layout.index, layout.n_k
    step, tk = layout.tile_shape
    e = _segment_entries(idx, seg["block"])
    rank = seg["rank"][e.segment]
    e = e.take((e.col * step < starts[rank]) | (np.minimum((e.col + 1) * step, n) > starts[rank + 1]))
    s0, s1 = starts[seg["rank"][e.segment]], starts[seg["rank"][e.segment] + 1]
    lo, hi = seg["lo"][e.segment], seg["hi"][e.segment]
    # the keys a block's owned rows may attend: the OR of those rows of its tile (every key if full)
    combo_first, combo = unique_rows(np.column_stack([e.tile, lo, hi]))
    masks = layout.masks.numpy()
    cols = np.ones((len(combo_first), tk), dtype=bool)
    for u, i in enumerate(combo_first):
        if e.tile[i] >= 0:
            cols[u] = masks[e.tile[i], lo[i]:hi[i]].any(0)
    bits = np.packbits(cols, axis=1)[combo]                                              # (entries, tk / 8)
    # blocks the shard or the sequence's end cuts: only the positions outside the shard, inside the sequence
    cut = np.flatnonzero(((e.col * step < s1) & ((e.col + 1) * step > s0)) | ((e.col + 1) * step > n))
    positions = e.col[cut][:, None] * step + np.arange(tk)[None, :]
    bits[cut] &= np.packbits((positions < n) & ((positions < s0[cut, None]) | (positions >= s1[cut, None])),
                             axis=1)
    keep = bits.any(1)
    return _Needs(e.segment[keep], e.group[keep], e.col[keep], bits[keep])


def _choose_shipped(needs: _Needs, seg: dict[str, np.ndarray], world: int, example: np.ndarray, head: np.ndarray,
                    kv_batch: int, kv_heads: int, ship_copies: int, ship_weight: float) -> np.ndarray:
    """Which segments ship their queries (module docstring, step 3): bool per segment.

    Costs are counted in key vectors (one key and its value, one head of one example): a segment's fetch is
    its remote positions for each example and kv head of k it reads (``example``, ``head`` per need, -1 =
    all), divided by how many segments of its rank need an average fetched key (keys are shared: a window's
    halo serves many blocks); shipping costs its rows times the other ranks, ``ship_copies`` (examples times
    query heads) and ``ship_weight`` (a shipped query and its partial result, in key vectors). Segments whose
    fetch costs more start shipped; then, narrowest first, one fetches after all if the keys that no fetching
    segment of its rank fetches yet cost less than shipping it (so two global blocks, which need the same
    keys, both ship)."""
    shipped = np.zeros(len(seg["block"]), dtype=bool)
    if world == 1 or len(needs.block) == 0:
        return shipped
    key, bits = _or_by_key(np.column_stack([needs.segment, example, head, needs.block]), needs.bits)
    segment, rank = key[:, 0], seg["rank"][key[:, 0]]
    vectors = np.where(key[:, 1] < 0, kv_batch, 1) * np.where(key[:, 2] < 0, kv_heads, 1) * _popcount(bits)
    wide = np.bincount(segment, vectors, minlength=len(shipped))
    fetch = np.column_stack([rank, key[:, 1:]])                              # (rank, example, head, block)
    distinct, distinct_bits = _or_by_key(fetch, bits)
    per_rank = np.bincount(distinct[:, 0], np.where(distinct[:, 1] < 0, kv_batch, 1)
                           * np.where(distinct[:, 2] < 0, kv_heads, 1) * _popcount(distinct_bits), minlength=world)
    sharing = np.maximum(np.bincount(rank, vectors, minlength=world) / np.maximum(per_rank, 1), 1)   # (W,)
    ship_cost = (seg["hi"] - seg["lo"]) * (world - 1) * ship_copies * ship_weight
    candidate = wide / sharing[seg["rank"]] > ship_cost
    if not candidate.any():
        return shipped
    _, code = unique_rows(fetch)                                       # one int per (rank, example, head, block)
    fetched = np.unique(code[~candidate[segment]])                     # what the other segments fetch
    shipped[candidate] = True
    order = np.argsort(segment, kind="stable")
    bounds = np.searchsorted(segment[order], np.arange(len(shipped) + 1))
    for s in np.flatnonzero(candidate)[np.argsort(wide[candidate], kind="stable")]:
        mine = order[bounds[s]:bounds[s + 1]]
        if vectors[mine][~np.isin(code[mine], fetched)].sum() <= ship_cost[s]:
            shipped[s] = False
            fetched = np.union1d(fetched, code[mine])
    return shipped


def _kv_keys(group: np.ndarray, layout: BlockLayout, kv_batch: int, kv_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Layout groups (example * Hl + head) -> (example of k, or -1 for all of them; kv head, or -1 for all)."""
    bl, hl = layout.index.full_ptr.shape[:2]
    if bl == 1:
        example = np.full(len(group), -1)
    elif kv_batch == 1:
        example = np.zeros(len(group), dtype=np.int64)      # per-example layouts over one shared k, v
    else:
        example = group // hl
    head = (group % hl) // (layout.heads // kv_heads) if hl > 1 else np.full(len(group), -1)
    return example.astype(np.int64), head.astype(np.int64)


def _or_by_key(key: np.ndarray, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``key`` (n, k) made distinct, the packed ``bits`` of equal keys OR-ed: (keys, bits)."""
    first, inverse = unique_rows(key)
    order = np.argsort(inverse, kind="stable")
    starts = np.searchsorted(inverse[order], np.arange(len(first)))
    merged = np.bitwise_or.reduceat(bits[order], starts, axis=0) if len(first) else bits[:0]
    return key[first], merged


def _popcount(bits: np.ndarray) -> np.ndarray:
    """Set bits of each row of packed bits (n, bytes)."""
    return np.unpackbits(bits, axis=1).sum(1, dtype=np.int64)


def _positions(fetch: dict[str, np.ndarray], select: np.ndarray, step: int) -> dict[str, np.ndarray]:
    """Fetches (rows of ``select``) as one row per position (the ``token`` column), other columns repeated."""
    rows = {name: column[select] for name, column in fetch.items() if name != "bits"}
    entry, col = np.nonzero(np.unpackbits(fetch["bits"][select], axis=1))
    out = {name: column[entry] for name, column in rows.items()}
    out["token"] = rows["block"][entry] * step + col
    return out


def _expand(rows: dict[str, np.ndarray], kv_batch: int, kv_heads: int, order: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Fetched positions as one row per key vector: an example key of -1 expanded to every example
    of k, a head key of -1 to every kv head; sorted by ``order`` then (example, head, position), the order
    both ends of an exchange agree on."""
    all_examples, all_heads = bool((rows["example"] < 0).any()), bool((rows["head"] < 0).any())  # all or none
    n_examples, n_heads = kv_batch if all_examples else 1, kv_heads if all_heads else 1
    copy = np.arange(len(rows["token"]) * n_examples * n_heads) % (n_examples * n_heads)
    out = {name: np.repeat(column, n_examples * n_heads) for name, column in rows.items()}
    if all_examples:
        out["example"] = copy // n_heads
    if all_heads:
        out["head"] = copy % n_heads
    sort = np.lexsort(tuple(out[name] for name in ("token", "head", "example", *reversed(order))))
    return {name: column[sort] for name, column in out.items()}
