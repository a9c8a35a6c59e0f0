"""SparseKVCache: a KV cache that keeps only the keys its pattern can still reach, for decoding.

>>> import torch, sparse_attn as sa
>>> cache = sa.SparseKVCache(sa.Local(7, 0) | sa.Sink(first=2), backend="reference")
>>> prompt = torch.randn(1, 2, 20, 8)                                  # (B, Hkv, N, D)
>>> out = cache.attend(prompt, prompt, prompt)                         # prefill: 20 queries
>>> for _ in range(30):                                                # then one token at a time
...     x = torch.randn(1, 2, 1, 8)
...     out = cache.attend(x, x, x)                                    # (1, 2, 1, 8)
>>> cache.seq_len, len(cache.positions)                                # 50 seen, 2 sinks + 8 held
(50, 10)
>>> sorted(cache.positions.tolist())
[0, 1, 42, 43, 44, 45, 46, 47, 48, 49]

Semantics: the cache holds keys at absolute positions 0, 1, 2, ... (appended in order by
``update``). ``attend(q, k, v)`` appends k, v and returns, for the new queries (at the positions of the
new keys), exactly the rows that ``sparse_attention(q_new, k_all, v_all, pattern)`` computes over the
whole past: the decode path of every pattern (bottom-right aligned, the pattern resolved for
n_q = the new tokens, n_k = every token so far; a non-causal pattern's queries see the later keys of
their own chunk, as the same call does). Keys are dropped by :func:`sparse_attn.retention.retention`:
sinks and global tokens stay in fixed slots, the trailing window in a ring buffer; a pattern with no
bound (a stride, random blocks, ``Causal()`` alone) keeps everything and warns once.

Order: an update first drops what no query at or after its own first position can reach, then
appends, so what it returns is everything its queries need; the next update drops the rest. The ring
holds ``window + chunk`` slots: sized on the first update, reallocated only when the chunk size changes
(a prefill chunk, then single tokens), never step by step.

Imports run one way: this module imports ``api``, ``layout``, ``pattern``, ``retention``, ``rules``,
``blocks``, ``checks``, ``score_mods`` and ``backends``; none of them imports it.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from . import backends
from .api import check_inputs, resolve_scale, sparse_attention
from .checks import check_bool, check_token_mask
from .held_attention import dense_attention, held_mask
from .layout import BlockLayout
from .pattern import check_pattern
from .positions import allowed_at_positions, check_starts, layout_of_mask, over_held_keys
from .retention import retention
from .rules import Context, resolve
from .score_mods import add_sink, alibi_alignment, check_mods, combine_partials

_MASK_PAIRS = 1 << 22  # (query, key) pairs evaluated at once where the held keys have gaps
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what sparse_attention takes
_KEPT_LAYOUTS = 8      # layouts of held positions a cache keeps, by their token mask (a decode step reuses one)
_KEPT_RULES = 64       # resolved rules a cache keeps, by context (a step resolves its context once per head)
_DENSE_ROWS = 64       # new queries up to this run as one dense attention over the held keys (numba, triton)


class SparseKVCache:
    """Keys and values of one attention layer, evicted by what ``pattern`` can still reach.

    Args:
        pattern: the layer's Pattern (a ``PerHead`` one names the query heads it takes).
        backend: for ``attend``: "auto" (triton for CUDA tensors, numba for CPU), "reference", "numba" or
            "triton", as in ``sparse_attention``.

    Storage is allocated on the first ``update`` (batch, kv heads, head dim, dtype and device from k);
    ``nbytes`` is what it holds allocated. Positions are shared by every head and example: for
    ``PerHead`` the cache keeps the union over heads.
    """

    def __init__(self, pattern, *, backend: str = "auto"):
        check_pattern("pattern", pattern)
        self.pattern, self.backend = pattern, backends.check_name(backend)
        self.retention = retention(pattern)
        self._fixed = np.asarray(self.retention.fixed if self.retention.bounded else (), dtype=np.int64)  # their slots
        self._starts: np.ndarray | None = None          # (B,) each example's first token (left padding), None: 0
        self._probe: BlockLayout | None = None          # a one-pair layout to ask the backend before any change
        # (B, Hkv, slots, D): fixed slots, then the ring. None until the first update: the methods that may run
        # before one check for None, the others (appending, writing, compacting) run after one
        self._keys: torch.Tensor = None  # type: ignore[assignment]
        self._values: torch.Tensor = None  # type: ignore[assignment]
        self._slot_positions = np.zeros(0, dtype=np.int64)  # (slots,) position held in each slot, -1 free
        self._ring_head = self._ring_count = 0          # the oldest ring entry (index into the ring), entries
        self._seen = 0
        self._new = np.zeros(0, dtype=np.int64)         # positions appended by the last update
        self._returned: torch.Tensor | None = None      # the held positions the last update returned
        self._layouts: dict[tuple, BlockLayout] = {}    # token mask (packed) -> its layout, latest last
        self._rules: dict[Context, object] = {}         # context -> the pattern's rule there (this step's)
        self._checked: tuple | None = None              # the last call that passed attend's checks, described

    # --- state ---------------------------------------------------------------------------------
    @property
    def bounded(self) -> bool:
        """True when the cache's size stops growing (the pattern's retention is bounded)."""
        return self.retention.bounded

    @property
    def seq_len(self) -> int:
        """Tokens seen (appended) so far: the next token's position."""
        return self._seen

    @property
    def positions(self) -> torch.Tensor:
        """Absolute positions (int64, CPU) of the held keys, in the order ``update`` returns them."""
        return torch.from_numpy(self._slot_positions[self._held_slots()])

    @property
    def nbytes(self) -> int:
        """Bytes of key and value storage allocated."""
        return 0 if self._keys is None else 2 * self._keys.nelement() * self._keys.element_size()

    def __repr__(self) -> str:
        return (f"SparseKVCache({self.pattern!r}, seq_len={self._seen}, held={len(self.positions)}, "
                f"bounded={self.bounded})")

    # --- appending -----------------------------------------------------------------------------
    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append k, v (B, Hkv, n_new, D) at the next positions; returns the held keys and values (B, Hkv,
        n_held, D) and their positions (int64 (n_held,), CPU), in slot order: the fixed tokens ascending, then
        the ring's slots (ascending positions until the ring wraps; the positions say which key is where).
        A view of the storage when the slots in use are contiguous (the steady state), else a gathered copy.
        Raises before changing anything if k, v cannot continue this cache."""
        self._check_kv(k, v)
        return self._append(k, v)

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n_new = k.shape[2]
        if n_new == 1 and self._replaces_oldest():
            return self._append_one(k, v)
        new = np.arange(self._seen, self._seen + n_new, dtype=np.int64)
        self._evict(t=self._seen)
        fixed = np.isin(new, self._fixed) if len(self._fixed) and new[0] <= self._fixed[-1] else \
            np.zeros(n_new, dtype=bool)
        self._make_room(k, int((~fixed).sum()))
        slots = np.empty(n_new, dtype=np.int64)
        slots[fixed] = np.searchsorted(self._fixed, new[fixed])
        ring_size = len(self._slot_positions) - len(self._fixed)
        ring = (self._ring_head + self._ring_count + np.arange(int((~fixed).sum()))) % max(ring_size, 1)
        slots[~fixed] = len(self._fixed) + ring
        self._ring_count += len(ring)
        self._write(slots, k, v)
        self._slot_positions[slots] = new
        self._seen += n_new
        self._new = new
        held = self._held_slots()
        if len(held) and held[-1] - held[0] == len(held) - 1:                # contiguous slots: a view
            keys, values = (t.narrow(2, int(held[0]), len(held)) for t in (self._keys, self._values))
        else:
            index = torch.from_numpy(held).to(self._keys.device)
            keys, values = self._keys.index_select(2, index), self._values.index_select(2, index)
        self._returned = torch.from_numpy(self._slot_positions[held])
        return keys, values, self._returned

    def _replaces_oldest(self) -> bool:
        """Whether the next token takes the oldest ring entry's slot: the steady decode step of a bounded
        pattern (every slot in use, the global queries behind, the oldest entry leaving the window now,
        the token not a fixed one)."""
        r, t = self.retention, self._seen
        ring_size = len(self._slot_positions) - len(self._fixed)
        if not r.bounded or self._ring_count != ring_size or ring_size == 0 or t <= self._dense_until() \
                or (len(self._fixed) and t <= self._fixed[-1]):           # (every fixed token appended: held)
            return False
        return self._slot_positions[len(self._fixed) + self._ring_head] == t - r.window - 1

    def _append_one(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_append`` of one token when :meth:`_replaces_oldest`: its key and value overwrite the oldest
        entry's slot, the ring turns by one, and the storage (every slot) is what the step attends."""
        slot = len(self._fixed) + self._ring_head
        self._keys.select(2, slot).copy_(k.select(2, 0))
        self._values.select(2, slot).copy_(v.select(2, 0))
        self._slot_positions[slot] = self._seen
        self._ring_head = (self._ring_head + 1) % (len(self._slot_positions) - len(self._fixed))
        self._new = np.arange(self._seen, self._seen + 1, dtype=np.int64)
        self._seen += 1
        self._returned = torch.from_numpy(self._slot_positions.copy())
        return self._keys, self._values, self._returned

    def _check_kv(self, k, v) -> None:
        """k, v as the caller passed them, and that they continue the held keys (batch, heads, head dim, dtype,
        device; the batch of ``set_starts``)."""
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4 or min(t.shape) == 0:
                raise ValueError(f"{name} must have shape (batch, kv_heads, n_new, head_dim) with every size >= 1, "
                                 f"got {tuple(t.shape)}")
        if (k.shape, k.dtype, k.device) != (v.shape, v.dtype, v.device):
            raise ValueError(f"k and v must have the same shape, dtype and device, got k {tuple(k.shape)} ({k.dtype}, "
                             f"{k.device}) and v {tuple(v.shape)} ({v.dtype}, {v.device})")
        if k.dtype not in _DTYPES:
            raise TypeError(f"k and v must be float16, bfloat16, float32 or float64, got {k.dtype}")
        if self._keys is not None:
            b, h, _, d = self._keys.shape
            if (k.shape[0], k.shape[1], k.shape[3], k.dtype, k.device) != (b, h, d, self._keys.dtype,
                                                                              self._keys.device):
                raise ValueError(f"k of shape {tuple(k.shape)} ({k.dtype}, {k.device}) does not continue this cache "
                                 f"of (batch, kv_heads, head_dim) = {(b, h, d)} ({self._keys.dtype}, "
                                 f"{self._keys.device}); use one SparseKVCache per layer and sequence batch")
        if self._starts is not None and k.shape[0] != len(self._starts):
            raise ValueError(f"k has batch {k.shape[0]} but set_starts gave {len(self._starts)} starts (one per "
                             f"example); use one SparseKVCache per sequence batch")

    def _dense_until(self) -> int:
        """The retention's ``dense_until`` in this batch: the last global query of the example that starts last."""
        until = self.retention.dense_until
        return until + int(self._starts.max()) if until >= 0 and self._starts is not None else until

    def _evict(self, t: int) -> None:
        """Drop ring entries that no query at a position >= t can reach (the oldest first)."""
        r = self.retention
        if not r.bounded or t <= self._dense_until() or self._ring_count == 0:
            return
        oldest = self._slot_positions[self._ring_slots(1)[0]]
        # ascending positions: at most (t - window) - oldest entries lie below the window (one per decode step)
        ring = self._ring_slots(min(self._ring_count, max(t - r.window - int(oldest), 0)))
        old = int(np.searchsorted(self._slot_positions[ring], t - r.window))   # entries below the window
        self._slot_positions[ring[:old]] = -1
        ring_size = len(self._slot_positions) - len(self._fixed)
        self._ring_head, self._ring_count = (self._ring_head + old) % ring_size, self._ring_count - old

    def _make_room(self, k: torch.Tensor, n_ring: int) -> None:
        """Room for ``n_ring`` more ring entries. The ring grows by doubling up to ``window + n_ring`` slots
        (what it holds once the window is full: at most ``window`` entries survive an eviction), and comes
        back to that size after a larger chunk or after the global queries have run; while everything is
        kept (an unbounded pattern, global queries still to come) it grows by doubling."""
        r = self.retention
        ring_size = len(self._slot_positions) - len(self._fixed)
        needed = self._ring_count + n_ring
        steady = r.bounded and self._seen > self._dense_until()
        target = r.window + n_ring if steady else None
        if ring_size < needed:
            size = max(needed, 2 * ring_size) if target is None else min(max(needed, 2 * ring_size), target)
        elif target is not None and ring_size > target:
            size = target
        elif self._keys is None:
            size = needed
        else:
            return
        b, h, _, d = k.shape
        n_fixed = len(self._fixed)
        keys = k.new_empty(b, h, n_fixed + size, d)                                          # (B, Hkv, S, D)
        values = k.new_empty(b, h, n_fixed + size, d)
        positions = np.full(n_fixed + size, -1, dtype=np.int64)
        if self._keys is not None:                       # fixed slots as they are, the ring unrolled
            old = np.concatenate([np.arange(n_fixed), self._ring_slots()])
            index = torch.from_numpy(old).to(k.device)
            keys[:, :, :len(old)] = self._keys.index_select(2, index)
            values[:, :, :len(old)] = self._values.index_select(2, index)
            positions[:len(old)] = self._slot_positions[old]
        elif not r.bounded:
            warnings.warn(f"SparseKVCache keeps every key of {self.pattern!r}: {r.reason}, so no key can be "
                          f"dropped and the cache grows with the sequence", stacklevel=4)
        self._keys, self._values, self._slot_positions, self._ring_head = keys, values, positions, 0

    def _write(self, slots: np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        if len(slots) and slots[-1] - slots[0] == len(slots) - 1 and (np.diff(slots) == 1).all():  # a slice
            self._keys.narrow(2, int(slots[0]), len(slots)).copy_(k)
            self._values.narrow(2, int(slots[0]), len(slots)).copy_(v)
        else:
            index = torch.from_numpy(slots).to(k.device)
            self._keys.index_copy_(2, index, k)
            self._values.index_copy_(2, index, v)

    def _ring_slots(self, count: int | None = None) -> np.ndarray:
        """The slots of the oldest ``count`` ring entries (None: all), oldest first."""
        ring_size = len(self._slot_positions) - len(self._fixed)
        count = self._ring_count if count is None else count
        return len(self._fixed) + (self._ring_head + np.arange(count)) % max(ring_size, 1)

    def _held_slots(self) -> np.ndarray:
        """The slots in use, in slot order (a full storage is then one slice)."""
        in_use = self._slot_positions >= 0
        return np.arange(len(in_use)) if in_use.all() else np.flatnonzero(in_use)

    # --- left padding ------------------------------------------------------------------------
    @property
    def starts(self) -> torch.Tensor | None:
        """Each example's first token (int64 (B,), CPU) as given to ``set_starts``, or None (every example at 0)."""
        return None if self._starts is None else torch.from_numpy(self._starts.copy())

    def set_starts(self, starts) -> None:
        """Mark a left-padded batch: example b's tokens before position ``starts[b]`` are padding, and the
        pattern's positions count from ``starts[b]`` (as Hugging Face's position ids do), so each example's
        rows equal those of its own sequence run alone.

        >>> import torch, sparse_attn as sa
        >>> cache = sa.SparseKVCache(sa.Local(3, 0) | sa.Sink(first=1), backend="reference")
        >>> cache.set_starts([0, 2])                   # example 1: two padding tokens, its sink at position 2
        >>> x = torch.randn(2, 1, 6, 4)                 # (B, Hkv, N, D), left-padded prompts
        >>> out = cache.attend(x, x, x)
        >>> for _ in range(8):
        ...     x = torch.randn(2, 1, 1, 4)
        ...     out = cache.attend(x, x, x)
        >>> sorted(cache.positions.tolist())            # both sinks, the window of 3 and the newest token
        [0, 2, 10, 11, 12, 13]

        ``starts``: (B,) ints >= 0, one per example, before or after the prefill's update (a Hugging Face
        cache learns them from the attention mask after its first update); they may change only while the
        keys the new starts need are still held, else a ValueError and nothing changes. Keys before an
        example's start are never attended and its queries there return 0 (no key_padding_mask needed). The
        cache keeps each example's sinks and global tokens at ``starts[b] + position`` (the union over the
        batch, as for ``PerHead``).
        """
        held_batch = None if self._keys is None else self._keys.shape[0]
        starts = check_starts(starts, held_batch)
        fixed = np.unique(self._fixed_of(starts))
        self._check_still_held(starts, fixed)
        if self._keys is not None and not np.array_equal(fixed, self._fixed):
            self._move_fixed(fixed)
        self._fixed, self._starts = fixed, starts

    def _fixed_of(self, starts: np.ndarray) -> np.ndarray:
        """The positions kept in fixed slots: the retention's fixed tokens counted from every start."""
        fixed = np.asarray(self.retention.fixed if self.retention.bounded else (), dtype=np.int64)
        return (starts[:, None] + fixed[None, :]).ravel()

    def _check_still_held(self, starts: np.ndarray, fixed: np.ndarray) -> None:
        """Refuse starts that need keys this cache has already dropped."""
        until = self.retention.dense_until
        needed = [fixed[fixed < self._seen]]
        needed += [np.arange(s, self._seen) for s in np.unique(starts) if self._seen <= until + s]  # global rows
        held = self._slot_positions[self._held_slots()]
        gone = np.setdiff1d(np.concatenate(needed), held)
        if len(gone):
            raise ValueError(f"set_starts({starts.tolist()}) needs the keys at positions {gone[:8].tolist()}, which "
                             f"this cache has already dropped (it had starts "
                             f"{None if self._starts is None else self._starts.tolist()}); set the starts before "
                             f"the second update, once the prefill has shown where each example begins")

    def _move_fixed(self, fixed: np.ndarray) -> None:
        """Re-slot the held keys for a new set of fixed positions: those in it to their fixed slots, the others
        into the ring in position order (one copy, when a prefill reveals the starts)."""
        held = self._held_slots()
        positions = self._slot_positions[held]
        in_fixed = np.isin(positions, fixed)
        ring = held[~in_fixed][np.argsort(positions[~in_fixed], kind="stable")]
        ring_size = max(len(self._slot_positions) - len(self._fixed), len(ring))
        slots = np.concatenate([np.searchsorted(fixed, positions[in_fixed]), len(fixed) + np.arange(len(ring))])
        sources = np.concatenate([held[in_fixed], ring])
        b, h, _, d = self._keys.shape
        index = torch.from_numpy(sources).to(self._keys.device)
        target = torch.from_numpy(slots).to(self._keys.device)
        keys, values = self._keys.new_empty(b, h, len(fixed) + ring_size, d), self._values.new_empty(
            b, h, len(fixed) + ring_size, d)                                           # (B, Hkv, S, D)
        keys.index_copy_(2, target, self._keys.index_select(2, index))
        values.index_copy_(2, target, self._values.index_select(2, index))
        slot_positions = np.full(len(fixed) + ring_size, -1, dtype=np.int64)
        slot_positions[slots] = self._slot_positions[sources]
        self._keys, self._values, self._slot_positions = keys, values, slot_positions
        self._ring_head, self._ring_count = 0, len(ring)

    # --- the batch ---------------------------------------------------------------------------------
    @property
    def batch(self) -> int | None:
        """Examples held: the batch of the first update or of ``set_starts``; None before either."""
        if self._keys is not None:
            return self._keys.shape[0]
        return None if self._starts is None else len(self._starts)

    def select_examples(self, index) -> None:
        """Keep the examples ``index`` of the batch, in that order: example i becomes what example ``index[i]`` was,
        its keys, values and start. Beam search reorders its beams so after every step, and expands a batch into
        beams with ``index = [0, 0, 1, 1, ...]``.

        >>> import torch, sparse_attn as sa
        >>> cache = sa.SparseKVCache(sa.Local(3, 0) | sa.Sink(first=1), backend="reference")
        >>> k = torch.arange(2.0).reshape(2, 1, 1, 1).expand(2, 1, 6, 4)   # example b's keys are all b
        >>> _ = cache.update(k, k)
        >>> cache.select_examples([1, 1, 0])                   # example 1 twice, then example 0
        >>> x = torch.zeros(3, 1, 1, 4)
        >>> keys, values, positions = cache.update(x, x)
        >>> keys[:, 0, 0, 0].tolist(), cache.batch              # the sink of each new example
        ([1.0, 1.0, 0.0], 3)

        ``index``: (B',) ints in 0 .. B - 1, a tensor on any device (read on the host) or a sequence; an example
        may be kept more than once or not at all. The examples share their positions, so every held key stays
        where it is, except the sinks and global tokens of starts (``set_starts``) that no kept example has: they
        join the window's ring and leave with it. Raises before changing anything; before the first update and
        ``set_starts`` there is nothing to select.
        """
        batch = self.batch
        if batch is None:
            return
        rows = index.cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        if rows.dtype.kind not in "iu" or rows.ndim != 1 or len(rows) == 0 or (rows < 0).any() or (rows >= batch).any():
            raise ValueError(f"index must be ints in 0 .. {batch - 1} of shape (n,) with n >= 1 (the examples of this "
                             f"cache's batch of {batch} to keep, in order), got {index!r}; pass indices into the batch "
                             f"the cache holds")
        rows = rows.astype(np.int64)
        if self._keys is not None:
            selected = torch.from_numpy(rows).to(self._keys.device)
            self._keys, self._values = self._keys.index_select(0, selected), self._values.index_select(0, selected)
        if self._starts is not None:
            starts = self._starts[rows]
            fixed = np.unique(self._fixed_of(starts))
            if self._keys is not None and not np.array_equal(fixed, self._fixed):
                self._move_fixed(fixed)
            self._fixed, self._starts = fixed, starts

    # --- attention -----------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               return_lse: bool = False, softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
               sinks: torch.Tensor | None = None):
        """``update(k, v)``, then the new queries q (B, Hq, n_new, D) over the held keys: equal to
        ``sparse_attention(q, k_all, v_all, pattern, ...)`` over the whole past. Returns out (B, Hq, n_new, D),
        or ``(out, lse)`` with ``return_lse=True``. ``softcap``, ``alibi_slopes``, ``sinks`` as in
        ``sparse_attention`` (ALiBi at the tokens' positions, whatever was evicted between them). Every
        argument is checked first: a call that raises leaves the cache as it was."""
        mods: dict[str, Any] = {"softcap": softcap, "alibi_slopes": alibi_slopes, "sinks": sinks}
        signature = _call_signature(q, k, v, scale, return_lse, mods, self._starts)
        if signature is None or signature != self._checked:
            self._check_kv(k, v)
            self._check_queries(q, k, v, scale, return_lse, mods)
            self._checked = signature
        else:                                           # as the last call: only what depends on the length
            self._rule(Context(q.shape[2], self._seen + k.shape[2], 0))
        keys, values, positions = self._append(k, v)
        return self.attention(q, keys, values, positions, scale=scale, return_lse=return_lse, **mods)

    def _check_queries(self, q, k, v, scale, return_lse, mods) -> None:
        """What ``attention`` would refuse after the update, checked before it: q against the new k, v (as the
        caller passed them), the pattern's heads and length, scale, return_lse, the modifiers and the backend."""
        check_inputs(q, k, v)
        check_mods(q, **mods)
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"q and k must hold the same new tokens (n_q == n_new), got q {tuple(q.shape)} and "
                             f"k {tuple(k.shape)}")
        self.pattern.check_heads(q.shape[1])
        resolve_scale(scale, q.shape[3])
        check_bool("return_lse", return_lse)
        self._rule(Context(q.shape[2], self._seen + k.shape[2], 0))                 # e.g. a Blocks grid too short
        module = backends.load(backends.choose(self.backend, q.device))
        if self._probe is None or (self._probe.block_size, self._probe.device) != (module.BLOCK_SIZE, q.device):
            self._probe = layout_of_mask(np.ones((1, 1, 1, 1), dtype=bool), 1, module.BLOCK_SIZE,
                                          self.pattern).to(q.device)
        module.check(q, k, v, self._probe)

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                  scale: float | None = None, return_lse: bool = False,
                  key_padding_mask: torch.Tensor | None = None, softcap: float | None = None,
                  alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
        """The queries q (B, Hq, n_new, D) of the last ``update`` over what it returned (keys, values and
        positions), with the pattern's semantics at their absolute positions (counted from each example's start,
        ``set_starts``). ``key_padding_mask`` (B, n_held) bool, True = padding, masks held keys as
        ``sparse_attention``'s does (a padded batch); ``softcap``, ``alibi_slopes`` and ``sinks`` as there, ALiBi's
        distance between the tokens' positions. Where the cache holds the whole past (nothing dropped yet: a
        prefill), the pattern's own layout. Elsewhere, up to 64 new queries on the numba and triton backends (a
        decode step): one dense attention over the held keys (:mod:`~sparse_attn.held_attention`); a larger
        chunk without key padding, ``set_starts`` or ALiBi: the pattern's layout over the held key blocks
        (:func:`~sparse_attn.positions.over_held_keys`); else a layout of the held positions
        (:func:`layout_at_positions`), built a few query rows at a time within a bounded mask, and with ALiBi
        one backend call per run of consecutive held positions (a sink run and the window: two), merged by
        log-sum-exp."""
        return_lse = check_bool("return_lse", return_lse)
        mods, sinks = check_mods(q, softcap, alibi_slopes, sinks)
        n_q, n_held = q.shape[2], keys.shape[2]
        if n_q != len(self._new):
            raise ValueError(f"q has {n_q} queries but the last update appended {len(self._new)} tokens; call "
                             f"attention right after the update that appended them")
        held_positions = positions.numpy()
        if n_held == self._seen:                        # the whole past: the pattern's own layout, keys in order
            if (held_positions != np.arange(n_held)).any():  # fixed slots first: sort (a copy, once per prefill)
                order = np.argsort(held_positions)
                index = torch.from_numpy(order).to(keys.device)
                keys, values = keys.index_select(2, index), values.index_select(2, index)
                key_padding_mask = None if key_padding_mask is None else key_padding_mask[:, order]
            return left_padded_attention(q, keys, values, self.pattern, self._starts, scale=scale,
                                         backend=self.backend, return_lse=return_lse,
                                         key_padding_mask=key_padding_mask, softcap=softcap,
                                         alibi_slopes=mods.alibi_slopes, sinks=sinks)
        backend = backends.choose(self.backend, q.device)
        if backend in ("numba", "triton") and n_q <= _DENSE_ROWS:
            every_key = self._attends_every_held(positions)
            return self._attend_dense(q, keys, values, held_positions, every_key, scale, return_lse, key_padding_mask,
                                      mods, sinks)
        block_size = backends.load(backend).BLOCK_SIZE
        if n_q > _DENSE_ROWS and key_padding_mask is None and self._starts is None and mods.alibi_slopes is None:
            chunk = self._attend_chunk(q, keys, values, held_positions, block_size, scale=scale, softcap=softcap)
            if chunk is not None:
                out, lse = chunk if sinks is None else add_sink(*chunk, sinks)
                return (out, lse) if return_lse else out
        context = Context(n_q, self._seen, 0)
        step = max(1, _MASK_PAIRS // n_held)
        parts = []
        for start in range(0, n_q, step):
            rows = slice(start, min(start + step, n_q))
            mask = allowed_at_positions(self.pattern, context, self._new[rows], held_positions, q.shape[1],
                                        key_padding_mask=key_padding_mask, starts=self._starts)
            if mods.alibi_slopes is None:
                layout = self._layout_of(mask, q.shape[1], block_size)
                parts.append(sparse_attention(q[:, :, rows], keys, values, layout, scale=scale, softcap=softcap,
                                              backend=self.backend, return_lse=True))
            else:
                parts.append(self._attend_runs(q[:, :, rows], self._new[rows], keys, values, held_positions, mask,
                                               block_size, scale=scale, softcap=softcap,
                                               alibi_slopes=mods.alibi_slopes))
        out, lse = (torch.cat(column, dim=2) for column in zip(*parts))
        if sinks is not None:
            out, lse = add_sink(out, lse, sinks)
        return (out, lse) if return_lse else out

    def _attend_chunk(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray,
                      block_size: int, **options) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(out, lse) of a chunk of new queries over the held keys, with no token mask: the pattern's own layout
        for the chunk over the whole past, its key blocks that are used gathered from the held keys
        (:func:`~sparse_attn.positions.over_held_keys`): work in the layout's blocks, not rows x held keys.
        None where that layout cannot be run so (its keys fit in less than a tile)."""
        layout = self.pattern.layout(q.shape[2], self._seen, heads=q.shape[1], block_size=block_size)
        held = over_held_keys(layout, positions)
        if held is None:
            return None
        compact, slots, index = held
        slots, index = slots.to(keys.device), index.to(keys.device)
        batch, kv_heads, _, dim = keys.shape
        compact_keys, compact_values = (t.new_zeros(batch, kv_heads, compact.n_k, dim).index_copy_(
            2, slots, t.index_select(2, index)) for t in (keys, values))                # (B, Hkv, compact n_k, D)
        return sparse_attention(q, compact_keys, compact_values, compact.to(q.device), backend=self.backend,
                                return_lse=True, **options)

    def _attends_every_held(self, positions: torch.Tensor) -> bool:
        """Whether the last update's one new query attends every key it returned (``positions`` being what it
        returned): past ``dense_until`` the cache then holds the fixed tokens and the window alone, and
        ``Retention.sees_all_held`` says the query attends them all (a decode step of ``Local(w - 1, 0) |
        Sink(...)``), so no mask is evaluated."""
        return (positions is self._returned and len(self._new) == 1 and self._starts is None
                and self.retention.sees_all_held and self._new[0] > self.retention.dense_until)

    def _attend_dense(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray,
                      every_key: bool, scale, return_lse: bool, key_padding_mask, mods, sinks):
        """The new queries over the held keys in one dense call (:func:`~sparse_attn.held_attention.dense_attention`):
        a decode step reads each held key once. No mask where the query attends ``every_key`` (see
        :meth:`_attends_every_held`) or where the pattern allows every held key, else the pattern's mask."""
        held = None if every_key else self._held_mask(q.shape[1], positions)          # (Bl, Hl, n_q, n_held) or None
        mask = None if held is None else torch.from_numpy(held).to(q.device)
        if key_padding_mask is not None:
            check_token_mask("key_padding_mask", key_padding_mask, None, len(positions))
            real = ~torch.as_tensor(key_padding_mask, device=q.device)[:, None, None, :]   # (B, 1, 1, n_held)
            mask = real if mask is None else mask & real
        query_pos, key_pos = (None, None) if mods.alibi_slopes is None else \
            (torch.from_numpy(p).to(q.device) for p in (self._new, positions))             # ALiBi's distances
        out, lse = dense_attention(q, keys, values, mask, resolve_scale(scale, q.shape[3]), mods, query_pos, key_pos,
                                   return_lse=return_lse or sinks is not None)
        if sinks is not None:
            out, lse = add_sink(out, lse, sinks)
        return (out, lse) if return_lse else out

    def _held_mask(self, heads: int, positions: np.ndarray) -> np.ndarray | None:
        """(B or 1, H or 1, n_new, n_held) bool of the last update's queries over the held keys at ``positions``, or
        None when every pair is allowed; with ``set_starts`` each example's positions count from its start."""
        n_q, heads = len(self._new), heads if self.pattern.head_dependent else 1
        if self._starts is None:
            mask = held_mask([self._rule(Context(n_q, self._seen, h)) for h in range(heads)], self._new, positions)
            return None if mask is None else mask[None]
        groups = {}
        for start in np.unique(self._starts):              # each example's positions count from its start
            n_k = self._seen - int(start)
            context = Context(max(1, min(n_q, n_k)), max(n_k, 1), 0)
            rules = [self._rule(context._replace(head=h)) for h in range(heads)]
            groups[start] = held_mask(rules, self._new - start, positions - start)
        if all(mask is None for mask in groups.values()):
            return None
        mask = np.ones((len(self._starts), heads, n_q, len(positions)), dtype=bool)
        for start, group in groups.items():
            if group is not None:
                mask[self._starts == start] = group
        return mask

    def _rule(self, context: Context):
        """The pattern resolved for ``context``, kept for the step's other calls (its check, its mask)."""
        rule = self._rules.get(context)
        if rule is None:
            if len(self._rules) >= _KEPT_RULES:
                self._rules.clear()
            rule = self._rules[context] = resolve(self.pattern, context)
        return rule

    def _attend_runs(self, q: torch.Tensor, query_pos: np.ndarray, keys: torch.Tensor, values: torch.Tensor,
                     positions: np.ndarray, mask: np.ndarray, block_size: int, *, alibi_slopes: torch.Tensor,
                     **options):
        """(out, lse) of the queries q (B, Hq, rows, D) at the consecutive positions ``query_pos`` over the held
        keys at ``positions`` (allowed pairs: ``mask`` (Bl, Hl, rows, n_held)) with ALiBi: one backend call per
        run of consecutive positions, padded as :func:`~sparse_attn.score_mods.alibi_alignment` says, merged by
        log-sum-exp."""
        n_q, query_start = q.shape[2], int(query_pos[0])
        order = np.argsort(positions, kind="stable")
        runs = np.split(order, np.flatnonzero(np.diff(positions[order]) != 1) + 1)
        outs, lses = [], []
        for run in runs:
            run_mask = mask[..., run]
            if not run_mask.any():
                continue
            pad_keys, pad_rows, shift = alibi_alignment(query_start, n_q, int(positions[run[0]]), len(run))
            run_mask = np.pad(run_mask, [(0, 0), (0, 0), (0, pad_rows), (0, pad_keys)])
            index = torch.from_numpy(run).to(keys.device)
            run_k, run_v = (_pad_tokens(t.index_select(2, index), pad_keys) for t in (keys, values))
            layout = self._layout_of(run_mask, q.shape[1], block_size)
            out, lse = sparse_attention(_pad_tokens(q, pad_rows), run_k, run_v, layout, alibi_slopes=alibi_slopes,
                                        backend=self.backend, return_lse=True, **options)
            outs.append(out[:, :, :n_q])
            lses.append(lse[:, :, :n_q] - alibi_slopes[:, :, None] * shift)
        if not outs:                                    # no allowed key: 0 and -inf, as sparse_attention
            lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            return torch.zeros_like(q), q.new_full(q.shape[:3], -torch.inf, dtype=lse_dtype)
        out, lse = combine_partials(torch.stack(outs), torch.stack(lses))
        return out.to(q.dtype), lse

    def _layout_of(self, mask: np.ndarray, heads: int, block_size: int) -> BlockLayout:
        """The layout of a token mask (Bl, Hl, rows, keys), kept for the next steps: a decode step of a bounded
        pattern sees the same mask as the step before once the cache is full (the window slides with the
        token), so the layout, its copy on the GPU and the kernels' work plan are built once, not every step."""
        key = (mask.shape, heads, block_size, np.packbits(mask).tobytes())
        layout = self._layouts.pop(key, None)
        if layout is None:
            layout = layout_of_mask(mask, heads, block_size, self.pattern)
        self._layouts[key] = layout                       # latest last; the oldest goes past _KEPT_LAYOUTS
        while len(self._layouts) > _KEPT_LAYOUTS:
            del self._layouts[next(iter(self._layouts))]
        return layout


def _call_signature(q, k, v, scale, return_lse, mods: dict, starts: np.ndarray | None) -> tuple | None:
    """What ``attend``'s checks read of a call, for a call that only tensors, a float or None scale and no
    modifiers describe (a decode step): a step like the last checked one passes them again. None: check."""
    if not all(type(t) is torch.Tensor for t in (q, k, v)) or any(m is not None for m in mods.values()) or \
            type(return_lse) is not bool or not (scale is None or type(scale) is float):
        return None
    return (tuple((t.shape, t.dtype, t.device) for t in (q, k, v)), scale, return_lse,
            None if starts is None else len(starts))


def _pad_tokens(t: torch.Tensor, count: int) -> torch.Tensor:
    """t (B, H, n, D) with ``count`` zero tokens appended."""
    return torch.nn.functional.pad(t, (0, 0, 0, count)) if count else t


def left_padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern, starts, *,
                          key_padding_mask: torch.Tensor | None = None, **options):
    """``sparse_attention(q, k, v, pattern, key_padding_mask=..., **options)`` for a left-padded batch: example
    b's keys before ``starts[b]`` are padding and its pattern positions count from ``starts[b]``, so its rows
    equal those of its own sequence alone (``Sink``/``Global(first=...)`` on its first real tokens).

    >>> import torch, sparse_attn as sa
    >>> x = torch.randn(2, 1, 6, 4, dtype=torch.float64)                 # example 1: 2 padding tokens
    >>> out = left_padded_attention(x, x, x, sa.Local(1) | sa.Global(first=1), [0, 2], backend="reference")
    >>> alone = sa.sparse_attention(x[1:, :, 2:], x[1:, :, 2:], x[1:, :, 2:], sa.Local(1) | sa.Global(first=1),
    ...                             backend="reference")
    >>> torch.equal(out[1:, :, 2:], alone), out[1, :, :2].abs().max().item()     # padding rows: 0
    (True, 0.0)

    ``starts``: (B,) ints, or None (every example at 0: one ``sparse_attention`` call). Queries are the last
    Nq positions as always; a query before its example's start returns 0 (lse -inf, or the sink with
    ``sinks``: a row with no key). ALiBi's distances, differences of positions, need no shift. One call per
    distinct start, on that group's rows and keys from the start on (layouts of other lengths: a batch of
    many different paddings costs one call each).
    """
    starts = None if starts is None else check_starts(starts, q.shape[0])
    if starts is None or not starts.any():
        return sparse_attention(q, k, v, pattern, key_padding_mask=key_padding_mask, **options)
    return_lse = check_bool("return_lse", options.pop("return_lse", False))
    slopes = options.pop("alibi_slopes", None)
    sinks = check_mods(q, options.get("softcap"), slopes, options.pop("sinks", None))[1]
    n_q, n_k = q.shape[2], k.shape[2]
    order, outs, lses = [], [], []
    for start in np.unique(starts):
        rows = np.flatnonzero(starts == start)
        index = torch.from_numpy(rows).to(q.device)
        first = min(max(int(start) - (n_k - n_q), 0), n_q)       # queries before the start are padding
        out = q.new_zeros(len(rows), q.shape[1], n_q, v.shape[3])                      # (b, Hq, Nq, D)
        lse = torch.full((len(rows), q.shape[1], n_q), -torch.inf, device=q.device,
                         dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        if start < n_k and first < n_q:
            part_k, part_v = (t if t.shape[0] == 1 else t.index_select(0, index) for t in (k, v))
            padding = None if key_padding_mask is None else key_padding_mask.index_select(0, index)[:, start:]
            part_slopes = slopes if slopes is None or slopes.dim() == 1 or len(slopes) == 1 else \
                slopes.index_select(0, index)
            part_out, part_lse = sparse_attention(
                q.index_select(0, index)[:, :, first:], part_k[:, :, start:], part_v[:, :, start:], pattern,
                key_padding_mask=padding if padding is not None and padding.any() else None, return_lse=True,
                alibi_slopes=part_slopes, **options)
            out = torch.cat([out[:, :, :first], part_out], dim=2)
            lse = torch.cat([lse[:, :, :first], part_lse], dim=2)
        order.append(rows)
        outs.append(out)
        lses.append(lse)
    inverse = torch.from_numpy(np.argsort(np.concatenate(order))).to(q.device)
    out, lse = torch.cat(outs).index_select(0, inverse), torch.cat(lses).index_select(0, inverse)
    if sinks is not None:
        out, lse = add_sink(out, lse, sinks)
    return (out, lse) if return_lse else out
