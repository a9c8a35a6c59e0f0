"""The first calls of backend="numba" in a fresh process: the compile (a cold cache) or the cache load (warm).

    NUMBA_CACHE_DIR=/tmp/numba-cold python benchmarks/numba_compile.py      # cold: compiles and fills the cache
    NUMBA_CACHE_DIR=/tmp/numba-cold python benchmarks/numba_compile.py      # warm: the next process loads it

A float32 forward, its backward, then a bfloat16 forward (B=1, H=2, N=256, D=64, ``Local(32) | Global(first=4)``),
each timed once on the wall clock; prints one line of seconds. Point ``NUMBA_CACHE_DIR`` at an empty folder for a
cold run: the package's own cache would otherwise be warm already.
"""
import time

import torch

import sparse_attn as sa
from sparse_attn import machine

q, k, v = (torch.randn(1, 2, 256, 64, requires_grad=True) for _ in range(3))       # (B, H, N, D)
layout = (sa.Local(32) | sa.Global(first=4)).layout(256, heads=2)
seconds = {}
start = time.perf_counter()
out = sa.sparse_attention(q, k, v, layout, backend="numba")
seconds["forward"] = time.perf_counter() - start
start = time.perf_counter()
out.sum().backward()
seconds["backward"] = time.perf_counter() - start
start = time.perf_counter()
sa.sparse_attention(*(t.detach().bfloat16() for t in (q, k, v)), layout, backend="numba")
seconds["bf16 forward"] = time.perf_counter() - start
print(", ".join(f"{name} {s:.1f} s" for name, s in seconds.items())
      + f" ({machine.cpu_model()}, load {machine.load_average()[0]:.2f})")
