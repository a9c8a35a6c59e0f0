"""The patterns the tests draw and the token masks they must give, written from DESIGN's definitions.

Hypothesis strategies of random pattern trees (``patterns``; ``patterns_for`` adds ``Blocks`` grids of a size), the
extreme arguments every kind accepts with their brute-force rules, the token mask of a pattern with call-time
data (``expected_mask``) or packed documents (``document_mask``), and the check that a layout's blocks hold
exactly a token mask (``check_blocks_exact``).

>>> expected_mask(sa.Local(1), 3, 3, 1, causal=True)[0, 0].int().tolist()
[[1, 0, 0], [1, 1, 0], [0, 1, 1]]
"""
import numpy as np
import torch
from hypothesis import strategies as st

import sparse_attn as sa
from sparse_attn.documents import document_spans
from sparse_attn.rules import Context, resolve

# --- random compositions ------------------------------------------------------------------------
leaves = st.one_of(
    st.builds(sa.Local, st.integers(0, 20), st.integers(0, 20), st.sampled_from([1, 1, 3, 8])),
    st.builds(sa.Stride, st.integers(1, 9), st.integers(-3, 3)),
    st.builds(sa.Dilated, st.integers(0, 6), st.integers(1, 4)),
    st.builds(sa.Global, st.lists(st.integers(0, 60), max_size=4), st.integers(0, 5), st.integers(0, 5)),
    st.builds(sa.Sink, st.lists(st.integers(0, 60), max_size=3), st.integers(0, 4), st.sampled_from([0, 5, 8])),
    st.builds(sa.Random, st.integers(0, 3), st.integers(0, 9), st.sampled_from([4, 7, 16])),
    st.just(sa.Causal()),
    st.just(sa.Dense()),
)


def block_grids(n_q, n_k, heads=None):
    """``Blocks`` leaves that fit (n_q, n_k): a random grid of a random block size, shared or per head."""
    def grid(block_size, per_head, density, seed):
        shape = ((heads,) if per_head else ()) + (-(-n_q // block_size), -(-n_k // block_size))
        return sa.Blocks(np.random.default_rng(seed).random(shape) < density, block_size)
    return st.builds(grid, st.sampled_from([1, 2, 3, 5, 8, 16, 100]), st.booleans() if heads else st.just(False),
                     st.sampled_from([0.0, 0.3, 0.7, 1.0]), st.integers(0, 2**16))


def pattern_trees(leaf):
    """Random compositions of ``leaf`` with |, & and ~."""
    return st.recursive(leaf, lambda inner: st.one_of(
        st.builds(lambda a, b: a | b, inner, inner),
        st.builds(lambda a, b: a & b, inner, inner),
        st.builds(lambda a: ~a, inner),
    ), max_leaves=5)


patterns = pattern_trees(leaves)                        # fits every size


def patterns_for(n_q, n_k, heads=None):
    """Compositions that may hold ``Blocks`` grids, which fit only (n_q, n_k) (and ``heads`` if per head)."""
    return pattern_trees(st.one_of(leaves, block_grids(n_q, n_k, heads)))


def check_layout_matches_mask(pattern, n_q, n_k, heads, block_size, **masks):
    """The layout of ``pattern`` with the call-time ``masks``: its token mask is ``expected_mask``'s, its blocks
    exact (``check_blocks_exact``)."""
    layout = pattern.layout(n_q, n_k, heads=heads, block_size=block_size, **masks)
    dense = layout.to_dense()                                          # (Bl, H, n_q, n_k)
    expected = expected_mask(pattern, n_q, n_k, heads, **masks)
    assert torch.equal(dense, expected.expand_as(dense))
    check_blocks_exact(layout, expected.expand(layout.batch, heads, n_q, n_k))
    return layout


def expected_mask(pattern, n_q, n_k, heads, causal=False, global_mask=None, key_padding_mask=None):
    """The call-time masks combined by their definitions: (p | globals) & causal & ~padding."""
    mask = pattern.mask(n_q, n_k, heads)[None]                         # (1, H, n_q, n_k)
    if global_mask is not None:
        mask = mask | global_mask[:, None, :, None] | global_mask[:, None, None, :]
    if causal:
        mask = mask & sa.Causal().mask(n_q, n_k)
    if key_padding_mask is not None:
        mask = mask & ~key_padding_mask[:, None, None, :]
    return mask


def check_blocks_exact(layout, expected):
    """Full blocks all allowed, partial blocks neither empty nor full, absent blocks empty; the
    transposed index lists the same blocks and tiles."""
    bs, n_qb, n_kb = layout.block_size, layout.n_q_blocks, layout.n_k_blocks
    assert layout.masks.shape[1:] == (min(bs, layout.n_q), min(bs, layout.n_k))
    padded = torch.zeros(*expected.shape[:2], n_qb * bs, n_kb * bs, dtype=torch.bool)
    padded[..., :layout.n_q, :layout.n_k] = expected
    tiles = padded.reshape(*expected.shape[:2], n_qb, bs, n_kb, bs).transpose(3, 4)  # (B, H, r, c, bs, bs)
    valid = torch.zeros_like(padded)
    valid[..., :layout.n_q, :layout.n_k] = True
    valid = valid.reshape(*expected.shape[:2], n_qb, bs, n_kb, bs).transpose(3, 4)
    allowed, area = tiles.sum((-1, -2)), valid.sum((-1, -2))
    for b in range(layout.batch):
        for h in range(layout.heads):
            hl = 0 if layout.shared_heads else h
            kind = torch.zeros(n_qb, n_kb, dtype=torch.int64)          # 0 absent, 1 full, 2 partial
            by_row, by_col = set(), set()
            for label, ptr, idx, tile_ids, t_ptr, t_idx, t_tiles in (
                    (1, layout.full_ptr, layout.full_idx, None, layout.full_t_ptr, layout.full_t_idx, None),
                    (2, layout.part_ptr, layout.part_idx, layout.part_mask,
                     layout.part_t_ptr, layout.part_t_idx, layout.part_t_mask)):
                for r in range(n_qb):
                    row = idx[int(ptr[b, hl, r]):int(ptr[b, hl, r + 1])]
                    assert (row[1:] > row[:-1]).all(), "key blocks of a row must be sorted"
                    for e in range(int(ptr[b, hl, r]), int(ptr[b, hl, r + 1])):
                        c = int(idx[e])
                        assert kind[r, c] == 0, "a block listed twice"
                        kind[r, c] = label
                        tile = -1 if tile_ids is None else int(tile_ids[e])
                        by_row.add((r, c, tile))
                        if tile >= 0:
                            tq, tk = layout.masks.shape[1:]                # block_size, or the sequence if shorter
                            assert torch.equal(layout.masks[tile], tiles[b, h, r, c, :tq, :tk]), "partial tile not exact"
                for c in range(n_kb):
                    for e in range(int(t_ptr[b, hl, c]), int(t_ptr[b, hl, c + 1])):
                        by_col.add((int(t_idx[e]), c, -1 if t_tiles is None else int(t_tiles[e])))
            assert by_row == by_col, "transposed index disagrees with the row index"
            a, s = allowed[b, h], area[b, h]
            assert torch.equal(kind == 1, (a == s) & (kind != 0)), "full blocks are exactly the all-allowed ones"
            assert (a[kind == 0] == 0).all(), "an absent block has allowed pairs"
            assert ((a[kind == 2] > 0) & (a[kind == 2] < s[kind == 2])).all(), "partial block is empty or full"


def has_random(pattern) -> bool:
    members = getattr(pattern, "patterns", ()) + ((pattern.pattern,) if isinstance(pattern, sa.Complement) else ())
    return isinstance(pattern, sa.Random) or any(has_random(p) for p in members)


# --- extreme arguments: any int is accepted and means what the definition says -------------------
N = 13  # the length the n-relative extremes below refer to
EXTREMES = [0, 1, N - 1, N, N + 1, 2**31, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]


def _local_rule(before, after, u):
    return lambda i, j, n: i // u - before <= j // u <= i // u + after


def _global_rule(tokens, first, last):
    return lambda i, j, n: any(t in tokens or t < first or t >= n - last for t in (i, j) if t >= 0)


# (make(x), definition(x)): every argument of every kind at every extreme; the definitions use Python ints
EXTREME_CASES = [
    (lambda x: sa.Local(x), lambda x: _local_rule(x, x, 1)),
    (lambda x: sa.Local(0, x), lambda x: _local_rule(0, x, 1)),
    (lambda x: sa.Local(x, 0), lambda x: _local_rule(x, 0, 1)),
    (lambda x: sa.Local(1, 0, block_size=max(x, 1)), lambda x: _local_rule(1, 0, max(x, 1))),
    (lambda x: sa.Local(x, x, block_size=max(x, 1)), lambda x: _local_rule(x, x, max(x, 1))),
    (lambda x: sa.Stride(max(x, 1)), lambda x: lambda i, j, n: (i - j) % max(x, 1) == 0),
    (lambda x: sa.Stride(3, offset=x), lambda x: lambda i, j, n: (i - j - x) % 3 == 0),
    (lambda x: sa.Stride(3, offset=-x), lambda x: lambda i, j, n: (i - j + x) % 3 == 0),
    (lambda x: sa.Stride(max(x, 1), offset=x - 5), lambda x: lambda i, j, n: (i - j - x + 5) % max(x, 1) == 0),
    (lambda x: sa.Stride(max(x, 1), offset=-2), lambda x: lambda i, j, n: (i - j + 2) % max(x, 1) == 0),
    (lambda x: sa.Dilated(x, 2), lambda x: lambda i, j, n: i - 2 * x <= j <= i + 2 * x and (i - j) % 2 == 0),
    (lambda x: sa.Dilated(1, max(x, 1)), lambda x: lambda i, j, n: abs(i - j) in (0, max(x, 1))),
    (lambda x: sa.Dilated(1, 2, after=x), lambda x: lambda i, j, n: i - 2 <= j <= i + 2 * x and (i - j) % 2 == 0),
    (lambda x: sa.Global(tokens=(x,)), lambda x: _global_rule((x,), 0, 0)),
    (lambda x: sa.Global(first=x), lambda x: _global_rule((), x, 0)),
    (lambda x: sa.Global(last=x), lambda x: _global_rule((), 0, x)),
    (lambda x: sa.Sink(tokens=(x,), first=x), lambda x: lambda i, j, n: j == x or j < x),
    (lambda x: sa.Sink(period=x), lambda x: lambda i, j, n: x > 0 and j % x == x - 1),
    (lambda x: sa.Sink(period=x + 3, width=x + 1), lambda x: lambda i, j, n: j % (x + 3) >= 2),
    (lambda x: sa.Sink(period=x + 3, width=1), lambda x: lambda i, j, n: j % (x + 3) == x + 2),
]
EXTREME_RANDOM = [lambda x: sa.Random(x, block_size=4), lambda x: sa.Random(2, seed=x, block_size=4),
                  lambda x: sa.Random(1, block_size=max(x, 1)), lambda x: sa.Random(x, seed=x, block_size=max(x, 1))]


# --- packed documents: each document a sequence by itself ----------------------------------------
def document_mask(pattern, ids, heads=1, causal=False, global_mask=None, key_padding_mask=None):
    """(B, H, N, N) bool by the definition: each document's own token mask (its pattern resolved for its
    length, its global tokens and padding) placed on the diagonal; nothing else."""
    ids = np.asarray(ids)
    batch, n = ids.shape
    out = torch.zeros(batch, heads, n, n, dtype=torch.bool)
    spans = document_spans(ids)
    for b, s, length, _ in zip(*spans):
        e = s + length
        i = np.arange(length)[:, None]
        j = np.arange(length)[None, :]
        for h in range(heads):
            m = np.broadcast_to(resolve(pattern, Context(int(length), int(length), h)).allows(i, j),
                                (length, length)).copy()
            if global_mask is not None:
                g = np.asarray(global_mask[b, s:e])
                m |= g[:, None] | g[None, :]
            if causal:
                m &= j <= i
            if key_padding_mask is not None:
                m &= ~np.asarray(key_padding_mask[b, s:e])[None, :]
            out[b, h, s:e, s:e] = torch.from_numpy(m)
    return out
