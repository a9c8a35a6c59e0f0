"""Before/after on one machine: FlexAttention with the old table-lookup mask_mod against the pattern's predicate.

    python benchmarks/results/flex_lookup_ab/flex_lookup_ab.py [--n 4096 16384] [--repeats 3]

Issue 22: until commit 698ca4c, ``BlockLayout.to_block_mask()`` gave FlexAttention a ``mask_mod`` that
looked every pair up in a two-level tile table (``tiles[tile_of_block[b, h, q // T, kv // T], q % T,
kv % T]``); now it gives the pattern's own predicate (``pattern.mask_mod``). ``benchmarks/cpu_kernels.py``
runs only the predicate (what Flex users write). This script times both mask_mods on the same block
lists, with numba as the yardstick, in one process, interleaved (repeat r runs every variant once
before repeat r+1), so that the old committed ratios (another machine) can be compared with the new
ones on this one. It is not a headline: the lookup is what no Flex user runs.

Same set-up as cpu_kernels.py: B=1, H=8, D=64, ``Local(256) | Global(first=16)``, compiled
``flex_attention`` (forward only), blocks 64 and 128, float32 and bfloat16. Writes
``flex_lookup_ab.json`` and ``flex_lookup_ab.md`` beside itself.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import sparse_attn as sa
from sparse_attn import machine
from sparse_attn.api import sparse_attention
from sparse_attn.backends.numba import bf16 as numba_bf16

BATCH, HEADS, DIM = 1, 8, 64
PATTERN = sa.Local(256) | sa.Global(first=16)
HERE = Path(__file__).parent


def lookup_block_mask(layout) -> BlockMask:
    """The BlockMask to_block_mask() returned before 698ca4c: the layout's block lists (the same as
    now) and the old mask_mod, a per-pair lookup in a (Bl, Hl, n_q_blocks, n_k_blocks) tile table
    (copied from sparse_attn/layout.py at 698ca4c^)."""
    new = layout.to_block_mask()
    bl, hl = layout.full_ptr.shape[:2]
    n_qb, n_kb, (tq, tk) = layout.n_q_blocks, layout.n_k_blocks, layout.tile_shape
    n_masks = layout.masks.shape[0]
    tiles_ext = torch.cat([layout.masks, torch.ones(1, tq, tk, dtype=torch.bool),
                           torch.zeros(1, tq, tk, dtype=torch.bool)])
    tile_of_block = torch.full((bl, hl, n_qb, n_kb), n_masks + 1, dtype=torch.int64)
    for ptr, idx, tiles in ((layout.part_ptr, layout.part_idx, layout.part_mask),
                            (layout.full_ptr, layout.full_idx, None)):
        counts = ptr[..., 1:] - ptr[..., :-1]
        for b in range(bl):
            for h in range(hl):
                p = ptr[b, h].long()
                rows = torch.repeat_interleave(torch.arange(n_qb), counts[b, h].long())
                cols = idx[p[0]:p[-1]].long()
                tile_of_block[b, h, rows, cols] = n_masks if tiles is None else tiles[p[0]:p[-1]].long()

    def mask_mod(b, h, q_idx, kv_idx):
        return tiles_ext[tile_of_block[b % bl, h % hl, q_idx // tq, kv_idx // tk], q_idx % tq, kv_idx % tk]

    return BlockMask.from_kv_blocks(new.kv_num_blocks, new.kv_indices, new.full_kv_num_blocks, new.full_kv_indices,
                                    BLOCK_SIZE=layout.block_size, mask_mod=mask_mod,
                                    seq_lengths=(layout.n_q, layout.n_k))


def runners(n: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, n, DIM, generator=gen).to(dtype) for _ in range(3))
    layout64 = PATTERN.layout(n, n, heads=HEADS, block_size=64)
    out = {"numba": lambda: sparse_attention(q, k, v, layout64, backend="numba")}
    torch._dynamo.config.recompile_limit = 64
    for block in (64, 128):
        layout = PATTERN.layout(n, n, heads=HEADS, block_size=block)
        for kind, mask in (("predicate", layout.to_block_mask()), ("lookup", lookup_block_mask(layout))):
            compiled = torch.compile(flex_attention, dynamic=False)
            out[f"flex-{block}-{kind}"] = (lambda c=compiled, m=mask: c(q, k, v, block_mask=m))
    reference = sparse_attention(q.double(), k.double(), v.double(), layout64, backend="numba")
    with torch.no_grad():                    # warm-up (compiles) and a correctness check, in the timed grad mode
        for name, fn in out.items():
            err = (fn().double() - reference).abs().max().item()
            assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), (name, err)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    meta = {"cpu": machine.cpu_model(), "cores": machine.cpus(), **machine.versions(("torch", "numba")),
            "torch_threads": torch.get_num_threads(), "numba_bf16": numba_bf16.native()[1],
            "loadavg_before": machine.load_average(), "command": "python " + " ".join(sys.argv),
            "repeats": args.repeats, "loadavg_by_point": {}}
    rows = []
    for n in args.n:
        for dtype in (torch.float32, torch.bfloat16):
            meta["loadavg_by_point"][f"{n} {dtype}"] = machine.load_average()
            fns = runners(n, dtype)
            samples = {name: [] for name in fns}
            with torch.no_grad():
                for _ in range(args.repeats):
                    for name, fn in fns.items():
                        start = time.perf_counter()
                        fn()
                        samples[name].append(time.perf_counter() - start)
            for name, s in samples.items():
                rows.append({"n": n, "dtype": str(dtype).removeprefix("torch."), "impl": name,
                             "forward_s": statistics.median(s), "samples_s": s})
                print(f"N={n} {rows[-1]['dtype']:>8} {name:>20}: {rows[-1]['forward_s'] * 1e3:9.1f} ms", flush=True)
    meta["loadavg_after"] = machine.load_average()
    (HERE / "flex_lookup_ab.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    at = {(r["n"], r["dtype"], r["impl"]): r["forward_s"] for r in rows}
    lines = ["# FlexAttention on CPU: the old table-lookup mask_mod vs the pattern's predicate, one machine", "",
             f"`{meta['command']}`", "",
             f"Machine: {meta['cpu']}, {meta['cores']} cores, torch {meta['torch']} ({meta['torch_threads']} threads), "
             f"numba {meta['numba']}; numba bf16: {meta['numba_bf16']}. Load average {meta['loadavg_before']} before, "
             f"{meta['loadavg_after']} after; per point: "
             + ", ".join(f"{k}: {v}" for k, v in meta["loadavg_by_point"].items()) + ".", "",
             f"B={BATCH}, H={HEADS}, D={DIM}, `Local(256) | Global(first=16)`, compiled flex_attention forward on "
             f"the same block lists; median of {args.repeats} interleaved repeats. Ratio = Flex time / numba time "
             "(above 1: numba faster). The lookup is what the benchmarks ran before commit 698ca4c; no Flex user "
             "writes it, so no headline uses it.", "",
             "| N | dtype | numba ms | flex-64 lookup ms (ratio) | flex-64 predicate ms (ratio) | "
             "flex-128 lookup ms (ratio) | flex-128 predicate ms (ratio) |", "|---:|---|---:|---:|---:|---:|---:|"]
    for n in args.n:
        for dtype in ("float32", "bfloat16"):
            base = at[(n, dtype, "numba")]
            cells = [f"{at[(n, dtype, f'flex-{b}-{k}')] * 1e3:.1f} ({at[(n, dtype, f'flex-{b}-{k}')] / base:.2f}x)"
                     for b in (64, 128) for k in ("lookup", "predicate")]
            lines.append(f"| {n} | {dtype} | {base * 1e3:.1f} | " + " | ".join(cells) + " |")
    (HERE / "flex_lookup_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
