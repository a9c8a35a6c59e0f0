"""``host_only``: functions that run eagerly on the host, never inside a torch.compile graph."""
from __future__ import annotations

import functools

import torch


def host_only(fn):
    """Like ``torch.compiler.disable`` (under torch.compile a call is a graph break), but without
    importing Dynamo, about a second and 100+ MB, until something is actually compiled.

    >>> @host_only
    ... def count(mask):
    ...     return int(mask.sum())
    >>> count(torch.ones(3))
    3
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper
