"""Pattern semantics against brute-force definitions written from the DESIGN table."""
import copy
import pickle
import re

import numpy as np
import pytest
import torch

import sparse_attn as sa
from sparse_attn.pattern import MAX_DEPTH
from tests.strategies import EXTREME_CASES, EXTREME_RANDOM, EXTREMES, N

SIZES = [(1, 1), (7, 7), (16, 16), (13, 29), (29, 13), (40, 40)]


def brute(rule, n_q, n_k):
    """Evaluate ``rule(i, j, n_k) -> bool`` pair by pair: the textbook definition, with query row r at
    position i = r + n_k - n_q (queries are the last n_q positions, as in a decode step)."""
    return torch.tensor([[bool(rule(r + n_k - n_q, j, n_k)) for j in range(n_k)] for r in range(n_q)])


DEFINITIONS = [
    (sa.Local(3), lambda i, j, n: i - 3 <= j <= i + 3),
    (sa.Local(2, 5), lambda i, j, n: i - 2 <= j <= i + 5),
    (sa.Local(0, 0), lambda i, j, n: i == j),
    (sa.Local(1, block_size=4), lambda i, j, n: i // 4 - 1 <= j // 4 <= i // 4 + 1),
    (sa.Stride(3), lambda i, j, n: (i - j) % 3 == 0),
    (sa.Stride(4, offset=1), lambda i, j, n: (i - j - 1) % 4 == 0),
    (sa.Dilated(2, 3), lambda i, j, n: i - 6 <= j <= i + 6 and (i - j) % 3 == 0),
    (sa.Dilated(2, 2, after=1), lambda i, j, n: i - 4 <= j <= i + 2 and (i - j) % 2 == 0),
    (sa.Global(tokens=(2, 5)), lambda i, j, n: i in (2, 5) or j in (2, 5)),
    (sa.Global(first=2, last=1), lambda i, j, n: 0 <= i < 2 or i >= n - 1 or j < 2 or j >= n - 1),
    (sa.Global(), lambda i, j, n: False),
    (sa.Sink(tokens=(3,), first=1), lambda i, j, n: j in (0, 3)),
    (sa.Sink(period=4, width=2), lambda i, j, n: j % 4 >= 2),
    (sa.Causal(), lambda i, j, n: j <= i),
    (sa.Dense(), lambda i, j, n: True),
    (sa.Local(2) | sa.Global(first=1), lambda i, j, n: abs(i - j) <= 2 or i == 0 or j == 0),
    (sa.Local(4) & sa.Causal(), lambda i, j, n: i - 4 <= j <= i + 4 and j <= i),
    (sa.Stride(2) & sa.Stride(3), lambda i, j, n: (i - j) % 6 == 0),
]


@pytest.mark.parametrize("pattern, rule", DEFINITIONS, ids=[repr(p) for p, _ in DEFINITIONS])
@pytest.mark.parametrize("n_q, n_k", SIZES)
def test_mask_matches_definition(pattern, rule, n_q, n_k):
    mask = pattern.mask(n_q, n_k, heads=2)
    assert mask.shape == (2, n_q, n_k) and mask.dtype == torch.bool
    expected = brute(rule, n_q, n_k)
    assert torch.equal(mask[0], expected) and torch.equal(mask[1], expected)


def test_decode_step_sees_what_the_last_row_of_the_full_sequence_sees():
    pattern = (sa.Local(5, 0) | sa.Global(first=2) | sa.Random(1, block_size=4)) & sa.Causal()
    full = pattern.mask(40, heads=2)
    for n in (1, 7, 40):
        assert torch.equal(pattern.mask(n, 40, heads=2), full[:, -n:]), n


@pytest.mark.parametrize("pattern", [
    sa.Random(2, seed=1, block_size=8),
    sa.Local(6) | sa.Global(first=3, last=2) | sa.Random(2, seed=4, block_size=8),
    sa.bigbird(block=8, window_blocks=3, global_blocks=1, random_blocks=2, seed=5),
    (sa.Local(4, 0) | sa.Random(1, seed=2, block_size=16)) & sa.Causal(),
], ids=repr)
def test_random_blocks_of_a_position_do_not_depend_on_n_q(pattern):
    """Random blocks are picked only for the tile rows holding a query; every query still sees what the same
    position sees in the full sequence, whatever n_q (decode, chunked prefill, n_q > n_k)."""
    n_k = 83
    full = pattern.mask(n_k, heads=3)
    for n_q in (1, 8, 9, 40, 67, 68, 75, 76, 82):  # across tile-row boundaries of block sizes 8 and 16
        assert torch.equal(pattern.mask(n_q, n_k, heads=3), full[:, -n_q:]), n_q
    assert torch.equal(pattern.mask(n_k + 10, n_k, heads=3)[:, 10:], full)


@pytest.mark.parametrize("pattern", [
    sa.Random(2, block_size=16),
    sa.Random(2) & sa.Causal(),
    sa.Random(3, seed=1, block_size=16) | sa.Local(4),
    sa.Local(6) | sa.Global(first=3, tokens=(70,)) | sa.Random(2, seed=4, block_size=8),  # a global row mid-tile
    sa.Stride(20) | sa.Sink(tokens=(21,)) | sa.Random(1, seed=2, block_size=8),
    (sa.Local(1, block_size=16) | sa.Global(first=16) | sa.Random(3, block_size=16)) & sa.Causal(),
], ids=repr)
def test_random_blocks_of_a_position_do_not_depend_on_the_length(pattern):
    """What a position sees among the keys up to it is the same in every sequence that holds it: the first m
    rows and keys of a longer sequence are the sequence of m tokens (Random's keys all lie before the query)."""
    for n in (256, 512):
        full = pattern.mask(n, heads=2)
        for m in (1, 15, 16, 17, 100, 255):
            assert torch.equal(full[:, :m, :m], pattern.mask(m, heads=2)), (n, m)
    causal = pattern & sa.Causal()
    full = causal.mask(512, heads=2)
    for t in (0, 63, 64, 255, 300, 511):                 # a decode step at position t: n_q = 1, n_k = t + 1
        assert torch.equal(causal.mask(1, t + 1, heads=2)[:, 0], full[:, t, :t + 1]), t


def test_random_keys_lie_in_tiles_before_the_query():
    mask = sa.Random(3, seed=5, block_size=8).mask(200, heads=4)                    # (H, N, N)
    i, j = torch.arange(200)[:, None], torch.arange(200)[None, :]
    assert not (mask & (j // 8 >= i // 8)).any()
    assert (mask.reshape(4, 25, 8, 200).any(2).sum(-1) == torch.arange(25).clamp(max=3) * 8).all()


def test_global_tokens_beyond_length_are_ignored():
    assert torch.equal(sa.Global(tokens=(1, 100)).mask(4), sa.Global(tokens=(1,)).mask(4))


def test_per_head_uses_one_pattern_per_head():
    p = sa.PerHead([sa.Local(0), sa.Causal(), sa.Dense()])
    mask = p.mask(5, heads=3)
    assert torch.equal(mask[0], sa.Local(0).mask(5)[0])
    assert torch.equal(mask[1], sa.Causal().mask(5)[0])
    assert mask[2].all()


class TestRandom:
    def test_each_row_gets_its_blocks_outside_the_rest_of_the_union(self):
        rest = sa.Local(1, block_size=4) | sa.Global(first=4)
        p = rest | sa.Random(2, seed=3, block_size=4)
        mask, rest_mask = p.mask(64, heads=4), rest.mask(64, heads=4)
        extra = (mask & ~rest_mask).reshape(4, 16, 4, 16, 4)           # (H, row tile, 4, col tile, 4)
        tiles = extra.any(dim=(2, 4))                                  # (H, 16, 16) chosen tiles
        assert torch.equal(extra.all(dim=(2, 4)), tiles), "random blocks are whole tiles"
        touched = rest_mask.reshape(4, 16, 4, 16, 4).any(dim=(2, 4))
        assert not (tiles & touched).any(), "random blocks avoid blocks the other members touch"
        before = torch.ones(16, 16, dtype=torch.bool).tril(-1)       # key tiles before the row's own
        assert not (tiles & ~before).any(), "random blocks lie before their row"
        free = (before & ~touched).sum(-1)                             # (H, 16): tile 0 is global, R - 1 window
        assert free[0].tolist() == [0, 0, 0, 1] + [r - 2 for r in range(4, 16)]
        assert torch.equal(tiles.sum(-1), free.clamp(max=2)), "2 random blocks, or every free one where fewer"

    def test_deterministic_per_seed_and_different_per_head(self):
        p = sa.Random(3, seed=7, block_size=8)
        first, again = p.mask(256, heads=4), sa.Random(3, seed=7, block_size=8).mask(256, heads=4)
        assert torch.equal(first, again)
        assert not torch.equal(first[0], first[1])
        assert not torch.equal(first, sa.Random(3, seed=8, block_size=8).mask(256, heads=4))

    def test_train_and_eval_identical_no_global_rng(self):
        p = sa.Random(2, block_size=4)
        torch.manual_seed(0)
        np.random.seed(0)
        a = p.mask(64)
        torch.manual_seed(1)
        np.random.seed(1)
        torch.randn(10)
        assert torch.equal(a, p.mask(64))

    def test_more_blocks_than_exist_takes_every_block_before_the_row(self):
        i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
        assert torch.equal(sa.Random(10, block_size=4).mask(12)[0], j // 4 < i // 4)


class TestAlgebra:
    def test_union_and_intersection_flatten(self):
        a, b, c = sa.Local(1), sa.Stride(2), sa.Causal()
        assert (a | b) | c == a | (b | c) == sa.Union(a, b, c)
        assert len(((a & b) & c).patterns) == 3

    def test_laws_on_masks(self):
        a, b = sa.Local(2), sa.Stride(3)
        assert torch.equal((a | b).mask(20), a.mask(20) | b.mask(20))
        assert torch.equal((a & b).mask(20), a.mask(20) & b.mask(20))
        assert torch.equal((a | b).mask(20), (b | a).mask(20))

    def test_immutable_hashable_equal(self):
        p = sa.Local(4) | sa.Global(tokens=[3, 1, 3])
        q = sa.Local(4, 4) | sa.Global(tokens=(1, 3))
        assert p == q and hash(p) == hash(q) and len({p, q}) == 1
        with pytest.raises(AttributeError):
            p.patterns = ()
        assert pickle.loads(pickle.dumps(p)) == p

    def test_readable_repr(self):
        assert repr(sa.Local(256) | sa.Global(first=16)) == "Local(256) | Global(first=16)"
        assert repr((sa.Local(3, 0) | sa.Stride(4)) & sa.Causal()) == "(Local(3, 0) | Stride(4)) & Causal()"
        assert repr(sa.Random(3, seed=1)) == "Random(3, seed=1)"

    def test_operands_must_be_patterns(self):
        with pytest.raises(TypeError, match="right operand of | must be a sparse_attn Pattern"):
            sa.Local(1) | 3


ALL_KINDS = [sa.Local(3), sa.Local(2, 0, block_size=8), sa.Stride(4, offset=1), sa.Dilated(4, 2), sa.Global(tokens=(0, 9)),
             sa.Global(first=2, last=3), sa.Sink(first=4, period=16, width=2), sa.Random(3, seed=5, block_size=16),
             sa.Causal(), sa.Dense(), sa.PerHead([sa.Local(1), sa.Dense()]),
             (sa.Local(8) | sa.Global(first=1) | sa.Random(2)) & sa.Causal()]


@pytest.mark.parametrize("pattern", ALL_KINDS, ids=repr)
def test_dict_round_trip(pattern):
    d = pattern.to_dict()
    assert sa.Pattern.from_dict(d) == pattern
    assert d == sa.Pattern.from_dict(d).to_dict()


INVALID = [
    (lambda: sa.Local(-1), ValueError, "Local before must be >= 0, got -1"),
    (lambda: sa.Local(2, -3), ValueError, "Local after must be >= 0, got -3"),
    (lambda: sa.Local(2.5), TypeError, "Local before must be an int, got 2.5"),
    (lambda: sa.Stride(0), ValueError, "Stride stride must be >= 1, got 0"),
    (lambda: sa.Dilated(4, 0), ValueError, "Dilated dilation must be >= 1, got 0"),
    (lambda: sa.Global(tokens=(-1,)), ValueError, "Global tokens must hold token positions >= 0, got -1"),
    (lambda: sa.Global(tokens="ab"), TypeError, "Global tokens must be a sequence of ints"),
    (lambda: sa.Sink(period=2, width=3), ValueError, "Sink width must be <= period"),
    (lambda: sa.Random(-2), ValueError, "Random blocks must be >= 0, got -2"),
    (lambda: sa.PerHead([]), ValueError, "PerHead needs a non-empty list"),
    (lambda: sa.PerHead([sa.Local(1), "x"]), TypeError, "every member of PerHead must be a sparse_attn Pattern"),
    (lambda: sa.PerHead([sa.Local(1)] * 3).mask(8, heads=2), ValueError, "PerHead has 3 patterns but heads=2"),
    (lambda: sa.Local(1).mask(0), ValueError, "n_q must be >= 1, got 0"),
    (lambda: sa.Local(1).mask(4, heads=0), ValueError, "heads must be >= 1, got 0"),
    (lambda: sa.Pattern.from_dict({"type": "window"}), ValueError, "unknown pattern type 'window'"),
    (lambda: sa.Pattern.from_dict({"type": "local", "width": 3}), ValueError, "pattern type 'local' has no field 'width'"),
    (lambda: sa.Pattern.from_dict({"before": 3}), ValueError, "a pattern dict needs a 'type' key"),
    (lambda: sa.Pattern.from_dict({"type": ["local"]}), ValueError, r"unknown pattern type \['local'\]"),
]


@pytest.mark.parametrize("make, error, message", INVALID, ids=[m for _, _, m in INVALID])
def test_invalid_parameters_raise_clear_errors(make, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        make()


@pytest.mark.parametrize("x", EXTREMES)
@pytest.mark.parametrize("n_q, n_k", [(N, N), (5, N), (2 * N, N)])
def test_extreme_arguments_mean_what_the_definition_says(x, n_q, n_k):
    for make, definition in EXTREME_CASES:
        pattern = make(x)
        assert torch.equal(pattern.mask(n_q, n_k)[0], brute(definition(x), n_q, n_k)), pattern


@pytest.mark.parametrize("x", EXTREMES)
def test_extreme_random_arguments_are_accepted(x):
    for make in EXTREME_RANDOM:
        mask = make(x).mask(N, heads=2)
        assert mask.shape == (2, N, N)


def test_arguments_are_stored_as_python_ints():
    p = sa.Dilated(np.int64(2), np.int64(2**62))
    assert type(p.before) is int and type(p.dilation) is int and repr(p) == "Dilated(2, 4611686018427387904)"
    assert p.to_dict() == {"type": "dilated", "before": 2, "dilation": 2**62}
    assert sa.Local(np.uint8(3)) == sa.Local(3) and sa.Global(tokens=np.arange(3)).tokens == (0, 1, 2)
    assert torch.equal(p.mask(5)[0], torch.eye(5, dtype=torch.bool)), "2 * 2**62 must not wrap around in int64"


INVALID_INPUTS = [
    (lambda: sa.Global(tokens=(1.5,)), TypeError, "Global tokens must be a sequence of ints, got (1.5,)"),
    (lambda: sa.Global(tokens=(True,)), TypeError, "Global tokens must be a sequence of ints"),
    (lambda: sa.Sink(tokens=3), TypeError, "Sink tokens must be a sequence of ints, got 3"),
    (lambda: sa.Local(np.float64(2.0)), TypeError, "Local before must be an int, got np.float64(2.0)"),
    (lambda: sa.Stride(3, offset=1.0), TypeError, "Stride offset must be an int, got 1.0"),
    (lambda: sa.Random(1, seed=True), TypeError, "Random seed must be an int, got True"),
    (lambda: sa.Local(1).mask(2**31), ValueError, "n_q must be <= 2147483647, got 2147483648"),
    (lambda: sa.Local(1).mask(4, 10**30), ValueError, "n_k must be <= 2147483647, got 10000000000"),
    (lambda: sa.Local(1).mask(4, heads=np.bool_(True)), TypeError, "heads must be an int, got np.True_"),
]


@pytest.mark.parametrize("make, error, message", INVALID_INPUTS, ids=[m for _, _, m in INVALID_INPUTS])
def test_invalid_inputs_raise_clear_errors(make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        make()


# --- nesting depth -------------------------------------------------------------------------------
def alternating(levels, leaf=sa.Local(1)):
    """``levels`` alternating | and & levels over ``leaf`` (a chain of one operator would flatten); the top is &."""
    p = leaf
    for level in range(levels):
        p = (p | sa.Stride(3 + level)) if (levels - level) % 2 == 0 else (p & sa.Local(5 + level))
    return p


def test_nesting_deeper_than_the_limit_is_refused_at_construction():
    deepest = alternating(MAX_DEPTH)
    with pytest.raises(ValueError, match=rf"this Union would nest {MAX_DEPTH + 1} levels of \|, &, ~ and PerHead, more "
                                         rf"than MAX_DEPTH={MAX_DEPTH}; combine the members of one operator once"):
        deepest | sa.Causal()
    with pytest.raises(ValueError, match=f"this PerHead would nest {MAX_DEPTH + 1} levels"):
        sa.PerHead([deepest])
    deepest & sa.Causal() & sa.Local(3)  # a chain of one operator does not nest
    alternating(MAX_DEPTH - 1, sa.Dilated(1, 2))
    with pytest.raises(ValueError, match=f"would nest {MAX_DEPTH + 1} levels"):  # Dilated is Local & Stride
        alternating(MAX_DEPTH, sa.Dilated(1, 2))


def test_pattern_dicts_deeper_than_the_limit_are_refused_before_recursing():
    d = {"type": "local", "before": 1}
    for level in range(5000):
        d = {"type": "union" if level % 2 else "intersection", "patterns": [d, {"type": "causal"}]}
    with pytest.raises(ValueError, match=f"would nest {MAX_DEPTH + 1} levels"):
        sa.Pattern.from_dict(d)


def _in_deep_stack(frames, fn):
    """``fn()`` called ``frames`` Python frames deep, as from inside a deep model."""
    return fn() if frames == 0 else _in_deep_stack(frames - 1, fn)


def test_every_operation_works_at_the_depth_limit_even_from_a_deep_stack(tmp_path):
    p, same = alternating(MAX_DEPTH - 1, sa.Dilated(1, 2)), alternating(MAX_DEPTH - 1, sa.Dilated(1, 2))
    per_head = sa.PerHead([alternating(MAX_DEPTH - 1), sa.Dense()])
    q = torch.randn(1, 2, 40, 8)
    masks = dict(causal=True, global_mask=torch.zeros(1, 40, dtype=torch.bool),
                 key_padding_mask=torch.arange(40)[None] >= 35)

    def every_operation():
        assert p == same and hash(p) == hash(same) and repr(p) == repr(same)
        assert sa.Pattern.from_dict(p.to_dict()) == p and pickle.loads(pickle.dumps(p)) == p
        assert copy.deepcopy(per_head) == per_head and per_head.head_dependent
        sa.save_pattern(p, tmp_path / "deep.toml")
        assert sa.load_pattern(tmp_path / "deep.toml") == p
        expected = p.mask(40, heads=2) & sa.Causal().mask(40) & ~masks["key_padding_mask"][:, None]
        assert torch.equal(p.layout(40, heads=2, block_size=8, **masks).to_dense()[0], expected)
        str(p.layout(40, block_size=8))
        for backend in ("reference", "numba"):
            out = sa.sparse_attention(q, q, q, p, backend=backend, **masks)
            torch.testing.assert_close(out, sa.sparse_attention(q, q, q, p.layout(40, heads=2, **masks)))
        assert sa.sparse_attention(q, q, q, per_head, backend="reference").shape == q.shape

    _in_deep_stack(300, every_operation)
