"""Layout build time and memory versus sequence length, for the Longformer and BigBird presets.

    python benchmarks/layout_build.py [--min-log2 14] [--max-log2 20] [--out benchmarks/results]

Each point runs in a fresh subprocess (the layout cache and earlier allocations stay out of it)
and reports the median build time of several builds, the peak memory traced during a build
(tracemalloc: numpy and Python allocations, which is where building happens), the process's
resident-memory high-water mark, and the size of the finished layout. A point that fails stops the run.
Writes ``layout_build.json`` and ``layout_build.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from sparse_attn import machine
from sparse_attn.bench.harness import run_json
from sparse_attn.bench.results import write_results

PATTERNS = {"longformer": ("Local(256) | Global(first=16)", 12), "bigbird-itc": ("bigbird-itc", 12)}
REPEATS = 3


def measure(expression: str, n: int, heads: int) -> dict:
    """Runs inside the child process."""
    import tracemalloc

    from sparse_attn.compiler import build_layout
    from sparse_attn.expression import parse_pattern

    pattern = parse_pattern(expression)[0]  # a preset name or a pattern expression, as `sparse-attn show` takes
    times = []
    for _ in range(REPEATS):
        tracemalloc.start()
        start = time.perf_counter()
        layout = build_layout(pattern, n, n, heads, 64, cache=False)
        times.append(time.perf_counter() - start)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    stored = sum(tensor.numel() * tensor.element_size() for tensor in layout.index)
    return {"n": n, "heads": heads, "build_s": statistics.median(times), "traced_peak_mb": peak / 2**20,
            "max_rss_mb": machine.process_peak_bytes() / 2**20, "layout_mb": stored / 2**20,
            "nnz_blocks": layout.nnz_blocks, "distinct_tiles": layout.masks.shape[0], "density": layout.density}


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = ["# Layout build time and memory\n", f"Command: `{record['command']}`  ",
             f"Machine: {m['processor']}, {m['cpus']} CPUs, {m['platform']}, Python "
             f"{m['python']} (load average at the end {m['loadavg'][0]:.1f}).\n",
             "Block size 64, 12 heads; median of 3 builds in a fresh process; traced peak = numpy/Python "
             "memory during one build; layout = the finished index tensors.\n",
             "| pattern | N | build (ms) | traced peak (MB) | layout (MB) | process RSS (MB) | computed blocks | "
             "distinct tiles | density |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in record["results"]:
        lines.append(f"| {r['pattern']} | {r['n']:,} | {r['build_s'] * 1e3:.1f} | {r['traced_peak_mb']:.1f} | "
                     f"{r['layout_mb']:.1f} | {r['max_rss_mb']:.0f} | {r['nnz_blocks']:,} | {r['distinct_tiles']} | "
                     f"{r['density']:.3%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-log2", type=int, default=14)
    parser.add_argument("--max-log2", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--point", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        expression, n, heads = args.point
        print(json.dumps(measure(expression, int(n), int(heads))))
        return
    rows = []
    for name, (expression, heads) in PATTERNS.items():
        for log2 in range(args.min_log2, args.max_log2 + 1):
            result = run_json([sys.executable, __file__, "--point", expression, str(2 ** log2), str(heads)])
            if "error" in result:
                sys.exit(f"{name} N={2 ** log2}: {result['error']}")
            result["pattern"] = name
            rows.append(result)
            print(f"{name:12s} N={result['n']:>9,d}  build {result['build_s'] * 1e3:8.1f} ms  "
                  f"traced peak {result['traced_peak_mb']:7.1f} MB  layout {result['layout_mb']:6.1f} MB  "
                  f"rss {result['max_rss_mb']:6.0f} MB", flush=True)
    where = {"platform": platform.platform(), "processor": machine.cpu_model(), "cpus": machine.cpus(),
             "python": platform.python_version(), "loadavg": machine.load_average()}
    command = ("python benchmarks/layout_build.py " + " ".join(sys.argv[1:])).strip()
    write_results(args.out, "layout_build", {"machine": where, "command": command, "results": rows}, markdown)


if __name__ == "__main__":
    main()
