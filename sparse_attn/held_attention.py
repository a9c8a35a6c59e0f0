"""Attention of a few new queries over a KV cache's held keys: the decode step of ``SparseKVCache``.

>>> import numpy as np, torch, sparse_attn as sa
>>> from sparse_attn.rules import Context, resolve
>>> rules = [resolve(sa.Local(3, 0) | sa.Sink(first=1), Context(1, 100, 0))]
>>> held = np.array([0, 96, 97, 98, 99])                       # a sink, then the window (slot order)
>>> held_mask(rules, np.array([99]), held) is None             # the query at 99 sees every held key
True
>>> held_mask(rules, np.array([98]), held)[0].astype(int).tolist()
[[1, 1, 1, 1, 0]]
>>> q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8)    # (B, Hq, 1, D), (B, Hkv, n_held, D)
>>> out, lse = dense_attention(q, k, k, None, 8 ** -0.5)
>>> out.shape, lse                                             # lse only when asked for
(torch.Size([1, 4, 1, 8]), None)

One query row over the ~4K keys a streaming cache holds is too small for a block-sparse kernel (its
cost per key block is not amortised by one row): it is a plain dot over the held keys. Two parts:

- :func:`held_mask` says which held keys each row may attend (the pattern's rule at the held positions),
  and None where every pair is allowed (a decode step of ``Local(w - 1, 0) | Sink(...)``): no mask at all.
- :func:`dense_attention` runs the rows over the held keys in one call. GQA groups the query heads of
  each key/value head into rows (``(B, Hq, n, D) -> (B, Hkv, G * n, D)``: the keys are read once, never
  repeated per query head). Without modifiers and lse it is ``torch.nn.functional.scaled_dot_product_attention``
  (with the mask where there is one); with softcap, ALiBi or lse wanted, the same in torch matmuls (float32
  for half inputs), masked pairs -inf, a row with no allowed key 0 with lse -inf.

Imports run one way: this module imports ``rules`` and ``score_mods``; ``kv_cache`` imports it.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .rules import Rule
from .score_mods import NO_MODS, ScoreMods, alibi_bias, modified_scores


def held_mask(rules: list[Rule], query_positions: np.ndarray, key_positions: np.ndarray) -> np.ndarray | None:
    """Which held keys each query may attend: (heads, rows, keys) bool, or None when every pair is allowed.

    ``rules``: the pattern resolved for each head (one rule for a pattern that is the same on every head);
    ``query_positions`` (rows,) and ``key_positions`` (keys,): positions in the sequence (int64; a negative
    position, padding before a left-padded example's start, is never allowed). O(rows x keys): one row's
    evaluation over the ~4K keys a streaming cache holds costs about what reading them once does.
    """
    i, j = query_positions[:, None], key_positions[None, :]                           # (rows, 1), (1, keys)
    real = (i >= 0) & (j >= 0)
    if len(rules) == 1 and real.all():                                                 # one rule, no padding
        allowed = rules[0].allows(i, j)
        return None if allowed.all() else allowed[None]
    mask = np.stack([rule.allows(i, j) & real for rule in rules])                      # (heads, rows, keys)
    return None if mask.all() else mask


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, mods: ScoreMods = NO_MODS, query_pos: torch.Tensor | None = None,
                    key_pos: torch.Tensor | None = None, return_lse: bool = False):
    """q (B, Hq, n, D) over keys, values (B or 1, Hkv, m, D): (out (B, Hq, n, D), lse (B, Hq, n) or None).

    ``mask``: (B or 1, Hq or 1, n, m) bool, True = allowed, or None (every pair); ``mods``: softcap and ALiBi
    (``query_pos`` (n,) and ``key_pos`` (m,) then give the positions whose distance ALiBi takes). lse is
    float32 (float64 for float64 inputs), computed only with ``return_lse`` or modifiers.
    """
    batch, q_heads, n, dim = q.shape
    kv_heads = keys.shape[1]
    rows = q.reshape(batch, kv_heads, q_heads // kv_heads * n, dim)                  # (B, Hkv, G * n, D)
    keys, values = keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1)  # (B, Hkv, m, D)
    mask = None if mask is None else _grouped(mask, kv_heads, q_heads)             # (B or 1, Hkv or 1, G * n, m)
    if mods == NO_MODS and not return_lse:
        out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)
        if mask is not None:                                                        # rows with no key: 0
            out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
        return out.reshape(q.shape), None
    out, lse = _softmax_attention(rows, keys, values, mask, scale, _bias(mods, query_pos, key_pos, kv_heads, q_heads),
                                  mods.softcap)
    return out.reshape(q.shape), lse.reshape(batch, q_heads, n)


def _grouped(per_head: torch.Tensor, kv_heads: int, q_heads: int) -> torch.Tensor:
    """(Bl, Hq or 1, n, m) -> (Bl, Hkv or 1, G * n, m): query head h = kv_head * G + g, as the rows."""
    group = q_heads // kv_heads
    if per_head.shape[1] == 1:
        return per_head.expand(-1, group, -1, -1).reshape(per_head.shape[0], 1, -1, per_head.shape[3])
    return per_head.reshape(per_head.shape[0], kv_heads, -1, per_head.shape[3])


def _bias(mods: ScoreMods, query_pos, key_pos, kv_heads: int, q_heads: int) -> torch.Tensor | None:
    """ALiBi's bias grouped as the rows, (Bs, Hkv, G * n, m), or None without slopes."""
    if mods.alibi_slopes is None:
        return None
    bias = alibi_bias(mods.alibi_slopes, query_pos, key_pos)                           # (Bs, Hq, n, m)
    return bias.reshape(bias.shape[0], kv_heads, -1, bias.shape[3])


def _softmax_attention(rows, keys, values, mask, scale: float, bias, softcap: float):
    """Softmax attention in float32 (float64 for float64 inputs): (out in the rows' dtype, lse)."""
    compute = torch.float64 if rows.dtype == torch.float64 else torch.float32
    scores = torch.matmul(rows.to(compute), keys.to(compute).transpose(-1, -2)) * scale  # (B, Hkv, G * n, m)
    scores = modified_scores(scores, softcap, bias)
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    lse = torch.logsumexp(scores, -1)                                                   # (B, Hkv, G * n)
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])   # a row with no key: 0
    return torch.matmul(weights, values.to(compute)).to(rows.dtype), lse
