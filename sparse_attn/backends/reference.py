"""The reference backend: plain masked softmax in torch. The oracle every fast backend is tested
against.

It evaluates the layout's token mask for a few query blocks at a time, so a forward costs
O(rows_per_chunk x block_size x n_k) memory instead of O(n_q x n_k); in training each chunk is
checkpointed, so the backward recomputes it rather than keeping all probabilities alive. It runs on
any device and dtype (half inputs are computed in float32) and is differentiable by autograd, softcap and
ALiBi (``score_mods``) included.
"""
from __future__ import annotations

import torch
from einops import rearrange
from torch.utils.checkpoint import checkpoint

from ..layout import BlockLayout
from ..score_mods import NO_MODS, ScoreMods, alibi_bias, modified_scores, query_positions

BLOCK_SIZE = 64
_SCORES_PER_CHUNK = 1 << 24  # score-matrix elements materialised at once


def check(q, k, v, layout: BlockLayout) -> None:
    """Every device, dtype and block size works."""


def attention(q, k, v, layout: BlockLayout, scale: float, mods: ScoreMods = NO_MODS):
    """out (B, Hq, Nq, D) in q's dtype and lse (B, Hq, Nq), float32 for half inputs. k, v (B or 1, Hkv,
    Nk, D): batch 1 broadcasts over q's batch in the einsums, so autograd sums dk, dv over the batch.
    ``mods``: softcap, then ALiBi, on every allowed score."""
    dtype = q.dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    batch, heads = q.shape[:2]
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs, lses = [], []
    for r0, r1, rows in layout.query_chunks(batch * heads * layout.n_k, _SCORES_PER_CHUNK):
        q_chunk = q[:, :, rows]                                         # (B, Hq, rows, D)
        if recompute:
            out, lse = checkpoint(_attend_chunk, q_chunk, k, v, layout, r0, r1, scale, mods, use_reentrant=False)
        else:
            out, lse = _attend_chunk(q_chunk, k, v, layout, r0, r1, scale, mods)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2).to(dtype), torch.cat(lses, dim=2)


def _attend_chunk(q, k, v, layout: BlockLayout, r0: int, r1: int, scale: float, mods: ScoreMods):
    """Exact softmax attention of query blocks r0..r1-1 over their allowed keys."""
    kv_heads = k.shape[1]
    q = rearrange(q, "b (h g) q d -> b h g q d", h=kv_heads)            # (B, Hkv, G, rows, D)
    mask = layout.row_mask(r0, r1)                                      # (Bl, Hl, rows, Nk)
    mask = mask[:, :, None] if layout.shared_heads else rearrange(mask, "b (h g) q k -> b h g q k", h=kv_heads)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale            # (B, Hkv, G, rows, Nk); k's b: B or 1
    if mods != NO_MODS:
        scores = modified_scores(scores, mods.softcap, _bias(mods, layout, r0, q.shape[3], kv_heads, q.device))
    scores = scores.masked_fill(~mask, float("-inf"))
    shift = scores.amax(-1, keepdim=True).detach()                      # softmax is shift-invariant
    shift = torch.where(torch.isinf(shift), 0.0, shift)                 # empty rows: any finite shift
    weights = torch.exp(scores - shift)                                 # masked pairs -> exactly 0
    total = weights.sum(-1, keepdim=True)
    empty = total == 0
    total = torch.where(empty, 1.0, total)                              # empty rows: 0 output, 0 grads
    lse = torch.where(empty, float("-inf"), shift + torch.log(total))   # (B, Hkv, G, rows, 1)
    out = torch.einsum("bhgqk,bhkd->bhgqd", weights / total, v)         # (B, Hkv, G, rows, D)
    return rearrange(out, "b h g q d -> b (h g) q d"), rearrange(lse, "b h g q 1 -> b (h g) q")


def _bias(mods: ScoreMods, layout: BlockLayout, r0: int, rows: int, kv_heads: int, device):
    """ALiBi's bias of the chunk's rows, (Bs, Hkv, G, rows, Nk), or None without slopes."""
    if mods.alibi_slopes is None:
        return None
    first = r0 * layout.tile_shape[0]
    query_pos = query_positions(layout.n_q, layout.n_k, slice(first, first + rows), device)
    bias = alibi_bias(mods.alibi_slopes, query_pos, torch.arange(layout.n_k, device=device))  # (Bs, Hq, rows, Nk)
    return rearrange(bias, "b (h g) q k -> b h g q k", h=kv_heads)
