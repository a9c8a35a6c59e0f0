"""Backends run a BlockLayout. Each is a module that exposes

- ``BLOCK_SIZE``: the block size of the layouts it builds from a Pattern;
- ``check(q, k, v, layout)``: raises ``ValueError``/``RuntimeError`` saying why it cannot run these
  inputs (device, dtype, head dim, block size) and what to do instead;
- ``attention(q, k, v, layout, scale) -> (out, lse)``: differentiable with respect to q, k, v.

Backends never import each other; ``load`` imports one on first use, so Triton and Numba are only
imported when asked for.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

MODULES = {"reference": "reference", "numba": "numba_cpu", "triton": "triton_gpu"}


def load(name: str) -> ModuleType:
    """The backend module ``name``, or a RuntimeError that says why it cannot be used."""
    if name not in MODULES:
        raise ValueError(f"backend must be one of {['auto', *MODULES]}, got {name!r}")
    loaded = sys.modules.get(f"{__name__}.{MODULES[name]}")  # a dict lookup torch.compile can trace
    if loaded is not None:
        return loaded
    try:
        return importlib.import_module(f"{__name__}.{MODULES[name]}")
    except ModuleNotFoundError as error:
        if error.name == f"{__name__}.{MODULES[name]}":
            raise RuntimeError(f"backend {name!r} is not built yet in this version of sparse_attn; "
                               f"use backend='reference'") from None
        raise RuntimeError(f"backend {name!r} needs the package {error.name!r}, which is not installed: "
                           f"pip install {error.name}") from error


def availability(name: str) -> tuple[bool, str]:
    """(usable, reason) for ``sparse-attn info``-style reports."""
    try:
        module = load(name)
    except RuntimeError as error:
        return False, str(error)
    return module.available() if hasattr(module, "available") else (True, "")
