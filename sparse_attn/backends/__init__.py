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

from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MODULES = ("reference", "numba", "triton")


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
