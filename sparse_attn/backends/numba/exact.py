"""The exact path of the Numba backend: rows and keys whose fast result is not finite, recomputed
by the reference's formulas over exactly their allowed pairs, in float64.

The fast path cannot keep a NaN or inf to the pairs that meet it: inside a computed tile a masked
pair multiplies its zero weight by the NaN in a matmul. So the kernels send here the rows of the
forward (``exact_row``), the keys of the backward's dk, dv (``exact_dk_dv``) and the rows of its dq
(``exact_dq_rows``) that came out NaN or inf. Scores are rounded to the inputs' dtype, so that they
overflow where torch's do. Finite inputs never come here unless a value overflows.

Bundles (``qkv`` = (q, k, v), ``ForwardResult``, ``Incoming``, ``BlockIndex``, ``Config``) are
those of ``bundles``; q, k, v are float arrays, or bf16 bits (uint16) read through
``bf16.to_float``. Scores carry the call's softcap and ALiBi (``mods``): in float64 from the
rounded ``scale q . k``, and in the fast path's base-2 formula where the fast backward must agree.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .bf16 import to_float
from .bundles import kv_example, query_examples, segment
from .lowlevel import copy_into, like
from .mods import exact_modified, exact_softcap_grad, head_modifiers, modified, position


@njit(cache=True, fastmath=False)
def exact_row(i, q_i, k, v, key_blocks, masks, config, out_i, head):
    """Row i of a query block (q_i (D,); k, v (Nk, D) of its kv head; key_blocks: the block's
    Segment; head: the block's HeadModifiers) as the reference computes it over the row's
    allowed keys, with the score modifiers: shift = the max score (NaN if
    a score is NaN, 0 if it is infinite), w = exp(s - shift), out = sum(w / sum(w) * v),
    lse = shift + log(sum(w)); no key with w > 0: out 0 @ v, lse -inf. Writes out_i; returns lse and
    the row's base-2 max, log2 sum and argmax for the backward: for a row with no key (lse -inf)
    +inf, so that P = 0; for lse NaN or +inf, NaN, so that every pair of the row goes to the exact
    backward."""
    scale, query = config.scale, position(head, i)
    keys = _allowed(i, key_blocks, masks, config.block_size, k.shape[0])
    # Each score once, into an array: loops over the keys that recomputed the score became, for D = 0 (a
    # version LLVM unswitches out), a loop over a loop-invariant score, which each of Numba's optimisation
    # runs unrolled 8x again for Intel targets (8 ** 6 copies of its address chain: LLVM's code generation
    # then overflowed the stack, a segfault seen with softcap alone).
    scores = np.empty(keys.size)
    for e in range(keys.size):
        scores[e] = exact_modified(head, _score(q_i, k[keys[e]], scale), query - keys[e])
    shift, arg, nan = -np.inf, -1, False
    for e in range(keys.size):
        if scores[e] != scores[e]:
            nan = True
        elif scores[e] > shift:
            shift, arg = scores[e], keys[e]
    shift = np.nan if nan else (0.0 if np.isinf(shift) else shift)
    total = 0.0
    for e in range(keys.size):
        total += np.exp(scores[e] - shift)
    norm = total if total != 0 else 1.0
    acc = np.zeros(out_i.size)
    for e in range(keys.size):
        w = np.exp(scores[e] - shift) / norm
        for d in range(out_i.size):
            acc[d] += w * to_float(v[keys[e], d])
    copy_into(out_i, acc)
    if total == 0:
        return -np.inf, np.inf, 0.0, -1
    lse = shift + np.log(total)
    if not np.isfinite(lse):
        return lse, np.nan, 0.0, -1
    return lse, _base2_score(q_i, k[arg], config, head, query - arg), np.log2(total), arg


@njit(cache=True, fastmath=False)
def exact_dk_dv(qkv, result, incoming, columns, config, e, g, j):
    """(dk, dv) (D,) float64 of key j of kv head g in example e of k, v: over the query examples that
    read it, the query heads of the group and their queries allowed to see j (``columns``: the
    transposed BlockIndex)."""
    q, k, _ = qkv
    batch, heads, n_q, dim = q.shape
    group, block_size = heads // k.shape[1], config.block_size
    acc_k, acc_v = np.zeros(dim), np.zeros(dim)
    b0, b1 = query_examples(e, batch, k.shape[0])
    for b in range(b0, b1):
        for h in range(g * group, (g + 1) * group):
            query_blocks = segment(columns, b, h, j // block_size)
            for i in _allowed(j % block_size, query_blocks, columns.masks, block_size, n_q):
                p, ds = _pair_grads(qkv, result, incoming, config, b, h, i, j)
                for d in range(dim):
                    acc_v[d] += p * to_float(incoming.dout[b, h, i, d])
                    acc_k[d] += ds * to_float(q[b, h, i, d])
    return config.scale * acc_k, acc_v


@njit(cache=True, fastmath=False, parallel=True)
def exact_dq_rows(rows, qkv, result, incoming, index, config, dq):
    """dq (B, Hq, Nq, D) of the given rows (flat (example, head, query) indices) by the exact path;
    ``index``: the row BlockIndex."""
    for e in prange(rows.size):
        _exact_dq_row(rows[e], qkv, result, incoming, index, config, dq)  # prange bodies only call: see bundles


@njit(cache=True, fastmath=False)
def _exact_dq_row(row, qkv, result, incoming, index, config, dq):
    """dq of one row (a flat (example, head, query) index): scale * sum over its keys of dS k."""
    q, k, _ = qkv
    heads, n_q, dim = q.shape[1], q.shape[2], q.shape[3]
    b, h, i = row // (heads * n_q), row // n_q % heads, row % n_q
    g, block_size = h // (heads // k.shape[1]), config.block_size
    key_blocks = segment(index, b, h, i // block_size)
    acc = np.zeros(dim)
    for j in _allowed(i % block_size, key_blocks, index.masks, block_size, k.shape[2]):
        _, ds = _pair_grads(qkv, result, incoming, config, b, h, i, j)
        for d in range(dim):
            acc[d] += ds * to_float(k[kv_example(b, k.shape[0]), g, j, d])
    copy_into(dq[b, h, i], config.scale * acc)


@njit(cache=True, fastmath=False)
def _pair_grads(qkv, result, incoming, config, b, h, i, j):
    """(P, dS) in float64 of the allowed pair (query i of head h, key j) of example b, as the fast
    backward forms them: P = 2 ** (min(S - row max, 0) - log2 sum), with S - row max = 0 for the
    row's maximum, and dS = P (dO . v - delta), times the softcap's derivative. A row with a +inf
    score (lse +inf) has P = exp(s) / inf, as the reference forms it (its shift is 0): NaN where
    exp(s) overflows in the inputs' dtype, else 0."""
    q, k, v = qkv
    e, g = kv_example(b, k.shape[0]), h // (q.shape[1] // k.shape[1])
    q_i, k_j, v_j, do_i = q[b, h, i], k[e, g, j], v[e, g, j], incoming.dout[b, h, i]
    head = head_modifiers(config, b, h, 0)
    distance = position(head, i) - j
    raw = _score(q_i, k_j, config.scale)
    if result.lse[b, h, i] == np.inf:
        p = np.float64(like(config.scale, np.exp(exact_modified(head, raw, distance)))) / np.inf
    else:
        top = result.argmax[b, h, i] == j
        x = 0.0 if top else _base2_score(q_i, k_j, config, head, distance) - result.row_max[b, h, i]
        p = np.exp2((0.0 if x > 0 else x) - result.log2_sum[b, h, i])
    dp = 0.0
    for d in range(do_i.size):
        dp += np.float64(to_float(do_i[d])) * np.float64(to_float(v_j[d]))
    return p, p * (dp - incoming.delta[b, h, i]) * exact_softcap_grad(head, raw)


@njit(cache=True, fastmath=False)
def _allowed(pos, blocks, masks, block_size, n):
    """The tokens (int64, ascending) that token ``pos`` of its block pairs with. Row index: pos is a
    query's offset in its query block and the Segment ``blocks`` holds key blocks, n = Nk; transposed
    index (its masks rows first too): pos is a key's offset in its key block, the blocks are query
    blocks, n = Nq."""
    tokens = np.empty(n, np.int64)
    count, full_at, part_at = 0, 0, 0
    while full_at < blocks.full.size or part_at < blocks.partial.size:
        full = part_at >= blocks.partial.size or (full_at < blocks.full.size
                                                  and blocks.full[full_at] < blocks.partial[part_at])
        start = (blocks.full[full_at] if full else blocks.partial[part_at]) * block_size
        for t in range(start, min(start + block_size, n)):
            if full or masks[blocks.tiles[part_at], pos, t - start]:
                tokens[count] = t
                count += 1
        if full:
            full_at += 1
        else:
            part_at += 1
    return tokens[:count]


@njit(cache=True, fastmath=False)
def _base2_score(x, y, config, head, distance):
    """The base-2 score of the fast path, log2(e) scale (x . y) rounded as _score rounds it, then the
    modifiers by the fast path's formula in the dtype computed in (as the fast backward recomputes it)."""
    return np.float64(modified(head, like(config.scale, _score(x, y, config.base2_scale)), distance))


@njit(cache=True, fastmath=False)
def _score(x, y, scale):
    """scale * (x . y) rounded as torch rounds it in the inputs' dtype (the dot product, then the
    product), so that it overflows where the reference's does; summed in float64, returned as float64."""
    dot = 0.0
    for d in range(x.size):
        dot += np.float64(to_float(x[d])) * np.float64(to_float(y[d]))
    return np.float64(like(scale, like(scale, dot) * scale))
