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


PACKAGE = Path(__file__).resolve().parent.parent / "sparse_attn"
MODULES = sorted(".".join(("sparse_attn", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
                 for path in PACKAGE.rglob("*.py") if path.name != "__main__.py")
OPTIONAL = {"sparse_attn.integrations": ("transformers", "4.54", ".[hf]"),
            "sparse_attn.backends.triton_gpu": ("triton", None, ".[triton]")}


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
    """Every module's docstring examples run and are true (found by walking the package, not listed)."""
    for prefix, (name, version, extra) in OPTIONAL.items():
        if module.startswith(prefix):
            pytest.importorskip(name, minversion=version, reason=f'needs {name}: pip install "{extra}"')
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    if result.attempted == 0:
        pytest.skip(f"{module} has no docstring examples")
    assert result.failed == 0


def test_every_module_is_found():
    assert {"sparse_attn", "sparse_attn.compiler", "sparse_attn.backends.numba.forward",
            "sparse_attn.integrations.transformers.cache"} <= set(MODULES)
    assert "sparse_attn.__main__" not in MODULES


def test_tests_and_their_subprocesses_import_the_checkout(tmp_path):
    """Even with the package also installed (pip install ".[test]") and from another directory."""
    checkout = Path(__file__).resolve().parent.parent / "sparse_attn"
    import sparse_attn
    code = "import sparse_attn; print(sparse_attn.__file__)"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert Path(sparse_attn.__file__).parent == checkout == Path(imported.stdout.strip()).parent
