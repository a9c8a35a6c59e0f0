"""Which bf16 GEMM the Numba kernels can call: GFLOP/s on one thread for the panel shapes they use.

    python benchmarks/results/cpu_bf16/gemm_candidates.py      # writes gemm_candidates.{json,md} here

C (M, N) float32 = A (M, K) @ B (K, N), M = 64 (a query block), candidates:

- ``openblas-sgemm``: float32 through ``lowlevel.gemm``, the kernels' float32 matmul: scipy's OpenBLAS when the
  committed run was made; MKL since cc72d24 (``SPARSE_ATTN_NUMBA_BLAS=scipy`` times OpenBLAS again);
- ``mkl-gemm_bf16bf16f32``: MKL's ``cblas_gemm_bf16bf16f32``, exported by libtorch_cpu;
- ``onednn-brgemm``: ``at::native::cpublas::brgemm`` (oneDNN's ukernel; B packed in pairs of rows),
  exported by libtorch_cpu, through ``numba_bf16.brgemm`` as the kernels call it;
- ``torch.mm-bf16``: ``torch.mm`` on bf16 (oneDNN matmul, with torch's per-call overhead).

scipy's OpenBLAS exports no sbgemm (checked below). Each point: median of 7 runs of enough calls
to last about 20 ms, interleaved across candidates.
"""
from __future__ import annotations

import ctypes
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from sparse_attn import machine
from sparse_attn.backends.numba import bf16 as numba_bf16
from sparse_attn.backends.numba.lowlevel import gemm, scipy_openblas

SHAPES = [(64, 64, 64), (64, 256, 64), (64, 576, 64), (64, 1024, 64), (64, 64, 576), (64, 64, 1024), (64, 128, 128)]
HERE = Path(__file__).parent


def _mkl():
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    fn = lib.cblas_gemm_bf16bf16f32
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    fn.argtypes, fn.restype = [i, i, i, i, i, i, f, p, i, p, i, f, p, i], None
    return fn


def _candidates(m, n, k):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen).bfloat16(), torch.randn(k, n, generator=gen).bfloat16()
    c = torch.zeros(m, n)
    a32, bt32, c32 = a.float().numpy(), b.float().T.contiguous().numpy(), c.numpy()
    one, zero = np.float32(1), np.float32(0)
    mkl, packed, a_bits = _mkl(), numba_bf16.pairs(b), numba_bf16.bits(a)
    return {
        "openblas-sgemm": lambda: gemm(one, a32, False, bt32, True, zero, c32),
        "mkl-gemm_bf16bf16f32": lambda: mkl(101, 111, 111, m, n, k, 1.0, a.data_ptr(), k, b.data_ptr(), n, 0.0,
                                            c.data_ptr(), n),
        "onednn-brgemm": lambda: numba_bf16.brgemm(a_bits, packed.reshape(-1), n, c32, False),
        "torch.mm-bf16": lambda: torch.mm(a, b),
    }


def _calls(fn):
    """How many calls of fn last about 20 ms (after a warm-up call)."""
    fn()
    return max(1, int(0.02 / max(1e-7, _seconds(fn, 1))))


def _seconds(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main():
    torch.set_num_threads(1)
    lib = scipy_openblas()
    if lib is not None:
        lib.scipy_openblas_set_num_threads(1)
    sbgemm = [name for name in ("scipy_sbgemm_", "scipy_cblas_sbgemm", "sbgemm_", "cblas_sbgemm")
              if lib is not None and hasattr(lib, name)]
    rows = []
    for m, n, k in SHAPES:
        fns = _candidates(m, n, k)
        calls = {name: _calls(fn) for name, fn in fns.items()}
        samples = {name: [] for name in fns}
        for _ in range(7):
            for name, fn in fns.items():
                samples[name].append(_seconds(fn, calls[name]))
        for name in fns:
            rows.append({"m": m, "n": n, "k": k, "impl": name, "gflops": 2 * m * n * k / statistics.median(samples[name]) / 1e9})
    record = {"cpu": machine.cpu_model(), "load_average": machine.load_average(), "torch": torch.__version__,
              "threads": 1, "scipy_openblas_sbgemm_symbols": sbgemm, "numba_bf16": numba_bf16.native()[1],
              "results": rows}
    (HERE / "gemm_candidates.json").write_text(json.dumps(record, indent=2) + "\n")
    names = list(_candidates(*SHAPES[0]))
    lines = ["# bf16 GEMM candidates for the Numba kernels (one thread, GFLOP/s, median of 7)", "",
             f"`python benchmarks/results/cpu_bf16/gemm_candidates.py` on {record['cpu']}, torch {torch.__version__}, "
             f"load average {record['load_average']}; sbgemm symbols in scipy's OpenBLAS: {sbgemm or 'none'}.", "",
             "| M x N x K | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for m, n, k in SHAPES:
        rates = {r["impl"]: r["gflops"] for r in rows if (r["m"], r["n"], r["k"]) == (m, n, k)}
        lines.append(f"| {m}x{n}x{k} | " + " | ".join(f"{rates[name]:.0f}" for name in names) + " |")
    (HERE / "gemm_candidates.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
