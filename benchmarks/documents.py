"""Packed documents: layout build and attention time, against FlexAttention and padding.

    python benchmarks/documents.py [--quick] [--n 65536 262144 1048576] [--attention-max 262144]
                                   [--repeats 3] [--limit 150] [--out benchmarks/results]

Two sets of documents, seeded, packed into one row (B=1) of N tokens:

- ``long-tailed``: lognormal lengths (mean 2048 tokens, sigma 1), the last one cut to fill N;
- ``16-token``: N / 16 documents of 16 tokens (65,536 of them at N = 1M).

Pattern ``Local(256) | Global(first=1)`` per document (each document's first token is global),
block size 64. Every point runs in a fresh subprocess under a time limit (``--limit``) and an
address-space limit (``--memory-gib``); a point that fails, runs out of memory or time reports n/a
with the reason.

Layout build (heads=1):

- ``sparse_attn``: ``compiler.build_layout(..., documents=..., cache=False)``, median of
  ``--repeats`` builds after one small warm-up build (imports); peak memory = the growth of the
  resident set's high-water mark during a build (RSS delta, the largest over the builds: numpy,
  torch and Python together; the mark is reset before each build), and tracemalloc's peak of one
  more build (numpy and Python only);
- ``flex-compiled`` / ``flex-eager``: FlexAttention's ``create_block_mask`` with a document
  ``mask_mod`` (same document, and the window / first-token rule relative to the document's start),
  ``_compile=True`` / ``False``: the first call (compilation included) and a second call with the
  same inputs (the time a training step pays once the kernel is compiled). A size is not run when
  the same implementation already failed at a smaller one, or when the smaller one's time grown as
  N^2 (what create_block_mask evaluates) exceeds the limit.

Attention (backend="numba", H=8, D=64, float32, layouts prebuilt, inputs random): forward and
forward+backward of the packed row (``documents=``) against the same documents padded into a batch
(B = documents, N = the longest, ``key_padding_mask``; long-tailed set only). Padded batches that do
not fit the memory budget run in micro-batches of documents, each padded to the same N, and their
times are summed. One warm-up call of each at 4,096 tokens (kernel compilation or loading), then
repeats interleaved (packed, padded, packed, ...); a sample above 5 s is not repeated. Sizes up to
``--attention-max`` tokens, under twice the time limit.

Writes ``documents.json``, ``documents.md`` and ``documents.png`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import sparse_attn as sa
from sparse_attn import machine
from sparse_attn.bench import peers
from sparse_attn.bench.harness import run_json
from sparse_attn.bench.results import header, write_results

PATTERN = sa.Local(256) | sa.Global(first=1)
PATTERN_NAME = "Local(256) | Global(first=1)"
BLOCK, HEADS, DIM = 64, 8, 64
MEAN_LENGTH, SIGMA, SEED = 2048, 1.0, 0
SETS = ("long-tailed", "16-token")
LAYOUT_IMPLS = ("sparse_attn", "flex-compiled", "flex-eager")
PADDED_BUDGET_BYTES = 3 * 2**30  # q, k, v, out and their gradients of one padded micro-batch
SLOW_SAMPLE_S = 5.0


def document_lengths(doc_set: str, n: int) -> list[int]:
    """The document lengths of ``doc_set`` packed into ``n`` tokens (they sum to ``n``), seeded.

    >>> document_lengths("16-token", 64)
    [16, 16, 16, 16]
    >>> sum(document_lengths("long-tailed", 65536))
    65536
    """
    if doc_set == "16-token":
        return [16] * (n // 16) + ([n % 16] if n % 16 else [])
    if doc_set != "long-tailed":
        raise ValueError(f"doc_set must be one of {SETS}, got {doc_set!r}")
    rng = np.random.default_rng(SEED)
    mu = math.log(MEAN_LENGTH) - SIGMA**2 / 2                          # lognormal mean = exp(mu + sigma^2 / 2)
    lengths, total = [], 0
    while total < n:
        length = int(min(max(1, round(rng.lognormal(mu, SIGMA))), n - total))
        lengths.append(length)
        total += length
    return lengths


def _documents(doc_set: str, n: int) -> torch.Tensor:
    return sa.documents_from_lengths([document_lengths(doc_set, n)])  # (1, N) int64


class PeakRSS:
    """The growth of the resident set's high-water mark over a ``with`` block (Linux: VmHWM reset through
    /proc/self/clear_refs, so earlier peaks, such as imports, do not hide it).

    >>> with PeakRSS() as peak:
    ...     block = np.ones(2**24)                                      # 128 MiB
    >>> peak.mb >= 128
    True
    """

    def __enter__(self):
        machine.reset_peak_rss()
        self.before = machine.status_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        self.mb = (machine.status_bytes("VmHWM") - self.before) / 2**20


# ---------------------------------------------------------------------------------------------- layout points

def layout_point(doc_set: str, n: int, repeats: int) -> dict:
    """sparse_attn's layout build, in this (fresh) process."""
    import tracemalloc

    from sparse_attn.compiler import build_layout

    build_layout(PATTERN, 256, 256, 1, BLOCK, documents=_documents(doc_set, 256), cache=False)  # imports
    documents = _documents(doc_set, n)
    times, peaks = [], []
    for _ in range(repeats):
        with PeakRSS() as peak:
            start = time.perf_counter()
            layout = build_layout(PATTERN, n, n, 1, BLOCK, documents=documents, cache=False)
            times.append(time.perf_counter() - start)
        peaks.append(peak.mb)
        if len(times) < repeats:
            del layout
    stored = sum(t.numel() * t.element_size() for t in layout.index)
    nnz, tiles = layout.nnz_blocks, layout.masks.shape[0]
    del layout
    tracemalloc.start()
    build_layout(PATTERN, n, n, 1, BLOCK, documents=documents, cache=False)
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"build_s": statistics.median(times), "samples_s": times, "rss_delta_mb": max(peaks),
            "traced_peak_mb": traced_peak / 2**20, "layout_mb": stored / 2**20, "nnz_blocks": int(nnz),
            "distinct_tiles": int(tiles)}


def document_mask_mod(documents: torch.Tensor):
    """FlexAttention's mask_mod for PATTERN applied per document: (b, h, q, kv) -> bool."""
    ids = documents[0]                                                       # (N,)
    change = torch.ones_like(ids, dtype=torch.bool)
    change[1:] = ids[1:] != ids[:-1]
    first = torch.cummax(torch.where(change, torch.arange(len(ids)), 0), 0).values  # (N,) each token's document start

    def mask_mod(b, h, q, kv):
        same = ids[q] == ids[kv]
        local = (q - kv).abs() <= 256
        global_ = (q == first[q]) | (kv == first[kv])
        return same & (local | global_)

    return mask_mod


def flex_point(doc_set: str, n: int, compiled: bool) -> dict:
    """FlexAttention's create_block_mask with the document mask_mod, in this (fresh) process."""
    from torch.nn.attention.flex_attention import create_block_mask

    warnings.filterwarnings("ignore", message="_compile flag", category=DeprecationWarning)
    mask_mod = document_mask_mod(_documents(doc_set, n))
    times, peaks = [], []
    for _ in range(2):
        with PeakRSS() as peak:
            start = time.perf_counter()
            block_mask = create_block_mask(mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=BLOCK,
                                           _compile=compiled)
            times.append(time.perf_counter() - start)
        peaks.append(peak.mb)
    nnz = int(block_mask.kv_num_blocks.sum()) + int(block_mask.full_kv_num_blocks.sum())
    return {"first_call_s": times[0], "build_s": times[1], "first_call_rss_delta_mb": peaks[0],
            "rss_delta_mb": peaks[1], "nnz_blocks": nnz}


# ------------------------------------------------------------------------------------------- attention points

def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _calls(q, k, v, layout):
    return peers.passes(peers.sparse_attn(q, k, v, layout, backend="numba"), q, k, v)


def _packed(doc_set: str, n: int):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n, DIM, generator=gen).requires_grad_() for _ in range(3))  # (1, H, N, D)
    layout = PATTERN.layout(n, heads=HEADS, block_size=BLOCK, documents=_documents(doc_set, n))
    return *_calls(q, k, v, layout), {"batch": 1, "n": n, "micro_batches": 1, "nnz_blocks": layout.nnz_blocks}


def _padded(doc_set: str, n: int):
    """The documents padded into (B, longest); micro-batches of documents when one batch exceeds the budget."""
    lengths = document_lengths(doc_set, n)
    longest = max(lengths)
    per_document = 8 * HEADS * longest * DIM * 4                            # q, k, v, out, dout, dq, dk, dv
    per_batch = max(1, PADDED_BUDGET_BYTES // per_document)
    chunks = [lengths[i:i + per_batch] for i in range(0, len(lengths), per_batch)]
    gen = torch.Generator().manual_seed(0)
    size = len(chunks[0])
    q, k, v = (torch.randn(size, HEADS, longest, DIM, generator=gen).requires_grad_()
               for _ in range(3))                                           # (b, H, longest, D)
    calls, nnz = [], 0
    for chunk in chunks:
        padding = torch.arange(longest)[None, :] >= torch.tensor(chunk)[:, None]   # (b, longest), True = padding
        layout = PATTERN.layout(longest, heads=HEADS, block_size=BLOCK, key_padding_mask=padding)
        nnz += layout.nnz_blocks
        b = len(chunk)
        calls.append(_calls(*(t[:b].detach().requires_grad_() for t in (q, k, v)), layout))

    def forward():
        for f, _ in calls:
            f()

    def forward_backward():
        for _, fb in calls:
            fb()

    return forward, forward_backward, {
        "batch": len(lengths), "n": longest, "micro_batches": len(chunks), "nnz_blocks": nnz,
        "padded_tokens": len(lengths) * longest}


def _variants(doc_set: str, n: int) -> dict:
    return {"packed": _packed(doc_set, n)} | ({"padded": _padded(doc_set, n)} if doc_set == "long-tailed" else {})


def attention_point(doc_set: str, n: int, repeats: int) -> dict:
    """Packed and (long-tailed set) padded attention, interleaved, in this (fresh) process."""
    warmup = {name: _timed(f) + _timed(fb) for name, (f, fb, _) in _variants(doc_set, 4096).items()}
    variants = _variants(doc_set, n)
    samples = {name: ([], []) for name in variants}
    for r in range(repeats):
        for name, (forward, forward_backward, _) in variants.items():
            fwd, fwd_bwd = samples[name]
            if r == 0 or fwd[-1] <= SLOW_SAMPLE_S:
                fwd.append(_timed(forward))
            if r == 0 or fwd_bwd[-1] <= SLOW_SAMPLE_S:
                fwd_bwd.append(_timed(forward_backward))
    result = {}
    for name, (_, _, shape) in variants.items():
        fwd, fwd_bwd = samples[name]
        result[name] = {**shape, "forward_s": statistics.median(fwd), "forward_samples_s": fwd,
                        "forward_backward_s": statistics.median(fwd_bwd), "forward_backward_samples_s": fwd_bwd,
                        "warmup_4096_s": warmup[name]}
    result["peak_rss_gib"] = machine.status_bytes("VmHWM") / 2**30
    return result


# ----------------------------------------------------------------------------------------------------- driver

def _child(args: list[str], limit_s: float, memory_gib: float) -> dict:
    """Run ``--point ...`` in a fresh process: its JSON, or {"status": ..., "error": why}."""
    return run_json([sys.executable, __file__, "--point", *args], limit_s, memory_gib=memory_gib)


def _not_run_reason(done: list[dict], impl: str, doc_set: str, n: int, limit_s: float) -> str | None:
    """Why a flex point is not worth running: a smaller size failed, or its N^2 growth passes the limit."""
    smaller = [r for r in done if r["impl"] == impl and r["set"] == doc_set and r["n"] < n]
    if not smaller:
        return None
    last = max(smaller, key=lambda r: r["n"])
    if "error" in last or "not_run" in last:
        return f"not run: already n/a at N={last['n']}"
    predicted = last["build_s"] * (n / last["n"]) ** 2
    if predicted > limit_s:
        return (f"not run: {last['build_s']:.1f} s at N={last['n']} grows as N^2 to about {predicted:.0f} s, "
                f"over the {limit_s:.0f} s limit")
    return None


def run_layouts(sizes, repeats, limit_s, memory_gib) -> list[dict]:
    rows = []
    for n in sizes:
        for doc_set in SETS:
            documents = len(document_lengths(doc_set, n))
            for impl in LAYOUT_IMPLS:
                row = {"impl": impl, "set": doc_set, "n": n, "documents": documents}
                reason = _not_run_reason(rows, impl, doc_set, n, limit_s) if impl.startswith("flex") else None
                if reason:
                    row["not_run"] = reason
                else:
                    point = ["layout", doc_set, str(n), str(repeats)] if impl == "sparse_attn" else \
                            ["flex", doc_set, str(n), str(impl == "flex-compiled")]
                    row |= _child(point, limit_s, memory_gib)
                rows.append(row)
                print(f"layout {impl:>13} {doc_set:>11} N={n:>8}: "
                      + (f"{row['build_s'] * 1e3:10.1f} ms, RSS +{row['rss_delta_mb']:.0f} MB" if "build_s" in row
                         else row.get("error") or row["not_run"]), flush=True)
    return rows


def run_attention(sizes, repeats, limit_s, memory_gib) -> list[dict]:
    rows = []
    for n in sizes:
        for doc_set in SETS:
            row = {"set": doc_set, "n": n}
            row |= _child(["attention", doc_set, str(n), str(repeats)], limit_s, memory_gib)
            rows.append(row)
            print(f"attention {doc_set:>11} N={n:>8}: "
                  + (row["error"] if "error" in row else
                     "  ".join(f"{name} fwd {row[name]['forward_s'] * 1e3:.0f} ms fwd+bwd "
                               f"{row[name]['forward_backward_s'] * 1e3:.0f} ms"
                               for name in ("packed", "padded") if name in row)), flush=True)
    return rows


def _ms(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:,.1f}"


def _reason(row: dict) -> str:
    """Why a point is n/a, with an allocator's failure shortened to the size it asked for."""
    reason = row.get("error") or row["not_run"]
    asked = re.search(r"allocate (\d+) bytes", reason)
    return f"{reason.split(':')[0]}: asked for {int(asked[1]) / 2**30:g} GiB at once" if asked else reason


def _layout_cell(row: dict) -> str:
    return _ms(row["build_s"]) if "build_s" in row else f"n/a ({_reason(row)})"


def _target_lines(record: dict) -> list[str]:
    layouts = {(r["impl"], r["set"], r["n"]): r for r in record["layouts"]}
    lines = []
    point = layouts.get(("sparse_attn", "16-token", 1_048_576))
    if point and "build_s" in point:
        met = point["build_s"] < 1 and point["rss_delta_mb"] < 300
        lines.append(f"- 1M tokens in {point['documents']:,} documents: layout built in {point['build_s']:.2f} s "
                     f"(target < 1 s) with {point['rss_delta_mb']:.0f} MB RSS delta and "
                     f"{point['traced_peak_mb']:.0f} MB traced peak (target < 300 MB): "
                     f"**{'met' if met else 'missed'}**")
    else:
        lines.append("- 1M tokens in 65,536 documents: not measured in this run")
    for doc_set in SETS:
        ours = layouts.get(("sparse_attn", doc_set, 262_144))
        flex = layouts.get(("flex-compiled", doc_set, 262_144))
        if not ours or "build_s" not in ours or not flex:
            lines.append(f"- 256K tokens, {doc_set}: not measured in this run")
        elif "build_s" in flex:
            ratio = flex["build_s"] / ours["build_s"]
            lines.append(f"- 256K tokens, {doc_set}: layout {ratio:,.0f}x faster than FlexAttention's compiled "
                         f"create_block_mask ({_ms(ours['build_s'])} ms vs {_ms(flex['build_s'])} ms, its second "
                         f"call; target >= 10x): **{'met' if ratio >= 10 else 'missed'}**")
        else:
            lines.append(f"- 256K tokens, {doc_set}: FlexAttention's compiled create_block_mask n/a "
                         f"({_reason(flex)}: its first call, compilation included, and "
                         f"its second call); sparse_attn {_ms(ours['build_s'])} ms: no ratio measured for this set")
    for row in record["attention"]:
        if row["set"] != "long-tailed" or "packed" not in row or "padded" not in row:
            continue
        for key, what in (("forward_s", "forward"), ("forward_backward_s", "forward+backward")):
            packed, padded = row["packed"][key], row["padded"][key]
            if packed is None or padded is None:
                continue
            ratio = padded / packed
            lines.append(f"- N={row['n']:,} long-tailed, {what}: packed {ratio:.2f}x faster than padded "
                         f"({_ms(packed)} ms vs {_ms(padded)} ms; target >= 1.5x): "
                         f"**{'met' if ratio >= 1.5 else 'missed'}**")
    misses = [row for row in record["attention"] if "padded" in row
              and row["padded"]["forward_s"] < 1.5 * row["packed"]["forward_s"]]
    for row in misses[:1]:
        padded, packed = row["padded"], row["packed"]
        lines.append(f"- Where the padded time goes (N={row['n']:,}): the padded batch holds "
                     f"{padded['padded_tokens'] / row['n']:.1f}x the tokens but computes only "
                     f"{padded['nnz_blocks'] / packed['nnz_blocks']:.2f}x the blocks: its layout (key_padding_mask) "
                     f"drops every block whose keys are all padding, so padding only adds the blocks of padding rows "
                     f"that still see a document's first token or last 256 tokens. The time per block is "
                     f"{padded['forward_s'] / padded['nnz_blocks'] * 1e6:.1f} us padded vs "
                     f"{packed['forward_s'] / packed['nnz_blocks'] * 1e6:.1f} us packed (forward): packing saves "
                     f"memory and those blocks, not the bulk of the compute")
    return lines


def _agreement(layouts: list[dict]) -> str:
    """Whether sparse_attn and FlexAttention computed the same number of blocks wherever both ran."""
    ours = {(r["set"], r["n"]): r["nnz_blocks"] for r in layouts if r["impl"] == "sparse_attn" and "nnz_blocks" in r}
    pairs = [(r, ours[(r["set"], r["n"])]) for r in layouts
             if r["impl"] != "sparse_attn" and "nnz_blocks" in r and (r["set"], r["n"]) in ours]
    differ = [f"{r['impl']} {r['set']} N={r['n']}: {r['nnz_blocks']} vs {nnz}" for r, nnz in pairs
              if r["nnz_blocks"] != nnz]
    if not pairs:
        return "FlexAttention ran at no point, so its block counts were not compared."
    if differ:
        return "Block counts DIFFER between FlexAttention's block mask and the layout: " + "; ".join(differ)
    return (f"Same semantics: at all {len(pairs)} points where FlexAttention ran, its block mask has exactly the "
            f"layout's number of computed blocks.")


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        "# Packed documents: layout build and attention", "",
        f"`{record['command']}`", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, numba {m['numba']}; load average "
        f"{m['loadavg_before']} before, {m['loadavg_after']} after (the machine is shared: compare within "
        f"this run).", "",
        f"Pattern `{PATTERN_NAME}` per document, block {BLOCK}. Documents: long-tailed = lognormal lengths "
        f"(mean {MEAN_LENGTH}, sigma {SIGMA}, seed {SEED}); 16-token = N / 16 documents of 16 tokens. Every "
        f"point in a fresh process, limit {record['limit_s']:.0f} s and {record['memory_gib']:g} GiB of "
        f"address space.", "",
        "## Layout build (heads=1)", "",
        f"sparse_attn: `build_layout(..., documents=..., cache=False)`, median of {record['repeats']} builds; "
        f"RSS delta = growth of the resident set's high-water mark during a build (peak memory); traced = "
        f"tracemalloc's peak (numpy and Python). FlexAttention: `create_block_mask` with a document mask_mod, "
        f"second call (first call, compilation included, in brackets).", "",
        "| set | N | documents | sparse_attn ms | RSS delta MB | traced MB | flex compiled ms | flex eager ms "
        "| flex compiled / sparse_attn |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    layouts = {(r["impl"], r["set"], r["n"]): r for r in record["layouts"]}
    for doc_set in SETS:
        for n in record["sizes"]:
            ours = layouts.get(("sparse_attn", doc_set, n))
            if ours is None:
                continue
            cells = []
            for impl in ("flex-compiled", "flex-eager"):
                flex = layouts[(impl, doc_set, n)]
                cells.append(_layout_cell(flex) + (f" ({_ms(flex['first_call_s'])})" if "build_s" in flex else ""))
            flex = layouts[("flex-compiled", doc_set, n)]
            ratio = f"{flex['build_s'] / ours['build_s']:,.0f}x" if "build_s" in flex and "build_s" in ours else ""
            memory = (f"{ours['rss_delta_mb']:.0f} | {ours['traced_peak_mb']:.0f}" if "build_s" in ours else " | ")
            lines.append(f"| {doc_set} | {n:,} | {ours['documents']:,} | {_layout_cell(ours)} | {memory} | "
                         f"{cells[0]} | {cells[1]} | {ratio} |")
    lines += ["", _agreement(record["layouts"]), "", "## Attention (numba)", "",
              f"H={HEADS}, D={DIM}, float32, layouts prebuilt; median of up to {record['repeats']} interleaved "
              f"repeats. Packed = one row with `documents=`; padded = B documents x the longest, "
              f"`key_padding_mask` (micro-batches of documents where one batch would exceed "
              f"{PADDED_BUDGET_BYTES / 2**30:g} GiB, times summed).", "",
              "| set | N | variant | batch x length | micro-batches | computed blocks | forward ms | fwd+bwd ms "
              "| padded / packed (fwd, fwd+bwd) |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in record["attention"]:
        if "error" in row:
            lines.append(f"| {row['set']} | {row['n']:,} | n/a ({row['error']}) | | | | | | |")
            continue
        for name in ("packed", "padded"):
            if name not in row:
                continue
            r = row[name]
            ratio = ""
            if name == "padded":
                ratio = ", ".join(f"{r[key] / row['packed'][key]:.2f}x" for key in ("forward_s", "forward_backward_s"))
            lines.append(f"| {row['set']} | {row['n']:,} | {name} | {r['batch']} x {r['n']:,} | {r['micro_batches']} "
                         f"| {r['nnz_blocks']:,} | {_ms(r['forward_s'])} | {_ms(r['forward_backward_s'])} | {ratio} |")
    lines += ["", "## Targets", "", *_target_lines(record)]
    return "\n".join(lines) + "\n"


def figure(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SETS), figsize=(10, 4), sharey=True)
    for ax, doc_set in zip(axes, SETS):
        for impl, style in zip(LAYOUT_IMPLS, ("o-", "s--", "^:")):
            points = [(r["n"], r["build_s"]) for r in record["layouts"]
                      if r["impl"] == impl and r["set"] == doc_set and "build_s" in r]
            if points:
                ax.plot(*zip(*points), style, label=impl)
        ax.set(xscale="log", yscale="log", title=f"{doc_set} documents", xlabel="tokens in the packed row")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("layout / block mask build (s)")
    axes[0].legend()
    fig.suptitle(f"{PATTERN_NAME} per document, block {BLOCK}: build time (missing points: n/a, see documents.md)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



def run_point(argv: list[str]) -> dict:
    kind, doc_set, n, extra = argv[0], argv[1], int(argv[2]), argv[3:]
    if kind == "layout":
        return layout_point(doc_set, n, int(extra[0]))
    if kind == "flex":
        return flex_point(doc_set, n, extra[0] == "True")
    return attention_point(doc_set, n, int(extra[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N=16384 only, 2 repeats (a smoke test)")
    parser.add_argument("--n", type=int, nargs="+", default=[65_536, 262_144, 1_048_576])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=float, default=150.0, help="seconds per point (default 150)")
    parser.add_argument("--memory-gib", type=float, default=12.0, help="address space per point (default 12)")
    parser.add_argument("--attention-max", type=int, default=262_144, help="largest N of the attention timings")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--point", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        print(json.dumps(run_point(args.point)))
        return
    sizes, repeats = ([16_384], 2) if args.quick else (sorted(args.n), args.repeats)
    where = header(("torch", "numba"))
    started = time.perf_counter()
    layouts = run_layouts(sizes, repeats, args.limit, args.memory_gib)
    attention = run_attention([n for n in sizes if n <= args.attention_max], repeats, 2 * args.limit,
                              args.memory_gib)
    where["loadavg_after"] = machine.load_average()
    record = {"command": " ".join(["python benchmarks/documents.py", *sys.argv[1:]]), "machine": where,
              "pattern": PATTERN_NAME, "block_size": BLOCK, "heads": HEADS, "head_dim": DIM, "dtype": "float32",
              "sizes": sizes, "repeats": repeats, "limit_s": args.limit, "memory_gib": args.memory_gib,
              "wall_s": time.perf_counter() - started, "layouts": layouts, "attention": attention}
    print(write_results(args.out, "documents", record, markdown, {"documents.png": figure}))


if __name__ == "__main__":
    main()
