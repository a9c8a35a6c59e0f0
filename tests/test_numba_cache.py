"""Where the Numba kernels cache their compiled code (issue 23, item 14)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import sparse_attn
from sparse_attn import backends


@pytest.fixture
def writable(monkeypatch):
    """Sets which directories count as writable: a set of paths, filled by the test."""
    paths = set()
    monkeypatch.setattr(backends, "_writable", lambda path: path in paths)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(backends, "_numba_config_cache_dir", lambda: "")
    return paths


def test_numba_finds_its_own_cache_where_it_can(writable):
    """Next to the module, or in the user cache: Numba's own choices, left alone."""
    writable.add(os.path.join(os.path.dirname(backends.__file__), "numba", "__pycache__"))
    assert backends.numba_cache_fallback() is None
    writable.clear()
    writable.add(backends._user_cache_dir())
    assert backends.numba_cache_fallback() is None


def test_nowhere_to_cache_falls_back_to_the_temp_dir(writable):
    fallback = backends.numba_cache_fallback()
    assert fallback is not None and os.path.dirname(fallback) == tempfile.gettempdir()


def test_a_users_numba_cache_dir_is_theirs(writable, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/somewhere/of/theirs")
    assert backends.numba_cache_fallback() is None


def _read_only_runner() -> list[str]:
    """A command prefix under which this process's user cannot write where its permissions say so:
    nothing for a non-root user, ``setpriv`` without the capabilities that let root write anyway."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a directory read-only to this user")
    return ["setpriv", "--bounding-set", "-dac_override,-fowner"]


def test_read_only_install_and_home_still_import_and_cache(tmp_path):
    """A copy of the package and a home that cannot be written, NUMBA_CACHE_DIR unset: importing the
    kernels works and they cache in the fallback. Before, the import failed ("cannot cache function
    'segment': no locator available")."""
    runner = _read_only_runner()
    install, home = tmp_path / "site-packages", tmp_path / "home"
    shutil.copytree(Path(sparse_attn.__file__).parent, install / "sparse_attn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    home.mkdir()
    for path in (install, home):
        subprocess.run(["chmod", "-R", "a-w", str(path)], check=True)
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_CACHE_DIR"}
    env.update(PYTHONPATH=str(install), HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"),
               PYTHONDONTWRITEBYTECODE="1")
    code = ("import os; from sparse_attn.backends.numba import forward; "
            "print(forward.forward_kernel.stats.cache_path); print(os.environ['NUMBA_CACHE_DIR'])")
    try:
        done = subprocess.run([*runner, sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(tmp_path)], check=True)
    assert done.returncode == 0, done.stderr[-2000:]
    cache_path, fallback = done.stdout.split()
    assert cache_path.startswith(fallback) and fallback.startswith(tempfile.gettempdir())
