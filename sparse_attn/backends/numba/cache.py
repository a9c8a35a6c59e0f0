"""Where the Numba kernels cache their compiled code, and when a cached kernel is still the right one.

>>> from sparse_attn.backends.numba import cache
>>> os.path.basename(cache.directory()).startswith("kernels-")
True

Numba's own choice would be ``__pycache__`` next to the kernels, stamped with each file's modification time:
a reinstall of the package (the same version, adding an extra) rewrites the files and throws the cache away,
and a kernel whose callee in another file changed would stay stale. So the kernels cache in
``<base>/kernels-<digest>``, where the digest hashes the source of every module of this subpackage, and
``<base>`` is the first writable of:

1. ``$NUMBA_CACHE_DIR``, where you set it (read, never changed);
2. the user's cache, ``~/.cache/sparse_attn`` (``$XDG_CACHE_HOME/sparse_attn``; the platform's own on macOS
   and Windows);
3. ``<temp dir>/sparse_attn-<uid>`` (a read-only home, as in some containers).

Equal sources share the cache whatever their paths or times (a reinstall, a second virtualenv); any edit of a
kernel module gives new directories. Only the functions of this subpackage use this locator: other Numba code
in the process keeps Numba's.
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile

from numba.core import caching
from numba.core.caching import _CacheLocator
from numba.misc.appdirs import AppDirs

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# The base of Numba's cache implementations, whose list of locators install() extends (CacheImpl in recent Numba,
# _CacheImpl in older releases)
_CACHE_IMPL = vars(caching).get("CacheImpl") or vars(caching)["_CacheImpl"]


@functools.cache
def sources_digest() -> str:
    """16 hex digits of the SHA-256 of this subpackage's modules (names and contents, in name order)."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(_PACKAGE)):
        if name.endswith(".py"):
            with open(os.path.join(_PACKAGE, name), "rb") as source:
                digest.update(name.encode() + b"\0" + source.read() + b"\0")
    return digest.hexdigest()[:16]


def bases() -> list[str]:
    """The candidate base directories, in the order they are tried (see the module docstring)."""
    user_cache = AppDirs(appname="sparse_attn", appauthor=False).user_cache_dir
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return [*filter(None, [os.environ.get("NUMBA_CACHE_DIR")]), user_cache,
            os.path.join(tempfile.gettempdir(), f"sparse_attn-{uid}")]


@functools.cache
def directory() -> str:
    """The directory the kernels cache in: ``kernels-<digest>`` under the first writable base."""
    for base in bases():
        path = os.path.join(base, f"kernels-{sources_digest()}")
        if _writable(path):
            return path
    raise RuntimeError(f"backend='numba' found no writable directory to cache its compiled kernels in (tried "
                       f"{bases()}): set NUMBA_CACHE_DIR to a writable directory")


def _writable(path: str) -> bool:
    """Whether the directory exists or can be made, and a file can be written in it (Numba's own test)."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


class KernelCacheLocator(_CacheLocator):
    """Numba's cache locator for the functions of this subpackage: ``directory()``, stamped with the sources'
    digest instead of a file's modification time."""

    def __init__(self, py_func):
        self._lineno = py_func.__code__.co_firstlineno

    def ensure_cache_path(self):
        pass                                             # directory() made it and checked it is writable

    def get_cache_path(self):
        return directory()

    def get_source_stamp(self):
        return sources_digest()

    def get_disambiguator(self):
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.dirname(os.path.abspath(py_file)) != _PACKAGE:
            return None                                  # not a kernel of ours: Numba's own locators
        return cls(py_func)


def install() -> None:
    """Put KernelCacheLocator first among Numba's locators (before any kernel module is imported: Numba picks a
    function's locator when ``cache=True`` decorates it)."""
    if KernelCacheLocator not in _CACHE_IMPL._locator_classes:
        _CACHE_IMPL._locator_classes.insert(0, KernelCacheLocator)
