"""The wheel ships the presets and the type marker; the docstring examples are true; tests import the checkout."""
import doctest
import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest


def test_wheel_contains_presets_and_py_typed(tmp_path):
    builders = pytest.importorskip("hatchling.builders.wheel")
    root = Path(__file__).resolve().parent.parent
    wheel = next(builders.WheelBuilder(str(root)).build(directory=str(tmp_path), versions=["standard"]))
    names = zipfile.ZipFile(wheel).namelist()
    assert "sparse_attn/py.typed" in names
    shipped = {n.split("/")[-1] for n in names if n.startswith("sparse_attn/patterns/")}
    assert {p.name for p in (root / "patterns").glob("*.toml")} == shipped


@pytest.mark.parametrize("module", ["sparse_attn", "sparse_attn.pattern", "sparse_attn.rules", "sparse_attn.compiler", "sparse_attn.documents",
                                    "sparse_attn.blocks", "sparse_attn.layout", "sparse_attn.api",
                                    "sparse_attn.presets", "sparse_attn.weights", "sparse_attn.viz",
                                    "sparse_attn.bench", "sparse_attn.cli", "sparse_attn.nn", "sparse_attn._host",
                                    "sparse_attn.checks", "sparse_attn.backends", "sparse_attn.expression",
                                    "sparse_attn.machine", "sparse_attn.bench.config",
                                    "sparse_attn.bench.implementations", "sparse_attn.bench.report",
                                    "sparse_attn.bench.peers", "sparse_attn.bench.results",
                                    "sparse_attn.bench.harness",
                                    "sparse_attn.retention", "sparse_attn.kv_cache", "sparse_attn.shard_plan", "sparse_attn.assembly",
                                    "sparse_attn.tiles", "sparse_attn.packing",
                                    "sparse_attn.distributed", "sparse_attn.backends.numba.bf16"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_transformers_integration_docstring_examples():
    pytest.importorskip("transformers", minversion="4.54", reason='needs transformers >= 4.54: pip install ".[hf]"')
    module = importlib.import_module("sparse_attn.integrations.transformers")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_tests_and_their_subprocesses_import_the_checkout(tmp_path):
    """Even with the package also installed (pip install ".[test]") and from another directory."""
    checkout = Path(__file__).resolve().parent.parent / "sparse_attn"
    import sparse_attn
    code = "import sparse_attn; print(sparse_attn.__file__)"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert Path(sparse_attn.__file__).parent == checkout == Path(imported.stdout.strip()).parent
