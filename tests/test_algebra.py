"""The complete pattern algebra: ~p (complement) and Blocks (any block layout), with |, & and PerHead.

Laws on masks (hypothesis over random compositions), layouts equal to masks at awkward sizes, block
classification of complements, DeepSpeed's sparsity configs as Blocks grids, the numba and triton
kernels against the float64 reference, serialisation and errors.
"""
import copy
import pickle
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparse_attn as sa
from sparse_attn import cli
from sparse_attn.expression import PatternTextError, parse_pattern
from sparse_attn.pattern import MAX_DEPTH
from sparse_attn.rules import ComplementRule, Context, resolve
from tests.helpers import run_backend
from tests.strategies import check_layout_matches_mask, has_random, patterns_for
from tests.tolerance import assert_within_rule

SIZES = st.tuples(st.integers(1, 40), st.integers(1, 40))


def no_random(n_q, n_k, heads=None):
    """Compositions without Random, whose tiles depend on their union siblings (so | is not mask or)."""
    return patterns_for(n_q, n_k, heads).filter(lambda p: not has_random(p))


# --- laws ------------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), sizes=SIZES, heads=st.integers(1, 2))
def test_complement_is_the_mask_negated_and_twice_is_the_pattern(data, sizes, heads):
    n_q, n_k = sizes
    p = data.draw(patterns_for(n_q, n_k, heads), label="p")
    mask = p.mask(n_q, n_k, heads)
    assert torch.equal((~p).mask(n_q, n_k, heads), ~mask)
    assert ~~p == p and (~~p is p or isinstance(p, sa.Complement))
    assert torch.equal(sa.Complement(sa.Complement(p)).mask(n_q, n_k, heads), mask)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), sizes=SIZES)
def test_de_morgan_both_ways(data, sizes):
    n_q, n_k = sizes
    a, b = data.draw(no_random(n_q, n_k), label="a"), data.draw(no_random(n_q, n_k), label="b")
    assert torch.equal((~(a | b)).mask(n_q, n_k), (~a & ~b).mask(n_q, n_k))
    assert torch.equal((~(a & b)).mask(n_q, n_k), (~a | ~b).mask(n_q, n_k))
    assert torch.equal((a & ~b).mask(n_q, n_k), a.mask(n_q, n_k) & ~b.mask(n_q, n_k))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), sizes=SIZES)
def test_a_pattern_and_its_complement_are_disjoint_and_cover_everything(data, sizes):
    n_q, n_k = sizes
    p = data.draw(no_random(n_q, n_k), label="p")
    assert not (p & ~p).mask(n_q, n_k).any()
    assert (p | ~p).mask(n_q, n_k).all()
    assert not (p & ~p).layout(n_q, n_k, block_size=4).nnz_blocks


def test_random_draws_among_the_tiles_a_complement_leaves_untouched():
    """In ``Random(k) | ~p`` the complement touches every tile that p does not cover completely, so the
    random tiles come from the tiles p covers: here tile R - 1, the window's one tile before row R (none in
    row 0: random tiles lie before their row)."""
    window = sa.Local(1, block_size=4)
    mask = (sa.Random(1, seed=2, block_size=4) | ~window).mask(64, heads=3)
    assert torch.equal(mask & ~window.mask(64), (~window).mask(64).expand(3, -1, -1))
    inside = (mask & window.mask(64)).reshape(3, 16, 4, 16, 4)          # (H, tile row, 4, tile col, 4)
    assert torch.equal(inside.all(dim=(2, 4)), inside.any(dim=(2, 4))), "whole tiles"
    drawn = inside.any(dim=(2, 4))                                                  # (H, tile row, tile col)
    assert torch.equal(drawn, torch.ones(15).diag(-1).bool().expand(3, 16, 16)), "tile R - 1"
    assert (sa.Random(2, block_size=4) | ~sa.Random(2, block_size=4)).mask(32).all()


# --- layouts at awkward sizes ------------------------------------------------------------------------
def grid(n_q, n_k, block_size, heads=None, density=0.4, seed=0):
    shape = ((heads,) if heads else ()) + (-(-n_q // block_size), -(-n_k // block_size))
    return np.random.default_rng(seed).random(shape) < density


AWKWARD = [  # (n_q, n_k, layout block size, heads)
    (1, 1, 16, 1), (37, 37, 8, 2), (30, 70, 16, 3), (70, 30, 16, 2), (100, 100, 32, 2), (65, 63, 4, 1),
]


@pytest.mark.parametrize("n_q, n_k, block_size, heads", AWKWARD)
@pytest.mark.parametrize("grid_block", [1, 5, 8, 16, 200])
def test_blocks_layout_agrees_with_mask(n_q, n_k, block_size, heads, grid_block):
    shared = sa.Blocks(grid(n_q, n_k, grid_block), grid_block)
    per_head = sa.Blocks(grid(n_q, n_k, grid_block, heads, seed=1), grid_block)
    for p in (shared, per_head, ~per_head, shared & sa.Causal(), ~shared | sa.Global(first=3),
              sa.PerHead([per_head] * heads) & ~sa.Local(2), sa.Random(1, block_size=8) | shared):
        check_layout_matches_mask(p, n_q, n_k, heads, block_size)


@pytest.mark.parametrize("n_q, n_k, block_size, heads", AWKWARD)
def test_complement_layout_agrees_with_mask(n_q, n_k, block_size, heads):
    for p in (~sa.Causal(), sa.Local(9) & ~sa.Global(first=1), ~(sa.Local(3, 0) | sa.Stride(5)),
              ~sa.Random(2, block_size=8) & sa.Local(12), sa.PerHead([~sa.Local(h) for h in range(heads)]),
              ~(sa.Local(1, block_size=8) | sa.Random(1, block_size=8)), ~sa.Dense(), ~~sa.Sink(period=7)):
        check_layout_matches_mask(p, n_q, n_k, heads, block_size)


@pytest.mark.parametrize("causal", [False, True])
def test_call_time_masks_apply_after_the_complement(causal):
    """key_padding_mask, global_mask and causal combine with the pattern as for any pattern: the complement
    is the pattern's, so padded keys stay unattended."""
    n, gen = 45, torch.Generator().manual_seed(0)
    global_mask = torch.rand(2, n, generator=gen) < 0.1
    padding = torch.arange(n)[None, :] >= torch.tensor([[45], [31]])
    for p in (~sa.Local(4), sa.Blocks(grid(n, n, 8, heads=2), 8) & ~sa.Global(first=1)):
        layout = check_layout_matches_mask(p, n, n, 2, 8, causal=causal, global_mask=global_mask,
                                           key_padding_mask=padding)
        assert not layout.to_dense()[1, :, :, 31:].any()


# --- block classification ------------------------------------------------------------------------
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), sizes=SIZES, block_size=st.sampled_from([1, 3, 4, 8, 16, 64]))
def test_complement_swaps_full_and_empty_blocks_and_keeps_partial_ones(data, sizes, block_size):
    n_q, n_k = sizes
    p = data.draw(patterns_for(n_q, n_k, heads=2), label="p")
    layout, complement = p.layout(n_q, n_k, 2, block_size), (~p).layout(n_q, n_k, 2, block_size)
    for head in range(2):                                 # 0 absent, 1 partial, 2 full: full <-> absent
        assert np.array_equal(complement.block_grid(head=head), 2 - layout.block_grid(head=head))


def test_complement_rule_classification_mirrors_the_inner_rule():
    ctx = Context(n_q=50, n_k=50, head=0)
    inner = resolve(sa.Local(5) | sa.Global(first=2), ctx)
    rule = resolve(~(sa.Local(5) | sa.Global(first=2)), ctx)
    assert isinstance(rule, ComplementRule) and rule.candidates(ctx, 8) is None
    from sparse_attn.rules import BlockRanges as Ranges
    rows, cols = np.divmod(np.arange(49), 7)
    ranges = Ranges.at(ctx, rows, cols, 8)                 # every 8-token block, the last row and column cut
    (nonempty, full, sig), (c_nonempty, c_full, c_sig) = inner.classify(ranges), rule.classify(ranges)
    assert np.array_equal(c_nonempty, ~full) and np.array_equal(c_full, ~nonempty) and np.array_equal(c_sig, sig)


def test_intersection_takes_its_candidates_from_the_other_members():
    ctx = Context(n_q=1 << 20, n_k=1 << 20, head=0)
    window = resolve(sa.Local(256), ctx).candidates(ctx, 64)
    for other in (~sa.Causal(), ~sa.Global(first=1), ~sa.Stride(3)):
        keys = resolve(sa.Local(256) & other, ctx).candidates(ctx, 64)
        assert keys is not None and np.array_equal(keys, window)
    layout = (sa.Local(256) & ~sa.Causal()).layout(1 << 20, heads=12, block_size=64)   # builds from the band
    assert layout.shared_heads and layout.nnz_blocks == 12 * (16384 * 5 - 10)      # diagonal + 4 above, cut


# --- Blocks as DeepSpeed layouts -----------------------------------------------------------------------
# DeepSpeed's sparse attention describes every pattern as an int64 (H, nb, nb) block layout built by
# SparsityConfig.make_layout(seq_len). The grids below are written out by hand from those rules
# (nb = 8 or 10 blocks); a drawn plan of random blocks is written as the columns it chose.
def rows(*lines):
    return [[int(c) for c in line] for line in lines]


DEEPSPEED = {
    # FixedSparsityConfig(num_heads=2, num_local_blocks=4, num_global_blocks=1, different_layout_per_head=True,
    # num_different_global_patterns=2), bidirectional, nb=10: windows of 4 blocks (the last one 2); head h's
    # global column is block 3 - h of every full window, the last window's is its last block (9).
    "fixed": [rows(*["1111000101"] * 4, *["0001111101"] * 4, *["0001000111"] * 2),
              rows(*["1111001001"] * 4, *["0010111101"] * 4, *["0010001011"] * 2)],
    # FixedSparsityConfig(num_heads=1, num_local_blocks=4, attention="unidirectional"), nb=8: causal within each
    # window, global column 3 (7) from its own row down.
    "fixed-unidirectional": [rows("10000000", "11000000", "11100000", "11110000",
                                  "00011000", "00011100", "00011110", "00011111")],
    # VariableSparsityConfig(local_window_blocks=[1, 2], global_block_indices=[0], horizontal_global_attention=True,
    # num_random_blocks=1), nb=8: windows {0}, {1,2}, then the last size again: {3,4}, {5,6}, {7}; block 0 global
    # row and column; random columns drawn per row: 5, 3, 7, 0, 6, 2, 1, 4.
    "variable": [rows("11111111", "11110000", "11100001", "10011000", "10011010", "10100110", "11000110",
                      "10001001")],
    # BigBirdSparsityConfig(num_random_blocks=1, num_sliding_window_blocks=3, num_global_blocks=1), nb=8: blocks
    # row-1..row+1, block 0 global row and column, random columns 6, 4, 7, 0, 1, 2, 3, 5.
    "bigbird": [rows("11111111", "11101000", "11110001", "10111000", "11011100", "10101110", "10010111",
                     "10000111")],
    # BSLongformerSparsityConfig(num_sliding_window_blocks=3, global_block_indices=[0, 6],
    # global_block_end_indices=[1, 8]), nb=8: blocks row-1..row+1, blocks 0, 6, 7 global rows and columns.
    "bslongformer": [rows("11111111", "11100011", "11110011", "10111011", "10011111", "10001111", "11111111",
                          "11111111")],
    # LocalSlidingWindowSparsityConfig(num_sliding_window_blocks=3), unidirectional, nb=8: blocks row-1..row.
    "local-sliding-window": [rows("10000000", "11000000", "01100000", "00110000", "00011000", "00001100",
                                  "00000110", "00000011")],
}
BLOCK = 4
# DeepSpeed configs that our own patterns also describe: same tokens
EQUIVALENT = {
    "bslongformer": sa.Local(1, block_size=BLOCK) | sa.Global(first=BLOCK, last=2 * BLOCK),
    "local-sliding-window": sa.Local(1, 0, block_size=BLOCK),
}


def token_mask(layout_grid, block, n_q, n_k):
    """What a block layout allows, token by token: each block entry repeated block x block, cut to the sequence."""
    ones = np.ones((block, block), dtype=np.int64)
    return torch.from_numpy(np.stack([np.kron(g, ones)[:n_q, :n_k] for g in layout_grid]).astype(bool))


@pytest.mark.parametrize("name", list(DEEPSPEED))
def test_deepspeed_layouts_run_as_exactly_their_blocks(name):
    layout_grid = torch.tensor(DEEPSPEED[name], dtype=torch.int64)                 # (H, nb, nb), as make_layout
    heads, nb = layout_grid.shape[:2]
    n = nb * BLOCK
    p = sa.Blocks(layout_grid, BLOCK)
    layout = p.layout(n, heads=heads, block_size=BLOCK)
    for h in range(heads):                               # exactly those blocks, every one full: no tiles at all
        assert np.array_equal(layout.block_grid(head=h), 2 * layout_grid[h].numpy())
    assert layout.masks.shape[0] == 0
    expected = token_mask(layout_grid.numpy(), BLOCK, n, n)
    assert torch.equal(p.mask(n, heads=heads), expected)
    if name in EQUIVALENT:
        assert torch.equal(EQUIVALENT[name].mask(n, heads=heads), expected)
    check_layout_matches_mask(p, n, n, heads, 16)         # larger layout blocks: whole or partial, exact
    q, k, v = (torch.randn(2, heads, n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
               for s in range(3))
    scores = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    dense = torch.softmax(scores.masked_fill(~expected, float("-inf")), -1) @ v   # every row has a key here
    for backend in ("reference", "numba"):
        torch.testing.assert_close(sa.sparse_attention(q, k, v, p, backend=backend), dense, atol=1e-10, rtol=0)


def test_blocks_of_a_sequence_that_is_not_a_multiple_of_the_block():
    layout_grid = np.array(DEEPSPEED["bigbird"][0], dtype=bool)                      # 8 x 8 blocks of 4
    for n_q, n_k in ((30, 30), (29, 32), (32, 29)):
        expected = token_mask(layout_grid[None], BLOCK, n_q, n_k)
        assert torch.equal(sa.Blocks(layout_grid, BLOCK).mask(n_q, n_k), expected)
        check_layout_matches_mask(sa.Blocks(layout_grid, BLOCK), n_q, n_k, 1, BLOCK)


def test_blocks_rows_are_query_rows_even_when_n_q_differs_from_n_k():
    """The grid is a layout: row r holds query rows r * block_size.., whatever n_k - n_q."""
    g = np.array([[1, 0, 0, 1], [0, 1, 1, 0]], dtype=bool)                        # 2 query blocks, 4 key blocks
    mask = sa.Blocks(g, 8).mask(10, 30)[0]
    assert torch.equal(mask, token_mask(g[None], 8, 10, 30)[0])
    assert mask[0, 0] and not mask[9, 0] and mask[9, 8]


# --- kernels against the float64 reference ------------------------------------------------------------
def check_backend(backend, q, k, v, layout):
    """float32 kernel vs the float64 reference, within twice torch's float32 error (the reference in float32)."""
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    got = run_backend(backend, q, k, v, layout, grad_out)
    oracle = run_backend("reference", q.double(), k.double(), v.double(), layout, grad_out)
    baseline = run_backend("reference", q, k, v, layout, grad_out)
    assert torch.equal(torch.isinf(got[1]), torch.isinf(oracle[1])), "rows without keys differ"
    finite = torch.isfinite(oracle[1])
    assert_within_rule("out", got[0], oracle[0], baseline[0])
    assert_within_rule("lse", got[1][finite], oracle[1][finite], baseline[1][finite])
    for name, index in (("dq", 2), ("dk", 3), ("dv", 4)):
        assert_within_rule(name, got[index], oracle[index], baseline[index])


def kernel_cases(n_q, n_k, heads):
    """A complement with empty rows, a per-head Blocks grid at a finer block than the layout's, and both."""
    blocks = sa.Blocks(grid(n_q, n_k, 8, heads, density=0.3, seed=4), 8)
    return {
        "complement": (sa.Local(12) | sa.Global(first=2)) & ~sa.Stride(3) & ~sa.Global(first=1),
        "blocks": blocks | sa.Local(2),
        "complement-of-blocks": ~blocks & sa.Local(20),
    }


def _qkv(n_q, n_k, heads, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, n, dim, generator=gen, dtype=torch.float64).float() for n in (n_q, n_k, n_k)]


@pytest.mark.parametrize("name", ["complement", "blocks", "complement-of-blocks"])
@pytest.mark.parametrize("n_q, n_k, causal", [(100, 100, False), (70, 100, True)])
def test_numba_against_the_float64_reference(name, n_q, n_k, causal):
    padding = torch.arange(n_k)[None, :] >= torch.tensor([[n_k], [n_k - 23]])
    layout = kernel_cases(n_q, n_k, 2)[name].layout(n_q, n_k, heads=2, block_size=16, causal=causal,
                                                   key_padding_mask=padding)
    if name == "complement" and n_q == n_k:
        assert not layout.to_dense()[:, :, 0].any(), "row 0, global in ~Global(first=1), has no key"
    check_backend("numba", *_qkv(n_q, n_k, 2, 16), layout)


@pytest.mark.parametrize("name", ["complement", "blocks", "complement-of-blocks"])
def test_triton_against_the_float64_reference(name):
    pytest.importorskip("triton", reason='needs triton (its interpreter without a GPU): pip install ".[triton]"')
    n_q, n_k = 40, 45                                    # tiny: Triton's interpreter without a GPU
    layout = kernel_cases(n_q, n_k, 2)[name].layout(n_q, n_k, heads=2, block_size=16)
    check_backend("triton", *_qkv(n_q, n_k, 2, 16), layout)


# --- serialisation ------------------------------------------------------------------------------------
ROUND_TRIP = [
    ~sa.Global(first=1),
    sa.Local(4) & ~sa.Global(first=1),
    ~(sa.Local(3) | ~sa.Stride(2)) & sa.Causal(),
    sa.PerHead([~sa.Local(1), sa.Dense()]),
    sa.Blocks([[1, 0], [1, 1]], 16),
    sa.Blocks(np.ones((3, 2, 5), dtype=bool), 8) | ~sa.Blocks([[0, 1]], 1000),
    sa.Blocks(np.eye(12, dtype=bool), 64),                               # more than 64 blocks: a short repr
]


@pytest.mark.parametrize("pattern", ROUND_TRIP, ids=repr)
def test_round_trips(pattern, tmp_path):
    d = pattern.to_dict()
    assert sa.Pattern.from_dict(d) == pattern and sa.Pattern.from_dict(d).to_dict() == d
    assert pickle.loads(pickle.dumps(pattern)) == pattern and copy.deepcopy(pattern) == pattern
    assert hash(sa.Pattern.from_dict(d)) == hash(pattern)
    sa.save_pattern(pattern, tmp_path / "p.toml")
    assert sa.load_pattern(tmp_path / "p.toml") == pattern
    if "<" not in repr(pattern):                         # small grids print as the expression that makes them
        assert parse_pattern(repr(pattern))[0] == pattern


def test_complement_dict_and_repr():
    p = sa.Local(4) & ~(sa.Global(first=1) | sa.Causal())
    assert repr(p) == "Local(4) & ~(Global(first=1) | Causal())"
    assert p.to_dict()["patterns"][1] == {"type": "complement", "pattern": {
        "type": "union", "patterns": [{"type": "global", "first": 1}, {"type": "causal"}]}}
    assert repr(sa.Complement(sa.Complement(sa.Causal()))) == "~~Causal()"
    assert ~sa.Complement(sa.Causal()) == sa.Causal()


def test_blocks_from_numpy_torch_and_lists_are_one_immutable_value():
    values = [[True, False, True], [False, True, True]]
    specs = [sa.Blocks(values, 4), sa.Blocks(np.array(values), 4), sa.Blocks(torch.tensor(values), 4),
             sa.Blocks(torch.tensor(values, dtype=torch.int64), 4), sa.Blocks(np.array(values, dtype=np.uint8), 4),
             sa.Blocks(torch.tensor(values).T.contiguous().T, 4),                 # non-contiguous views
             sa.Blocks(np.array(values).T.copy().T, np.int64(4))]
    assert len(set(specs)) == 1 and all(s == specs[0] for s in specs)
    assert specs[0] != sa.Blocks(values, 8) and specs[0] != sa.Blocks([[1, 0, 1], [0, 1, 0]], 4)
    source = np.array(values)
    p = sa.Blocks(source, 4)
    source[0, 0] = False                                 # the spec holds its own copy
    assert p.blocks[0, 0] and p.blocks.dtype == bool and not p.blocks.flags.writeable
    with pytest.raises(ValueError):
        p.blocks[0, 0] = False
    with pytest.raises(ValueError):
        p.blocks.flags.writeable = True
    with pytest.raises(AttributeError):
        p.block_size = 8
    assert repr(sa.Blocks(np.ones((2, 40, 40), dtype=bool), 16)) == "Blocks(<bool (2, 40, 40) grid, 3200 blocks set>, 16)"


# --- errors -----------------------------------------------------------------------------------------
ERRORS = [
    (lambda: sa.Blocks([[1, 0], [1, 1]], 16).mask(40), ValueError,
     "Blocks grid of 2 x 2 blocks of 16 tokens does not fit n_q=40, n_k=40: they need ceil(40 / 16) = 3 rows and "
     "ceil(40 / 16) = 3 columns; build the grid for these lengths (3 x 3 blocks), or use lengths of 17..32 queries "
     "and 17..32 keys with this grid"),
    (lambda: sa.Blocks(np.ones((2, 3, 3), bool), 16).layout(48, heads=4), ValueError,
     "Blocks has a grid for 2 heads, shape (2, 3, 3), but heads=4; give one (n_qb, n_kb) grid per query head, or "
     "one 2-D grid that every head shares"),
    (lambda: sa.Blocks(np.ones((2, 2)), 4), TypeError,
     "Blocks blocks must be a bool (or 0/1 integer) tensor or array of shape (n_qb, n_kb) or (H, n_qb, n_kb), got "
     "ndarray of dtype float64"),
    (lambda: sa.Blocks([[1, 0], [1]], 4), TypeError, "Blocks blocks must be a bool (or 0/1 integer) tensor"),
    (lambda: sa.Blocks([[0, 2]], 4), ValueError, "Blocks blocks must hold bools or 0 and 1 only, got the value 2"),
    (lambda: sa.Blocks([1, 0], 4), ValueError,
     "Blocks blocks must have shape (n_qb, n_kb) or (H, n_qb, n_kb) with every size >= 1, got shape (2,)"),
    (lambda: sa.Blocks(np.zeros((0, 3), bool), 4), ValueError, "with every size >= 1, got shape (0, 3)"),
    (lambda: sa.Blocks(torch.ones(2, 2, dtype=torch.bool, device="meta"), 4), ValueError,
     "Blocks blocks is a meta tensor, which has no values"),
    (lambda: sa.Blocks([[1]], 0), ValueError, "Blocks block_size must be >= 1, got 0"),
    (lambda: sa.Blocks([[1]], 2.0), TypeError, "Blocks block_size must be an int, got 2.0"),
    (lambda: sa.Complement("Local(3)"), TypeError,
     "the pattern of Complement (~) must be a sparse_attn Pattern such as sa.Local(256) | sa.Global(first=1), got "
     "str: 'Local(3)'"),
    (lambda: parse_pattern("~3"), PatternTextError, "pattern expression: '~' complements a pattern, got 3"),
    (lambda: sa.Pattern.from_dict({"type": "blocks", "blocks": [[1, 0]]}), TypeError, "block_size"),
]


@pytest.mark.parametrize("make, error, message", ERRORS, ids=[m[:50] for _, _, m in ERRORS])
def test_errors(make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make()


def test_complements_count_in_the_nesting_limit():
    p = sa.Local(1)
    for level in range(MAX_DEPTH - 1):                   # ~ and | alternate: each adds one level
        p = ~p if level % 2 else p | sa.Stride(3 + level)
    p = ~p if (MAX_DEPTH - 1) % 2 else p | sa.Causal()
    with pytest.raises(ValueError, match=f"this Complement would nest {MAX_DEPTH + 1} levels"):
        sa.Complement(p)
    with pytest.raises(ValueError, match=f"would nest {MAX_DEPTH + 1} levels"):
        sa.Pattern.from_dict({"type": "complement", "pattern": p.to_dict()})
    assert ~~p == p and sa.Pattern.from_dict(p.to_dict()) == p


def test_expressions_and_the_command_line(capsys):
    assert parse_pattern("Local(4) & ~Global(first=1)")[0] == sa.Local(4) & ~sa.Global(first=1)
    assert parse_pattern("~" * 1001 + "Causal()")[0] == ~sa.Causal()             # no recursion on chains
    assert parse_pattern("~PerHead([Local(1), ~Dense()])")[1] is None
    assert cli.main(["show", "Local(4) & ~Global(first=1)", "--seq-len", "16", "--block-size", "4"]) in (0, None)
    out = capsys.readouterr().out
    assert "BlockLayout of Local(4) & ~Global(first=1)" in out and "3 full, 7 partial" in out
