"""Argument checks shared by every public entry point: one wording for every error.

>>> check_int("heads", 12, minimum=1)
12
>>> check_int("heads", 0, minimum=1)
Traceback (most recent call last):
...
ValueError: heads must be >= 1, got 0

Each check returns the value in its canonical Python type (numpy ints become ``int``), so arithmetic
on it never wraps, and raises a ``TypeError`` for a wrong type or a ``ValueError`` for a wrong value,
naming the argument and what was received.
"""
from __future__ import annotations

import math
import operator

import numpy as np


def as_int(value) -> int | None:
    """``value`` as a Python int (numpy ints and other integer types included), else None; bools are not ints."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int, checked: ``check_int("heads", np.int64(4), 1) == 4``."""
    as_python = as_int(value)
    if as_python is None:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and as_python < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {as_python}")
    if maximum is not None and as_python > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {as_python}")
    return as_python


def check_bool(name: str, value) -> bool:
    """``value`` as a bool (a numpy bool included), else a TypeError naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_float(name: str, value, *, low: float, high: float = math.inf, high_open: bool = False) -> float:
    """``value`` as a finite float in [low, high] (or [low, high) with ``high_open``).

    >>> check_float("dropout", 0.1, low=0.0, high=1.0, high_open=True)
    0.1
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float, got {value!r} ({type(value).__name__})")
    value = float(value)
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or value < low or above:
        interval = f"[{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a finite float in {interval}, got {value!r}")
    return value


def check_token_mask(name: str, mask, batch: int | None, n: int) -> None:
    """A call-time (batch, n) bool mask, torch or numpy (``batch=None``: any batch >= 1); not converted.

    >>> check_token_mask("key_padding_mask", np.zeros((2, 5), dtype=bool), 2, 5)
    >>> check_token_mask("key_padding_mask", np.zeros((2, 4), dtype=bool), None, 5)
    Traceback (most recent call last):
    ...
    ValueError: key_padding_mask must have shape (batch, 5) with batch >= 1, got (2, 4)
    """
    shape = f"(batch, {n})" if batch is None else f"({batch}, {n})"
    if str(getattr(mask, "dtype", None)) not in ("torch.bool", "bool") or not hasattr(mask, "shape"):
        meaning = "True = padding" if name == "key_padding_mask" else "True = global token"
        raise TypeError(f"{name} must be a torch.bool tensor of shape {shape}, got "
                        f"{getattr(mask, 'dtype', type(mask).__name__)}; convert with .bool() ({meaning})")
    if len(mask.shape) != 2 or mask.shape[1] != n or mask.shape[0] == 0 or batch not in (None, mask.shape[0]):
        expected = f"{shape} with batch >= 1" if batch is None else shape
        raise ValueError(f"{name} must have shape {expected}, got {tuple(mask.shape)}")
