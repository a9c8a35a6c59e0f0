"""benchmarks/decode.py without running it: its examples, that its baselines hold what they claim to hold, and
that the committed table is the committed JSON's."""
import doctest
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("decode_benchmark", ROOT / "benchmarks" / "decode.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_docstring_examples():
    assert doctest.testmod(bench).failed == 0


@pytest.mark.parametrize("impl", bench.IMPLS)
def test_every_implementation_computes_the_decode_step(impl):
    """Each baseline's step: SparseKVCache and the full cache give the pattern's attention, sdpa the dense one,
    the sliding window sdpa over its last 4,096 tokens; memory as each holds it."""
    pytest.importorskip("transformers")
    n = 5000
    gen = torch.Generator().manual_seed(0)
    step, nbytes = bench.BUILDERS[impl](n, gen)
    keys, values = bench._prefix(n, torch.Generator().manual_seed(0))                   # (1, Hkv, N, D)
    q = torch.randn(1, bench.Q_HEADS, 1, bench.DIM, generator=gen)
    k, v = (torch.randn(1, bench.KV_HEADS, 1, bench.DIM, generator=gen) for _ in range(2))
    keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)                  # (1, Hkv, N + 1, D)
    mask = bench.PATTERN.mask(1, n + 1)[0, 0]                                          # (N + 1,) the pattern's keys
    if impl == "DynamicCache + sdpa":
        mask = torch.ones(n + 1, dtype=torch.bool)
    elif impl == "sliding window + sdpa":
        mask = torch.arange(n + 1) > n - bench.WINDOW
    expected = torch.nn.functional.scaled_dot_product_attention(q, keys[:, :, mask], values[:, :, mask],
                                                               enable_gqa=True)
    torch.testing.assert_close(step(q, k, v), expected, atol=1e-5, rtol=1e-5)
    per_token = 2 * bench.KV_HEADS * bench.DIM * 4
    held = {"SparseKVCache": 4 + 4096, "held keys + sdpa": 4 + 4096,
            "sliding window + sdpa": bench.WINDOW - 1}.get(impl, n + 1)
    assert nbytes() == held * per_token


def test_committed_table_is_rendered_from_the_committed_json():
    results = ROOT / "benchmarks" / "results"
    record = json.loads((results / "decode.json").read_text())
    assert bench.markdown(record) == (results / "decode.md").read_text()
