"""The Numba kernels' float32 matmul shapes on one core, through three CPU matmul routes.

    python benchmarks/cpu_matmuls.py [--repeats 7] [--out benchmarks/results]

A query block of 64 rows, head dim 64, against a panel of W keys (W = 64, 576: the band of `Local(256)` at
blocks of 64, 1024: a full panel): the forward's two products, S = Q K^T (64 x W) and O += P V (64 x 64), and
the backward's one other shape, dQ += dS K (W x 64: a key block's 64 keys against a panel of W queries), timed
one thread, through

- ``openblas``: scipy's OpenBLAS ``cblas_sgemm``, the kernels' BLAS where torch carries no MKL (and before cc72d24);
- ``mkl``: MKL's ``sgemm_``, which torch's CPU build carries (libtorch_cpu exports it): the kernels' BLAS where
  it is there (``lowlevel.matmul_blas``);
- ``brgemm``: torch's ``at::native::cpublas::brgemm`` for float32 (oneDNN's batch-reduce micro-kernel, what the
  compiled FlexAttention CPU kernel calls). It reads B row-major and has no transpose, so S reads K^T, stored
  (D, N) for a sequence of N = 4096 keys: its leading dimension is N, and N + 16 is timed beside it
  (a power-of-two stride maps the rows of B onto the same cache sets). No dQ: it needs a transpose.

The backward's five products are two of S's shape (S^T = K Q^T, dP^T = V dO^T), two of O's (dV += P^T dO,
dK += dS^T Q) and dQ, all of 2 x 64 x 64 x W flops: with nothing but its matmuls, forward+backward takes
3 + t(dQ) / (t(S) + t(O)) times the forward, the floor the report gives per route and W.

Every call goes through ctypes (a few microseconds of the 20-150 microseconds a call takes, the same for each
route). GFLOP/s = 2 x 64 x 64 x W / seconds; median over ``--repeats`` batches of 200 calls. Writes
``cpu_matmuls.json`` and ``cpu_matmuls.md`` into ``--out``. The batches of every route, product and W are
taken in turn, so the routes meet the same spells of a noisy machine.
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
PRODUCTS = ("S = Q K^T", "O += P V", "dQ += dS K")
CALLS = 200
_BRGEMM_F32 = "_ZN2at6native7cpublas6brgemmEllllllbPKfS3_Pfb"  # brgemm(M, N, K, ld_a, ld_b, ld_c, add_C, A, B, C, vnni)
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def _routes():
    """name -> (scores(q, k, kt, ld_kt, s), pv(p, v, o), dq(st, k, dq) or None): row-major float32 arrays, one
    call each; st (64, W) holds dS^T, as the backward kernel keeps it."""
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
                                           v.ctypes.data, DIM, 1.0, o.ctypes.data, DIM),
                     lambda st, k, dq: cblas(_ROW_MAJOR, _TRANS, _NO_TRANS, w(st), DIM, ROWS, 1.0, st.ctypes.data,
                                             w(st), k.ctypes.data, DIM, 1.0, dq.ctypes.data, DIM)),
        # row-major S (64, W) is column-major S^T (W, 64) = K Q^T: A = k read as (64, W) column-major, transposed;
        # row-major dQ (W, 64) is column-major dQ^T (64, W) = K^T dS^T: st read column-major is dS, transposed
        "mkl": (lambda q, k, kt, ld, s: mkl(b"T", b"N", w(s), ROWS, DIM, k, DIM, q, DIM, s, w(s), 0.0),
                lambda p, v, o: mkl(b"N", b"N", DIM, ROWS, w(p), v, DIM, p, w(p), o, DIM, 1.0),
                lambda st, k, dq: mkl(b"N", b"T", DIM, w(st), ROWS, k, DIM, st, w(st), dq, DIM, 1.0)),
        "brgemm": (lambda q, k, kt, ld, s: brgemm(ROWS, w(s), DIM, DIM, ld, w(s), False, q.ctypes.data,
                                                  kt.ctypes.data, s.ctypes.data, False),
                   lambda p, v, o: brgemm(ROWS, DIM, w(p), w(p), DIM, DIM, True, p.ctypes.data, v.ctypes.data,
                                          o.ctypes.data, False),
                   None),
    }


def _seconds_per_call(calls: dict, repeats: int) -> dict:
    """key -> median seconds per call over ``repeats`` batches of CALLS calls, every key's batches taken in turn
    (a slow spell of the machine falls on all of them, not on one route)."""
    batches: dict = {key: [] for key in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            start = time.perf_counter()
            for _ in range(CALLS):
                call()
            batches[key].append((time.perf_counter() - start) / CALLS)
    return {key: statistics.median(times) for key, times in batches.items()}


def measure(repeats: int) -> list[dict]:
    """One row per (route, product, W, B's leading dimension), results checked against numpy."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    k = rng.standard_normal((N, DIM), dtype=np.float32)                               # (N, D)
    v = rng.standard_normal((N, DIM), dtype=np.float32)
    kts = {ld: np.ascontiguousarray(np.pad(k.T, ((0, 0), (0, ld - N)))) for ld in (N, N + 16)}  # (D, ld) = K^T
    calls = {}                                                   # (route, product, W, ld_b) -> one checked call
    for name, (scores, pv, dq) in _routes().items():
        for width in WIDTHS:
            s = np.empty((ROWS, width), np.float32)
            p = rng.standard_normal((ROWS, width), dtype=np.float32)
            o = np.zeros((ROWS, DIM), np.float32)
            for ld in (N, N + 16) if name == "brgemm" else (None,):
                call = functools.partial(scores, q, k[:width], kts[ld or N], ld, s)
                call()
                assert np.allclose(s, q @ k[:width].T, rtol=1e-4, atol=1e-3), (name, width, "scores")
                calls[name, "S = Q K^T", width, ld] = call
            pv(p, v[:width], o)
            assert np.allclose(o, p @ v[:width], rtol=1e-4, atol=1e-2), (name, width, "pv")
            calls[name, "O += P V", width, None] = functools.partial(pv, p, v[:width], o)
            if dq is None:
                continue
            grad = np.zeros((width, DIM), np.float32)
            dq(p, k[:ROWS], grad)
            assert np.allclose(grad, p.T @ k[:ROWS], rtol=1e-4, atol=1e-2), (name, width, "dq")
            calls[name, "dQ += dS K", width, None] = functools.partial(dq, p, k[:ROWS], grad)
    seconds = _seconds_per_call(calls, repeats)
    return [{"route": route, "product": product, "width": width, "ld_b": ld,
             "gflops": 2 * ROWS * DIM * width / seconds[route, product, width, ld] / 1e9}
            for route, product, width, ld in calls]


def matmul_floor(rates: dict) -> float:
    """forward+backward / forward with nothing but the matmuls, from one route's GFLOP/s per product at one W
    (every product has the same flops): 3 + t(dQ) / (t(S) + t(O)).

    >>> matmul_floor({"S = Q K^T": 60.0, "O += P V": 60.0, "dQ += dS K": 30.0})
    4.0
    """
    return 3 + (1 / rates["dQ += dS K"]) / (1 / rates["S = Q K^T"] + 1 / rates["O += P V"])


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
    for product in PRODUCTS:
        for width in WIDTHS:
            values = [cell.get(("openblas", product, width, None)), cell.get(("mkl", product, width, None)),
                      cell.get(("brgemm", product, width, N)) or cell.get(("brgemm", product, width, None)),
                      cell.get(("brgemm", product, width, N + 16))]
            lines.append(f"| {product} | {width} | " + " | ".join("" if x is None else f"{x:.1f}" for x in values)
                         + " |")
    lines += ["", "O += P V reads V row-major (its leading dimension is the head dim), the same for every route.", "",
              "The backward's five products: two of S's shape, two of O's and dQ. With nothing but its matmuls at "
              "these rates, forward+backward would take this many times the forward:", "",
              "| route | " + " | ".join(f"W = {width}" for width in WIDTHS) + " |",
              "|---|" + "---:|" * len(WIDTHS)]
    for route in ("openblas", "mkl"):
        floors = [matmul_floor({product: cell[(route, product, width, None)] for product in PRODUCTS})
                  for width in WIDTHS]
        lines.append(f"| {route} | " + " | ".join(f"{floor:.2f}x" for floor in floors) + " |")
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
