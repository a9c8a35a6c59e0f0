"""Where the Numba kernels cache their compiled code, and that a reinstall of the same sources keeps it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import sparse_attn
from sparse_attn.backends.numba import cache

# In a fresh process: compile (or load) a small kernel of the package, print where it is cached and whether it
# came from the cache
_CACHED_KERNEL = ("import sparse_attn; from sparse_attn.backends.numba import bf16, cache; bf16.even(3); "
                  "print(sparse_attn.__file__, cache.directory(), sum(bf16.even.stats.cache_hits.values()))")


@pytest.fixture
def writable(monkeypatch):
    """Sets which directories count as writable: a set of base directories, filled by the test."""
    bases = set()
    monkeypatch.setattr(cache, "_writable", lambda path: os.path.dirname(path) in bases)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    cache.directory.cache_clear()
    yield bases
    cache.directory.cache_clear()


def test_the_kernels_cache_in_the_first_writable_base(writable, monkeypatch):
    user_cache, temp = cache.bases()
    assert os.path.basename(user_cache) == "sparse_attn" and temp.startswith(tempfile.gettempdir())
    writable.update({user_cache, temp})
    assert cache.directory() == os.path.join(user_cache, f"kernels-{cache.sources_digest()}")
    writable.discard(user_cache)
    cache.directory.cache_clear()
    assert cache.directory().startswith(temp)
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/somewhere/of/theirs")
    writable.add("/somewhere/of/theirs")
    cache.directory.cache_clear()
    assert cache.directory().startswith("/somewhere/of/theirs/kernels-")


def test_nowhere_writable_says_what_to_set(writable):
    with pytest.raises(RuntimeError, match="found no writable directory .* set NUMBA_CACHE_DIR"):
        cache.directory()


def test_only_the_package_kernels_take_its_locator():
    from sparse_attn.backends.numba import bf16

    assert cache.KernelCacheLocator.from_function(bf16.even.py_func, bf16.__file__) is not None
    assert cache.KernelCacheLocator.from_function(test_only_the_package_kernels_take_its_locator, __file__) is None


def _copy_of_the_package(to: Path) -> Path:
    """A copy of the package's sources at ``to`` (fresh files: new modification times), its folder for PYTHONPATH."""
    shutil.copytree(Path(sparse_attn.__file__).parent, to / "sparse_attn", ignore=shutil.ignore_patterns("__pycache__"))
    return to


def _run(code: str, pythonpath: Path, **env: str) -> subprocess.CompletedProcess:
    """``python -c code`` importing the package from ``pythonpath`` (run there: not from the checkout)."""
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(pythonpath), **env},
                          cwd=pythonpath, capture_output=True, text=True, timeout=300)


def test_a_reinstall_of_the_same_sources_loads_the_cache(tmp_path):
    """Numba's own locator stamps a kernel with its file's modification time, so reinstalling the package (adding an
    extra) recompiled everything; the kernels' locator stamps them with their sources' digest."""
    first, second = _copy_of_the_package(tmp_path / "first"), _copy_of_the_package(tmp_path / "second")
    runs = [_run(_CACHED_KERNEL, install, NUMBA_CACHE_DIR=str(tmp_path / "cache")) for install in (first, second)]
    assert all(run.returncode == 0 for run in runs), [run.stderr[-2000:] for run in runs]
    (file_first, where_first, hits_first), (file_second, where_second, hits_second) = (run.stdout.split() for run in runs)
    assert file_first.startswith(str(first)) and file_second.startswith(str(second))
    assert where_first == where_second and (hits_first, hits_second) == ("0", "1")


def test_an_edited_kernel_module_gets_a_cache_of_its_own(tmp_path):
    """Numba invalidated a kernel only when its own file changed, so an edit of a callee in another file left the
    callers' cached code stale; now an edit of any module of the subpackage gives a new directory."""
    install = _copy_of_the_package(tmp_path)
    digest = "from sparse_attn.backends.numba import cache; print(cache.sources_digest())"
    before = _run(digest, install).stdout
    with open(install / "sparse_attn" / "backends" / "numba" / "mods.py", "a") as module:
        module.write("\n# an edit\n")
    after = _run(digest, install).stdout
    assert before.strip() and after.strip() and before != after


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
    kernels works and they cache in the temp dir. Before, the import failed ("cannot cache function
    'segment': no locator available")."""
    runner = _read_only_runner()
    install, home = _copy_of_the_package(tmp_path / "site-packages"), tmp_path / "home"
    home.mkdir()
    for path in (install, home):
        subprocess.run(["chmod", "-R", "a-w", str(path)], check=True)
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_CACHE_DIR"}
    env.update(PYTHONPATH=str(install), HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"),
               PYTHONDONTWRITEBYTECODE="1")
    code = ("from sparse_attn.backends.numba import cache, forward; "
            "print(forward.forward_kernel.stats.cache_path); print(cache.directory())")
    try:
        done = subprocess.run([*runner, sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(tmp_path)], check=True)
    assert done.returncode == 0, done.stderr[-2000:]
    cache_path, directory = done.stdout.split()
    assert cache_path == directory and directory.startswith(tempfile.gettempdir())
