"""Packed documents in the compiler: each document resolved as a sequence of its own, classified once per
(length, offset in its first block, own global tokens and padding), and moved into place by whole blocks;
blocks where documents meet are the OR of their parts. Classified documents are kept across calls
(``DOCUMENT_CLASSES``).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from .blocks import block_areas, ceil_div, unique_rows
from .checks import check_int
from .documents import Spans
from .rules import Context, resolve, with_call_data
from .tiles import allowed_counts, blocks_and_tiles


class DocumentClassCache:
    """Classified documents (a class's blocks and tiles, see ``_document_blocks``) kept across calls, least
    recently used out first past ``budget`` bytes. A packed training run meets the same document lengths
    batch after batch: each (pattern, head, causal, block, length, offset, own global tokens and padding)
    is classified once, and the next batches only translate its blocks.

    >>> import torch, sparse_attn as sa
    >>> cache = DocumentClassCache(budget=1 << 20)
    >>> docs = torch.tensor([[0] * 100 + [1] * 156])
    >>> from sparse_attn.compiler import build_layout
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




def document_classes(spans: Spans, step: int, global_row, padding_row):
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
    classes: dict[tuple, Any] = {(int(v // step), int(v % step), None, None): g  # arrays, then lists of own docs
                                 for v, g in zip(values, groups)}
    for d in np.flatnonzero(own):
        s, e = spans.start[d], spans.start[d] + length[d]
        key = (int(length[d]), int(offset[d]),
               *(None if row is None or not row[s:e].any() else np.flatnonzero(row[s:e]).astype(np.int64).tobytes()
                 for row in (global_row, padding_row)))
        classes.setdefault(key, []).append(d)
    return [(key, np.asarray(members, dtype=np.int64)) for key, members in classes.items()]


def document_blocks(pattern, head: int, causal: bool, groups: list, spans: Spans, n: int, step: int,
                     classes: DocumentClassCache):
    """Blocks of one (example, head) of packed documents (``groups``: the example's ``document_classes``):
    keys, full flags, tile ids, tiles (as ``tiles.blocks_and_tiles``).

    Each document is resolved as a sequence of its own length (with its own global tokens and padding)
    and classified in a block grid offset by where it starts in its first block. Documents of equal
    length and offset have the same blocks up to a translation by whole blocks, so a class of them is
    classified once (``classes`` keeps the classes of earlier examples and calls) and its blocks are translated to
    every member. A block that lies inside one document is that document's; a block cut by a document's
    ends is the union of the parts of every document in it (only diagonal blocks hold several), merged
    from the parts' tiles and then classified against the block's area.
    """
    n_kb = ceil_div(n, step)
    pool_parts, out, cut_keys, cut_tiles = [], [], [], []  # tiles; uncut (keys, full, tile); cut parts
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
        pool_parts.append(tiles)
        n_pool += len(tiles)
    pool = np.concatenate(pool_parts) if pool_parts else np.zeros((0, step, ceil_div(step, 8)), dtype=np.uint8)
    no_parts = np.zeros(0, dtype=np.int64)
    *merged_blocks, merged = _merge_parts(np.concatenate(cut_keys or [no_parts]),
                                          np.concatenate(cut_tiles or [no_parts]), pool, n, step)
    keys, full, tile = (np.concatenate(column) for column in zip(*out, merged_blocks))
    pool = np.concatenate([pool, merged])
    order = np.argsort(keys)
    keys, full, tile = keys[order], full[order], tile[order]
    used = np.unique(tile[tile >= 0])                    # parts merged into another tile are dropped
    return keys, full, np.where(tile >= 0, np.searchsorted(used, tile), -1), pool[used]


def _document_class(pattern, head: int, causal: bool, key: tuple, step: int):
    """``blocks_and_tiles`` of a class's document alone (``key`` from ``document_classes``), in the grid of
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
    return blocks_and_tiles(rule, ctx, step, (step, step), offset, keep_cut=True)


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
    allowed = allowed_counts(pool)[tile]
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
    allowed[several] = allowed_counts(merged)[inverse]
    n_kb = ceil_div(n, step)
    full = allowed == block_areas(block_keys // n_kb, block_keys % n_kb, (step, step), (n, n))
    return block_keys, full, np.where(full, -1, tile), merged
