"""The Numba kernels' float32 matmul shapes on one core, through three CPU matmul routes.

    python benchmarks/cpu_matmuls.py [--repeats 7] [--out benchmarks/results]

A query block of 64 rows, head dim 64, against a panel of W keys (W = 64, 576: the band of `Local(256)` at
blocks of 64, 1024: a full panel): the forward's two products, S = Q K^T (64 x W) and O += P V (64 x 64), timed
one thread, through

- ``openblas``: scipy's OpenBLAS ``cblas_sgemm``, the kernels' BLAS where torch carries no MKL (and before cc72d24);
- ``mkl``: MKL's ``sgemm_``, which torch's CPU build carries (libtorch_cpu exports it): the kernels' BLAS where
  it is there (``lowlevel.matmul_blas``);
- ``brgemm``: torch's ``at::native::cpublas::brgemm`` for float32 (oneDNN's batch-reduce micro-kernel, what the
  compiled FlexAttention CPU kernel calls). It reads B row-major and has no transpose, so S reads K^T, stored
  (D, N) for a sequence of N = 4096 keys: its leading dimension is N, and N + 16 is timed beside it
  (a power-of-two stride maps the rows of B onto the same cache sets).

Every call goes through ctypes (a few microseconds of the 20-150 microseconds a call takes, the same for each
route). GFLOP/s = 2 x 64 x 64 x W / seconds; median over ``--repeats`` batches of 200 calls. Writes
``cpu_matmuls.json`` and ``cpu_matmuls.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from sparse_attn import machine
from sparse_attn.backends.numba.lowlevel import scipy_openblas, torch_cpu_library
from sparse_attn.bench.results import header, write_results

ROWS, DIM, N = 64, 64, 4096
WIDTHS = (64, 576, 1024)
CALLS = 200
_BRGEMM_F32 = "_ZN2at6native7cpublas6brgemmEllllllbPKfS3_Pfb"  # brgemm(M, N, K, ld_a, ld_b, ld_c, add_C, A, B, C, vnni)
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def _routes():
    """name -> (scores(q, k, kt, ld_kt, s), pv(p, v, o)): row-major float32 arrays, one call each."""
    blas = scipy_openblas()
    if blas is None:
        sys.exit("needs scipy's OpenBLAS (scipy.libs/libscipy_openblas*)")
    torch_cpu = torch_cpu_library()
    if torch_cpu is None:
        sys.exit("needs torch's CPU library (libtorch_cpu) for MKL's sgemm_ and the float32 brgemm")
    c_int, c_long, c_float, ptr = ctypes.c_int, ctypes.c_long, ctypes.c_float, ctypes.c_void_p
    cblas = blas.scipy_cblas_sgemm
    cblas.argtypes = [c_int] * 6 + [c_float, ptr, c_int, ptr, c_int, c_float, ptr, c_int]
    fortran = torch_cpu.sgemm_
    brgemm = getattr(torch_cpu, _BRGEMM_F32)
    brgemm.argtypes = [c_long] * 6 + [ctypes.c_bool, ptr, ptr, ptr, ctypes.c_bool]

    def mkl(ta, tb, m, n, k, a, lda, b, ldb, c, ldc, beta):          # column-major C (m, n) = op(A) op(B) + beta C
        ints = [ctypes.byref(c_int(x)) for x in (m, n, k, lda, ldb, ldc)]
        fortran(ta, tb, *ints[:3], ctypes.byref(c_float(1.0)), ptr(a.ctypes.data), ints[3], ptr(b.ctypes.data), ints[4],
                ctypes.byref(c_float(beta)), ptr(c.ctypes.data), ints[5])

    w = lambda s: s.shape[1]                                         # noqa: E731  (the panel's width)
    return {
        "openblas": (lambda q, k, kt, ld, s: cblas(_ROW_MAJOR, _NO_TRANS, _TRANS, ROWS, w(s), DIM, 1.0, q.ctypes.data,
                                                   DIM, k.ctypes.data, DIM, 0.0, s.ctypes.data, w(s)),
                     lambda p, v, o: cblas(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, ROWS, DIM, w(p), 1.0, p.ctypes.data, w(p),
                                           v.ctypes.data, DIM, 1.0, o.ctypes.data, DIM)),
        # row-major S (64, W) is column-major S^T (W, 64) = K Q^T: A = k read as (64, W) column-major, transposed
        "mkl": (lambda q, k, kt, ld, s: mkl(b"T", b"N", w(s), ROWS, DIM, k, DIM, q, DIM, s, w(s), 0.0),
                lambda p, v, o: mkl(b"N", b"N", DIM, ROWS, w(p), v, DIM, p, w(p), o, DIM, 1.0)),
        "brgemm": (lambda q, k, kt, ld, s: brgemm(ROWS, w(s), DIM, DIM, ld, w(s), False, q.ctypes.data,
                                                  kt.ctypes.data, s.ctypes.data, False),
                   lambda p, v, o: brgemm(ROWS, DIM, w(p), w(p), DIM, DIM, True, p.ctypes.data, v.ctypes.data,
                                          o.ctypes.data, False)),
    }


def _seconds_per_call(call, repeats: int) -> float:
    call()
    batches = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        batches.append((time.perf_counter() - start) / CALLS)
    return statistics.median(batches)


def measure(repeats: int) -> list[dict]:
    """One row per (route, product, W, B's leading dimension), results checked against numpy."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    k = rng.standard_normal((N, DIM), dtype=np.float32)                               # (N, D)
    v = rng.standard_normal((N, DIM), dtype=np.float32)
    kts = {ld: np.ascontiguousarray(np.pad(k.T, ((0, 0), (0, ld - N)))) for ld in (N, N + 16)}  # (D, ld) = K^T
    rows = []
    for name, (scores, pv) in _routes().items():
        for width in WIDTHS:
            s = np.empty((ROWS, width), np.float32)
            p = rng.standard_normal((ROWS, width), dtype=np.float32)
            o = np.zeros((ROWS, DIM), np.float32)
            flops = 2 * ROWS * DIM * width
            for ld in (N, N + 16) if name == "brgemm" else (None,):
                call = functools.partial(scores, q, k[:width], kts[ld or N], ld, s)
                call()
                assert np.allclose(s, q @ k[:width].T, rtol=1e-4, atol=1e-3), (name, width, "scores")
                rows.append({"route": name, "product": "S = Q K^T", "width": width, "ld_b": ld,
                             "gflops": flops / _seconds_per_call(call, repeats) / 1e9})
            o[:] = 0
            pv(p, v[:width], o)
            assert np.allclose(o, p @ v[:width], rtol=1e-4, atol=1e-2), (name, width, "pv")
            rows.append({"route": name, "product": "O += P V", "width": width, "ld_b": None,
                         "gflops": flops / _seconds_per_call(functools.partial(pv, p, v[:width], o), repeats) / 1e9})
    return rows


def _loads(averages) -> str:
    """A load average triple as the record holds it (a tuple in the run, a list in the JSON) in one form."""
    return "/".join(f"{x:g}" for x in averages)


def markdown(record: dict) -> str:
    lines = ["# The Numba kernels' float32 matmul shapes on one core", "", f"`{record['command']}`", "",
             f"Machine: {record['machine']['cpu']}, {record['machine']['cores']} cores, torch "
             f"{record['machine']['torch']}, scipy {record['machine']['scipy']}; load average "
             f"{_loads(record['machine']['loadavg_before'])} before, {_loads(record['loadavg_after'])} after. One "
             f"thread. 64 query "
             f"rows, head dim 64, W keys; GFLOP/s, median of {record['repeats']} batches of {CALLS} calls.", "",
             "| product | W | openblas | mkl | brgemm (ld N) | brgemm (ld N + 16) |", "|---|---:|---:|---:|---:|---:|"]
    cell = {(r["route"], r["product"], r["width"], r["ld_b"]): r["gflops"] for r in record["rows"]}
    for product in ("S = Q K^T", "O += P V"):
        for width in WIDTHS:
            values = [cell.get(("openblas", product, width, None)), cell.get(("mkl", product, width, None)),
                      cell.get(("brgemm", product, width, N)) or cell.get(("brgemm", product, width, None)),
                      cell.get(("brgemm", product, width, N + 16))]
            lines.append(f"| {product} | {width} | " + " | ".join("" if x is None else f"{x:.1f}" for x in values)
                         + " |")
    lines += ["", "O += P V reads V row-major (its leading dimension is the head dim), the same for every route."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    blas = scipy_openblas()
    blas.scipy_openblas_set_num_threads(1)
    command = "python benchmarks/cpu_matmuls.py" + ("" if args.repeats == 7 else f" --repeats {args.repeats}")
    record = {"machine": header(["torch", "scipy", "numpy"]), "repeats": args.repeats, "command": command}
    record["rows"] = measure(args.repeats)
    record["loadavg_after"] = machine.load_average()
    print(write_results(args.out, "cpu_matmuls", record, markdown))


if __name__ == "__main__":
    main()
