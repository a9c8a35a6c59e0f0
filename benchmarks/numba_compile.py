"""The first calls of backend="numba" in a fresh process: the compile (a cold cache) or the cache load (warm).

    NUMBA_CACHE_DIR=/tmp/numba-cold python benchmarks/numba_compile.py      # cold: compiles and fills the cache
    NUMBA_CACHE_DIR=/tmp/numba-cold python benchmarks/numba_compile.py      # warm: the next process loads it
    NUMBA_CACHE_DIR=/tmp/numba-cold2 python benchmarks/numba_compile.py --out run.json   # also writes the record
    NUMBA_CACHE_DIR=/tmp/numba-cold3 python benchmarks/numba_compile.py --modifiers    # and each score modifier's

A float32 forward, its backward, then a bfloat16 forward (B=1, H=2, N=256, D=64, ``Local(32) | Global(first=4)``),
each timed once on the wall clock and in this process's CPU time (Numba compiles on one thread, so on a shared
machine the CPU time says more than the wall clock); prints one line of seconds, and a digest of the results'
bits (the same seeded inputs every run), so a cold and a warm process can be compared bit for bit. Point
``NUMBA_CACHE_DIR`` at an empty folder for a cold run: the package's own cache would otherwise be warm already.
``--modifiers`` then times a float32 forward and backward with a softcap, with ALiBi and with both (the kernels
compiled a specialisation for each until one kernel per dtype served every combination). ``--out`` writes the seconds with the CPU, the load average before and after, the cache folder, the digest and the
Numba version as JSON.
"""
import argparse
import hashlib
import json
import os
import time

import numba
import torch

import sparse_attn as sa
from sparse_attn import machine

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", help="a JSON file to write the record to")
parser.add_argument("--modifiers", action="store_true", help="also time softcap, ALiBi and both, forward and backward")
args = parser.parse_args()

load_before = machine.load_average()
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 256, 64, generator=generator, requires_grad=True) for _ in range(3))  # (B, H, N, D)
layout = (sa.Local(32) | sa.Global(first=4)).layout(256, heads=2)
seconds, cpu_seconds = {}, {}


def timed(name, call):
    """Runs call(); its wall-clock and CPU seconds go to seconds[name] and cpu_seconds[name]."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = call()
    seconds[name], cpu_seconds[name] = time.perf_counter() - wall, time.process_time() - cpu
    return result


out = timed("forward", lambda: sa.sparse_attention(q, k, v, layout, backend="numba"))
timed("backward", lambda: out.sum().backward())
out_bf16 = timed("bf16 forward",
                 lambda: sa.sparse_attention(*(t.detach().bfloat16() for t in (q, k, v)), layout, backend="numba"))
results = (out, q.grad, k.grad, v.grad, out_bf16)
if args.modifiers:
    slopes = torch.tensor([0.5, 0.25])
    for name, mods in (("softcap", {"softcap": 20.0}), ("alibi", {"alibi_slopes": slopes}),
                       ("softcap+alibi", {"softcap": 20.0, "alibi_slopes": slopes})):
        modified = timed(f"{name} forward", lambda mods=mods: sa.sparse_attention(q, k, v, layout, backend="numba",
                                                                                  **mods))
        timed(f"{name} backward", lambda modified=modified: modified.sum().backward())
digest = hashlib.sha256(b"".join(t.detach().contiguous().view(torch.uint8).numpy().tobytes()
                                 for t in results)).hexdigest()[:16]
print(", ".join(f"{name} {seconds[name]:.1f} s (CPU {cpu_seconds[name]:.1f} s)" for name in seconds)
      + f" ({machine.cpu_model()}, load {load_before[0]:.2f}); results' bits {digest}")
if args.out:
    record = {"seconds": {name: round(s, 2) for name, s in seconds.items()},
              "cpu_seconds": {name: round(s, 2) for name, s in cpu_seconds.items()}, "cpu": machine.cpu_model(),
              "load_average_before": load_before, "load_average_after": machine.load_average(),
              "numba_cache_dir": os.environ.get("NUMBA_CACHE_DIR"), "digest": digest, "numba": numba.__version__}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
