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

import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch

from ._host import host_only
from .blocks import block_areas, ceil_div, check_lengths
from .checks import check_bool, check_int, check_token_mask
from .documents import Spans, check_documents, document_ids, document_spans
from .layout import BlockLayout, CallData
from .rules import Context, Rule, block_table, resolve, with_call_data

_TILE_ELEMENTS = 1 << 20  # token pairs evaluated at once when building tiles
_INT32_MAX = 2**31 - 1
_POPCOUNT = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(1)  # set bits of each byte


@host_only  # host-side numpy: under torch.compile a graph break, not a trace
def build_layout(pattern, n_q: int, n_k: int | None = None, heads: int = 1, block_size: int = 64, *,
                 causal: bool = False, global_mask=None, key_padding_mask=None, documents=None,
                 cache: bool = True, batch: int | None = None,
                 classes: DocumentClassCache | None = None) -> BlockLayout:
    """What :meth:`Pattern.layout` returns. Layouts are cached, call-time masks and documents by their values,
    so every layer of a model called with the same padding shares one layout; ``cache=False`` builds anew
    (what a benchmark of the build times). ``batch``: the batch the masks and documents must have (the
    inputs' in ``sparse_attention``; None: any, the same for all). ``classes``: where classified documents are
    kept between calls (default: ``DOCUMENT_CLASSES``, or none with ``cache=False``).

    Under ``torch.compile`` this is a graph break; for ``fullgraph=True`` build the layout outside
    the compiled function and pass it to ``sparse_attention``.
    """
    n_q, n_k = check_lengths(n_q, n_k)
    heads, block_size = check_int("heads", heads, 1), check_int("block_size", block_size, 1)
    causal = check_bool("causal", causal)
    pattern.check_heads(heads)
    documents = _document_values(documents, check_call_masks(n_q, n_k, global_mask, key_padding_mask, batch,
                                                             documents))
    global_mask, key_padding_mask = _mask_values("global_mask", global_mask), _mask_values("key_padding_mask",
                                                                                            key_padding_mask)
    documents = _Documents.of(documents)
    if classes is None:
        classes = DOCUMENT_CLASSES if cache else DocumentClassCache(budget=2**62)   # one call's, unbounded
    if not cache:
        return _compile(pattern, n_q, n_k, heads, block_size, causal, global_mask, key_padding_mask, documents,
                        classes)
    call_data = (_Mask.of(global_mask), _Mask.of(key_padding_mask), documents)
    key = (pattern, n_q, n_k, heads, block_size, causal, call_data)
    layout = LAYOUT_CACHE.get(key)
    if layout is None:
        layout = _compile(pattern, n_q, n_k, heads, block_size, causal, global_mask, key_padding_mask, documents,
                          classes)
        LAYOUT_CACHE.put(key, layout, None if call_data == (None, None, None) else call_data)
    return layout


def check_call_masks(n_q: int, n_k: int, global_mask, key_padding_mask, batch: int | None = None,
                     documents=None) -> np.ndarray | None:
    """The call-time masks' types and shapes (``batch=None``: any batch, the same for all), and the documents
    (``sparse_attn.documents.check_documents``), returned as an int64 array (None when not given).

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
        batch = key_padding_mask.shape[0]
    if documents is None:
        return None
    if n_q != n_k:
        raise ValueError(f"documents needs n_q == n_k (each document is its own sequence of queries and keys), "
                         f"got n_q={n_q}, n_k={n_k}; pass documents only for self-attention over a packed sequence")
    return check_documents(documents, batch, n_q)


def _mask_values(name: str, mask) -> np.ndarray | None:
    """A checked call-time mask as the numpy array its layout is built from."""
    if isinstance(mask, torch.Tensor):
        if mask.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor: its values, which decide the layout, cannot be read; pass "
                             f"a tensor with values (sparse_attention with meta q, k, v needs no layout)")
        mask = mask.detach().cpu().numpy()
    return mask


def _document_values(documents, ids: np.ndarray | None) -> np.ndarray | None:
    """The checked ids of a documents tensor; a meta tensor's values, which decide the layout, cannot be read."""
    if documents is not None and ids is None:
        raise ValueError("documents is a meta tensor: its values, which decide the layout, cannot be read; pass a "
                         "tensor with values (sparse_attention with meta q, k, v needs no layout)")
    return ids


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


class _Documents(NamedTuple):
    """Checked documents as a hashable value, for the layout cache and the compiler: the batch and the
    spans (``sparse_attn.documents.Spans``: example, start, length and id of every document) as bytes."""

    batch: int
    spans: bytes

    @staticmethod
    def of(ids: np.ndarray | None) -> _Documents | None:
        return None if ids is None else _Documents(ids.shape[0], np.stack(document_spans(ids)).tobytes())

    def example(self, b: int) -> Spans:
        """The documents of example ``b``."""
        spans = np.frombuffer(self.spans, np.int64).reshape(len(Spans._fields), -1)
        return Spans(*spans[:, spans[0] == b])

    def ids(self, n: int) -> np.ndarray:
        """The (batch, n) int64 ids these documents were read from."""
        return document_ids(Spans(*np.frombuffer(self.spans, np.int64).reshape(len(Spans._fields), -1)), self.batch, n)


class LayoutCache:
    """The layouts ``build_layout`` keeps: least recently used out first, within ``budget`` bytes.

    A layout counts its index tensors and call-time data, plus ``ENTRY_BYTES`` for the objects around them.
    Layouts built with call-time data (padding or global masks, packed documents: what changes with every
    batch) are kept for the ``recent`` latest values of that data only: every layer of a model called with
    one batch shares one layout, and the next batches' layouts replace it, so a packed training run never
    fills the cache with packings that will not recur. The latest layout is kept even when it alone is over
    the budget (so a model's layers share it), with nothing else.

    >>> import sparse_attn as sa
    >>> cache = LayoutCache(budget=1 << 20)
    >>> layout = build_layout(sa.Local(8), 256, cache=False)
    >>> cache.put(("Local(8)", 256), layout, call_data=None)
    >>> cache.get(("Local(8)", 256)) is layout, len(cache), cache.nbytes <= cache.budget
    (True, 1, True)
    """

    ENTRY_BYTES = 8 << 10  # a layout's Python and tensor objects: measured at about 7.5 KB on CPython 3.11

    def __init__(self, budget: int, recent: int = 2):
        self.recent = check_int("recent", recent, 1)
        self._entries: OrderedDict[tuple, tuple[BlockLayout, object, int]] = OrderedDict()  # latest last
        self._call_data: OrderedDict[object, None] = OrderedDict()    # call-time data values, latest last
        self._nbytes = 0
        self._lock = threading.Lock()
        self.budget = budget

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def budget(self) -> int:
        """The bytes the kept layouts may count; lowering it drops the least recently used ones at once."""
        return self._budget

    @budget.setter
    def budget(self, value: int) -> None:
        with self._lock:
            self._budget = check_int("budget", value, 0)
            self._keep_budget()

    @property
    def nbytes(self) -> int:
        """The bytes the kept layouts count."""
        return self._nbytes

    @property
    def layouts(self) -> list[BlockLayout]:
        """The kept layouts, least recently used first."""
        with self._lock:
            return [layout for layout, _, _ in self._entries.values()]

    def get(self, key) -> BlockLayout | None:
        """The layout kept for ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            if entry[1] is not None:
                self._call_data.move_to_end(entry[1])
            return entry[0]

    def put(self, key, layout: BlockLayout, call_data) -> None:
        """Keep ``layout`` for ``key``; ``call_data``: the hashable call-time data it was built with, or None."""
        with self._lock:
            self._drop(key)
            size = layout_bytes(layout) + self.ENTRY_BYTES
            self._entries[key] = (layout, call_data, size)
            self._nbytes += size
            if call_data is not None:
                self._call_data[call_data] = None
                self._call_data.move_to_end(call_data)
                while len(self._call_data) > self.recent:
                    stale, _ = self._call_data.popitem(last=False)
                    for old in [k for k, (_, data, _) in self._entries.items() if data == stale]:
                        self._drop(old)
            self._keep_budget()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._call_data.clear()
            self._nbytes = 0

    def _keep_budget(self) -> None:
        while len(self._entries) > 1 and self._nbytes > self._budget:
            self._drop(next(iter(self._entries)))

    def _drop(self, key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._nbytes -= entry[2]


def layout_bytes(layout: BlockLayout) -> int:
    """Bytes of a layout's index tensors and call-time data on the host."""
    tensors = sum(t.numel() * t.element_size() for t in layout.index)
    return tensors + sum(a.nbytes for a in layout.call_data or () if a is not None)


LAYOUT_CACHE = LayoutCache(budget=256 << 20)  # what build_layout keeps; set LAYOUT_CACHE.budget to change it


class DocumentClassCache:
    """Classified documents (a class's blocks and tiles, see ``_document_blocks``) kept across calls, least
    recently used out first past ``budget`` bytes. A packed training run meets the same document lengths
    batch after batch: each (pattern, head, causal, block, length, offset, own global tokens and padding)
    is classified once, and the next batches only translate its blocks.

    >>> import sparse_attn as sa
    >>> cache = DocumentClassCache(budget=1 << 20)
    >>> docs = torch.tensor([[0] * 100 + [1] * 156])
    >>> first = build_layout(sa.Local(8), 256, documents=docs, cache=False, classes=cache)
    >>> again = build_layout(sa.Local(8), 256, documents=docs + 3, cache=False, classes=cache)
    >>> len(cache), cache.hits                       # two documents classified once, found again in the next call
    (2, 2)
    """

    ENTRY_BYTES = 1 << 10  # a class's tuple and array objects

    def __init__(self, budget: int):
        self._entries: OrderedDict[tuple, tuple[tuple, int]] = OrderedDict()  # latest last
        self._nbytes = 0
        self._lock = threading.Lock()
        self.budget = check_int("budget", budget, 0)
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple) -> tuple | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: tuple, value: tuple) -> None:
        with self._lock:
            size = sum(a.nbytes for a in value) + self.ENTRY_BYTES
            old = self._entries.pop(key, None)
            self._nbytes += size - (old[1] if old else 0)
            self._entries[key] = (value, size)
            while self._nbytes > self.budget and len(self._entries) > 1:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._nbytes -= dropped

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._nbytes = self.hits = 0


DOCUMENT_CLASSES = DocumentClassCache(budget=64 << 20)  # what build_layout keeps of classified documents


def _compile(pattern, n_q, n_k, heads, block_size, causal, global_mask, key_padding_mask,
             documents: _Documents | None, classes: DocumentClassCache) -> BlockLayout:
    """The layout of checked arguments; the masks are bool numpy arrays (batch, n) or None; ``classes``: the
    classified documents to reuse and add to."""
    # a block_size beyond both lengths means one block a side, as a block of max(n_q, n_k) does: compile
    # with that, so no cost and no intermediate depends on how large block_size is
    step = min(block_size, max(n_q, n_k))
    batch = next((m.shape[0] for m in (global_mask, key_padding_mask) if m is not None),
                 None if documents is None else documents.batch)
    n_heads = heads if pattern.head_dependent else 1
    tables, tiles = [], []
    for b in range(batch or 1):
        positions = None if global_mask is None else global_mask[b]
        padding = None if key_padding_mask is None else key_padding_mask[b]
        if documents is None:
            positions = None if positions is None else np.flatnonzero(positions).astype(np.int64)
        else:
            spans = documents.example(b)
            groups = _document_classes(spans, step, positions, padding)  # for every head
        for h in range(n_heads):
            if documents is None:
                ctx = Context(n_q, n_k, h)
                rule = with_call_data(resolve(pattern, ctx), positions, causal, padding)
                keys, full, tile, masks, _ = _blocks_and_tiles(rule, ctx, step, (min(step, n_q), min(step, n_k)))
            else:
                keys, full, tile, masks = _document_blocks(pattern, h, causal, groups, spans, n_q, step, classes)
            tables.append((keys, full, np.where(full, -1, tile + sum(len(t) for t in tiles))))
            tiles.append(masks)
    masks, remap = _unique_tiles(np.concatenate(tiles), min(step, n_k))
    n_kb = ceil_div(n_k, step)
    shape = (batch or 1, n_heads)
    group = np.concatenate([np.full(len(t[0]), g, dtype=np.int64) for g, t in enumerate(tables)])
    keys, full, tile = (np.concatenate(column) for column in zip(*tables))
    if len(keys) > _INT32_MAX:
        raise ValueError(f"the layout has {len(keys)} (example, head, block) entries, more than its int32 indices "
                         f"hold ({_INT32_MAX}); use a larger block_size (got {block_size})")
    tensors = csr_index(group, keys // n_kb, keys % n_kb, full, remap[tile[~full]], shape, ceil_div(n_q, step), n_kb)
    tensors["masks"] = torch.from_numpy(masks)
    call_data = CallData(None if documents is None else documents.ids(n_q),        # copies: the caller's arrays
                         *(None if m is None else np.array(m, dtype=bool) for m in (key_padding_mask, global_mask)))
    return BlockLayout.trusted(pattern=pattern, n_q=n_q, n_k=n_k, heads=heads, block_size=block_size, causal=causal,
                               call_data=call_data, **tensors)


def csr_index(group: np.ndarray, rows: np.ndarray, cols: np.ndarray, full: np.ndarray, part_tile: np.ndarray,
              shape: tuple[int, int], n_q_blocks: int, n_k_blocks: int) -> dict[str, torch.Tensor]:
    """A BlockLayout's index tensors, all but ``masks``, from its computed blocks sorted by (group, row, col):
    each one's group (example * Hl + head, in a ``shape`` = (Bl, Hl) layout), block row and column, whether it
    is full, and for the partial ones (in the same order) their tile's index in ``masks``."""
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


def _blocks_and_tiles(rule: Rule, ctx: Context, bs: int, tile_shape: tuple[int, int], offset: int = 0,
                      keep_cut: bool = False):
    """Blocks of one (example, head): keys, full flags, tile ids of partial blocks, tiles (bits packed along
    the keys, as ``np.packbits(tile, axis=-1)``), and which blocks are cut (reach past the sequence's start
    or end).

    Partial blocks are grouped by signature (plus how they are cut by the sequence ends); one tile per
    group is evaluated at token level, then tiles that turn out all-allowed promote their blocks to full
    and all-empty ones drop them. ``offset``: the grid starts that many tokens before position 0 (a
    packed document, see :meth:`~sparse_attn.rules.Blocks.at`); ``keep_cut``: cut blocks keep their tile,
    never full, for a caller that merges them with the rest of their block.
    """
    keys, full, sig = block_table(rule, ctx, bs, offset)
    n_qb, n_kb = ceil_div(ctx.n_q + offset, bs), ceil_div(ctx.n_k + offset, bs)
    rows, cols = keys // n_kb, keys % n_kb
    cut = (((rows == 0) & (offset > 0)) * 8 + ((rows == n_qb - 1) & ((ctx.n_q + offset) % bs != 0)) * 4
           + ((cols == 0) & (offset > 0)) * 2 + ((cols == n_kb - 1) & ((ctx.n_k + offset) % bs != 0)))
    part = np.flatnonzero(~full | (keep_cut & (cut > 0)))
    first, group = unique_rows(np.column_stack([sig[part], cut[part]]))
    starts = rows[part][first] * bs - offset, cols[part][first] * bs - offset
    tiles = _tiles(rule, ctx, tile_shape, *starts)
    allowed = tiles.sum((1, 2))
    area = (np.minimum(starts[0] + bs, ctx.n_q) - np.maximum(starts[0], 0)) * (
        np.minimum(starts[1] + bs, ctx.n_k) - np.maximum(starts[1], 0))
    promote = (allowed == area) & ~(keep_cut & (cut[part][first] > 0))
    keep_tile = (allowed > 0) & ~promote
    new_id = np.cumsum(keep_tile) - 1
    keep = np.ones(len(keys), dtype=bool)
    keep[part] = allowed[group] > 0
    full = full.copy()
    full[part] = promote[group]
    tile = np.full(len(keys), -1, dtype=np.int64)
    tile[part] = np.where(keep_tile[group], new_id[group], -1)
    return keys[keep], full[keep], tile[keep], np.packbits(tiles[keep_tile], axis=-1), cut[keep] > 0


def _document_blocks(pattern, head: int, causal: bool, groups: list, spans: Spans, n: int, step: int,
                     classes: DocumentClassCache):
    """Blocks of one (example, head) of packed documents (``groups``: the example's ``_document_classes``):
    keys, full flags, tile ids, tiles (as ``_blocks_and_tiles``).

    Each document is resolved as a sequence of its own length (with its own global tokens and padding)
    and classified in a block grid offset by where it starts in its first block. Documents of equal
    length and offset have the same blocks up to a translation by whole blocks, so a class of them is
    classified once (``classes`` keeps the classes of earlier examples and calls) and its blocks are translated to
    every member. A block that lies inside one document is that document's; a block cut by a document's
    ends is the union of the parts of every document in it (only diagonal blocks hold several), merged
    from the parts' tiles and then classified against the block's area.
    """
    n_kb = ceil_div(n, step)
    pool, out, cut_keys, cut_tiles = [], [], [], []       # tiles; uncut (keys, full, tile); cut parts
    n_pool = 0
    for key, members in groups:
        found = classes.get((pattern, head, causal, step, key))
        if found is None:
            found = _document_class(pattern, head, causal, key, step)
            classes.put((pattern, head, causal, step, key), found)
        keys, full, tile, tiles, cut = found
        per_side = ceil_div(key[0] + key[1], step)
        first = spans.start[members] // step                                      # (m,) first block of each
        shifted = (first[:, None] + keys // per_side) * n_kb + first[:, None] + keys % per_side   # (m, k)
        tile = np.where(tile >= 0, tile + n_pool, -1)
        out.append((shifted[:, ~cut].reshape(-1), np.tile(full[~cut], len(members)), np.tile(tile[~cut], len(members))))
        cut_keys.append(shifted[:, cut].reshape(-1))
        cut_tiles.append(np.tile(tile[cut], len(members)))
        pool.append(tiles)
        n_pool += len(tiles)
    pool = np.concatenate(pool) if pool else np.zeros((0, step, ceil_div(step, 8)), dtype=np.uint8)
    no_parts = np.zeros(0, dtype=np.int64)
    *merged_blocks, merged = _merge_parts(np.concatenate(cut_keys or [no_parts]),
                                          np.concatenate(cut_tiles or [no_parts]), pool, n, step)
    keys, full, tile = (np.concatenate(column) for column in zip(*out, merged_blocks))
    pool = np.concatenate([pool, merged])
    order = np.argsort(keys)
    keys, full, tile = keys[order], full[order], tile[order]
    used = np.unique(tile[tile >= 0])                    # parts merged into another tile are dropped
    return keys, full, np.where(tile >= 0, np.searchsorted(used, tile), -1), pool[used]


def _document_classes(spans: Spans, step: int, global_row, padding_row):
    """Classes of documents resolving to the same blocks: ``(key, member indices)``, the key being (length,
    offset in the first block, global positions, padded positions) with the last two None where they play no
    part (positions within the document, as int64 bytes). Documents with their own global tokens or padding
    form classes by those values; every other document by its length and offset alone (a pattern, Random's
    draws included, depends on nothing else)."""
    length, offset = spans.length, spans.start % step
    own = np.zeros(len(length), dtype=bool)
    for row in (global_row, padding_row):
        if row is not None:
            before = np.concatenate([[0], np.cumsum(row)])
            own |= before[spans.start + length] > before[spans.start]
    shared = np.flatnonzero(~own)
    code = length[shared] * step + offset[shared]
    values, inverse = np.unique(code, return_inverse=True)
    groups = np.split(shared[np.argsort(inverse, kind="stable")], np.cumsum(np.bincount(inverse.reshape(-1)))[:-1])
    classes = {(int(v // step), int(v % step), None, None): g for v, g in zip(values, groups)}
    for d in np.flatnonzero(own):
        s, e = spans.start[d], spans.start[d] + length[d]
        key = (int(length[d]), int(offset[d]),
               *(None if row is None or not row[s:e].any() else np.flatnonzero(row[s:e]).astype(np.int64).tobytes()
                 for row in (global_row, padding_row)))
        classes.setdefault(key, []).append(d)
    return [(key, np.asarray(members, dtype=np.int64)) for key, members in classes.items()]


def _document_class(pattern, head: int, causal: bool, key: tuple, step: int):
    """``_blocks_and_tiles`` of a class's document alone (``key`` from ``_document_classes``), in the grid of
    its offset, cut blocks kept as tiles."""
    length, offset, global_positions, padded = key
    ctx = Context(length, length, head)
    if global_positions is not None:
        global_positions = np.frombuffer(global_positions, np.int64)
    padding = None
    if padded is not None:
        padding = np.zeros(length, dtype=bool)
        padding[np.frombuffer(padded, np.int64)] = True
    try:
        resolved = resolve(pattern, ctx)
    except ValueError as error:  # a spec that fits only some lengths (a Blocks grid): say which document
        raise ValueError(f"with documents, the pattern is resolved for each document by itself, and a document "
                         f"of {length} tokens fails: {error}") from error
    rule = with_call_data(resolved, global_positions, causal, padding)
    return _blocks_and_tiles(rule, ctx, step, (step, step), offset, keep_cut=True)


def _merge_parts(keys: np.ndarray, tiles: np.ndarray, pool: np.ndarray, n: int, step: int):
    """Blocks made of parts (block key, packed tile in ``pool``), classified against the block's area: a block
    of one part is that part's tile; the tile of a block of several parts (a diagonal block where documents
    meet) is the OR of theirs, merged once for every set of parts. Returns keys, full flags, tile ids
    (into ``pool`` followed by the merged tiles; -1 for full blocks) and the merged tiles."""
    order = np.lexsort((tiles, keys))
    keys, tiles = keys[order], tiles[order]
    starts = np.flatnonzero(np.append(len(keys) > 0, keys[1:] != keys[:-1]))
    block_keys, sizes = keys[starts], np.diff(np.append(starts, len(keys)))
    tile = tiles[starts]
    allowed = _POPCOUNT[pool].sum((1, 2))[tile]
    several = np.flatnonzero(sizes > 1)
    entries = np.flatnonzero(np.repeat(sizes > 1, sizes))                # the parts of those blocks, in order
    parts = np.full((len(several), int(sizes.max(initial=1))), -1, dtype=np.int64)      # (blocks, most parts)
    parts[np.repeat(np.arange(len(several)), sizes[several]),
          entries - np.repeat(starts[several], sizes[several])] = tiles[entries]
    first, inverse = unique_rows(parts)
    unique = parts[first]
    valid = unique >= 0                                  # each row: its parts first, then -1 padding
    first_part = np.concatenate([[0], np.cumsum(valid.sum(1))[:-1]]).astype(np.int64)
    merged = (np.bitwise_or.reduceat(pool[unique[valid]], first_part, axis=0) if len(unique)
              else pool[:0])                                                            # (merges, tq, tk / 8)
    tile[several] = len(pool) + inverse
    allowed[several] = _POPCOUNT[merged].sum((1, 2))[inverse]
    n_kb = ceil_div(n, step)
    full = allowed == block_areas(block_keys // n_kb, block_keys % n_kb, (step, step), (n, n))
    return block_keys, full, np.where(full, -1, tile), merged


def _tiles(rule: Rule, ctx: Context, tile_shape: tuple[int, int], i0: np.ndarray, j0: np.ndarray) -> np.ndarray:
    """Token masks (n, tq, tk) of blocks starting at query row i0 and key j0 (negative before the sequence's
    start), False outside the sequence. Evaluated a few tile rows at a time, in bounded memory."""
    tq, tk = tile_shape
    out = np.zeros((len(i0) * tq, tk), dtype=bool)                      # every tile row, stacked
    cols = np.arange(tk, dtype=np.int64)
    rows_per_chunk = max(1, _TILE_ELEMENTS // tk)
    for s in range(0, len(out), rows_per_chunk):
        row = np.arange(s, min(s + rows_per_chunk, len(out)), dtype=np.int64)
        i = (i0[row // tq] + row % tq)[:, None]                        # (rows, 1) query rows
        j = j0[row // tq][:, None] + cols[None, :]                     # (rows, tk) keys
        inside = (i >= 0) & (i < ctx.n_q) & (j >= 0) & (j < ctx.n_k)
        positions = np.clip(i, 0, ctx.n_q - 1) + ctx.shift
        out[s:s + len(row)] = rule.allows(positions, np.clip(j, 0, ctx.n_k - 1)) & inside
    return out.reshape(len(i0), tq, tk)


def _unique_tiles(packed: np.ndarray, tk: int) -> tuple[np.ndarray, np.ndarray]:
    """Deduplicate packed tiles (n, tq, ceil(tk / 8)) across examples and heads: (unique tiles as bool
    (m, tq, tk), old index -> new index)."""
    first, inverse = unique_rows(packed.reshape(len(packed), packed[0].size if len(packed) else 0))
    return np.unpackbits(packed[first], axis=-1, count=tk).astype(bool), inverse


def unique_rows(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of a 2-D array: (index of each one's first occurrence, row -> its distinct row's number).
    Rows are compared as raw bytes (one sort of byte strings, much faster than ``np.unique(axis=0)``)."""
    matrix = np.ascontiguousarray(matrix)
    rows = matrix.view(np.dtype((np.void, matrix.dtype.itemsize * matrix.shape[1]))).reshape(-1)
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)
