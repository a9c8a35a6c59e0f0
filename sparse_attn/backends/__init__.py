"""Backends run a BlockLayout. Each is a module that exposes

- ``BLOCK_SIZE``: the block size of the layouts it builds from a Pattern;
- ``check(q, k, v, layout)``: raises ``ValueError``/``RuntimeError`` saying why it cannot run these
  inputs (device, dtype, head dim, block size) and what to do instead;
- ``attention(q, k, v, layout, scale, mods=NO_MODS) -> (out, lse)``: differentiable with respect to q, k, v
  (and through lse: its gradient reaches q and k); ``mods`` a ``sparse_attn.score_mods.ScoreMods``, the
  softcap and ALiBi of every allowed score (sinks are applied outside the backends, by ``add_sink``).

Backends never import each other; ``load`` imports one on first use, so Triton and Numba are only
imported when asked for.
"""
from __future__ import annotations

import os
import sys
import tempfile
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MODULES = ("reference", "numba", "triton")


def numba_cache_fallback() -> str | None:
    """The directory the Numba kernels must cache in because Numba has none, or None where it has one.

    Numba caches a compiled kernel (``cache=True``) in ``NUMBA_CACHE_DIR`` when that is set, else in
    ``__pycache__`` next to the module (``backends/numba/``), else in the user cache (``$XDG_CACHE_HOME/numba`` or
    ``~/.cache/numba``), the first it can write; with none (a read-only install and a read-only or
    missing home, as in some containers) importing the kernels fails: "cannot cache function ...: no
    locator available". Then: ``<temp dir>/sparse_attn-numba-cache-<uid>``, kept across processes.
    """
    if os.environ.get("NUMBA_CACHE_DIR") or _numba_config_cache_dir():
        return None
    if _writable(_kernels_pycache()) or _writable(_user_cache_dir()):
        return None
    try:
        return os.path.join(tempfile.gettempdir(), f"sparse_attn-numba-cache-{os.getuid()}"
                            if hasattr(os, "getuid") else "sparse_attn-numba-cache")
    except OSError:                                      # no writable temp dir either: Numba's error stands
        return None


def _kernels_pycache() -> str:
    """The ``__pycache__`` next to the Numba kernels (the ``numba`` subpackage), Numba's first choice."""
    return os.path.join(os.path.dirname(__file__), "numba", "__pycache__")


def _numba_config_cache_dir() -> str:
    """Numba's cache dir setting where Numba is imported already (it read NUMBA_CACHE_DIR then), else ''."""
    config = getattr(sys.modules.get("numba"), "config", None)
    return getattr(config, "CACHE_DIR", "") or ""


def _user_cache_dir() -> str:
    """Numba's user-wide cache directory (numba.misc.appdirs, as Numba's own locator asks it)."""
    from numba.misc.appdirs import AppDirs

    return AppDirs(appname="numba", appauthor=False).user_cache_dir


def _writable(path: str) -> bool:
    """Whether the directory exists or can be made, and a file can be written in it (Numba's own test)."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def _point_numba_cache() -> None:
    """Where Numba has no writable cache directory, give it ``numba_cache_fallback()`` (before any kernel
    module is imported: Numba picks a kernel's cache directory when it decorates it)."""
    fallback = numba_cache_fallback()
    if fallback is None:
        return
    os.environ["NUMBA_CACHE_DIR"] = fallback
    if "numba" in sys.modules:
        sys.modules["numba"].config.CACHE_DIR = fallback


_point_numba_cache()


def check_name(backend) -> str:
    """``backend`` if it names a backend or "auto", else an error listing the choices.

    >>> check_name("trition")
    Traceback (most recent call last):
    ...
    ValueError: backend must be one of ['auto', 'reference', 'numba', 'triton'], got 'trition'
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {['auto', *MODULES]}, got {backend!r}")
    if backend != "auto" and backend not in MODULES:
        raise ValueError(f"backend must be one of {['auto', *MODULES]}, got {backend!r}")
    return backend


def choose(backend: str, device: torch.device) -> str:
    """The backend that runs tensors on ``device``: ``backend`` itself, or for "auto" triton on CUDA and
    numba elsewhere.

    >>> import torch
    >>> choose("auto", torch.device("cpu")), choose("reference", torch.device("cpu"))
    ('numba', 'reference')
    """
    if check_name(backend) != "auto":
        return backend
    return "triton" if device.type == "cuda" else "numba"


def load(name: str) -> ModuleType:
    """The backend module ``name``, or a RuntimeError that says why it cannot be used."""
    if check_name(name) == "auto":
        raise ValueError(f"load() takes a backend name, not 'auto': choose one of {list(MODULES)}")
    try:
        # import statements rather than importlib: torch.compile traces them, so even the first call of
        # a backend may happen inside a compiled function
        if name == "numba":
            from .numba import backend as module
        elif name == "triton":
            from . import triton_gpu as module  # type: ignore[no-redef]  # one module API, three modules
        else:
            from . import reference as module  # type: ignore[no-redef]
    except ModuleNotFoundError as error:
        raise RuntimeError(f"backend {name!r} needs the package {error.name!r}, which is not installed: "
                           f"pip install {error.name}") from error
    return module


def availability(name: str) -> tuple[bool, str]:
    """(usable, reason) for ``sparse-attn info``-style reports."""
    try:
        module = load(name)
    except RuntimeError as error:
        return False, str(error)
    return module.available() if hasattr(module, "available") else (True, "")
