"""Short sequences on the CPU: backend="numba" against torch's SDPA with the pattern's token mask, where
``backend="auto"`` switches from one to the other.

    python benchmarks/short_sequences.py --out benchmarks/results/short_sequences

B=1, H=8, D=64, float32, three patterns, N from 64 to 2048: the median time of a forward (no grad) and of a
forward and backward, each side called as a user calls it: ``sparse_attention(q, k, v, pattern, backend="numba")``
(the layout from the cache) and ``scaled_dot_product_attention(q, k, v, attn_mask=mask)`` with the layout's token
mask built once. Calls alternate between the two, so both see the machine's drift. The table gives numba's time
over SDPA's: above 1, SDPA is faster.
"""
import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import sparse_attn as sa
from sparse_attn import machine
from sparse_attn.bench.results import header, write_results

PATTERNS = {"Local(256) | Global(first=16)": sa.Local(256) | sa.Global(first=16),
            "Local(32) | Global(first=1)": sa.Local(32) | sa.Global(first=1),
            "Local(127, 0) & Causal()": sa.Local(127, 0) & sa.Causal()}
LENGTHS = (64, 128, 160, 192, 224, 256, 320, 384, 512, 1024, 2048)


def medians(calls: dict, samples: int) -> dict:
    """Median seconds of each call, its samples interleaved with the others' (two warm-up rounds first)."""
    times: dict = {name: [] for name in calls}
    for round_ in range(samples + 2):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def measure(pattern, n: int, heads: int = 8, dim: int = 64) -> dict:
    q, k, v = (torch.randn(1, heads, n, dim, requires_grad=True) for _ in range(3))
    mask = pattern.layout(n, heads=heads).to_dense()

    def numba(grad):
        with torch.set_grad_enabled(grad):
            out = sa.sparse_attention(q, k, v, pattern, backend="numba")
        if grad:
            out.sum().backward()

    def sdpa(grad):
        with torch.set_grad_enabled(grad):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if grad:
            out.sum().backward()

    samples = max(7, int(20_000 / n))
    times = medians({"numba forward": lambda: numba(False), "sdpa forward": lambda: sdpa(False),
                     "numba fwd+bwd": lambda: numba(True), "sdpa fwd+bwd": lambda: sdpa(True)}, samples)
    return {"n": n, "samples": samples, **{name: round(t * 1e3, 4) for name, t in times.items()}}


def markdown(record: dict) -> str:
    machine = record["machine"]
    lines = [f"# Short sequences: numba against SDPA with the pattern's mask\n\n{machine['cpu']} "
             f"({machine['cpu_kind']}), {machine['cores']} cores, torch {machine['torch']}"
             f", numba {machine['numba']}; load average before {machine['loadavg_before'][0]}, "
             f"after {record['loadavg_after'][0]}. B=1, H=8, D=64, float32; ms, medians of interleaved calls; "
             f"'ratio' is numba's time over SDPA's (above 1: SDPA is faster).\n\n`{record['command']}`\n"]
    for label, rows in record["patterns"].items():
        lines += [f"\n## `{label}`\n",
                  "| N | numba forward | SDPA forward | ratio | numba fwd+bwd | SDPA fwd+bwd | ratio |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['n']} | {r['numba forward']:.3f} | {r['sdpa forward']:.3f} | "
                         f"{r['numba forward'] / r['sdpa forward']:.2f} | {r['numba fwd+bwd']:.3f} | "
                         f"{r['sdpa fwd+bwd']:.3f} | {r['numba fwd+bwd'] / r['sdpa fwd+bwd']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="a folder for short_sequences.json and .md")
    args = parser.parse_args()
    record = {"machine": header(["torch", "numba"]), "command": "python benchmarks/short_sequences.py",
              "patterns": {}}
    for label, pattern in PATTERNS.items():
        record["patterns"][label] = []
        for n in LENGTHS:
            record["patterns"][label].append(measure(pattern, n))
            print(label, record["patterns"][label][-1], flush=True)
    record["loadavg_after"] = machine.load_average()
    text = markdown(record) if args.out is None else write_results(args.out, "short_sequences", record, markdown)
    print(text)


if __name__ == "__main__":
    main()
