"""One line when a kernel starts compiling: which, for which dtype, about how long, and where it is cached.

A kernel compiles once per dtype and CPU, on its first call, and then loads from the cache (``cache``) in every
later process; the compile takes about half a minute of CPU per kernel, with nothing else on the screen. So
when the forward or the backward kernel starts compiling, the logger ``sparse_attn.compile`` says so, at INFO:
through the application's logging where it has handlers, else on stderr. To silence it::

    logging.getLogger("sparse_attn.compile").setLevel(logging.WARNING)

>>> message("forward_kernel", "float32", "/cache")
'sparse_attn: compiling the numba forward kernel for float32 on first use (about 30 s of CPU, once: cached in /cache)'
"""
from __future__ import annotations

import functools
import logging
import sys

from numba.core import event

from . import cache

LOGGER = logging.getLogger("sparse_attn.compile")
LOGGER.setLevel(logging.INFO)                    # shown unless the application sets it higher
KERNELS = {"forward_kernel": "forward", "backward_kernel": "backward"}


def message(kernel: str, dtype: str, directory: str) -> str:
    """The line said when ``kernel`` starts compiling for ``dtype``."""
    return (f"sparse_attn: compiling the numba {KERNELS[kernel]} kernel for {dtype} on first use (about 30 s of CPU, "
            f"once: cached in {directory})")


class _Announcer(event.Listener):
    """Says ``message`` when Numba starts compiling one of KERNELS of this subpackage (Numba's "numba:compile"
    event: a compile after a cache miss, not a cache load)."""

    def on_start(self, compile_event):
        function = compile_event.data["dispatcher"].py_func
        if function.__module__.startswith(__package__) and function.__name__ in KERNELS:
            _say(message(function.__name__, _dtype(compile_event.data["args"][0]), cache.directory()))

    def on_end(self, compile_event):
        pass


def _dtype(qkv) -> str:
    """The dtype the kernel is compiled for, from the Numba type of its (q, k, v) argument."""
    dtype = str(qkv.dtype.dtype)
    return "bfloat16" if dtype == "uint16" else dtype       # bf16 inputs reach the kernels as their bits


def _say(line: str) -> None:
    if not LOGGER.isEnabledFor(logging.INFO):
        return
    if LOGGER.hasHandlers():
        LOGGER.info(line)
    else:                                        # no logging configured: Python would drop an INFO record
        print(line, file=sys.stderr, flush=True)


@functools.cache
def announce_compiles() -> None:
    """Say ``message`` whenever a kernel starts compiling in this process, from now on (the first call registers
    the listener; later ones do nothing)."""
    event.register("numba:compile", _Announcer())
