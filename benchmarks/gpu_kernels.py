"""GPU kernels: backend="triton" against FlexAttention (same blocks), dense flash SDPA and masked dense SDPA.

    python benchmarks/gpu_kernels.py --resume                 # the plan: targets, the 1M point, the rest; 500-s budget
    python benchmarks/gpu_kernels.py --resume --million       # only the 1M-token Longformer memory target
    python benchmarks/gpu_kernels.py --list --resume          # the points left to measure (no GPU needed)
    python benchmarks/gpu_kernels.py [--quick] [--n 8192 32768] [--batch 1 4] [--head-dim 64 128] [--no-million]
                                     [--patterns ...] [--impls ...] [--budget-s 500] [--out benchmarks/results]

For bf16, H=16 heads, every (pattern, head_dim, batch, N) point times the forward and the
forward+backward of five implementations on identical inputs, each the peer of ``sparse_attn.bench.peers``
that ``sparse-attn bench`` runs too (``make_runner`` maps the names):

- ``triton``: ``sparse_attention(..., backend="triton")`` with a prebuilt ``BlockLayout`` of block 64;
  ``triton-128`` the same with block 128 (the markdown shows triton at its faster block, per pass);
- ``flex-128``: ``torch.compile(flex_attention)`` with ``layout.to_block_mask()`` of the same pattern's
  layout built with block 128 (FlexAttention's default block): its block lists come from the layout, its
  ``mask_mod`` is the pattern's own predicate (``pattern.mask_mod``: arithmetic, as a FlexAttention user
  writes one; the same block lists as ``create_block_mask`` would compute, in milliseconds instead of a
  compiled N x N sweep), compiled afresh for each point and never run eagerly (``peers.flex``);
- ``flex-64``: the same with block 64, kernel tiles 64 x 64 forward and backward (``peers.FLEX_TILES``;
  FlexAttention's default tiles on an H100 are 128 wide, which a 64-block mask does not allow);
- ``flex-128-max``, ``flex-64-max``: ``flex-128`` and ``flex-64`` compiled with
  ``mode="max-autotune-no-cudagraphs"``: FlexAttention picks its tiles, warps and stages by timing its
  candidates (about a minute a point; not in the default plan, ``--impls`` names them). Without it a
  64-block mask has no backward on an H100/H200 (torch 2.11): FlexAttention filters its default backward
  tiles (128 wide) against the block before any override applies, and fails with NoValidChoicesError. The markdown compares triton with the fastest flex, per point and per
  pass, and says which block that was;
- ``sdpa``: dense ``scaled_dot_product_attention`` restricted to the flash kernel (causal for the
  causal pattern), the speed-of-light for the hardware;
- ``triton-softcap``, ``triton-alibi``: ``triton`` (block 64) with ``softcap=50.0`` (Gemma 2's) or ALiBi's
  geometric slopes ``2^(-8 (h + 1) / H)``: what the score modifiers cost (issue 27); not in the default plan,
  ``--impls`` names them, and the markdown lists each against ``triton`` at the same point;
- ``masked-sdpa``: the naive baseline, dense ``scaled_dot_product_attention`` with the pattern's token
  mask (``layout.row_mask``: (1, 1, N, N) bool when heads share the pattern, else (1, H, N, N)); torch
  picks the kernel (recorded as ``sdpa_backend``) and turns the bool mask into a bf16 bias at every
  call. Where the mask, that bias and the inputs, output and gradients would not fit in the free GPU
  memory, the point is an error row ("does not fit: ...") without trying.

Throughput is TFLOP/s on *computed* FLOPs: ``layout.flops(D)`` per example for the sparse ones (at
their own block; forward+backward counts 3.5x, the backward being 2.5x the forward), ``4 N^2 D`` per
head (half for causal flash SDPA) for the dense ones. Peak memory is the CUDA allocator's high-water
mark above the inputs during one call; for forward+backward also in all (inputs and gradients included).

The plan, in order (a run may be cut by its budget at any point, so what decides the targets comes
first): (a) N=32768, B=1, D=64 then 128, every pattern and implementation; (b) the 1M-token point,
Longformer, B=1, D=64, N=1,048,576, with triton, flex-128 and flex-64 (dense attention would compute
10^12 pairs per head), in the plan when Longformer is, unless ``--no-million``; ``--million`` alone
measures only it; (c) the other N at D=64, then at D=128, ascending N (then larger B, if asked).
After every point ``gpu_kernels.json`` and ``gpu_kernels.md`` in ``--out`` are rewritten (whole,
never half), so a run killed mid-way keeps what it measured; ``gpu_kernels.png`` (forward+backward
time and peak memory against N, B=1) is drawn when the run stops: done, budget spent or GPU lost.
``--resume`` skips the points already there (error rows included; the point a kill interrupted is
not there and runs again) and refuses rows measured on another set-up (GPU, driver, CUDA, versions).
No point starts after ``--budget-s`` seconds: the run then writes, lists what it left and exits 0.
An error at one point (out of memory, a compile failure) is that point's result; an error that leaves
the CUDA context unusable stops the run (exit 1), and ``--resume`` continues in a fresh process.

Time on one H100, an estimate, not a measurement (nothing here has run on a GPU yet): a flex point
takes ~20-40 s (two compiles: the inference and the training graph), a triton point ~3-8 s (the
kernels JIT once per head_dim, ~1 min), a dense point ~2-10 s (up to ~40 s at N=128K: masked SDPA
computes every pair); masked BigBird beyond 32K does not fit and costs nothing. The default plan (183 points: 30 targets, 3 at
1M, 150 others; 74 of them flex) is ~50-60 min, more than one session's 30 minutes of device time:
(a) the targets ~7-10 min, (b) the 1M point ~2 min, so two 500-s calls with ``--resume`` decide the
targets and the memory target; (c) the rest ~40 min (~30 of it compiling flex), which ``--impls``
or ``--n`` can trim. ``--quick`` (15 points: N=8192, B=1, D=64) ~4 min. Needs a CUDA GPU; it refuses
to run without one.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a bare checkout runs it without installing
import sparse_attn as sa  # noqa: E402
from sparse_attn.bench import peers  # noqa: E402
from sparse_attn.bench.harness import cuda_usable  # noqa: E402
from sparse_attn.bench.results import error_text, resumed_rows, write_results  # noqa: E402
from sparse_attn.machine import gpu, versions  # noqa: E402

DEVICE = "cuda"
HEADS = 16
DTYPE = torch.bfloat16
BLOCK = 64
PATTERNS = {  # name: (pattern, causal SDPA baseline)
    "longformer": (sa.Local(256) | sa.Global(first=16), False),
    "bigbird-itc": (sa.bigbird(block=64, window_blocks=3, global_blocks=2, random_blocks=3), False),
    "sliding-causal": (sa.Local(1023, 0) & sa.Causal(), True),
}
TRITON_BLOCKS = {"triton": 64, "triton-128": 128}  # implementation: the block of its layout
FLEX_BLOCKS = {"flex-128": 128, "flex-64": 64, "flex-128-max": 128, "flex-64-max": 64}  # its BlockMask's block
FLEX_MODES = {"flex-128-max": peers.AUTOTUNE, "flex-64-max": peers.AUTOTUNE}  # torch.compile mode (default: none)
BLOCKS = TRITON_BLOCKS | FLEX_BLOCKS
TRITON_MODS = ("triton-softcap", "triton-alibi")  # triton at block 64 with a score modifier (issue 27)
IMPLEMENTATIONS = (*TRITON_BLOCKS, *FLEX_BLOCKS, "sdpa", "masked-sdpa", *TRITON_MODS)
DEFAULT_IMPLS = [impl for impl in IMPLEMENTATIONS  # autotuning: ~1 min a point; modifiers: asked for by name
                 if impl not in FLEX_MODES and impl not in TRITON_MODS]
SPARSE = (*TRITON_BLOCKS, *FLEX_BLOCKS)  # those that skip blocks, the only ones at 1M tokens
KEY = ("impl", "pattern", "head_dim", "batch", "n")  # a point; a row is a point plus its results
DEFAULT_N = [4096, 8192, 16384, 32768, 65536, 131072]
TARGET_N = 32768
MILLION = 1_048_576
MILLION_POINT = ("longformer", 64, 1, MILLION)  # (pattern, head_dim, batch, n)
FIGURE_BATCH = 1
STEM = "gpu_kernels"


def point_of(row: dict) -> tuple:
    """The point a row measured: (impl, pattern, head_dim, batch, n)."""
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


def free_gpu_bytes() -> int:
    """Bytes the next allocations can get: free on the device plus what the allocator holds unused."""
    free, _total = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


class DoesNotFit(Exception):
    """A point skipped because its estimated memory exceeds the free GPU memory: its row's error."""


def masked_sdpa_bytes(layout, batch: int, head_dim: int) -> int:
    """What masked SDPA needs: the token mask (1 byte a pair, per head only where heads differ), the bias
    torch builds from it (one ``DTYPE`` a pair), and q, k, v, the output, its gradient and dq, dk, dv.

    >>> masked_sdpa_bytes(sa.Local(256).layout(32768, heads=HEADS), batch=1, head_dim=64) / 2**30
    3.5
    """
    mask_pairs = layout.batch * (1 if layout.shared_heads else layout.heads) * layout.n_q * layout.n_k
    tensors = 8 * batch * HEADS * layout.n_q * head_dim
    return mask_pairs * (1 + DTYPE.itemsize) + tensors * DTYPE.itemsize


def check_fits(needed: int) -> None:
    """Raise ``DoesNotFit`` if ``needed`` bytes exceed the free GPU memory."""
    free = free_gpu_bytes()
    if needed > free:
        raise DoesNotFit(f"does not fit: needs ~{needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")


def masked_sdpa_backend(q, k, v, mask) -> str:
    """The kernel ``scaled_dot_product_attention`` picks for these inputs and mask, e.g. "efficient_attention"."""
    from torch.nn.attention import SDPBackend

    return SDPBackend(torch._fused_sdp_choice(q, k, v, mask)).name.lower()


def make_runner(impl: str, q, k, v, layout, causal: bool) -> tuple:
    """A function computing the attention output with implementation ``impl`` on ``layout``'s pattern (its peer
    in ``sparse_attn.bench.peers``), and what to record of how it runs ({"sdpa_backend": ...} for masked SDPA,
    else {})."""
    if impl in TRITON_BLOCKS:
        return peers.sparse_attn(q, k, v, layout, backend="triton"), {}
    if impl in TRITON_MODS:
        mods = peers.score_mods(impl.removeprefix("triton-"), q.shape[1], q.device)
        return lambda: sa.sparse_attention(q, k, v, layout, backend="triton", **mods), {}
    if impl in FLEX_BLOCKS:  # compiled afresh for each point; autotuning picks its own tiles
        tiles = None if impl in FLEX_MODES else peers.FLEX_TILES.get(layout.block_size)
        return peers.flex(q, k, v, layout, mode=FLEX_MODES.get(impl), kernel_options=tiles), {}
    if impl == "masked-sdpa":
        mask = peers.token_mask(layout, q.device)                           # (1, 1|H, N, N) bool
        return peers.masked_sdpa(q, k, v, mask), {"sdpa_backend": masked_sdpa_backend(q, k, v, mask)}
    return peers.sdpa(q, k, v, causal=causal, flash=True), {}


def _timed_s(fn) -> float:
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _fill(row: dict) -> None:
    """Measure ``row``'s point into it step by step: what was measured before an error stays."""
    pattern, causal = PATTERNS[row["pattern"]]
    impl, head_dim, batch, n = row["impl"], row["head_dim"], row["batch"], row["n"]
    layout = pattern.layout(n, heads=HEADS, block_size=BLOCKS.get(impl, BLOCK)).to(DEVICE)
    row["density"] = layout.density
    if impl == "sdpa":
        row["fwd_flops"] = 4 * batch * HEADS * n * n * head_dim // (2 if causal else 1)
    elif impl == "masked-sdpa":
        row["fwd_flops"] = 4 * batch * HEADS * n * n * head_dim                # every pair, masked or not
        check_fits(masked_sdpa_bytes(layout, batch, head_dim))
    else:
        row["fwd_flops"] = layout.flops(head_dim) * (batch // layout.batch)
    torch.manual_seed(0)                                                     # every implementation: same inputs
    q, k, v = (torch.randn(batch, HEADS, n, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
               for _ in range(3))                                            # (B, H, N, D)
    grad_out = torch.randn_like(q)                                           # (B, H, N, D)
    forward, details = make_runner(impl, q, k, v, layout, causal)
    row.update(details)

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
    except DoesNotFit as skipped:
        row["error"] = str(skipped)
    except torch.cuda.OutOfMemoryError:
        row["error"] = "out of memory"
    except Exception as error:  # a peer failing at one point (e.g. a compile error) is a result, not a crash
        row["error"] = error_text(error)
    return row


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
    """The requested points: those that decide the targets (N=32768, B=1) first, then the 1M-token point,
    then the rest by B, D, N (ascending), pattern and implementation.

    >>> plan(parse_args(["--n", "8192", "32768", "--batch", "1", "2", "--head-dim", "64",
    ...                  "--patterns", "longformer", "--impls", "triton", "sdpa"]))  # doctest: +NORMALIZE_WHITESPACE
    [('triton', 'longformer', 64, 1, 32768), ('sdpa', 'longformer', 64, 1, 32768),
     ('triton', 'longformer', 64, 1, 1048576),
     ('triton', 'longformer', 64, 1, 8192), ('sdpa', 'longformer', 64, 1, 8192),
     ('triton', 'longformer', 64, 2, 8192), ('sdpa', 'longformer', 64, 2, 8192),
     ('triton', 'longformer', 64, 2, 32768), ('sdpa', 'longformer', 64, 2, 32768)]
    """
    million = [(impl, *MILLION_POINT) for impl in args.impls if impl in SPARSE]
    if args.million:
        return million
    if args.no_million or MILLION_POINT[0] not in args.patterns:
        million = []
    grid = [(impl, pattern, head_dim, batch, n) for batch in args.batch for head_dim in args.head_dim
            for n in args.n for pattern in args.patterns for impl in args.impls]

    def order(point):
        impl, pattern, head_dim, batch, n = point
        return batch, head_dim, n, list(PATTERNS).index(pattern), IMPLEMENTATIONS.index(impl)
    targets = sorted((p for p in grid if p[3:] == (1, TARGET_N)), key=order)
    rest = sorted((p for p in grid if p[3:] != (1, TARGET_N)), key=order)
    return list(dict.fromkeys(targets + million + rest))                    # --n 1048576 would repeat it


def write(out: Path, meta: dict, rows: list[dict], pending: list[tuple], plot: bool = False) -> None:
    """``gpu_kernels.json`` and ``.md`` in ``out`` (and ``.png`` with ``plot``: between points the figure is
    left as it is, drawing the whole plan's takes 1.6 s on a 2-core CPU), each replaced whole."""
    record = {"meta": meta, "rows": rows, "not_measured": [dict(zip(KEY, point)) for point in pending]}
    write_results(out, STEM, record, lambda r: to_markdown(r["rows"], r["meta"], len(r["not_measured"])),
                  {f"{STEM}.png": figure} if plot else None)


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


def fastest(rows: list[dict | None], key: str) -> dict | None:
    """The row with the smallest ``row[key]`` among those that have it (None: not measured).

    >>> fastest([None, {"fwd_ms": 2.0}, {"fwd_ms": 1.5}, {"error": "out of memory"}], "fwd_ms")
    {'fwd_ms': 1.5}
    """
    return min((r for r in rows if r is not None and key in r), key=lambda r: r[key], default=None)


def _best_cell(family: list[dict | None], best: dict | None, key: str, spec: str, errors: list[str],
               block: bool = False) -> str:
    """The fastest block's ``best[key]`` among one implementation's blocks (with its block: ``1.50 (128)``);
    else the family's error footnotes (``E1,E2``); — if none of its rows is there."""
    if best is not None and key in best:
        return format(best[key], spec) + (f" ({BLOCKS[best['impl']]})" if block else "")
    notes = [_footnote(r, errors) for r in family if r is not None and "error" in r]
    return ",".join(dict.fromkeys(notes)) or "—"


def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"


def _million_lines(index: dict, errors: list[str], meta: dict) -> list[str]:
    """The 1M-token target, one line per implementation measured there."""
    lines = []
    capacity = meta.get("gpu_memory_gib")
    for impl in SPARSE:
        row = index.get((impl, *MILLION_POINT))
        if row is None:
            continue
        if "fwd_bwd_total_peak_mb" not in row:
            lines.append(f"- {impl}: {_footnote(row, errors)} ({row['error']})" if "error" in row
                         else f"- {impl}: no memory measured")
            continue
        fits = "fits" if row["fwd_bwd_total_peak_mb"] <= capacity * 1024 else "does not fit"
        lines.append(f"- {impl}: forward {row['fwd_ms']:.1f} ms, forward+backward {row['fwd_bwd_ms']:.1f} ms; "
                     f"forward+backward peak {_gib(row['fwd_bwd_total_peak_mb'])} allocated in all (inputs, "
                     f"gradients, layout included; {_gib(row['fwd_bwd_reserved_peak_mb'])} reserved by the "
                     f"allocator): {fits} in the GPU's {capacity} GiB")
    if not lines:
        return []
    return ["", f"1M tokens (target: a Longformer pattern at N = 1,048,576, B=1, H={HEADS}, D=64, bf16 fits in the "
                "GPU's memory forward+backward):", "", *lines]


def _backend_line(rows: list[dict]) -> list[str]:
    """Which kernels torch picked for masked SDPA, with how many points each."""
    picked = [r["sdpa_backend"] for r in rows if "sdpa_backend" in r]
    if not picked:
        return []
    counts = ", ".join(f"{name} ({picked.count(name)} points)" for name in dict.fromkeys(picked))
    return ["", f"masked-sdpa ran torch's {counts}."]


def _modifier_lines(index: dict, points: list[tuple], errors: list[str]) -> list[str]:
    """Each score modifier's times at a point and their ratio to ``triton`` (block 64) without it."""
    lines = []
    for point in points:
        plain = index.get(("triton", *point))
        found = [(impl, index[(impl, *point)]) for impl in TRITON_MODS if (impl, *point) in index]
        cells = [f"{impl[7:]} forward {_cell(row, 'fwd_ms', '.2f', errors)} ms "
                 f"({_ratio(row, plain, 'fwd_ms', 'fwd_ms', '.2f')}x), forward+backward "
                 f"{_cell(row, 'fwd_bwd_ms', '.2f', errors)} ms "
                 f"({_ratio(row, plain, 'fwd_bwd_ms', 'fwd_bwd_ms', '.2f')}x)" for impl, row in found]
        if cells:
            pattern, head_dim, batch, n = point
            lines.append(f"- {pattern}, D={head_dim}, B={batch}, N={n}: " + "; ".join(cells))
    if not lines:
        return []
    return ["", "Score modifiers (issue 27): triton at block 64 with softcap=50 or ALiBi slopes, and x its time "
                "without (target: forward <= 1.10x):", "", *lines]


def to_markdown(rows: list[dict], meta: dict, pending: int = 0) -> str:
    index = {point_of(r): r for r in rows}
    points = sorted({key[1:] for key in index}, key=lambda p: (list(PATTERNS).index(p[0]), *p[1:]))
    errors = list(dict.fromkeys(r["error"] for r in rows if "error" in r))  # distinct, first seen first
    columns = ["pattern", "D", "B", "N", "density", "fwd ms triton (block) / flex (block) / sdpa / masked",
               "f+b ms triton (block) / flex (block) / sdpa / masked", "TFLOP/s fwd triton / flex / sdpa",
               "TFLOP/s f+b triton / flex / sdpa", "fwd x flex", "f+b x flex", "f+b x masked", "fwd % sdpa",
               "peak MiB f+b triton / flex / sdpa / masked"]
    lines = [f"# GPU kernels on {meta['device']}", "",
             f"bf16, H={HEADS}; {meta['device']} ({meta['gpu_memory_gib']} GiB), driver "
             f"{meta['driver']}, CUDA {meta['cuda']}; torch {meta['torch']}, triton {meta['triton']}. Times are "
             "medians; TFLOP/s count computed FLOPs (f+b = 3.5x forward); peak memory is above the inputs (and the "
             "mask, for masked). "
             "triton and flex at their faster block (64 or 128, in brackets) for that pass; flex = FlexAttention, "
             "compiled, its mask_mod the pattern's own predicate (`pattern.mask_mod`: arithmetic, as its users "
             "write one), its block lists from the layout (`layout.to_block_mask()`); masked = dense SDPA "
             "with the pattern's bool mask. `x flex` = FlexAttention time / triton time (>= 1: triton as fast or "
             "faster), `x masked` likewise; `% sdpa` = triton forward TFLOP/s / dense flash SDPA forward TFLOP/s; "
             "`E<i>`: error i below; —: not measured.", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for point in points:
        s, m = (index.get((impl, *point)) for impl in ("sdpa", "masked-sdpa"))
        triton = [index.get((impl, *point)) for impl in TRITON_BLOCKS]
        flex = [index.get((impl, *point)) for impl in FLEX_BLOCKS]
        t_fwd, t_bwd = fastest(triton, "fwd_ms"), fastest(triton, "fwd_bwd_ms")
        f_fwd, f_bwd = fastest(flex, "fwd_ms"), fastest(flex, "fwd_bwd_ms")
        density = next((f"{r['density']:.2%}" for r in (*triton, *flex, s, m) if r is not None and "density" in r),
                       "—")

        def cells(key, spec, best_triton, best_flex, dense=(s, m), block=False):
            return " / ".join([_best_cell(triton, best_triton, key, spec, errors, block),
                               _best_cell(flex, best_flex, key, spec, errors, block),
                               *(_cell(r, key, spec, errors) for r in dense)])
        row = [*map(str, point), density, cells("fwd_ms", ".2f", t_fwd, f_fwd, block=True),
               cells("fwd_bwd_ms", ".2f", t_bwd, f_bwd, block=True),
               cells("fwd_tflops", ".0f", t_fwd, f_fwd, dense=(s,)),
               cells("fwd_bwd_tflops", ".0f", t_bwd, f_bwd, dense=(s,)),
               _ratio(f_fwd, t_fwd, "fwd_ms", "fwd_ms", ".2f"), _ratio(f_bwd, t_bwd, "fwd_bwd_ms", "fwd_bwd_ms", ".2f"),
               _ratio(m, t_bwd, "fwd_bwd_ms", "fwd_bwd_ms", ".1f"), _ratio(t_fwd, s, "fwd_tflops", "fwd_tflops", ".0%"),
               cells("fwd_bwd_peak_mb", ".0f", t_bwd, f_bwd)]
        lines.append("| " + " | ".join(row) + " |")
    lines += _backend_line(rows)
    lines += _modifier_lines(index, points, errors)
    if errors:
        lines += ["", "Errors:", "", *(f"- E{i}: {error}" for i, error in enumerate(errors, 1))]
    lines += _million_lines(index, errors, meta)
    lines += ["", "Targets (issue 25), bf16, B=1, D = 64 and 128, at N = 32K, against FlexAttention at its faster "
              "block: Longformer and the causal sliding window forward >= 1.5x, forward+backward >= 1.2x; BigBird-ITC "
              "forward >= 3x, forward+backward >= 2x; forward TFLOP/s on computed blocks >= 300 (sliding window) and "
              ">= 200 (Longformer); a 1M-token Longformer forward+backward (H=16, D=64) fits and does not slow down."]
    if pending:
        lines += ["", f"**Incomplete:** {pending} requested points not measured yet (time budget or a stop); "
                      "`--resume` measures them."]
    return "\n".join(lines) + "\n"


def figure(record: dict, path: Path) -> None:
    """Forward+backward time (top rows) and peak memory above the inputs (bottom rows) against N at B=1:
    one column per pattern, one row per head_dim, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["rows"] if r["batch"] == FIGURE_BATCH]
    dims = sorted({r["head_dim"] for r in rows}) or [64]
    quantities = (("fwd_bwd_ms", "f+b ms"), ("fwd_bwd_peak_mb", "f+b peak MiB above inputs"))
    fig, axes = plt.subplots(len(quantities) * len(dims), len(PATTERNS), squeeze=False,
                             figsize=(4.6 * len(PATTERNS), 3.4 * len(quantities) * len(dims)))
    styles = dict(zip(IMPLEMENTATIONS, ("o-", "o--", "s--", "^--", "v--", "<--", "k:", "x-.", "D-", "P-")))
    for q, (key, label) in enumerate(quantities):
        for d, head_dim in enumerate(dims):
            for p, pattern in enumerate(PATTERNS):
                ax = axes[q * len(dims) + d, p]
                for impl in IMPLEMENTATIONS:
                    line = sorted((r["n"], r[key]) for r in rows if key in r
                                  and (r["impl"], r["pattern"], r["head_dim"]) == (impl, pattern, head_dim))
                    if line:
                        ax.plot(*zip(*line), styles[impl], label=impl, markersize=4)
                ax.set(xscale="log", yscale="log", xlabel="N", ylabel=label, title=f"{pattern}, D={head_dim}")
                ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper right", fontsize=8)
    meta = record["meta"]
    fig.suptitle(f"{meta['device']}: bf16, B={FIGURE_BATCH}, H={HEADS}; torch {meta['torch']}, "
                 f"triton {meta['triton']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.92, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=list(DEFAULT_N))
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    parser.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS, choices=IMPLEMENTATIONS)
    parser.add_argument("--quick", action="store_true", help="N=8192, B=1, D=64 only, no 1M point (a smoke run)")
    million = parser.add_mutually_exclusive_group()
    million.add_argument("--million", action="store_true",
                         help="only the 1M-token target: Longformer, B=1, D=64, N=1,048,576 (triton, flex-128, flex-64)")
    million.add_argument("--no-million", action="store_true", help="leave the 1M-token point out of the plan")
    parser.add_argument("--resume", action="store_true", help="keep the rows in --out and skip their points")
    parser.add_argument("--budget-s", type=float, default=500.0,
                        help="start no point after this many seconds (default 500: one 10-minute call)")
    parser.add_argument("--list", action="store_true", help="print the points to measure and exit (no GPU needed)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.batch, args.head_dim, args.no_million = [8192], [1], [64], True
    return args


def machine() -> dict:
    """The set-up the rows were measured on: ``--resume`` refuses rows from another."""
    card = gpu()                                  # the GPU's name goes under "device", this json's key for it
    return {"device": card.pop("gpu"), **card, **versions(("torch", "triton")),
            "python": platform.python_version(), "dtype": str(DTYPE), "heads": HEADS, "block_size": BLOCK}


def main(argv: list[str] | None = None) -> None:
    start = time.monotonic()
    args = parse_args(argv)
    json_path = args.out / f"{STEM}.json"
    if args.list:
        done = {point_of(r) for r in (resumed_rows(json_path, {}) if args.resume else [])}
        for point in plan(args):
            if point not in done:
                print(*point)
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_kernels.py times CUDA kernels and needs a CUDA GPU; none is visible here "
                 "(torch.cuda.is_available() is False). Run it on a GPU machine.")
    meta = machine()
    rows = resumed_rows(json_path, meta) if args.resume else []
    if json_path.exists() and not args.resume:
        print(f"replacing {json_path} (--resume would keep its rows)")
    done = {point_of(r) for r in rows}
    todo = [point for point in plan(args) if point not in done]
    print(f"{len(todo)} points to measure, {len(rows)} rows kept; no point starts after {args.budget_s:.0f} s",
          flush=True)
    save = lambda rows, pending, plot=False: write(args.out, meta, rows, pending, plot)  # noqa: E731
    left, why = run(todo, rows, measure, save, start + args.budget_s, cuda_usable)
    save(rows, left, plot=True)
    print(f"wrote {json_path}, {STEM}.md and {STEM}.png in {args.out}")
    if left:
        print(f"not measured ({why}): {len(left)} points, rerun with --resume to measure them:")
        for point in left:
            print(" ", *point)
    if why.startswith("the CUDA context"):
        sys.exit(f"stopped: {why}")


if __name__ == "__main__":
    main()
