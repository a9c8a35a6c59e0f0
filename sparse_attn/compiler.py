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
from .assembly import assemble_layout
from .blocks import ceil_div, check_lengths
from .checks import check_bool, check_int, check_token_mask
from .documents import Spans, check_documents, document_ids, document_spans, document_values
from .layout import BlockLayout, CallData
from .packing import DOCUMENT_CLASSES, DocumentClassCache, document_blocks, document_classes
from .rules import Context, PatternSpec, resolve, with_call_data
from .tiles import blocks_and_tiles, distinct_packed_tiles


@host_only  # host-side numpy: under torch.compile a graph break, not a trace
def build_layout(pattern: PatternSpec, n_q: int, n_k: int | None = None, heads: int = 1, block_size: int = 64, *,
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
    check_call_masks(n_q, n_k, global_mask, key_padding_mask, batch, documents)
    global_mask, key_padding_mask = _mask_values("global_mask", global_mask), _mask_values("key_padding_mask",
                                                                                            key_padding_mask)
    documents = _Documents.of(None if documents is None else _readable("documents", document_values, documents))
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
                     documents=None) -> None:
    """The call-time masks' types and shapes (``batch=None``: any batch, the same for all), and the documents
    (``sparse_attn.documents.check_documents``: their values too, where they have values).

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
    if documents is not None:
        if n_q != n_k:
            raise ValueError(f"documents needs n_q == n_k (each document is its own sequence of queries and keys), "
                             f"got n_q={n_q}, n_k={n_k}; pass documents only for self-attention over a packed "
                             f"sequence")
        check_documents(documents, batch, n_q)


def _mask_values(name: str, mask) -> np.ndarray | None:
    """A checked call-time mask as the numpy array its layout is built from (None: not given)."""
    if mask is None:
        return None
    return _readable(name, lambda m: m.detach().cpu().numpy() if isinstance(m, torch.Tensor) else m, mask)


def _readable(name: str, values, data):
    """``values(data)``, the values a layout is built from; a meta tensor has none to read."""
    if isinstance(data, torch.Tensor) and data.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor: its values, which decide the layout, cannot be read; pass "
                         f"a tensor with values (sparse_attention with meta q, k, v needs no layout)")
    return values(data)


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


def _compile(pattern: PatternSpec, n_q, n_k, heads, block_size, causal, global_mask, key_padding_mask,
             documents: _Documents | None, classes: DocumentClassCache) -> BlockLayout:
    """The layout of checked arguments; the masks are bool numpy arrays (batch, n) or None; ``classes``: the
    classified documents to reuse and add to."""
    # a block_size beyond both lengths means one block a side, as a block of max(n_q, n_k) does: compile
    # with that, so no cost and no intermediate depends on how large block_size is
    step = min(block_size, max(n_q, n_k))
    batch = next((m.shape[0] for m in (global_mask, key_padding_mask) if m is not None),
                 None if documents is None else documents.batch)
    n_heads = heads if pattern.head_dependent else 1
    tables: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    tiles: list[np.ndarray] = []
    for b in range(batch or 1):
        positions = None if global_mask is None else global_mask[b]
        padding = None if key_padding_mask is None else key_padding_mask[b]
        if documents is None:
            positions = None if positions is None else np.flatnonzero(positions).astype(np.int64)
        else:
            spans = documents.example(b)
            groups = document_classes(spans, step, positions, padding)  # for every head
        for h in range(n_heads):
            if documents is None:
                ctx = Context(n_q, n_k, h)
                rule = with_call_data(resolve(pattern, ctx), positions, causal, padding)
                keys, full, tile, masks, _ = blocks_and_tiles(rule, ctx, step, (min(step, n_q), min(step, n_k)))
            else:
                keys, full, tile, masks = document_blocks(pattern, h, causal, groups, spans, n_q, step, classes)
            tables.append((keys, full, np.where(full, -1, tile + sum(len(t) for t in tiles))))
            tiles.append(masks)
    masks, remap = distinct_packed_tiles(np.concatenate(tiles), min(step, n_k))
    n_kb = ceil_div(n_k, step)
    group = np.concatenate([np.full(len(t[0]), g, dtype=np.int64) for g, t in enumerate(tables)])
    keys, full, tile = (np.concatenate(column) for column in zip(*tables))
    call_data = CallData(None if documents is None else documents.ids(n_q),        # copies: the caller's arrays
                         *(None if m is None else np.array(m, dtype=bool) for m in (key_padding_mask, global_mask)))
    return assemble_layout(pattern, n_q=n_q, n_k=n_k, heads=heads, block_size=block_size, causal=causal,
                           shape=(batch or 1, n_heads), blocks_per_side=(ceil_div(n_q, step), n_kb), group=group,
                           rows=keys // n_kb, cols=keys % n_kb, full=full, part_tile=remap[tile[~full]], masks=masks,
                           call_data=call_data)
