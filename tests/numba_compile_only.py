"""Compile the Numba kernels for the CPU that ``NUMBA_CPU_NAME`` names, running none of them: the code may use
instructions this machine lacks (AVX-512 on a Zen 3, AMX on anything but a Xeon).

    NUMBA_CPU_NAME=icelake-server NUMBA_CPU_FEATURES= NUMBA_CACHE_DIR=/tmp/empty \\
        python -m tests.numba_compile_only float32:brgemm float64 bfloat16:blas

Each argument is a dtype and, for float32 and bfloat16, the route that CPU's own hosts take: ``brgemm``
(float32 on AVX-512: oneDNN's float32 brgemm; bfloat16 with bf16 dot products: the bf16 matmuls) or ``blas``
(float32 without AVX-512; bfloat16 computed in float32, which is float32's route). For each, one forward and
backward through ``sparse_attention`` with a softcap and ALiBi compiles every kernel of that dtype (one
specialisation serves every modifier combination). ``tests/test_numba_targets.py`` runs it per CPU.

How nothing runs: every Numba dispatcher called from Python compiles for its argument types and returns without
running the compiled code. A kernel that returns nothing writes into arrays the host made, which stay as they
were, but for its boolean ones (rows flagged for the exact path), set True so that the host takes the branches
they guard and their kernels compile too; a function that returns a value (a schedule, a size) gives zeros of its
return type, empty arrays for arrays: what the host does with them next is only to hand them to other kernels.
"""
import sys
import time

import numpy as np
import torch
from numba import types
from numba.core.dispatcher import Dispatcher
from numba.np.numpy_support import as_dtype

import sparse_attn as sa
from sparse_attn.backends.numba import backend


def compile_only(self, *args):
    argtypes = tuple(self.typeof_pyval(arg) for arg in args)
    self.compile(argtypes)
    returned = self.overloads[argtypes].signature.return_type
    if returned != types.none:
        return zeros(returned)
    for arg in args:
        if isinstance(arg, np.ndarray) and arg.dtype == np.bool_:
            arg[...] = True
    return None


def zeros(numba_type):
    """A value of ``numba_type``: 0 for numbers, an empty C-contiguous array, a tuple of such."""
    if isinstance(numba_type, types.BaseTuple):
        return tuple(zeros(t) for t in numba_type.types)
    if isinstance(numba_type, types.Array) and numba_type.layout == "C":
        return np.zeros((0,) * numba_type.ndim, as_dtype(numba_type.dtype))
    if isinstance(numba_type, (types.Integer, types.Float, types.Boolean)):
        return as_dtype(numba_type).type(0)
    raise TypeError(f"no stand-in for a kernel's result of type {numba_type}")


def compile_dtype(dtype: torch.dtype, route: str) -> None:
    """Forward and backward of a GQA call with a softcap and ALiBi, in ``dtype`` on ``route``."""
    bf16_route = dtype == torch.bfloat16 and route == "brgemm"
    backend.native_bf16 = lambda: (bf16_route, "the route asked for")      # what bf16_matmuls asks
    backend.float32_brgemm = lambda: (route == "brgemm", "the route asked for")
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 150, 16, generator=generator, dtype=dtype, requires_grad=True)       # (B, Hq, N, D)
    k, v = (torch.randn(2, 2, 150, 16, generator=generator, dtype=dtype, requires_grad=True) for _ in range(2))
    pattern = sa.Local(20) | sa.Global(first=2)
    out = sa.sparse_attention(q, k, v, pattern, backend="numba", softcap=20.0, alibi_slopes=torch.rand(4))
    out.float().sum().backward()


def main(specs: list[str]) -> None:
    Dispatcher.__call__ = compile_only
    for spec in specs:
        name, _, route = spec.partition(":")
        start = time.process_time()
        compile_dtype(getattr(torch, name), route or "blas")
        print(f"{spec}: compiled in {time.process_time() - start:.0f} s of CPU", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
