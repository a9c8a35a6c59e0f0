"""Attention probabilities of the allowed pairs only, as one sparse matrix per (example, head).

>>> import torch, sparse_attn as sa
>>> q = k = torch.randn(1, 2, 300, 16)
>>> w = sa.attention_weights(q, k, sa.Local(4) | sa.Global(first=1))
>>> w[0][1].shape, w[0][1].nnz                   # (example 0, head 1): scipy.sparse.csr_array
((300, 300), 3270)
>>> bool(abs(w[0][1].sum(axis=1) - 1).max() < 1e-5)
True

With ``sinks`` each row gives the sink its share: the row sums to ``1 - exp(sink - lse)``.

>>> w = sa.attention_weights(q, k, sa.Local(4), sinks=torch.zeros(2), softcap=20.0)
>>> bool((w[0][0].sum(axis=1) < 1).all())
True

Scores are computed for a few query blocks at a time (as the reference backend does), so memory is
O(rows_per_chunk x block_size x n_k) plus the result, which holds exactly the allowed pairs: nothing
N x N is ever allocated for a sparse pattern.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .api import check_inputs, resolve_layout, resolve_scale
from .layout import BlockLayout
from .pattern import Pattern
from .score_mods import alibi_bias, check_mods, modified_scores, query_positions

if TYPE_CHECKING:
    import scipy.sparse

_SCORES_PER_CHUNK = 1 << 24  # score elements materialised at once (as in the reference backend)


def attention_weights(q: torch.Tensor, k: torch.Tensor, pattern: Pattern | BlockLayout, *, causal: bool = False,
                      key_padding_mask: torch.Tensor | None = None, global_mask: torch.Tensor | None = None,
                      documents: torch.Tensor | None = None, scale: float | None = None,
                      softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None, block_size: int = 64) -> list[list[scipy.sparse.csr_array]]:
    """Softmax probabilities that ``sparse_attention`` would apply, for the allowed pairs only.

    Args:
        q: (B, Hq, Nq, D); k: (B or 1, Hkv, Nk, D) with Hkv dividing Hq (grouped-query attention);
            a k of batch 1 is shared by every example.
        pattern: a Pattern, or a prebuilt BlockLayout (then causal and the masks are already in it).
        causal, key_padding_mask, global_mask, documents, scale, softcap, alibi_slopes, sinks: as in
            ``sparse_attention``.
        block_size: the block size of the layout built from a Pattern (it does not change the result).

    Returns:
        A nested list ``weights[b][h]`` of ``scipy.sparse.csr_array`` of shape (Nq, Nk) and dtype
        float64 (float32 for float16/bfloat16/float32 inputs). Its stored entries are exactly the
        allowed pairs (explicit zeros where a probability underflows); every row sums to 1 (with ``sinks``:
        1 less the sink's share, ``exp(sink - lse)``), and a row with no allowed key is empty (all zero).
    """
    batch, heads, n_q, head_dim = check_inputs(q, k)
    if q.device.type == "meta":
        raise ValueError("attention_weights returns probabilities, which meta tensors do not have; call it with "
                         "tensors that hold values (sparse_attention propagates meta shapes)")
    n_k = k.shape[2]
    layout = resolve_layout(pattern, batch, heads, n_q, n_k, block_size, causal, key_padding_mask, global_mask,
                            documents)
    scale = resolve_scale(scale, head_dim)
    mods, sinks = check_mods(q, softcap, alibi_slopes, sinks)

    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k = q.detach().to(compute), k.detach().to(compute)
    sinks = None if sinks is None else sinks.detach().to(compute)
    key_pos = torch.arange(n_k, device=q.device)
    group = heads // k.shape[1]
    layout = layout.to(q.device)
    parts: list[list[list[Any]]] = [[[] for _ in range(heads)] for _ in range(batch)]  # (b, h): (counts, cols, values)
    for r0, r1, chunk_rows in layout.query_chunks(n_k, _SCORES_PER_CHUNK):
        mask = layout.row_mask(r0, r1)                              # (Bl, Hl, rows, Nk)
        # the allowed pairs of each stored (example, head) mask, found once and shared by its users
        pairs = {(bl, hl): (mask[bl, hl].nonzero(as_tuple=True), mask[bl, hl].sum(-1).cpu().numpy())
                 for bl in range(mask.shape[0]) for hl in range(mask.shape[1])}
        query_pos = query_positions(n_q, n_k, chunk_rows, q.device)
        for b in range(batch):
            for h in range(heads):
                stored = (b % mask.shape[0], h % mask.shape[1])
                (rows, cols), counts = pairs[stored]
                q_rows = q[b, h, chunk_rows]                                         # (rows, D)
                scores = (q_rows @ k[b % k.shape[0], h // group].T) * scale           # (rows, Nk)
                slopes = mods.alibi_slopes
                bias = None if slopes is None else alibi_bias(
                    slopes[b % len(slopes), h].reshape(1, 1), query_pos, key_pos)[0, 0]  # (rows, Nk)
                scores = modified_scores(scores, mods.softcap, bias).masked_fill(~mask[stored], float("-inf"))
                probs = torch.softmax(scores, dim=-1)
                if sinks is not None:                                                 # the keys' share
                    probs = probs * torch.sigmoid(torch.logsumexp(scores, -1, keepdim=True) - sinks[h])
                parts[b][h].append((counts, cols.cpu().numpy(), probs[rows, cols].cpu().numpy()))
    return [[_csr(chunks, n_q, n_k) for chunks in per_head] for per_head in parts]


def _csr(chunks, n_q: int, n_k: int) -> scipy.sparse.csr_array:
    import scipy.sparse  # here, not at module level: it costs ~180 ms of ``import sparse_attn``

    counts, cols, values = (np.concatenate(column) for column in zip(*chunks))
    indptr = np.zeros(n_q + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return scipy.sparse.csr_array((values, cols.astype(np.int64), indptr), shape=(n_q, n_k))
