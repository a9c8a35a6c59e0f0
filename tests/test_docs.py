"""Every ```python block of README.md and docs/*.md runs as written.

Each file's blocks run in order in one namespace (a later block may use what an earlier one defined),
in a temporary working directory, so nothing is written into the checkout. A block that needs a CUDA
GPU or the network is marked in the markdown by an HTML comment on the line before its fence,
``<!-- skip: needs a CUDA GPU -->``, and reported here as skipped with that reason (a block that needs
only a CUDA GPU runs where there is one). A block that
imports an optional dependency that is not installed (transformers, triton, matplotlib) is skipped
with the install command.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, Block, python_blocks

NEEDS_CUDA = "needs a CUDA GPU"  # the one skip reason a machine can meet
EXTRAS = {"transformers": "hf", "triton": "triton", "matplotlib": "viz"}
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [block for path in DOCUMENTS for block in python_blocks(path)]


@dataclass
class _File:
    """One markdown file's run: its namespace, working directory and progress."""
    workdir: Path
    namespace: dict                    # a module's, registered in sys.modules (_module_namespace)
    done: int = 0                      # blocks of this file attempted so far
    stopped: str | None = None         # why later blocks cannot run (an earlier one failed or was skipped)


_FILES: dict[Path, _File] = {}


def _module_namespace(name: str) -> dict:
    """The namespace of a module registered as ``name`` in sys.modules: torch.compile imports the module named
    by a compiled function's ``__name__`` global (torch 2.11's Dynamo fails on a name it cannot import)."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    return vars(module)


def _file_state(path: Path, tmp_path_factory) -> _File:
    """``path``'s run: a working directory and a module of its own (named after the path, so each file's
    compiled functions find their own globals)."""
    name = "docs_" + "".join(c if c.isalnum() else "_" for c in str(path.relative_to(ROOT)))
    return _File(tmp_path_factory.mktemp(path.stem), _module_namespace(name))


@pytest.fixture(autouse=True)
def _headless_matplotlib(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")


def _run(block: Block, state: _File) -> None:
    """Run one block in the file's namespace and directory; skip if an optional dependency is missing."""
    state.done += 1
    if block.skip is not None and not (block.skip == NEEDS_CUDA and torch.cuda.is_available()):
        pytest.skip(f"{block}: {block.skip}")
    if state.stopped is not None:
        pytest.skip(state.stopped)
    cwd = Path.cwd()
    os.chdir(state.workdir)
    try:
        exec(compile(block.source, str(block), "exec"), state.namespace)
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if missing not in EXTRAS or importlib.util.find_spec(missing) is not None:
            state.stopped = f"an earlier block failed: {block}"
            raise
        state.stopped = f"an earlier block needs {missing}: {block}"
        pytest.skip(f"{block}: needs {missing}: pip install \".[{EXTRAS[missing]}]\"")
    except BaseException:
        state.stopped = f"an earlier block failed: {block}"
        raise
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_block_runs(block: Block, tmp_path_factory):
    if block.path not in _FILES:
        _FILES[block.path] = _file_state(block.path, tmp_path_factory)
    state = _FILES[block.path]
    same_file = [b for b in BLOCKS if b.path == block.path]
    for earlier in same_file[state.done:same_file.index(block)]:   # not run yet when tests are selected
        try:
            _run(earlier, state)
        except (Exception, pytest.skip.Exception):
            pass                                                    # reported by its own test; state.stopped says
    _run(block, state)


def test_blocks_are_found():
    assert {block.path.name for block in BLOCKS} >= {"README.md", "integrations.md", "choosing-patterns.md"}


def test_parser_reads_indented_blocks_and_skip_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("""Text.

```bash
echo not python
```

1. In a list:

   ```python
   x = 1
   if x:
       y = 2
   ```

<!-- skip: needs a CUDA GPU -->
```python
torch.zeros(1, device="cuda")
```
""")
    first, second = python_blocks(page)
    assert (first.line, first.source, first.skip) == (9, "x = 1\nif x:\n    y = 2\n", None)
    assert (second.line, second.skip) == (16, "needs a CUDA GPU")
