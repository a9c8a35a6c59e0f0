"""GPU kernels: backend="triton" against FlexAttention (same blocks) and dense flash SDPA.

    python benchmarks/gpu_kernels.py [--quick] [--n 8192 32768] [--batch 1 4] [--head-dim 64 128]
                                     [--out benchmarks/results]

For bf16, H=16 heads, every (pattern, head_dim, batch, N) point times the forward and the
forward+backward of three implementations on identical inputs:

- ``triton``: ``sparse_attention(..., backend="triton")`` with a prebuilt ``BlockLayout``;
- ``flex``: ``torch.compile(flex_attention)`` with ``layout.to_block_mask()``, the same blocks;
- ``sdpa``: dense ``scaled_dot_product_attention`` restricted to the flash kernel (causal for the
  causal pattern), the speed-of-light for the hardware.

Throughput is TFLOP/s on *computed* FLOPs: ``layout.flops(D)`` per example for the sparse ones
(forward; forward+backward counts 3.5x, the backward being 2.5x the forward), ``4 N^2 D`` per
head (half for causal) for SDPA. Peak memory is the CUDA allocator's high-water mark above the
inputs during one call. Writes ``gpu_kernels.json`` and ``gpu_kernels.md`` into ``--out``.
Needs a CUDA GPU; it refuses to run without one.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

import sparse_attn as sa
from sparse_attn.api import sparse_attention

HEADS = 16
DTYPE = torch.bfloat16
BLOCK = 64
PATTERNS = {  # name: (pattern, causal SDPA baseline)
    "longformer": (sa.Local(256) | sa.Global(first=16), False),
    "bigbird-itc": (sa.bigbird(block=64, window_blocks=3, global_blocks=2, random_blocks=3), False),
    "streaming-causal": (sa.streaming(sink=4, window=1020), True),
}
IMPLEMENTATIONS = ("triton", "flex", "sdpa")


def bench_ms(fn, grads=()) -> float:
    """Median time of ``fn`` in milliseconds (Triton's do_bench: warm-up, L2 flush, repeats)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=list(grads), return_mode="median")


def peak_mb(fn) -> float:
    """Allocator high-water mark above what was allocated before ``fn``, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def make_runner(impl: str, q, k, v, layout, causal: bool):
    """A function computing the attention output with implementation ``impl``."""
    if impl == "triton":
        return lambda: sparse_attention(q, k, v, layout, backend="triton")
    if impl == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        block_mask = layout.to_block_mask()
        flex = torch.compile(flex_attention, dynamic=False)
        return lambda: flex(q, k, v, block_mask=block_mask)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return sdpa


def measure(impl: str, pattern_name: str, head_dim: int, batch: int, n: int) -> dict:
    pattern, causal = PATTERNS[pattern_name]
    layout = pattern.layout(n, heads=HEADS, block_size=BLOCK).to("cuda")
    q, k, v = (torch.randn(batch, HEADS, n, head_dim, device="cuda", dtype=DTYPE, requires_grad=True)
               for _ in range(3))                                                    # (B, H, N, D)
    grad_out = torch.randn_like(q)
    if impl == "sdpa":
        flops = 4 * batch * HEADS * n * n * head_dim // (2 if causal else 1)
    else:
        flops = layout.flops(head_dim) * (batch // layout.batch)
    forward = make_runner(impl, q, k, v, layout, causal)

    def forward_backward():
        forward().backward(grad_out)

    row = {"impl": impl, "pattern": pattern_name, "head_dim": head_dim, "batch": batch, "n": n,
           "fwd_flops": flops, "density": layout.density}
    try:
        with torch.no_grad():
            forward()                                                               # compile / warm up
            row["fwd_ms"] = bench_ms(forward)
            row["fwd_peak_mb"] = peak_mb(forward)
        forward_backward()
        row["fwd_bwd_ms"] = bench_ms(forward_backward, grads=(q, k, v))
        row["fwd_bwd_peak_mb"] = peak_mb(forward_backward)
        row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_ms"] / 1e9
    except torch.cuda.OutOfMemoryError:
        row["error"] = "out of memory"
    except Exception as error:  # a peer failing at one point (e.g. a compile error) is a result, not a crash
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    del q, k, v, grad_out
    torch.cuda.empty_cache()
    return row


def _cell(row: dict | None, key: str, spec: str) -> str:
    if row is None:
        return "—"
    if "error" in row:
        return row["error"][:20]
    return format(row[key], spec)


def _ratio(numerator: dict | None, denominator: dict | None, key_n: str, key_d: str, spec: str) -> str:
    if any(r is None or "error" in r for r in (numerator, denominator)):
        return "—"
    return format(numerator[key_n] / denominator[key_d], spec)


def to_markdown(rows: list[dict], meta: dict) -> str:
    index = {(r["impl"], r["pattern"], r["head_dim"], r["batch"], r["n"]): r for r in rows}
    points = sorted({(r["pattern"], r["head_dim"], r["batch"], r["n"]) for r in rows},
                    key=lambda p: (list(PATTERNS).index(p[0]), *p[1:]))
    columns = ["pattern", "D", "B", "N", "density", "fwd ms triton / flex / sdpa", "f+b ms triton / flex / sdpa",
               "TFLOP/s fwd triton / flex / sdpa", "TFLOP/s f+b triton / flex / sdpa", "fwd x flex", "f+b x flex",
               "fwd % sdpa", "peak MiB f+b triton / flex / sdpa"]
    lines = [f"# GPU kernels on {meta['device']}", "",
             f"bf16, H={HEADS}, block {BLOCK}; torch {meta['torch']}, triton {meta['triton']}. Times are medians; "
             "TFLOP/s count computed FLOPs (f+b = 3.5x forward); peak memory is above the inputs. "
             "`x flex` = FlexAttention time / triton time (>= 1: triton as fast or faster); "
             "`% sdpa` = triton forward TFLOP/s / dense flash SDPA forward TFLOP/s.", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for pattern, head_dim, batch, n in points:
        t, f, s = (index.get((impl, pattern, head_dim, batch, n)) for impl in IMPLEMENTATIONS)
        density = next((r["density"] for r in (t, f) if r is not None), float("nan"))
        triple = lambda key, spec: " / ".join(_cell(r, key, spec) for r in (t, f, s))  # noqa: E731
        cells = [pattern, str(head_dim), str(batch), str(n), f"{density:.3f}", triple("fwd_ms", ".2f"),
                 triple("fwd_bwd_ms", ".2f"), triple("fwd_tflops", ".0f"), triple("fwd_bwd_tflops", ".0f"),
                 _ratio(f, t, "fwd_ms", "fwd_ms", ".2f"), _ratio(f, t, "fwd_bwd_ms", "fwd_bwd_ms", ".2f"),
                 _ratio(t, s, "fwd_tflops", "fwd_tflops", ".0%"), triple("fwd_bwd_peak_mb", ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Targets (issue 4): forward >= 1.0x FlexAttention, forward+backward >= 0.9x, triton TFLOP/s >= 60% "
              "of dense flash SDPA's at N = 32K, peak memory O(N).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    parser.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--quick", action="store_true", help="one small point per pattern (a smoke run)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_kernels.py times CUDA kernels and needs a CUDA GPU; none is visible here "
                 "(torch.cuda.is_available() is False). Run it on a GPU machine.")
    if args.quick:
        args.n, args.batch, args.head_dim = [8192], [1], [64]
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "dtype": str(DTYPE), "heads": HEADS, "block_size": BLOCK}
    rows = []
    for pattern_name in args.patterns:
        for head_dim in args.head_dim:
            for batch in args.batch:
                for n in args.n:
                    for impl in args.impls:
                        row = measure(impl, pattern_name, head_dim, batch, n)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_kernels.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (args.out / "gpu_kernels.md").write_text(to_markdown(rows, meta))
    print(f"wrote {args.out / 'gpu_kernels.json'} and {args.out / 'gpu_kernels.md'}")


if __name__ == "__main__":
    main()
