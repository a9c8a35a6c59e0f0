"""The float64 oracle of attention with score modifiers, written from the formulas (issue 27, DESIGN.md), not
from any backend or from ``sparse_attn.score_mods``.

>>> import torch, sparse_attn as sa
>>> q = k = v = torch.randn(1, 2, 6, 4, dtype=torch.float64)
>>> out, lse = oracle(q, k, v, sa.Local(1).mask(6), 0.5, softcap=5.0, alibi_slopes=torch.tensor([0.5, 0.25]),
...                   sinks=torch.zeros(2))
>>> out.shape, lse.shape
(torch.Size([1, 2, 6, 4]), torch.Size([1, 2, 6]))

For query row i (at key-sequence position i' = i + Nk - Nq) and an allowed key j:

    s_ij = scale * q_i . k_j
    s_ij <- softcap * tanh(s_ij / softcap)                  (softcap given)
    s_ij <- s_ij - slope[b, h] * |i' - j|                   (alibi_slopes given)
    lse_i = log(exp(sink_h) + sum_j exp(s_ij))              (the sink term only with sinks)
    out_i = sum_j exp(s_ij - lse_i) v_j

A row with no allowed key: out 0, lse = sink_h (-inf without sinks). k, v of batch 1 serve every example;
Hkv dividing Hq: query head h reads kv head h // (Hq / Hkv). Differentiable by autograd with respect to q,
k, v and sinks (no NaN from empty rows).
"""
from __future__ import annotations

import torch


def oracle(q, k, v, mask, scale, softcap=None, alibi_slopes=None, sinks=None, dtype=torch.float64):
    """(out, lse) in ``dtype``: out (B, Hq, Nq, D), lse (B, Hq, Nq). float64 is the oracle; a kernel's dtype gives
    the tolerance rule's baseline, the same computation done by torch in that dtype.

    q (B, Hq, Nq, D); k, v (B or 1, Hkv, Nk, D); mask: bool, broadcastable to (B, Hq, Nq, Nk), True =
    allowed (``pattern.mask(n_q, n_k, heads)``, ``layout.to_dense()``); alibi_slopes (Hq,) or (B, Hq);
    sinks (Hq,)."""
    batch, q_heads, n_q, _ = q.shape
    n_k = k.shape[2]
    group = q_heads // k.shape[1]
    q = q.to(dtype)
    k = k.to(dtype).repeat_interleave(group, dim=1).expand(batch, -1, -1, -1)      # (B, Hq, Nk, D)
    v = v.to(dtype).repeat_interleave(group, dim=1).expand(batch, -1, -1, -1)      # (B, Hq, Nk, D)
    mask = torch.as_tensor(mask, dtype=torch.bool).expand(batch, q_heads, n_q, n_k)
    s = scale * (q @ k.transpose(-1, -2))                                         # (B, Hq, Nq, Nk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        slope = alibi_slopes.to(dtype).reshape(-1, q_heads)[:, :, None, None]      # (B or 1, Hq, 1, 1)
        i = torch.arange(n_q, device=s.device)[:, None] + (n_k - n_q)
        j = torch.arange(n_k, device=s.device)[None, :]
        s = s - slope * (i - j).abs().to(dtype)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:                       # one more "key" per row: logit sink_h, value 0
        sink = sinks.to(dtype)[None, :, None, None].expand(batch, q_heads, n_q, 1)
        s = torch.cat([s, sink], dim=-1)                                          # (B, Hq, Nq, Nk + 1)
        v = torch.cat([v, v.new_zeros(batch, q_heads, 1, v.shape[-1])], dim=2)    # (B, Hq, Nk + 1, D)
    return _softmax_attention(s, v)


def _softmax_attention(s, v):
    """out = softmax(s) v and lse = logsumexp(s) over the last axis; an all -inf row gives 0 and -inf."""
    top = s.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isneginf(top), 0.0, top)                  # any finite shift for empty rows
    weights = torch.exp(s - top)
    total = weights.sum(-1, keepdim=True)
    empty = total == 0
    total = torch.where(empty, 1.0, total)
    out = (weights / total) @ v
    lse = torch.where(empty, float("-inf"), top + torch.log(total))
    return out, lse[..., 0]
