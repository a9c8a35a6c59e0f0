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

import functools
import hashlib

import numpy as np
import torch
import torch.distributed as dist

from . import backends
from .api import check_inputs, resolve_layout, resolve_scale
from .checks import check_bool
from .layout import BlockLayout
from .pattern import Pattern
from .shard_plan import RankProgram, ShardPlan


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern | BlockLayout, *,
                     group=None, causal: bool = False, key_padding_mask=None, global_mask=None, documents=None,
                     scale: float | None = None, backend: str = "auto", return_lse: bool = False):
    """This rank's rows of ``sparse_attn.sparse_attention`` over the sequence split across the ranks of ``group``.

    Args:
        q: (B, Hq, n_rank, D), k, v: (B or 1, Hkv, n_rank, D): this rank's contiguous shard of the sequence
            (rank 0 holds its start); shards may differ in length (at least one token each).
        pattern: a Pattern, or a BlockLayout of the whole sequence (n_q == n_k == the sum of the shards).
        group: the ``torch.distributed`` process group (default: the world).
        key_padding_mask, global_mask, documents: as in ``sparse_attn.sparse_attention``, for the **whole**
            sequence, (B, N), the same on every rank (they decide which keys each rank needs; they are small).
        causal, scale, backend, return_lse: as in ``sparse_attn.sparse_attention``.

    Returns:
        out (B, Hq, n_rank, D), or ``(out, lse)`` with ``return_lse=True``.

    Every rank must call it with the same pattern, masks, shapes (but its own n_rank) and dtype; a rank
    that differs makes every rank raise a ValueError instead of hanging.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sparse_attn.distributed.sparse_attention needs torch.distributed: call "
                           "torch.distributed.init_process_group(...) first (or use sparse_attn.sparse_attention "
                           "in a single process)")
    batch, q_heads, n_rank, head_dim = check_inputs(q, k, v)
    if k.shape[2] != n_rank:
        raise ValueError(f"q, k and v must be this rank's shard of one sequence (the same n_rank), got q "
                         f"{tuple(q.shape)} and k {tuple(k.shape)}")
    return_lse = check_bool("return_lse", return_lse)
    module = backends.load(backends.choose(backend, q.device))
    scale = resolve_scale(scale, head_dim)
    shard_sizes, fingerprints = _gather(n_rank, _fingerprint(q, k, pattern, causal, key_padding_mask, global_mask,
                                                             documents, scale, backend), group, q.device)
    n = sum(shard_sizes)
    for name, mask in (("key_padding_mask", key_padding_mask), ("global_mask", global_mask),
                       ("documents", documents)):
        if mask is not None and getattr(mask, "ndim", 2) == 2 and mask.shape[-1] != n and len(shard_sizes) > 1:
            raise ValueError(f"{name} covers the whole sequence: shape (batch, {n}) on every rank (the sum of the "
                             f"shards {list(shard_sizes)}), got {tuple(mask.shape)}; pass the full mask, not "
                             f"this rank's part")
    if len(set(fingerprints)) > 1:
        differ = [r for r, fp in enumerate(fingerprints) if fp != fingerprints[0]]
        raise ValueError(f"the ranks called sparse_attention with different arguments (pattern, masks, documents, "
                         f"causal, scale, backend, batch, heads, head_dim or dtype): ranks {differ} differ from rank "
                         f"0; every rank must pass the same ones, only the shard of q, k, v is its own")
    layout = resolve_layout(pattern, batch, q_heads, n, n, module.BLOCK_SIZE, causal, key_padding_mask,
                            global_mask, documents)
    rank = dist.get_rank(group)
    program = _program(layout, shard_sizes, rank, batch, k.shape[0], k.shape[1], q.element_size(), q.device)
    module.check(q, k, v, program.local_layout)
    out, lse = _attend(program, q, k, v, module, scale, group, len(shard_sizes))
    return (out, lse) if return_lse else out


def _attend(program: RankProgram, q, k, v, module, scale: float, group, world: int):
    """out (B, Hq, n_rank, D) and lse (B, Hq, n_rank) of this rank's rows (differentiable)."""
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
    out, lse = module.attention(padded, keys, values, program.local_layout, scale)
    out = out[:, :, program.rows_before:program.rows_before + n_rank]           # (B, Hq, n_rank, D)
    lse = lse[:, :, program.rows_before:program.rows_before + n_rank]           # (B, Hq, n_rank)
    if program.lse_layout is None:
        return out, lse
    shipped_out, shipped_lse = _shipped_rows(program, q, keys, values, module, scale, group, world)
    return (out.index_copy(2, program.lse_rows, shipped_out.to(out.dtype)),
            lse.index_copy(2, program.lse_rows, shipped_lse.to(lse.dtype)))


def _compact(program: RankProgram, own: torch.Tensor, fetched: torch.Tensor, shape) -> torch.Tensor:
    """The compact key (or value) buffer of ``shape`` (Bk, Hkv, n_compact, D): this rank's vectors and the
    fetched ones in their slots, zeros where no row of this rank attends."""
    buffer = own.new_zeros(shape[0] * shape[1] * shape[2], shape[3])
    buffer.index_copy_(0, program.own_slots, own)
    buffer.index_copy_(0, program.kv_recv_slots, fetched)
    return buffer.view(shape)


def _shipped_rows(program: RankProgram, q, keys, values, module, scale: float, group, world: int):
    """This rank's shipped rows: sent to every rank, attended there over that rank's keys, the partial results
    sent back and combined by log-sum-exp. Returns out (B, Hq, n_ship, D) and lse (B, Hq, n_ship)."""
    batch, q_heads, _, head_dim = q.shape
    n_ship = len(program.lse_rows)
    rows = q.index_select(2, program.lse_rows).permute(2, 0, 1, 3).reshape(n_ship, batch * q_heads * head_dim)
    received = _Exchange.apply(rows.repeat(world, 1), [n_ship] * world, program.lse_recv_counts, group)
    n_q = program.lse_layout.n_q
    shipped = received.new_zeros(n_q, received.shape[1]).index_copy(0, program.lse_slots, received)
    shipped = shipped.view(n_q, batch, q_heads, head_dim).permute(1, 2, 0, 3)          # (B, Hq, n_q, D)
    part_out, part_lse = module.attention(shipped.contiguous(), keys, values, program.lse_layout, scale)
    partial = torch.cat([part_out.to(part_lse.dtype), part_lse[..., None]], dim=-1)    # (B, Hq, n_q, D + 1)
    partial = partial.permute(2, 0, 1, 3).reshape(n_q, -1).index_select(0, program.lse_slots)  # (sent, B*Hq*(D+1))
    back = _Exchange.apply(partial, program.lse_recv_counts, [n_ship] * world, group)
    back = back.view(world, n_ship, batch, q_heads, head_dim + 1)                  # (W, n_ship, B, Hq, D + 1)
    out, lse = combine_partials(back[..., :head_dim], back[..., head_dim])
    return out.permute(1, 2, 0, 3), lse.permute(1, 2, 0)


def combine_partials(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of disjoint key sets from the results over each: out (P, ..., D) and lse
    (P, ...) of P parts -> out (..., D), lse (...). A row no part attends gives 0 and -inf (gradients 0).

    >>> out, lse = combine_partials(torch.tensor([[[1.0]], [[3.0]]]), torch.tensor([[0.0], [0.0]]))
    >>> out.item(), round(lse.item(), 4)              # two equal halves: the mean, log 2
    (2.0, 0.6931)
    """
    top = lse.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight = torch.exp(lse - top)                                                  # (P, ...)
    total = weight.sum(0)
    seen = total > 0
    safe = torch.where(seen, total, torch.ones_like(total))
    combined = (weight[..., None] * out).sum(0) / safe[..., None]
    return combined, torch.where(seen, top + torch.log(safe), torch.full_like(top, -torch.inf))


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


def _gather(n_rank: int, fingerprint: int, group, device) -> tuple[tuple[int, ...], list[int]]:
    """Every rank's shard length and argument fingerprint, in rank order (one all_gather)."""
    mine = torch.tensor([n_rank, fingerprint], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu().tolist()
    return tuple(n for n, _ in table), [fp for _, fp in table]


def _fingerprint(q, k, pattern, causal, key_padding_mask, global_mask, documents, scale, backend) -> int:
    """A 63-bit digest of the arguments every rank must share (not the shard length)."""
    digest = hashlib.blake2b(digest_size=8)
    shapes = (q.shape[0], q.shape[1], q.shape[3], k.shape[0], k.shape[1], str(q.dtype), bool(causal), scale, backend)
    digest.update(repr(shapes).encode())
    if isinstance(pattern, BlockLayout):
        digest.update(repr((pattern.n_q, pattern.n_k, pattern.heads, pattern.block_size, pattern.causal)).encode())
        for tensor in pattern.index:
            digest.update(tensor.detach().cpu().numpy().tobytes())
    else:
        digest.update(repr(pattern).encode())
    for mask in (key_padding_mask, global_mask, documents):
        value = None if mask is None else np.asarray(torch.as_tensor(mask).detach().cpu())
        digest.update(b"-" if value is None else repr((value.shape, str(value.dtype))).encode() + value.tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1


@functools.lru_cache(maxsize=32)
def _program(layout: BlockLayout, shard_sizes: tuple[int, ...], rank: int, q_batch: int, kv_batch: int,
             kv_heads: int, itemsize: int, device: torch.device) -> RankProgram:
    """This rank's program, its tensors on ``device`` (cached: layouts of equal arguments are one object)."""
    plan = ShardPlan.build(layout, shard_sizes, kv_heads=kv_heads, q_batch=q_batch, kv_batch=kv_batch,
                           itemsize=itemsize)
    program = plan.program(rank)
    return program._replace(**{name: value.to(device) for name, value in program._asdict().items()
                               if isinstance(value, (torch.Tensor, BlockLayout))})
