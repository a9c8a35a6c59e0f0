"""CPU kernels: backend="numba" against FlexAttention (same blocks), the reference and dense SDPA.

    python benchmarks/cpu_kernels.py [--quick] [--n 4096 16384 65536] [--repeats 5] [--no-scale]
                                     [--impls ...] [--pattern PATTERN] [--out benchmarks/results]

B=1, H=8, D=64, pattern ``Local(256) | Global(first=16)`` (``--pattern``: any pattern text, e.g. the preset
``bigbird-itc`` or ``"Local(1023, 0) & Causal()"``), float32, and bfloat16 for the names ending
in ``-bf16`` (``numba-bf16``: bf16 matmuls where the CPU has native bf16, see docs/backend-numba.md).
For every N it times, in one process and interleaved (repeat r runs every implementation once
before repeat r+1, after the two torch.mm calls that measure the matmul rates, starting with the r-th
implementation, so that the one run right after the matmuls, whose 4096^3 operands evict the caches, is
each in turn), the forward and the forward+backward (``peers.passes``) of these peers of
``sparse_attn.bench.peers``, the ones ``sparse-attn bench`` runs:

- ``numba``: ``sparse_attention(..., backend="numba")`` with a prebuilt block-64 ``BlockLayout``;
- ``flex-64`` / ``flex-128``: ``torch.compile(flex_attention)`` with ``layout.to_block_mask()`` of
  the same pattern at block 64 / 128, as a FlexAttention user runs it: the mask_mod is the pattern's
  own predicate (``pattern.mask_mod``: ``(q - kv).abs() <= 256 | (q < 16) | (kv < 16)``, no table
  lookup) and the block lists are the layout's, the same ones ``create_block_mask`` finds. On CPU
  FlexAttention's C++ kernel tiles by the block itself (query and key tiles = ``BLOCK_SIZE``; it has
  no other forward tile knob), so the two blocks are its two tile choices; the markdown compares numba
  with the faster of the two in each dtype. Forward only: FlexAttention has no CPU backward in
  torch 2.13;
- ``reference``: ``backend="reference"`` (torch, chunked dense rows);
- ``sdpa-dense``: ``scaled_dot_product_attention`` with no mask, the cost sparse attention avoids;
- ``numba-softcap``, ``numba-alibi`` (asked for by name): ``numba`` with ``softcap=50`` or ALiBi's slopes
  (``peers.score_mods``); the markdown lists each as x the time of ``numba`` at the same N;

plus ``torch.mm`` of 4096^3 in float32 and in bfloat16 (the machine's matmul rates; 1024^3 in bfloat16 on a
CPU without native bf16, where torch's bf16 mm is a scalar loop of about 1 GFLOP/s), in the same
rounds, and the load average before each N (the machine is shared). Times are medians. Throughput is GFLOP/s on computed blocks, ``layout.flops(D)`` for the forward (3.5x that
for forward+backward). The scale points (forward+backward at N=262,144 and forward at N=1,048,576)
run each in a fresh subprocess that reports time and peak resident memory.
Writes ``cpu_kernels.json`` and ``cpu_kernels.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import numba
import torch

import sparse_attn as sa
from sparse_attn import machine
from sparse_attn.api import sparse_attention
from sparse_attn.backends.numba import bf16 as numba_bf16
from sparse_attn.backends.numba.lowlevel import matmul_blas
from sparse_attn.bench import peers
from sparse_attn.bench.harness import run_json
from sparse_attn.bench.results import header, write_results
from sparse_attn.expression import parse_pattern

BATCH, HEADS, DIM = 1, 8, 64
PATTERN_NAME = "Local(256) | Global(first=16)"  # the default --pattern
SLOW_FLOPS = {"reference": 1e11, "sdpa-dense": 1e12}  # skip above these dense FLOPs (minutes per call here)
SCALE_POINTS = ((262_144, True), (1_048_576, False))
NUMBA_MODS = ("numba-softcap", "numba-alibi")  # numba float32 with a score modifier (issue 27), asked for by name
FLEX_MASK_MOD = {PATTERN_NAME: "pattern.mask_mod: (q - kv).abs() <= 256 | (q < 16) | (kv < 16), the predicate (no "
                                "lookup table)"}  # what the default pattern's mask_mod computes


def _inputs(n: int, grad: bool, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(BATCH, HEADS, n, DIM, generator=gen).to(dtype).requires_grad_(grad)  # (B, H, N, D)
            for _ in range(3)]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _runner(impl: str, n: int, pattern: sa.Pattern):
    """(forward, forward+backward, FLOPs of one forward, skip reason or None) for one implementation."""
    name = impl.removesuffix("-bf16")
    q, k, v = _inputs(n, grad=True, dtype=torch.bfloat16 if impl.endswith("-bf16") else torch.float32)
    dense_flops = 4 * BATCH * HEADS * n * n * DIM
    if name == "numba" or name == "reference":
        layout = pattern.layout(n, n, heads=HEADS, block_size=64)
        flops = layout.flops(DIM) * BATCH
        if name == "reference" and dense_flops > SLOW_FLOPS[name]:
            return None, None, flops, f"computes dense rows: {dense_flops / 1e12:.1f} TFLOP per forward"
        attend = peers.sparse_attn(q, k, v, layout, backend=name)
    elif name in NUMBA_MODS:
        layout = pattern.layout(n, n, heads=HEADS, block_size=64)
        flops = layout.flops(DIM) * BATCH
        mods = peers.score_mods(name.removeprefix("numba-"), HEADS, "cpu")
        attend = lambda: sparse_attention(q, k, v, layout, backend="numba", **mods)  # noqa: E731
    elif name.startswith("flex"):
        torch._dynamo.config.recompile_limit = 64  # one compiled variant per (N, block, dtype): more than the default 8
        block = int(name.split("-")[1])
        layout = pattern.layout(n, n, heads=HEADS, block_size=block)
        q, k, v = (t.detach() for t in (q, k, v))  # FlexAttention refuses inputs that require grad on CPU
        # fresh=False: the flex runners of one N are timed in turns, and a reset would send them back to compiling
        forward = peers.flex(q, k, v, layout, fresh=False)
        return forward, None, layout.flops(DIM) * BATCH, None
    elif name == "sdpa-dense":
        flops = dense_flops
        if dense_flops > SLOW_FLOPS[name]:
            return None, None, flops, f"dense O(N^2): {dense_flops / 1e12:.1f} TFLOP per forward"
        attend = peers.sdpa(q, k, v)
    else:
        raise ValueError(f"unknown implementation {name!r}")
    return *peers.passes(attend, q, k, v), flops, None


def _matmul_sizes() -> dict[str, int]:
    """The square torch.mm size that gives each dtype's matmul rate: 4096, but 1024 for bfloat16 on a CPU
    without native bf16 dot products, where torch's bf16 mm falls back to a scalar loop (about 1 GFLOP/s on an
    AMD EPYC without AVX-512: a 4096^3 call takes minutes, and the script times one per repeat)."""
    return {"float32": 4096, "bfloat16": 4096 if numba_bf16.native()[0] else 1024}


def _matmul(dtype: torch.dtype, size: int):
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    return lambda: torch.mm(a, b)


def run_sizes(lengths, impls, repeats, pattern: sa.Pattern):
    results, mm_times, mm_bf16_times, load = [], [], [], {}
    sizes = _matmul_sizes()
    for n in lengths:
        load[n] = machine.load_average()
        runners = {}
        for name in impls:
            forward, forward_backward, flops, skip = _runner(name, n, pattern)
            if skip is None:
                compile_s = _timed(forward) + (_timed(forward_backward) if forward_backward else 0)  # warm-up
                runners[name] = (forward, forward_backward, flops, compile_s)
            else:
                results.append({"n": n, "impl": name, "skipped": skip, "flops_forward": flops})
        times = {name: ([], []) for name in runners}
        matmul, matmul_bf16 = _matmul(torch.float32, sizes["float32"]), _matmul(torch.bfloat16, sizes["bfloat16"])
        matmul(), matmul_bf16()
        names = list(runners)
        for r in range(repeats):
            mm_times.append(_timed(matmul))
            mm_bf16_times.append(_timed(matmul_bf16))
            first = r % max(len(names), 1)                                   # each in turn first after the matmuls
            for name in names[first:] + names[:first]:
                forward, forward_backward, _, _ = runners[name]
                slow = times[name][0] and times[name][0][-1] > 5                # one sample is enough
                if r == 0 or not slow:
                    times[name][0].append(_timed(forward))
                    if forward_backward:
                        times[name][1].append(_timed(forward_backward))
        for name, (_, _, flops, compile_s) in runners.items():
            fwd = statistics.median(times[name][0])
            fwd_bwd = statistics.median(times[name][1]) if times[name][1] else None
            results.append({"n": n, "impl": name, "forward_s": fwd, "forward_backward_s": fwd_bwd,
                            "forward_samples": times[name][0], "forward_backward_samples": times[name][1],
                            "flops_forward": flops, "forward_gflops": flops / fwd / 1e9,
                            "forward_backward_gflops": 3.5 * flops / fwd_bwd / 1e9 if fwd_bwd else None,
                            "warmup_s": compile_s})
            print(f"N={n:>7} {name:>15}: forward {fwd * 1e3:9.1f} ms  fwd+bwd "
                  f"{fwd_bwd * 1e3 if fwd_bwd else float('nan'):9.1f} ms  {flops / fwd / 1e9:6.1f} GFLOP/s", flush=True)
    rates = {"matmul_size": sizes["float32"], "matmul_bf16_size": sizes["bfloat16"],
             "matmul_gflops": 2 * sizes["float32"] ** 3 / statistics.median(mm_times) / 1e9,
             "matmul_samples_s": mm_times,
             "matmul_bf16_gflops": 2 * sizes["bfloat16"] ** 3 / statistics.median(mm_bf16_times) / 1e9,
             "matmul_bf16_samples_s": mm_bf16_times}
    return results, rates, load


def scale_point(n: int, backward: bool, pattern: sa.Pattern) -> dict:
    """Run once in this process (a fresh one): time and peak resident memory."""
    q, k, v = _inputs(n, grad=backward)
    start = time.perf_counter()
    layout = pattern.layout(n, n, heads=HEADS, block_size=64)
    layout_s = time.perf_counter() - start
    base_rss = machine.process_peak_bytes()
    start = time.perf_counter()
    if backward:
        out = sparse_attention(q, k, v, layout, backend="numba")
        out.backward(torch.ones_like(out))
    else:
        with torch.no_grad():
            out = sparse_attention(q, k, v, layout, backend="numba")
    seconds = time.perf_counter() - start
    peak = machine.process_peak_bytes()
    tensor_bytes = 4 * BATCH * HEADS * n * DIM
    return {"n": n, "backward": backward, "seconds": seconds, "layout_s": layout_s,
            "peak_rss_gib": peak / 2 ** 30, "rss_before_call_gib": base_rss / 2 ** 30,
            "one_qkv_tensor_gib": tensor_bytes / 2 ** 30,
            "flops_forward": layout.flops(DIM) * BATCH, "finite": bool(torch.isfinite(out).all())}


def run_scale_points(pattern_text: str) -> list[dict]:
    points = []
    for n, backward in SCALE_POINTS:
        cmd = [sys.executable, __file__, "--scale-point", str(n), "--pattern", pattern_text] + (
            ["--backward"] if backward else [])
        point = run_json(cmd)
        points.append({"n": n, "backward": backward, "error": point["error"]} if "error" in point else point)
        print(points[-1], flush=True)
    return points


def _fastest_flex(at: dict, n: int, suffix: str = "") -> dict | None:
    """FlexAttention's faster block at N in one dtype (``suffix`` "" for float32, "-bf16"): its row, or None."""
    rows = [at[(n, f"flex-{block}{suffix}")] for block in (64, 128) if (n, f"flex-{block}{suffix}") in at]
    return min(rows, key=lambda r: r["forward_s"]) if rows else None


def _faster(peer_s: float, numba_s: float) -> str:
    """'is 1.62x faster' or 'is SLOWER: 0.79x (Flex 1.27x faster)': numba against the peer, said plainly."""
    ratio = peer_s / numba_s
    return f"is {ratio:.2f}x faster" if ratio >= 1 else f"is SLOWER: {ratio:.2f}x (Flex {1 / ratio:.2f}x faster)"


def _headline(results) -> list[str]:
    """numba against FlexAttention at its faster block, per N and dtype (forward: Flex has no CPU backward)."""
    at = {(r["n"], r["impl"]): r for r in results if "forward_s" in r}
    lines = ["| N | dtype | numba forward ms | FlexAttention forward ms (faster block) | other block ms | "
             "numba vs Flex (Flex time / numba time) |", "|---:|---|---:|---:|---:|---:|"]
    for n in sorted({r["n"] for r in results}):
        for dtype, suffix in (("float32", ""), ("bfloat16", "-bf16")):
            mine, best = at.get((n, "numba" + suffix)), _fastest_flex(at, n, suffix)
            if not (mine and best):
                continue
            other = [at[(n, f"flex-{b}{suffix}")] for b in (64, 128)
                     if (n, f"flex-{b}{suffix}") in at and at[(n, f"flex-{b}{suffix}")] is not best]
            other_ms = f"{other[0]['forward_s'] * 1e3:.1f} ({other[0]['impl']})" if other else ""
            ratio = best["forward_s"] / mine["forward_s"]
            verdict = f"{ratio:.2f}x" + ("" if ratio >= 1 else " (numba slower)")
            lines.append(f"| {n} | {dtype} | {mine['forward_s'] * 1e3:.1f} | {best['forward_s'] * 1e3:.1f} "
                         f"({best['impl']}) | {other_ms} | {verdict} |")
    return lines


def _target_lines(results, mm_gflops, bf16_gflops) -> list[str]:
    """Issue 24's targets at each N (bf16 against float32: issue 22's)."""
    at = {(r["n"], r["impl"]): r for r in results if "forward_s" in r}
    lines = []
    for n in sorted({r["n"] for r in results}):
        numba_, bf16 = at.get((n, "numba")), at.get((n, "numba-bf16"))
        if numba_ and bf16:
            lines.append(f"- N={n}: numba-bf16 against numba float32 (float32 time / bf16 time, above 1: bf16 faster): "
                         f"{numba_['forward_s'] / bf16['forward_s']:.2f}x in the forward (issue 22: >= 1.6x at "
                         f"N=16384), {numba_['forward_backward_s'] / bf16['forward_backward_s']:.2f}x in "
                         f"forward+backward (>= 1.4x)")
        flex_bf16 = _fastest_flex(at, n, "-bf16")
        if bf16 and flex_bf16:
            lines.append(f"- N={n}: numba-bf16 forward {_faster(flex_bf16['forward_s'], bf16['forward_s'])} than "
                         f"FlexAttention bf16 at its faster block ({flex_bf16['impl']}; target >= 1.5x), "
                         f"{bf16['forward_gflops']:.1f} GFLOP/s against the bf16 matmul rate's {bf16_gflops:.1f} "
                         f"(target >= 50% of it)")
        best = _fastest_flex(at, n)
        if bf16 and flex_bf16 and best and best["forward_s"] < flex_bf16["forward_s"]:
            lines.append(f"- N={n}: FlexAttention is faster in float32 than in bf16 here ({best['impl']} "
                         f"{best['forward_s'] * 1e3:.1f} ms, {flex_bf16['impl']} {flex_bf16['forward_s'] * 1e3:.1f} ms): "
                         f"numba-bf16 forward {_faster(best['forward_s'], bf16['forward_s'])} than that float32 "
                         f"FlexAttention, a bf16 user's fastest Flex on this CPU")
        if not numba_:
            continue
        if best:
            lines.append(f"- N={n}: numba forward {_faster(best['forward_s'], numba_['forward_s'])} than "
                         f"FlexAttention at its faster block ({best['impl']}; target >= 2.0x)")
        lines.append(f"- N={n}: numba forward {numba_['forward_gflops']:.1f} GFLOP/s = "
                     f"{numba_['forward_gflops'] / mm_gflops:.0%} of the float32 matmul rate (target >= 60%); "
                     f"forward+backward = {numba_['forward_backward_s'] / numba_['forward_s']:.2f}x forward "
                     f"(target <= 3.0x)")
    return lines


def _blas(where: dict) -> str:
    """", float32 matmuls on MKL (from torch)" where the record names numba's BLAS (runs before it: scipy's), or
    the route ``bf16.float32_brgemm`` chose where the record names one (runs before it: the BLAS)."""
    if where.get("numba_float32_brgemm"):
        return f", float32 matmuls on {where['numba_float32']}"
    return f", float32 matmuls on {where['numba_blas']}" if "numba_blas" in where else ""


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        "# CPU kernels: numba vs FlexAttention, reference and dense SDPA, float32 and bfloat16", "",
        f"`{record['command']}`", "",
        f"Machine: {m['cpu']}" + (f" ({m['cpu_kind']})" if m.get("cpu_kind") else "") + f", {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
        f"numba {m['numba']} ({m['numba_threads']} threads{_blas(m)}); "
        f"load average {tuple(m['loadavg_before'])} before, "
        f"{tuple(m['loadavg_after'])} after, before each N: "
        + ", ".join(f"{n}: {tuple(round(x, 2) for x in load)}" for n, load in record["loadavg_by_n"].items())
        + " (the machine is shared: compare ratios within this run).", "",
        f"B={BATCH}, H={HEADS}, D={DIM}, `{record.get('pattern', PATTERN_NAME)}`; float32, and bfloat16 for `-bf16` "
        f"(bf16 matmuls in numba: {record['numba_bf16']}). Median of {record['repeats']} interleaved "
        f"repeats. GFLOP/s on computed blocks (`layout.flops(D)`, x3.5 for forward+backward). "
        f"Matmul rates (torch.mm, same run): fp32 **{record['matmul_gflops']:.0f} GFLOP/s** "
        f"({record.get('matmul_size', 4096)}^3), bf16 **{record['matmul_bf16_gflops']:.1f} GFLOP/s** "
        f"({record.get('matmul_bf16_size', 4096)}^3). Speed-up: of numba in the same dtype "
        f"(numba or numba-bf16) over the row's implementation.", "",
        "FlexAttention: `torch.compile(flex_attention)` on `layout.to_block_mask()`, whose mask_mod is the "
        f"pattern's own predicate (`{record.get('flex_mask_mod', 'pattern.mask_mod')}`), at blocks 64 and 128 "
        "(on CPU its tiles are the block). numba against Flex at its faster block, forward:", "",
        *_headline(record["results"]), "",
        "Every implementation:", "",
        "| N | implementation | forward ms | fwd+bwd ms | forward GFLOP/s | fwd+bwd GFLOP/s | numba speed-up (fwd) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    at = {(r["n"], r["impl"]): r for r in record["results"] if "forward_s" in r}
    for r in record["results"]:
        if "skipped" in r:
            lines.append(f"| {r['n']} | {r['impl']} | skipped: {r['skipped']} | | | | |")
            continue
        base = at.get((r["n"], "numba-bf16" if r["impl"].endswith("-bf16") else "numba"))
        speedup = f"{r['forward_s'] / base['forward_s']:.2f}x" if base else ""
        if r["forward_backward_s"] is None:
            fb, fb_rate = "no CPU backward in torch", ""
        else:
            fb, fb_rate = f"{r['forward_backward_s'] * 1e3:.1f}", f"{r['forward_backward_gflops']:.1f}"
        lines.append(f"| {r['n']} | {r['impl']} | {r['forward_s'] * 1e3:.1f} | {fb} | {r['forward_gflops']:.1f} | "
                     f"{fb_rate} | {speedup} |")
    lines += _modifier_lines(at)
    lines += ["", "Targets:", *_target_lines(record["results"], record["matmul_gflops"], record["matmul_bf16_gflops"])]
    if not record.get("numba_bf16_native", not record["numba_bf16"].startswith("no ")):
        lines += ["", "This CPU has no native bf16 dot products: numba-bf16 converts q, k, v to float32, runs "
                      "the float32 kernels and rounds the results back to bf16, so it cannot beat numba float32 "
                      "here; the bf16 speed-up targets are for CPUs with AVX512-BF16 or AMX-BF16. torch's own "
                      "bf16 kernels (FlexAttention, SDPA, torch.mm) are far slower in bf16 than in float32 on "
                      "this CPU too (the rows above): the bf16 ratios against them say more about this CPU than "
                      "about the kernels."]
    if record.get("scale"):
        lines += ["", "Scale (numba, fresh process each):", "",
                  "| N | pass | seconds | peak RSS GiB | one q/k/v tensor GiB |", "|---:|---|---:|---:|---:|"]
        for p in record["scale"]:
            if "error" in p:
                lines.append(f"| {p['n']} | {'fwd+bwd' if p['backward'] else 'forward'} | failed: {p['error']} | | |")
            else:
                lines.append(f"| {p['n']} | {'fwd+bwd' if p['backward'] else 'forward'} | {p['seconds']:.1f} | "
                             f"{p['peak_rss_gib']:.1f} | {p['one_qkv_tensor_gib']:.2f} |")
    return "\n".join(lines) + "\n"


def _modifier_lines(at: dict) -> list[str]:
    """numba float32 with softcap=50 or ALiBi slopes, as x its time without, at each N both ran."""
    lines = []
    for n in sorted({n for n, _ in at}):
        plain = at.get((n, "numba"))
        cells = [f"{impl[6:]} forward x{at[n, impl]['forward_s'] / plain['forward_s']:.2f}, forward+backward "
                 f"x{at[n, impl]['forward_backward_s'] / plain['forward_backward_s']:.2f}"
                 for impl in NUMBA_MODS if plain and (n, impl) in at]
        if cells:
            lines.append(f"- N={n}: " + "; ".join(cells))
    if not lines:
        return []
    return ["", "Score modifiers (issue 27): numba float32 with softcap=50 or ALiBi slopes, x its time without "
                "(target: forward <= 1.10x):", "", *lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N=4096 only, 3 repeats, no scale points")
    parser.add_argument("--n", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--impls", nargs="+", default=["numba", "numba-bf16", "flex-64", "flex-64-bf16", "flex-128",
                                                       "flex-128-bf16", "reference", "sdpa-dense", "sdpa-dense-bf16"])
    parser.add_argument("--no-scale", action="store_true", help="skip the N=262K / 1M scale points")
    parser.add_argument("--pattern", default=PATTERN_NAME, help="pattern text: a preset or an expression")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--scale-point", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    pattern, _ = parse_pattern(args.pattern)
    if args.scale_point:
        print(json.dumps(scale_point(args.scale_point, args.backward, pattern)))
        return
    lengths, repeats = ([4096], 3) if args.quick else (args.n, args.repeats)
    where = {**header(("torch", "numba")), "torch_threads": torch.get_num_threads(),
             "numba_threads": numba.get_num_threads(), "numba_blas": matmul_blas().name,
             "numba_float32_brgemm": numba_bf16.float32_brgemm()[0], "numba_float32": numba_bf16.float32_brgemm()[1]}
    results, rates, load_by_n = run_sizes(lengths, args.impls, repeats, pattern)
    scale = [] if args.quick or args.no_scale else run_scale_points(args.pattern)
    where["loadavg_after"] = machine.load_average()
    record = {"machine": where, "loadavg_by_n": load_by_n, "batch": BATCH, "heads": HEADS, "head_dim": DIM,
              "dtypes": ["float32", "bfloat16"], "numba_bf16": numba_bf16.native()[1], "pattern": args.pattern,
              "numba_bf16_native": numba_bf16.native()[0],
              "repeats": repeats, **rates, "results": results, "scale": scale,
              "flex_mask_mod": FLEX_MASK_MOD.get(args.pattern, f"pattern.mask_mod of {args.pattern}")}
    record["command"] = shlex.join(["python", "benchmarks/cpu_kernels.py", *sys.argv[1:]])
    print(write_results(args.out, "cpu_kernels", record, markdown))


if __name__ == "__main__":
    main()
