"""benchmarks/documents.py without running it: its examples, that its FlexAttention baseline means the
same pattern as the layout it is compared with, and that the committed table is the committed JSON's."""
import doctest
import importlib.util
import json
from pathlib import Path

import torch

import sparse_attn as sa

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("documents_benchmark", ROOT / "benchmarks" / "documents.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_docstring_examples():
    assert doctest.testmod(bench).failed == 0


def test_flex_mask_mod_allows_exactly_the_pairs_of_the_documents_layout():
    documents = sa.documents_from_lengths([[50, 1, 300, 16, 33]])                         # (1, 400)
    n = documents.shape[1]
    mask_mod = bench.document_mask_mod(documents)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    flex = mask_mod(0, 0, i, j)                                                            # (N, N)
    layout = bench.PATTERN.layout(n, block_size=bench.BLOCK, documents=documents)
    assert torch.equal(flex, layout.to_dense()[0, 0])


def test_committed_table_is_rendered_from_the_committed_json():
    results = ROOT / "benchmarks" / "results"
    record = json.loads((results / "documents.json").read_text())
    assert bench.markdown(record) == (results / "documents.md").read_text()
