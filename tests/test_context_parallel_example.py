"""examples/context_parallel.py runs: an attention layer sequence-parallel over 2 gloo processes equals the
single-process layer (output, input gradient, parameter gradients), and says so."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # gloo ranks
def test_context_parallel_example_equals_the_single_process_layer():
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "context_parallel.py")], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "equals the single-process layer" in proc.stdout, proc.stdout
