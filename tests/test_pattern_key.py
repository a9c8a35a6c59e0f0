"""``pattern_key``: a pattern as a value of builtins, what torch.compile keys a pattern by (``tests/test_compile.py``).

Equal patterns have equal keys and unequal ones different keys, the key gives back an equal pattern of the same
class, and it holds only str, int, bytes and tuples, which Dynamo guards on by value.
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_attn as sa
from sparse_attn.pattern import KINDS, pattern_from_key, pattern_key
from tests.strategies import patterns_for
from tests.test_pattern_kinds import EXAMPLES

PATTERNS = patterns_for(16, 16, heads=2)


def builtins_only(key) -> bool:
    if isinstance(key, tuple):
        return all(builtins_only(part) for part in key)
    return type(key) in (str, int, bytes)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_round_trips_through_its_key(kind):
    pattern = EXAMPLES[kind]
    key = pattern_key(pattern)
    assert key[0] == kind and builtins_only(key)
    assert pattern_from_key(key) == pattern and type(pattern_from_key(key)) is type(pattern)


@settings(max_examples=200, deadline=None)
@given(PATTERNS, PATTERNS)
def test_keys_are_equal_exactly_when_patterns_are(p, q):
    assert (pattern_key(p) == pattern_key(q)) == (p == q)
    assert pattern_key(sa.Pattern.from_dict(p.to_dict())) == pattern_key(p)     # an equal pattern made anew
    assert pattern_from_key(pattern_key(p)) == p and builtins_only(pattern_key(p))
    hash(pattern_key(p))


@given(st.sampled_from([(2, 3), (1, 4, 4), (3, 2, 5)]), st.integers(1, 9), st.randoms())
def test_a_blocks_grid_is_its_shape_and_bytes(shape, block_size, rng):
    grid = [[rng.random() < 0.5 for _ in range(shape[-1])] for _ in range(shape[-2])]
    pattern = sa.Blocks([grid] * shape[0] if len(shape) == 3 else grid, block_size)
    _, (key_shape, key_block_size, bits) = pattern_key(pattern)
    assert (key_shape, key_block_size, len(bits)) == (shape, block_size, pattern.blocks.size)
    assert pattern_from_key(pattern_key(pattern)) == pattern
