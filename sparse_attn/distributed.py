"""Sequence-parallel sparse attention over ``torch.distributed``: each rank holds one shard of the sequence.

Run with one process per rank (``torchrun --nproc-per-node 2 script.py``; NCCL on GPUs, gloo on CPU)::

    import torch.distributed as dist
    import sparse_attn as sa
    from sparse_attn.distributed import sparse_attention

    dist.init_process_group("gloo")
    # q, k, v: (B, H, n_rank, D), this rank's contiguous part of the sequence, ranks in order
    out = sparse_attention(q, k, v, sa.Local(256) | sa.Global(first=16))   # (B, H, n_rank, D)

The result on every rank is exactly its rows of ``sa.sparse_attention`` over the whole sequence, and
gradients flow to this rank's q, k and v (the gradients of keys other ranks read are sent back to
their owner). Only what the pattern needs moves: each rank fetches the key/value vectors its rows may
attend from other ranks (a window's halo, global and random columns, per head and example), and rows
that see most of the sequence (global rows) are sent to every rank instead, attended there over that
rank's keys, and combined by log-sum-exp. How is decided by a :class:`~sparse_attn.shard_plan.ShardPlan`,
built once per (pattern, shard sizes, masks) and cached like a layout.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import numbers
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from . import backends
from .api import check_inputs, resolve_layout, resolve_scale
from .checks import check_bool
from .layout import BlockLayout
from .pattern import Pattern
from .score_mods import ScoreMods, add_sink, check_mods, combine_partials
from .shard_plan import AlibiCall, RankProgram, ShardPlan


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern | BlockLayout, *,
                     group=None, causal: bool = False, key_padding_mask=None, global_mask=None, documents=None,
                     scale: float | None = None, softcap: float | None = None, alibi_slopes=None, sinks=None,
                     backend: str = "auto", return_lse: bool = False):
    """This rank's rows of ``sparse_attn.sparse_attention`` over the sequence split across the ranks of ``group``.

    Args:
        q: (B, Hq, n_rank, D), k, v: (B or 1, Hkv, n_rank, D): this rank's contiguous shard of the sequence
            (rank 0 holds its start); shards may differ in length (at least one token each).
        pattern: a Pattern, or a BlockLayout of the whole sequence (n_q == n_k == the sum of the shards).
        group: the ``torch.distributed`` process group (default: the world).
        key_padding_mask, global_mask, documents: as in ``sparse_attn.sparse_attention``, for the **whole**
            sequence, (B, N), the same on every rank (they decide which keys each rank needs; they are small).
        causal, scale, backend, return_lse: as in ``sparse_attn.sparse_attention``.
        softcap, alibi_slopes, sinks: as in ``sparse_attn.sparse_attention``, the same on every rank. ALiBi's
            distances are those of the whole sequence: each backend call runs keys and rows at consecutive
            positions (one call per run of consecutive key blocks this rank holds, one per shipped segment,
            merged by log-sum-exp). The sink joins each row's denominator once, after the merge of the ranks'
            partial results.

    Returns:
        out (B, Hq, n_rank, D), or ``(out, lse)`` with ``return_lse=True``.

    Every rank must call it with the same pattern, masks, shapes (but its own n_rank), dtype and autograd
    (``requires_grad`` of q, k, v). Each rank checks its arguments first; then the ranks agree, in one
    ``all_gather`` before any data moves, that every rank's arguments are valid and the same (by a digest of
    their full content, :func:`content_digest`). A rank whose arguments are invalid raises its error, and
    every other rank a ValueError naming that rank and its error; ranks that differ make every rank raise
    a ValueError naming what differs. None of them hangs.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sparse_attn.distributed.sparse_attention needs torch.distributed: call "
                           "torch.distributed.init_process_group(...) first (or use sparse_attn.sparse_attention "
                           "in a single process)")
    try:
        call, failure = _check_call(q, k, v, pattern, causal, key_padding_mask, global_mask, documents, scale,
                                    backend, return_lse, (softcap, alibi_slopes, sinks)), None
    except Exception as error:                      # shared with the other ranks below, then raised here
        call, failure = None, error
    table = _agree(call, failure, group, q)
    assert call is not None  # a rank whose checks failed raised in _agree
    shard_sizes = tuple(row[0] for row in table)
    _check_whole_masks(call, shard_sizes)
    _check_same(table)
    n = sum(shard_sizes)
    layout = resolve_layout(pattern, call.batch, call.q_heads, n, n, call.module.BLOCK_SIZE, call.causal,
                            key_padding_mask, global_mask, documents)
    program = _program(layout, shard_sizes, dist.get_rank(group), call.batch, k.shape[0], k.shape[1],
                       q.element_size(), q.device, call.mods.alibi_slopes is not None)
    call.module.check(q, k, v, program.local_layout)
    out, lse = _attend(program, q, k, v, call.module, call.scale, call.mods, group, len(shard_sizes))
    if call.sinks is not None:
        out, lse = add_sink(out, lse, call.sinks)
    return (out, lse) if call.return_lse else out


# the arguments every rank must share, each compared by its digest (the shard of q, k, v is each rank's own)
AGREED = ("pattern", "causal", "key_padding_mask", "global_mask", "documents", "scale", "softcap", "alibi_slopes",
          "sinks", "backend", "shapes (batch, heads, head_dim)", "dtype", "requires_grad")


class _Call(NamedTuple):
    """One rank's checked arguments and the digests of those in AGREED (same order)."""

    batch: int
    q_heads: int
    n_rank: int
    causal: bool
    scale: float
    mods: ScoreMods
    sinks: torch.Tensor | None
    module: ModuleType
    return_lse: bool
    masks: dict[str, np.ndarray | None]
    digests: tuple[int, ...]


def _check_call(q, k, v, pattern, causal, key_padding_mask, global_mask, documents, scale, backend,
                return_lse, modifiers) -> _Call:
    """Every check this rank can make alone (it raises what single-process ``sparse_attention`` raises)."""
    batch, q_heads, n_rank, head_dim = check_inputs(q, k, v)
    if k.shape[2] != n_rank:
        raise ValueError(f"q, k and v must be this rank's shard of one sequence (the same n_rank), got q "
                         f"{tuple(q.shape)} and k {tuple(k.shape)}")
    causal, return_lse = check_bool("causal", causal), check_bool("return_lse", return_lse)
    name = backends.choose(backend, q.device)
    module = backends.load(name)
    scale = resolve_scale(scale, head_dim)
    mods, sinks = check_mods(q, *modifiers)
    if isinstance(pattern, Pattern):
        pattern.check_heads(q_heads)
    elif not isinstance(pattern, BlockLayout):
        raise TypeError(f"pattern must be a sparse_attn Pattern or BlockLayout, got {type(pattern).__name__}")
    masks = {"key_padding_mask": _call_data(key_padding_mask), "global_mask": _call_data(global_mask),
             "documents": _call_data(documents)}
    recorded = tuple(torch.is_grad_enabled() and t.requires_grad for t in (q, k, v))
    agreed = (pattern, causal, *masks.values(), scale, mods.softcap, mods.alibi_slopes, sinks, (name, q.device.type),
              (batch, q_heads, head_dim, *k.shape[:2]), str(q.dtype), recorded)
    return _Call(batch, q_heads, n_rank, causal, scale, mods, sinks, module, return_lse, masks,
                 tuple(content_digest(value) for value in agreed))


def _call_data(mask):
    """A mask or document ids as the values that decide the layout: a numpy array, integers as int64 (so ids
    of int32 on one rank and int64 on another agree), or None."""
    if mask is None:
        return None
    value = np.asarray(torch.as_tensor(mask).detach().cpu())
    return value.astype(np.int64) if np.issubdtype(value.dtype, np.integer) else value


def _agree(call: _Call | None, failure: Exception | None, group, q) -> list[list[int]]:
    """One all_gather, once every rank has checked its call: each rank's shard length, its error message's
    length (0: its checks passed) and its digests, (W, 2 + len(AGREED)) in rank order. If a rank failed,
    every rank raises (see ``_raise_failures``)."""
    message = b"" if failure is None else _describe(failure)
    row = [0, len(message), *[0] * len(AGREED)] if call is None else [call.n_rank, 0, *call.digests]
    device = _collective_device(group, q)
    table = _gather(torch.tensor(row, dtype=torch.int64, device=device), group).tolist()
    if any(row[1] for row in table):
        _raise_failures(table, message, failure, group, device)
    return table


def _raise_failures(table: list[list[int]], message: bytes, failure: Exception | None, group, device) -> None:
    """Some rank's checks failed: one more all_gather shares the messages (every rank knows that it comes from
    the table), then a failed rank raises its own error, every other rank a ValueError naming the failed
    ranks and their errors."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    failed = [r for r in range(world) if table[r][1]]
    text = torch.zeros(max(table[r][1] for r in failed), dtype=torch.uint8)
    text[:len(message)] = torch.tensor(list(message), dtype=torch.uint8)
    texts = _gather(text.to(device), group)                                              # (W, longest) bytes
    if failure is not None:
        raise failure
    reasons = "; ".join(f"rank {r} of {world}: {bytes(texts[r, :table[r][1]].tolist()).decode(errors='replace')}"
                        for r in failed)
    raise ValueError(f"sparse_attention failed its argument checks on another rank, so rank {rank} stops too "
                     f"(no rank waits for the others): {reasons}; fix the call on rank {failed[0]}")


def _describe(failure: Exception) -> bytes:
    """A failed check as the bytes the other ranks print: its type and message, at most 2000 bytes."""
    text = f"{type(failure).__name__}: {failure}".encode()
    return text if len(text) <= 2000 else text[:1997] + b"..."


def _check_whole_masks(call: _Call, shard_sizes: tuple[int, ...]) -> None:
    """Masks and documents of the whole sequence, not this rank's part of it."""
    n = sum(shard_sizes)
    for name, mask in call.masks.items():
        if mask is not None and mask.ndim == 2 and mask.shape[-1] != n and len(shard_sizes) > 1:
            raise ValueError(f"{name} covers the whole sequence: shape (batch, {n}) on every rank (the sum of the "
                             f"shards {list(shard_sizes)}), got {tuple(mask.shape)}; pass the full mask, not "
                             f"this rank's part")


def _check_same(table: list[list[int]]) -> None:
    """Every rank's digests equal rank 0's, or a ValueError naming the arguments that differ and where."""
    differ = {name: [r for r, row in enumerate(table) if row[2 + i] != table[0][2 + i]]
              for i, name in enumerate(AGREED)}
    found = [f"{name} on ranks {ranks}" for name, ranks in differ.items() if ranks]
    if found:
        raise ValueError(f"the ranks called sparse_attention with different arguments: {'; '.join(found)} "
                         f"differ from rank 0's; every rank must pass the same pattern, masks, documents, causal, "
                         f"scale, softcap, alibi_slopes, sinks, backend, batch, heads, head_dim, dtype and "
                         f"requires_grad of q, k, v, only its shard of the sequence is its own")


def _gather(row: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``row`` (1-D, the same length on every rank), stacked in rank order on the CPU."""
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    return torch.stack(rows).cpu()


def _collective_device(group, q) -> torch.device:
    """Where the group's collectives take tensors: for NCCL q's CUDA device (the current one where q is not a
    CUDA tensor: a rank whose inputs failed their checks joins the all_gather all the same), else the CPU."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return q.device if isinstance(q, torch.Tensor) and q.device.type == "cuda" else \
        torch.device("cuda", torch.cuda.current_device())


def content_digest(value) -> int:
    """A 63-bit digest of ``value``'s full content: equal for equal content, different (but for a 2**-63 chance)
    for any difference. Patterns are read field by field (their kind, every field, recursively through
    ``|``, ``&``, ``~`` and ``PerHead``; a ``Blocks`` grid by its bytes), a BlockLayout by its lengths, block
    size and every index tensor, arrays and tensors by dtype, shape and bytes; also tuples, lists, str, bool,
    int, float and None. Anything else is a TypeError.

    >>> import sparse_attn as sa
    >>> content_digest(sa.Local(4) | sa.Global(first=1)) == content_digest(sa.Local(4, 4) | sa.Global(first=1))
    True
    >>> grid = np.eye(9, dtype=bool)                     # prints as "<bool (9, 9) grid, 9 blocks set>"
    >>> content_digest(sa.Blocks(grid, 16)) == content_digest(sa.Blocks(grid[::-1], 16))
    False
    """
    digest = hashlib.blake2b(digest_size=8)
    _feed(digest, value)
    return int.from_bytes(digest.digest(), "little") >> 1


def _feed(digest, value) -> None:
    """Feed ``value`` to ``digest`` in a form that no other value shares: a type tag, then lengths before
    contents."""
    if isinstance(value, Pattern):
        fields = tuple((field.name, getattr(value, field.name)) for field in dataclasses.fields(value))
        _feed(digest, ("pattern", value.kind, fields))
    elif isinstance(value, BlockLayout):
        _feed(digest, ("layout", value.n_q, value.n_k, value.heads, value.block_size, value.causal, tuple(value.index)))
    elif isinstance(value, torch.Tensor):
        _feed_tensor(digest, value.detach().cpu())
    elif isinstance(value, np.ndarray):
        _feed_bytes(digest, b"a" + repr((value.dtype.str, value.shape)).encode(), np.ascontiguousarray(value).tobytes())
    elif isinstance(value, (tuple, list)):
        digest.update(b"t%d:" % len(value))
        for item in value:
            _feed(digest, item)
    elif isinstance(value, (str, bool, np.bool_, numbers.Integral, float, np.floating)) or value is None:
        _feed_bytes(digest, b"s", _scalar(value).encode())
    else:
        raise TypeError(f"content_digest takes patterns, BlockLayouts, arrays, tensors, tuples, lists and scalars, "
                        f"got {type(value).__name__}: {value!r}")


def _scalar(value) -> str:
    """A scalar as exact, typed text: bools before ints (True is 1), floats in hex."""
    if value is None:
        return "none"
    if isinstance(value, (bool, np.bool_)):
        return f"bool:{bool(value)}"
    if isinstance(value, numbers.Integral):
        return f"int:{int(value)}"
    if isinstance(value, (float, np.floating)):
        return f"float:{float(value).hex()}"
    return f"str:{value}"


def _feed_tensor(digest, tensor: torch.Tensor) -> None:
    """A CPU tensor: as the numpy array of its values where numpy has its dtype, else its raw bytes."""
    try:
        _feed(digest, tensor.numpy())
    except TypeError:                                              # bfloat16 and other dtypes numpy lacks
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        _feed_bytes(digest, b"r" + repr((str(tensor.dtype), tuple(tensor.shape))).encode(), raw)


def _feed_bytes(digest, header: bytes, content: bytes) -> None:
    digest.update(b"%d:%d:" % (len(header), len(content)))
    digest.update(header)
    digest.update(content)


def _attend(program: RankProgram, q, k, v, module, scale: float, mods: ScoreMods, group, world: int):
    """out (B, Hq, n_rank, D) and lse (B, Hq, n_rank) of this rank's rows (differentiable), without sinks."""
    kv_batch, kv_heads, n_rank, head_dim = k.shape
    k_rows, v_rows = k.reshape(-1, head_dim), v.reshape(-1, head_dim)           # (Bk * Hkv * n_rank, D)
    sent = torch.cat([k_rows.index_select(0, program.kv_send_index),
                      v_rows.index_select(0, program.kv_send_index)], dim=-1)     # (sent, 2D)
    fetched = _Exchange.apply(sent, program.kv_send_counts, program.kv_recv_counts, group)     # (received, 2D)
    shape = (kv_batch, kv_heads, program.n_compact, head_dim)
    keys = _compact(program, k_rows, fetched[:, :head_dim], shape)              # (Bk, Hkv, n_compact, D)
    values = _compact(program, v_rows, fetched[:, head_dim:], shape)

    n_rows = program.local_layout.n_q
    rows_after = n_rows - program.rows_before - n_rank
    padded = torch.nn.functional.pad(q, (0, 0, program.rows_before, rows_after))   # (B, Hq, n_rows, D)
    out, lse = _run(module, padded, keys, values, program.local_layout, program.local_calls, scale, mods)
    out = out[:, :, program.rows_before:program.rows_before + n_rank]           # (B, Hq, n_rank, D)
    lse = lse[:, :, program.rows_before:program.rows_before + n_rank]           # (B, Hq, n_rank)
    if program.shipped_layout is None:
        return out, lse
    shipped_out, shipped_lse = _shipped_rows(program, q, keys, values, module, scale, mods, group, world)
    return (out.index_copy(2, program.shipped_rows, shipped_out.to(out.dtype)),
            lse.index_copy(2, program.shipped_rows, shipped_lse.to(lse.dtype)))


def _compact(program: RankProgram, own: torch.Tensor, fetched: torch.Tensor, shape) -> torch.Tensor:
    """The compact key (or value) buffer of ``shape`` (Bk, Hkv, n_compact, D): this rank's vectors and the
    fetched ones in their slots, zeros where no row of this rank attends."""
    buffer = own.new_zeros(shape[0] * shape[1] * shape[2], shape[3])
    buffer.index_copy_(0, program.own_slots, own)
    buffer.index_copy_(0, program.kv_recv_slots, fetched)
    return buffer.view(shape)


def _shipped_rows(program: RankProgram, q, keys, values, module, scale: float, mods: ScoreMods, group, world: int):
    """This rank's shipped rows: sent to every rank, attended there over that rank's keys, the partial results
    sent back and combined by log-sum-exp. Returns out (B, Hq, n_ship, D) and lse (B, Hq, n_ship)."""
    batch, q_heads, _, head_dim = q.shape
    n_ship = len(program.shipped_rows)
    rows = q.index_select(2, program.shipped_rows).permute(2, 0, 1, 3).reshape(n_ship, batch * q_heads * head_dim)
    received = _Exchange.apply(rows.repeat(world, 1), [n_ship] * world, program.shipped_recv_counts, group)
    assert program.shipped_layout is not None  # a rank ships rows only where the plan has a layout for them
    n_q = program.shipped_layout.n_q
    shipped = received.new_zeros(n_q, received.shape[1]).index_copy(0, program.shipped_slots, received)
    shipped = shipped.view(n_q, batch, q_heads, head_dim).permute(1, 2, 0, 3)          # (B, Hq, n_q, D)
    part_out, part_lse = _run(module, shipped.contiguous(), keys, values, program.shipped_layout, program.shipped_calls,
                              scale, mods)
    partial = torch.cat([part_out.to(part_lse.dtype), part_lse[..., None]], dim=-1)    # (B, Hq, n_q, D + 1)
    partial = partial.permute(2, 0, 1, 3).reshape(n_q, -1).index_select(0, program.shipped_slots)  # (sent, B*Hq*(D+1))
    back = _Exchange.apply(partial, program.shipped_recv_counts, [n_ship] * world, group)
    back = back.view(world, n_ship, batch, q_heads, head_dim + 1)                  # (W, n_ship, B, Hq, D + 1)
    out, lse = combine_partials(back[..., :head_dim], back[..., head_dim])
    return out.permute(1, 2, 0, 3), lse.permute(1, 2, 0)


def _run(module, q, keys, values, layout: BlockLayout, calls: tuple[AlibiCall, ...], scale: float, mods: ScoreMods):
    """The backend over ``layout``; with ALiBi over ``calls`` instead (rows and keys at consecutive positions),
    the calls of the same rows merged by log-sum-exp, rows no call covers 0 with lse -inf.

    The result always depends on q, keys and values (a layout without a block, which makes no call, runs as
    it is: 0, lse -inf, no distance to correct), so every rank's backward reaches the same exchanges."""
    if mods.alibi_slopes is None or not calls:
        return module.attention(q, keys, values, layout, scale, mods)
    slopes = mods.alibi_slopes[:, :, None]                                             # (Bs, Hq, 1)
    by_rows: dict[tuple[int, int], list] = {}
    for c in calls:
        rows = torch.nn.functional.pad(q[:, :, c.row0:c.row1], (0, 0, 0, c.pad_rows))
        run_k, run_v = (torch.nn.functional.pad(t[:, :, c.key0:c.key1], (0, 0, 0, c.pad_keys)) for t in (keys, values))
        out, lse = module.attention(rows, run_k, run_v, c.layout, scale, mods)
        n = c.row1 - c.row0
        by_rows.setdefault((c.row0, c.row1), []).append((out[:, :, :n], lse[:, :, :n] - slopes * c.shift))
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses, done = [], [], 0
    for (row0, row1), parts in sorted(by_rows.items()) + [((q.shape[2], q.shape[2]), None)]:
        outs.append(q.new_zeros(*q.shape[:2], row0 - done, q.shape[3]))               # rows no call covers
        lses.append(torch.full((*q.shape[:2], row0 - done), -torch.inf, dtype=lse_dtype, device=q.device))
        if parts is not None:
            out, lse = combine_partials(*(torch.stack(column) for column in zip(*parts)))
            outs.append(out.to(q.dtype))
            lses.append(lse)
        done = row1
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


class _Exchange(torch.autograd.Function):
    """``all_to_all`` of rows: ``send_counts[p]`` rows of x go to rank p, ``recv_counts[p]`` come from it (in
    rank order); the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, send_counts: list[int], recv_counts: list[int], group):
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        return _all_to_all(x, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return _all_to_all(grad.contiguous(), recv_counts, send_counts, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """A collective: every rank calls it, also one with nothing to send or receive."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out


@functools.lru_cache(maxsize=32)
def _program(layout: BlockLayout, shard_sizes: tuple[int, ...], rank: int, q_batch: int, kv_batch: int,
             kv_heads: int, itemsize: int, device: torch.device, alibi: bool) -> RankProgram:
    """This rank's program, its tensors on ``device`` (cached: layouts of equal arguments are one object)."""
    plan = ShardPlan.build(layout, shard_sizes, kv_heads=kv_heads, q_batch=q_batch, kv_batch=kv_batch,
                           itemsize=itemsize)
    program = plan.program(rank, alibi=alibi)
    moved: dict[str, Any] = {name: value.to(device) for name, value in program._asdict().items()
             if isinstance(value, (torch.Tensor, BlockLayout))}
    calls: dict[str, Any] = {name: tuple(c._replace(layout=c.layout.to(device)) for c in getattr(program, name))
             for name in ("local_calls", "shipped_calls")}
    return program._replace(**moved, **calls)
