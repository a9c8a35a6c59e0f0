"""GPU kernels: backend="triton" against FlexAttention (same blocks) and dense flash SDPA.

    python benchmarks/gpu_kernels.py --resume                 # the grid, target points first, 500-s budget
    python benchmarks/gpu_kernels.py --resume --million       # the 1M-token Longformer memory target
    python benchmarks/gpu_kernels.py --list --resume          # the points left to measure (no GPU needed)
    python benchmarks/gpu_kernels.py [--quick] [--n 8192 32768] [--batch 1 4] [--head-dim 64 128]
                                     [--patterns ...] [--impls ...] [--budget-s 500] [--out benchmarks/results]

For bf16, H=16 heads, every (pattern, head_dim, batch, N) point times the forward and the
forward+backward of three implementations on identical inputs:

- ``triton``: ``sparse_attention(..., backend="triton")`` with a prebuilt ``BlockLayout``;
- ``flex``: ``torch.compile(flex_attention)`` with ``layout.to_block_mask()``, the same blocks,
  compiled afresh for each point and never run eagerly (``compiled_flex``);
- ``sdpa``: dense ``scaled_dot_product_attention`` restricted to the flash kernel (causal for the
  causal pattern), the speed-of-light for the hardware.

Throughput is TFLOP/s on *computed* FLOPs: ``layout.flops(D)`` per example for the sparse ones
(forward; forward+backward counts 3.5x, the backward being 2.5x the forward), ``4 N^2 D`` per
head (half for causal) for SDPA. Peak memory is the CUDA allocator's high-water mark above the
inputs during one call; for forward+backward also in all (inputs and gradients included).

Points run in order, those that decide the targets first (N=32768, B=1; D=64, then 128; every
pattern and implementation), then B=1 at the other N, then B=2 and 4. After every point
``gpu_kernels.json`` and ``gpu_kernels.md`` in ``--out`` are rewritten (whole, never half), so a
run killed mid-way keeps what it measured; ``--resume`` skips the points already there (error
rows included; the point a kill interrupted is not there and runs again). No point starts after
``--budget-s`` seconds: the run then writes, lists what it left and exits 0. An error at one point
(out of memory, a compile failure) is that point's result; an error that leaves the CUDA context
unusable stops the run (exit 1), and ``--resume`` continues in a fresh process. ``--million``
measures only the 1M-token target (Longformer, B=1, D=64, N=1,048,576; triton, then flex: dense
SDPA would compute 10^12 pairs per head), into the same files.

Time on one H100, an estimate, not a measurement: the default grid (270 points: 3 patterns x 2 D
x 3 B x 5 N x 3 implementations) about 60-75 min, mostly FlexAttention compiling anew for every
shape (~20-40 s a point, forward and training graphs) and dense SDPA at large N (~12 min in all),
so it takes several 500-s calls with ``--resume``; its first 18 points (the targets) about 5 min;
``--quick`` (9 points: N=8192, B=1, D=64) about 2 min; ``--million`` (2 points) about 1-2 min.
Needs a CUDA GPU; it refuses to run without one.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a bare checkout runs it without installing
import sparse_attn as sa  # noqa: E402
from sparse_attn.api import sparse_attention  # noqa: E402
from sparse_attn.machine import versions  # noqa: E402

DEVICE = "cuda"
HEADS = 16
DTYPE = torch.bfloat16
BLOCK = 64
PATTERNS = {  # name: (pattern, causal SDPA baseline)
    "longformer": (sa.Local(256) | sa.Global(first=16), False),
    "bigbird-itc": (sa.bigbird(block=64, window_blocks=3, global_blocks=2, random_blocks=3), False),
    "streaming-causal": (sa.streaming(sink=4, window=1020), True),
}
IMPLEMENTATIONS = ("triton", "flex", "sdpa")
KEY = ("impl", "pattern", "head_dim", "batch", "n")  # a point; a row is a point plus its results
TARGET_N = 32768
MILLION = 1_048_576
MILLION_POINT = ("longformer", 64, 1, MILLION)  # (pattern, head_dim, batch, n)


def _key(row: dict) -> tuple:
    return tuple(row[k] for k in KEY)


def bench_ms(fn, grads=()) -> float:
    """Median time of ``fn`` in milliseconds (Triton's do_bench: warm-up, L2 flush, repeats)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=list(grads), return_mode="median")


def peak_mb(fn) -> tuple[float, float, float]:
    """(above what was allocated before ``fn``, allocated in all, reserved by the allocator): high-water
    marks during ``fn``, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return (peak - before) / 2**20, peak / 2**20, torch.cuda.max_memory_reserved() / 2**20


def compiled_flex():
    """``torch.compile(flex_attention)`` that runs compiled or raises, never silently eagerly.

    Dynamo caches compiled code per code object: every point compiles ``flex_attention`` anew (its
    shapes are static, and grad mode is guarded too), and past ``recompile_limit`` (8) entries
    Dynamo would run it eagerly, materialising the N x N scores. ``reset()`` empties that cache for
    each point; ``fullgraph=True`` turns any fall-back left (a graph break, the limit) into an
    error, which ``measure`` records as the point's result.
    """
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def make_runner(impl: str, q, k, v, layout, causal: bool):
    """A function computing the attention output with implementation ``impl``."""
    if impl == "triton":
        return lambda: sparse_attention(q, k, v, layout, backend="triton")
    if impl == "flex":
        block_mask = layout.to_block_mask()
        flex = compiled_flex()
        return lambda: flex(q, k, v, block_mask=block_mask)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return sdpa


def _timed_s(fn) -> float:
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _fill(row: dict) -> None:
    """Measure ``row``'s point into it step by step: what was measured before an error stays."""
    pattern, causal = PATTERNS[row["pattern"]]
    impl, head_dim, batch, n = row["impl"], row["head_dim"], row["batch"], row["n"]
    layout = pattern.layout(n, heads=HEADS, block_size=BLOCK).to(DEVICE)
    row["density"] = layout.density
    torch.manual_seed(0)                                                     # every implementation: same inputs
    q, k, v = (torch.randn(batch, HEADS, n, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
               for _ in range(3))                                            # (B, H, N, D)
    grad_out = torch.randn_like(q)                                           # (B, H, N, D)
    if impl == "sdpa":
        row["fwd_flops"] = 4 * batch * HEADS * n * n * head_dim // (2 if causal else 1)
    else:
        row["fwd_flops"] = layout.flops(head_dim) * (batch // layout.batch)
    forward = make_runner(impl, q, k, v, layout, causal)

    def forward_backward():
        forward().backward(grad_out)

    with torch.no_grad():
        row["fwd_warmup_s"] = _timed_s(forward)                              # compiles (flex) / JITs (triton)
        row["fwd_ms"] = bench_ms(forward)
        row["fwd_tflops"] = row["fwd_flops"] / row["fwd_ms"] / 1e9
        row["fwd_peak_mb"] = peak_mb(forward)[0]
    row["fwd_bwd_warmup_s"] = _timed_s(forward_backward)
    row["fwd_bwd_ms"] = bench_ms(forward_backward, grads=(q, k, v))
    row["fwd_bwd_tflops"] = 3.5 * row["fwd_flops"] / row["fwd_bwd_ms"] / 1e9
    q.grad = k.grad = v.grad = None                                          # the peak includes fresh gradients
    row["fwd_bwd_peak_mb"], row["fwd_bwd_total_peak_mb"], row["fwd_bwd_reserved_peak_mb"] = peak_mb(forward_backward)


def measure(impl: str, pattern_name: str, head_dim: int, batch: int, n: int) -> dict:
    """One point's row: times, TFLOP/s and peak memory, and ``error`` if something failed on the way."""
    row = dict(zip(KEY, (impl, pattern_name, head_dim, batch, n)))
    try:
        _fill(row)
    except torch.cuda.OutOfMemoryError:
        row["error"] = "out of memory"
    except Exception as error:  # a peer failing at one point (e.g. a compile error) is a result, not a crash
        row["error"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
    return row


def cuda_usable() -> bool:
    """Free the last point's memory; False if an error (an illegal memory access, say) left CUDA unusable."""
    gc.collect()                                                             # autograd graphs, tracebacks
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.ones(1, device="cuda").item() == 1.0
    except RuntimeError:
        return False


def run(todo: list[tuple], rows: list[dict], measure_point, save, deadline: float, usable,
        clock=time.monotonic) -> tuple[list[tuple], str]:
    """Measure the points ``todo`` in order into ``rows``, calling ``save(rows, not yet measured)`` after
    each, until ``clock()`` reaches ``deadline`` or ``usable()`` says a point left the GPU unusable.

    Returns the points not measured and why ("" when none are left).
    """
    for i, point in enumerate(todo):
        if clock() >= deadline:
            return todo[i:], "time budget spent"
        print(f"[{i + 1}/{len(todo)}] measuring {dict(zip(KEY, point))}", flush=True)
        rows.append(measure_point(*point))
        save(rows, todo[i + 1:])
        print(json.dumps(rows[-1]), flush=True)
        if not usable():
            return todo[i + 1:], f"the CUDA context is unusable after {rows[-1].get('error', 'this point')}"
    return [], ""


def plan(args: argparse.Namespace) -> list[tuple]:
    """The requested points, those that decide the targets (N=32768, B=1) first, then by B, D, N.

    >>> plan(parse_args(["--n", "8192", "32768", "--batch", "1", "2", "--head-dim", "64",
    ...                  "--patterns", "longformer", "--impls", "triton"]))       # doctest: +NORMALIZE_WHITESPACE
    [('triton', 'longformer', 64, 1, 32768), ('triton', 'longformer', 64, 1, 8192),
     ('triton', 'longformer', 64, 2, 8192), ('triton', 'longformer', 64, 2, 32768)]
    """
    if args.million:
        return [(impl, *MILLION_POINT) for impl in args.impls if impl != "sdpa"]
    points = [(impl, pattern, head_dim, batch, n) for batch in args.batch for head_dim in args.head_dim
              for n in args.n for pattern in args.patterns for impl in args.impls]
    return sorted(points, key=lambda point: point[3:] != (1, TARGET_N))     # stable: the rest keep their order


def load_rows(path: Path, meta: dict | None) -> list[dict]:
    """The rows already measured at ``path`` ([] if none), refused if measured on another set-up than ``meta``
    (None: any)."""
    if not path.exists():
        return []
    record = json.loads(path.read_text())
    differ = [f"{key}: {record['meta'].get(key)!r} there, {value!r} here" for key, value in (meta or {}).items()
              if record["meta"].get(key) != value]
    if differ:
        sys.exit(f"--resume: {path} was measured on another set-up ({'; '.join(differ)}). Ratios from two set-ups "
                 f"do not mix: drop --resume to start afresh, or give another --out.")
    return record["rows"]


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a run killed while writing keeps the previous file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write(out: Path, meta: dict, rows: list[dict], pending: list[tuple]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"meta": meta, "rows": rows, "not_measured": [dict(zip(KEY, point)) for point in pending]}
    _replace(out / "gpu_kernels.json", json.dumps(record, indent=1) + "\n")
    _replace(out / "gpu_kernels.md", to_markdown(rows, meta, len(pending)))


def _footnote(row: dict, errors: list[str]) -> str:
    return f"E{errors.index(row['error']) + 1}"


def _cell(row: dict | None, key: str, spec: str, errors: list[str]) -> str:
    """``row[key]`` formatted; ``E<i>`` (footnote i) where an error stopped the row before it; — if absent."""
    if row is not None and key in row:
        return format(row[key], spec)
    if row is not None and "error" in row:
        return _footnote(row, errors)
    return "—"


def _ratio(numerator: dict | None, denominator: dict | None, key_n: str, key_d: str, spec: str) -> str:
    if numerator is None or denominator is None or key_n not in numerator or key_d not in denominator:
        return "—"
    return format(numerator[key_n] / denominator[key_d], spec)


def _million_lines(index: dict, errors: list[str]) -> list[str]:
    """The 1M-token target, one line per implementation measured there."""
    lines = []
    for impl in IMPLEMENTATIONS:
        row = index.get((impl, *MILLION_POINT))
        if row is None:
            continue
        if "fwd_bwd_total_peak_mb" not in row:
            lines.append(f"- {impl}: {_footnote(row, errors)} ({row['error']})" if "error" in row
                         else f"- {impl}: no memory measured")
            continue
        peak_gb, reserved_gb = (row[key] * 2**20 / 1e9 for key in ("fwd_bwd_total_peak_mb", "fwd_bwd_reserved_peak_mb"))
        lines.append(f"- {impl}: forward {row['fwd_ms']:.1f} ms, forward+backward {row['fwd_bwd_ms']:.1f} ms; "
                     f"forward+backward peak {peak_gb:.1f} GB allocated in all (inputs, gradients, layout included; "
                     f"{reserved_gb:.1f} GB reserved by the allocator): "
                     f"{'fits' if peak_gb <= 80 else 'does not fit'} in 80 GB")
    if not lines:
        return []
    return ["", f"1M tokens (target: a Longformer pattern at N = 1,048,576, H={HEADS}, D=64, bf16 fits in 80 GB "
                "forward+backward):", "", *lines]


def to_markdown(rows: list[dict], meta: dict, pending: int = 0) -> str:
    index = {_key(r): r for r in rows}
    points = sorted({key[1:] for key in index}, key=lambda p: (list(PATTERNS).index(p[0]), *p[1:]))
    errors = list(dict.fromkeys(r["error"] for r in rows if "error" in r))  # distinct, first seen first
    columns = ["pattern", "D", "B", "N", "density", "fwd ms triton / flex / sdpa", "f+b ms triton / flex / sdpa",
               "TFLOP/s fwd triton / flex / sdpa", "TFLOP/s f+b triton / flex / sdpa", "fwd x flex", "f+b x flex",
               "fwd % sdpa", "peak MiB f+b triton / flex / sdpa"]
    lines = [f"# GPU kernels on {meta['device']}", "",
             f"bf16, H={HEADS}, block {BLOCK}; torch {meta['torch']}, triton {meta['triton']}. Times are medians; "
             "TFLOP/s count computed FLOPs (f+b = 3.5x forward); peak memory is above the inputs. "
             "`x flex` = FlexAttention time / triton time (>= 1: triton as fast or faster); "
             "`% sdpa` = triton forward TFLOP/s / dense flash SDPA forward TFLOP/s; "
             "`E<i>`: error i below; —: not measured.", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for point in points:
        t, f, s = (index.get((impl, *point)) for impl in IMPLEMENTATIONS)
        density = next((f"{r['density']:.2%}" for r in (t, f, s) if r is not None and "density" in r), "—")
        triple = lambda key, spec: " / ".join(_cell(r, key, spec, errors) for r in (t, f, s))  # noqa: E731
        cells = [*map(str, point), density, triple("fwd_ms", ".2f"),
                 triple("fwd_bwd_ms", ".2f"), triple("fwd_tflops", ".0f"), triple("fwd_bwd_tflops", ".0f"),
                 _ratio(f, t, "fwd_ms", "fwd_ms", ".2f"), _ratio(f, t, "fwd_bwd_ms", "fwd_bwd_ms", ".2f"),
                 _ratio(t, s, "fwd_tflops", "fwd_tflops", ".0%"), triple("fwd_bwd_peak_mb", ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    if errors:
        lines += ["", "Errors:", "", *(f"- E{i}: {error}" for i, error in enumerate(errors, 1))]
    lines += _million_lines(index, errors)
    lines += ["", "Targets (issue 4): forward >= 1.0x FlexAttention, forward+backward >= 0.9x, triton TFLOP/s >= 60% "
              "of dense flash SDPA's at N = 32K, peak memory O(N)."]
    if pending:
        lines += ["", f"**Incomplete:** {pending} requested points not measured yet (time budget or a stop); "
                      "`--resume` measures them."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    parser.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--quick", action="store_true", help="N=8192, B=1, D=64 only (a smoke run)")
    parser.add_argument("--million", action="store_true",
                        help="only the 1M-token target: Longformer, B=1, D=64, N=1,048,576 (triton, flex)")
    parser.add_argument("--resume", action="store_true", help="keep the rows in --out and skip their points")
    parser.add_argument("--budget-s", type=float, default=500.0,
                        help="start no point after this many seconds (default 500: one 10-minute call)")
    parser.add_argument("--list", action="store_true", help="print the points to measure and exit (no GPU needed)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.batch, args.head_dim = [8192], [1], [64]
    return args


def machine() -> dict:
    """The set-up the rows were measured on: ``--resume`` refuses rows from another."""
    return {"device": torch.cuda.get_device_name(), **versions(("torch", "triton")),
            "python": platform.python_version(), "dtype": str(DTYPE), "heads": HEADS, "block_size": BLOCK}


def main(argv: list[str] | None = None) -> None:
    start = time.monotonic()
    args = parse_args(argv)
    json_path = args.out / "gpu_kernels.json"
    if args.list:
        done = {_key(r) for r in (load_rows(json_path, None) if args.resume else [])}
        for point in plan(args):
            if point not in done:
                print(*point)
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_kernels.py times CUDA kernels and needs a CUDA GPU; none is visible here "
                 "(torch.cuda.is_available() is False). Run it on a GPU machine.")
    meta = machine()
    rows = load_rows(json_path, meta) if args.resume else []
    if json_path.exists() and not args.resume:
        print(f"replacing {json_path} (--resume would keep its rows)")
    done = {_key(r) for r in rows}
    todo = [point for point in plan(args) if point not in done]
    print(f"{len(todo)} points to measure, {len(rows)} rows kept; no point starts after {args.budget_s:.0f} s",
          flush=True)
    save = lambda rows, pending: write(args.out, meta, rows, pending)  # noqa: E731
    left, why = run(todo, rows, measure, save, start + args.budget_s, cuda_usable)
    save(rows, left)
    print(f"wrote {json_path} and {args.out / 'gpu_kernels.md'}")
    if left:
        print(f"not measured ({why}): {len(left)} points, rerun with --resume to measure them:")
        for point in left:
            print(" ", *point)
    if why.startswith("the CUDA context"):
        sys.exit(f"stopped: {why}")


if __name__ == "__main__":
    main()
