"""benchmarks/context_parallel.py without running it: its examples, that the committed table is the committed
JSON's, that the committed gloo measurements agree with the plan's bytes, and the ring model."""
import doctest
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))           # the script imports its sibling decode.py
    try:
        spec = importlib.util.spec_from_file_location("context_parallel_benchmark",
                                                      ROOT / "benchmarks" / "context_parallel.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_docstring_examples(bench):
    assert doctest.testmod(bench).failed == 0


def test_committed_table_is_rendered_from_the_committed_json(bench):
    record = json.loads((RESULTS / "context_parallel.json").read_text())
    assert bench.markdown(record) == (RESULTS / "context_parallel.md").read_text()


def test_committed_measurements_equal_the_plan_on_every_rank():
    record = json.loads((RESULTS / "context_parallel.json").read_text())
    assert record["measured"], "the committed run has no gloo measurement"
    for point in record["measured"]:
        sparse = point["sparse"]
        assert sparse["measured"] == sparse["expected"] and sparse["agree"], (point["name"], point["n"])


def test_ring_model_moves_every_other_shard(bench):
    n, world, kv_heads, head_dim, itemsize = 1 << 20, 8, 16, 64, 2
    shard = n // world * kv_heads * 2 * head_dim * itemsize                # one shard's K and V
    model = bench.ring_bytes(n, world, kv_heads, head_dim, itemsize)
    assert model["forward_received"] == (world - 1) * shard
