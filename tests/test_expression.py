"""PATTERN texts -> patterns: presets, files and expressions, and the errors for everything else."""
import functools
import math
import operator

import pytest

import sparse_attn as sa
from sparse_attn import bench
from sparse_attn.expression import PatternTextError, parse_pattern, per_head_count


def test_parse_pattern_builds_what_python_would():
    assert parse_pattern("Local(64) | Global(first=2)")[0] == sa.Local(64) | sa.Global(first=2)
    assert parse_pattern("(Local(3, 0) | Stride(4)) & Causal()")[0] == sa.sparse_transformer(4)
    assert parse_pattern("Local(1) | Local(2) & Causal() | Dense()")[0] == \
        sa.Local(1) | (sa.Local(2) & sa.Causal()) | sa.Dense()
    assert parse_pattern("PerHead([Local(1), Dense()])")[0] == sa.PerHead([sa.Local(1), sa.Dense()])
    assert parse_pattern("preset('bigbird-itc')")[0] == sa.preset("bigbird-itc")
    assert parse_pattern("dilated-longformer") == (sa.preset("dilated-longformer"), 12)
    assert parse_pattern("longformer", named=bench.PATTERNS)[0] == sa.Local(256) | sa.Global(first=16)
    with pytest.raises(PatternTextError, match="gives a int, not a Pattern"):
        parse_pattern("3")
    with pytest.raises(PatternTextError, match="unary minus applies to ints only"):
        parse_pattern("-Local(1)")
    with pytest.raises(PatternTextError, match=r"pattern expression \"preset\('../x'\)\": no preset named '../x'"):
        parse_pattern("preset('../x')")
    assert math.isclose(parse_pattern("bigbird-itc")[0].layout(1024).density,
                        sa.preset("bigbird-itc").layout(1024).density)


def test_errors_are_value_errors():
    """Library callers catch ValueError, as for any bad argument; the CLI prints the message."""
    for text in ("bigbird-itx", "Local(", "__import__('os')", "missing.toml", "Local(-1)"):
        with pytest.raises(ValueError):
            parse_pattern(text)


def test_long_chains_are_evaluated_without_recursion():
    chain = " | ".join(["Local(1)"] * 2000)                           # deeper than Python's recursion limit
    assert parse_pattern(chain)[0] == functools.reduce(operator.or_, [sa.Local(1)] * 2000)


def test_per_head_count():
    assert per_head_count(sa.Local(1)) is None
    assert per_head_count(sa.PerHead([sa.Local(1)] * 3) & sa.Causal()) == 3
