"""Context parallelism: bytes each rank moves per layer with sparse_attn.distributed, against ring attention.

    python benchmarks/context_parallel.py [--quick] [--n 64K 128K 256K 512K 1M] [--ranks 2 4 8 16 32 64]
                                          [--measured-n 16K 64K] [--measured-ranks 2 4] [--repeats 3]
                                          [--limit 900] [--out benchmarks/results]

Patterns (block size 64): Longformer ``Local(256) | Global(first=16)``, BigBird-ITC
(``sa.preset("bigbird-itc")``: 3 window blocks, the first and last block global, 3 random blocks per
block row, drawn per head) and the causal sliding window ``Local(1023, 0) & Causal()``. The sequence
of N tokens is split into W equal contiguous shards, one per rank.

**Computed** (B=1, H=16 query and key/value heads, D=64, bf16: 2 bytes per element, partial results of
shipped rows in float32): ``ShardPlan.build(layout, shards, kv_heads=16, itemsize=2).bytes_per_rank(64, 2)``
gives the bytes each rank sends and receives in one call (one layer), forward and backward; the table
reports the largest and the mean over ranks, and the load balance max/mean of ``plan.work`` (the blocks
each rank's kernels compute). Ring attention's bytes for the same N and W, per rank (every rank sends and
receives the same; S = N/W * Hkv * 2D * itemsize, one shard's keys and values):

- forward: the K, V of every other shard visit once: (W - 1) * S;
- backward: K, V go around the ring again (W - 1) * S, and the gradient accumulators dK, dV travel with
  them and take one more hop home, W * S: (2W - 1) * S in all.

**Measured** with gloo on this machine (B=1, H=4, D=64, float32, W processes started with
torch.multiprocessing, one thread each): in every worker, ``torch.distributed.all_to_all_single``,
``all_gather``, ``isend`` and ``irecv`` are wrapped to add up the bytes each rank hands to gloo for
the other ranks (an all_to_all's own chunk is a local copy and not counted), per call of
``sparse_attn.distributed.sparse_attention`` (forward, and the backward of its output separately), and
the same for a minimal ring attention (``ring_attention`` below: K and V passed around the ring with
isend/irecv, W - 1 steps, each attending the visiting shard; its backward passes K, V and dK, dV as in
the model above). The measured bytes are compared with ``ShardPlan.bytes_per_rank`` (itemsize 4) and with
the ring model, rank by rank. Wall time per call: the slowest rank, median over ``--repeats`` calls.
The ring computes the same pattern (each step's blocks are the layout's blocks of its rows and the
visiting shard), so its outputs and gradients are checked against sparse_attn's.

Writes ``context_parallel.json``, ``context_parallel.md`` and ``context_parallel.png`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparse_attn as sa
from sparse_attn import machine
from sparse_attn.bench.results import header, write_results
from sparse_attn.distributed import combine_partials, sparse_attention
from sparse_attn.shard_plan import ShardPlan

from decode import short, token_count            # benchmarks/decode.py (this script's folder is on sys.path)

PATTERNS = {"Longformer": sa.Local(256) | sa.Global(first=16),
            "BigBird-ITC": sa.preset("bigbird-itc"),
            "causal sliding window": sa.Local(1023, 0) & sa.Causal()}
PATTERN_SPECS = {"Longformer": "Local(256) | Global(first=16)", "BigBird-ITC": 'sa.preset("bigbird-itc")',
                 "causal sliding window": "Local(1023, 0) & Causal()"}
BLOCK = 64
HEADS, DIM, ITEMSIZE = 16, 64, 2                     # computed: bf16
MEASURED_HEADS, MEASURED_ITEMSIZE = 4, 4             # measured: float32, D = DIM
SIZES = (65_536, 131_072, 262_144, 524_288, 1_048_576)
RANKS = (2, 4, 8, 16, 32, 64)
MEASURED_SIZES, MEASURED_RANKS = (16_384, 65_536), (2, 4)
DIRECTIONS = ("forward_sent", "forward_received", "backward_sent", "backward_received")
FIGURE_RANKS, FIGURE_N = 8, 1_048_576


def ring_bytes(n: int, world: int, kv_heads: int, head_dim: int, itemsize: int) -> dict[str, int]:
    """Ring attention's bytes per rank for one call (every rank the same; the model in the module docstring).

    >>> ring_bytes(1024, 4, kv_heads=1, head_dim=8, itemsize=4)     # S = 256 * 1 * 16 * 4 = 16 KiB
    {'forward_sent': 49152, 'forward_received': 49152, 'backward_sent': 114688, 'backward_received': 114688}
    """
    shard = n // world * kv_heads * 2 * head_dim * itemsize                        # one shard's K and V
    forward, backward = (world - 1) * shard, (2 * world - 1) * shard
    return {"forward_sent": forward, "forward_received": forward, "backward_sent": backward,
            "backward_received": backward}


def equal_shards(n: int, world: int) -> list[int]:
    """``n`` tokens in ``world`` contiguous shards as equal as can be (the first ones one longer).

    >>> equal_shards(10, 4)
    [3, 3, 2, 2]
    """
    return [n // world + (r < n % world) for r in range(world)]


# ---------------------------------------------------------------------------------------------- computed

def computed_point(plan: ShardPlan, n: int, world: int) -> dict:
    """Bytes per rank (max and mean over ranks) of a plan, its load balance and ring attention's bytes."""
    traffic = plan.bytes_per_rank(DIM, ITEMSIZE)
    row = {"n": n, "ranks": world,
           "max": {d: int(traffic[d].max()) for d in DIRECTIONS},
           "mean": {d: float(traffic[d].mean()) for d in DIRECTIONS},
           "total_max": int(sum(traffic[d] for d in DIRECTIONS).max()),
           "total_mean": float(sum(traffic[d] for d in DIRECTIONS).mean()),
           "work_max_over_mean": float(plan.work.max() / plan.work.mean()),
           "shipped_rows": int(plan.shipped_rows.sum()),
           "ring": ring_bytes(n, world, HEADS, DIM, ITEMSIZE)}
    row["ring_total"] = sum(row["ring"].values())
    return row


def run_computed(sizes, worlds) -> dict[str, list[dict]]:
    out = {}
    for name, pattern in PATTERNS.items():
        rows = out[name] = []
        for n in sizes:
            layout = pattern.layout(n, heads=HEADS, block_size=BLOCK)
            for world in worlds:
                started = time.perf_counter()
                plan = ShardPlan.build(layout, equal_shards(n, world), kv_heads=HEADS, itemsize=ITEMSIZE)
                row = computed_point(plan, n, world) | {"plan_s": time.perf_counter() - started}
                rows.append(row)
                print(f"{name:>22} N={short(n):>5} W={world:>2}: max/rank {_mib(row['total_max'])} MiB "
                      f"(ring {_mib(row['ring_total'])} MiB), work max/mean {row['work_max_over_mean']:.3f}, "
                      f"plan {row['plan_s']:.1f} s", flush=True)
            del layout
    return out


# ---------------------------------------------------------------------------------------------- measured

class Traffic:
    """Bytes this rank hands to gloo for the other ranks, by wrapping torch.distributed's collectives and
    point-to-point calls (``start`` / ``stop`` bracket what is counted)."""

    WRAPPED = ("all_to_all_single", "all_gather", "isend", "irecv")

    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.counting = False
        self.reset()
        for name in self.WRAPPED:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def reset(self):
        self.sent = {"exchange": 0, "handshake": 0}
        self.received = {"exchange": 0, "handshake": 0}

    def _wrap(self, name: str, original):
        def wrapped(*args, **kwargs):
            if self.counting:
                getattr(self, "_" + name)(*args, **kwargs)
            return original(*args, **kwargs)
        return wrapped

    def _all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, **_):
        out_splits = output_split_sizes or [output.shape[0] // self.world] * self.world
        in_splits = input_split_sizes or [input.shape[0] // self.world] * self.world
        self.sent["exchange"] += (sum(in_splits) - in_splits[self.rank]) * _row_bytes(input)
        self.received["exchange"] += (sum(out_splits) - out_splits[self.rank]) * _row_bytes(output)

    def _all_gather(self, tensor_list, tensor, **_):
        self.sent["handshake"] += (self.world - 1) * tensor.numel() * tensor.element_size()
        self.received["handshake"] += sum(t.numel() * t.element_size() for r, t in enumerate(tensor_list) if r != self.rank)

    def _isend(self, tensor, dst=None, **_):
        self.sent["exchange"] += tensor.numel() * tensor.element_size()

    def _irecv(self, tensor, src=None, **_):
        self.received["exchange"] += tensor.numel() * tensor.element_size()

    def take(self) -> dict:
        taken = {"sent": self.sent["exchange"], "received": self.received["exchange"],
                 "handshake_sent": self.sent["handshake"], "handshake_received": self.received["handshake"]}
        self.reset()
        return taken


def _row_bytes(x: torch.Tensor) -> int:
    """Bytes of one row (along the first dimension) of ``x``, also when it has no rows."""
    return int(np.prod(x.shape[1:], dtype=np.int64)) * x.element_size()


class RingAttention(torch.autograd.Function):
    """Minimal ring attention of this rank's rows: (q, k, v) shards (B, H, n_rank, D) -> out (B, H, n_rank, D).

    Forward: W steps; at step s the rank holds the K, V of rank (rank - s) mod W, attends them (its
    ``step_layouts[source]``: the whole sequence's layout cut to this rank's rows and that shard's keys, over
    tensors of the whole sequence's length with only those rows and keys filled) and passes them on to
    rank + 1 (W - 1 passes); the partial results are combined by log-sum-exp. Backward: K, V go around again,
    each step adds this rank's dQ and the visiting shard's dK, dV (which travel with it); after the last
    step the dK, dV go home (one more pass)."""

    @staticmethod
    def forward(ctx, q, k, v, step_layouts, starts, scale):
        rank, world = dist.get_rank(), dist.get_world_size()
        kv = torch.cat([k, v], dim=-1)                                                      # (B, H, n_rank, 2D)
        parts = []
        for s in range(world):
            source = (rank - s) % world
            parts.append(_ring_step(q, kv, step_layouts[source], starts, rank, source, scale))
            if s < world - 1:
                kv = _pass_on(kv, rank, world)
        out, lse = combine_partials(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.step_layouts, ctx.starts, ctx.scale = step_layouts, starts, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        rank, world = dist.get_rank(), dist.get_world_size()
        delta = (grad_out * out).sum(-1)                                                   # (B, H, n_rank)
        kv = torch.cat([k, v], dim=-1)
        grad_q, grad_kv = torch.zeros_like(q), torch.zeros_like(kv)
        for s in range(world):
            source = (rank - s) % world
            with torch.enable_grad():
                q_s, kv_s = q.detach().requires_grad_(), kv.detach().requires_grad_()
                out_s, lse_s = _ring_step(q_s, kv_s, ctx.step_layouts[source], ctx.starts, rank, source, ctx.scale)
                weight = torch.where(torch.isfinite(lse_s), torch.exp(lse_s - lse), 0.0)   # 0 where no key
                dq, dkv = torch.autograd.grad(
                    (out_s, lse_s), (q_s, kv_s),
                    (weight[..., None] * grad_out, weight * ((grad_out * out_s).sum(-1) - delta)))
            grad_q += dq
            grad_kv += dkv
            if s < world - 1:
                kv, grad_kv = _pass_on(kv, rank, world), _pass_on(grad_kv, rank, world)
        grad_kv = _pass_on(grad_kv, rank, world)                                           # home
        head_dim = q.shape[-1]
        return grad_q, grad_kv[..., :head_dim], grad_kv[..., head_dim:], None, None, None


def ring_attention(q, k, v, step_layouts, starts, scale):
    """This rank's rows of the pattern by ring attention (``RingAttention``)."""
    return RingAttention.apply(q, k, v, step_layouts, starts, scale)


def _ring_step(q, kv, layout, starts, rank: int, source: int, scale: float):
    """out (B, H, n_rank, D), lse (B, H, n_rank) of this rank's rows over ``source``'s keys."""
    n, head_dim = int(starts[-1]), q.shape[-1]
    q_full = torch.nn.functional.pad(q, (0, 0, int(starts[rank]), n - int(starts[rank + 1])))            # (B, H, N, D)
    kv_full = torch.nn.functional.pad(kv, (0, 0, int(starts[source]), n - int(starts[source + 1])))     # (B, H, N, 2D)
    out, lse = sa.sparse_attention(q_full, kv_full[..., :head_dim], kv_full[..., head_dim:], layout, scale=scale,
                                   backend="numba", return_lse=True)
    rows = slice(int(starts[rank]), int(starts[rank + 1]))
    return out[:, :, rows], lse[:, :, rows]


def _pass_on(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Send ``x`` to rank + 1 and receive the same shape from rank - 1 (a ring)."""
    received = torch.empty_like(x)
    requests = [dist.isend(x.contiguous(), (rank + 1) % world), dist.irecv(received, (rank - 1) % world)]
    for request in requests:
        request.wait()
    return received


def step_layouts(pattern, n: int, starts, rank: int, heads: int) -> list:
    """For each source rank p: the layout of ``pattern`` over the whole sequence cut to this rank's rows and
    p's keys (``pattern & Blocks``; the shard bounds must be multiples of the block size)."""
    n_blocks = n // BLOCK
    layouts = []
    for source in range(len(starts) - 1):
        grid = np.zeros((n_blocks, n_blocks), dtype=bool)
        grid[starts[rank] // BLOCK:starts[rank + 1] // BLOCK, starts[source] // BLOCK:starts[source + 1] // BLOCK] = True
        layouts.append((pattern & sa.Blocks(grid, BLOCK)).layout(n, heads=heads, block_size=BLOCK))
    return layouts


def _inputs(n: int, rank: int, starts):
    """This rank's shard of seeded q, k, v and output gradient of the whole sequence, (1, H, n_rank, D) each."""
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, MEASURED_HEADS, n, DIM, generator=gen) for _ in range(4)]
    return [x[:, :, int(starts[rank]):int(starts[rank + 1])].clone() for x in full]


def _timed_calls(attend, q, k, v, grad, traffic: Traffic, repeats: int) -> dict:
    """``repeats`` forward and backward calls of ``attend``: bytes of the first, times of each, the results."""
    times = {"forward_s": [], "backward_s": []}
    bytes_ = {}
    for r in range(repeats):
        q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
        dist.barrier()
        traffic.counting, started = True, time.perf_counter()
        out = attend(q_, k_, v_)
        times["forward_s"].append(time.perf_counter() - started)
        traffic.counting = False
        forward = traffic.take()
        dist.barrier()
        traffic.counting, started = True, time.perf_counter()
        out.backward(grad)
        times["backward_s"].append(time.perf_counter() - started)
        traffic.counting = False
        backward = traffic.take()
        if r == 0:
            bytes_ = {"forward": forward, "backward": backward}
    return {"bytes": bytes_, **times, "result": (out.detach(), q_.grad, k_.grad, v_.grad)}


def measured_worker(rank: int, world: int, port: int, name: str, n: int, repeats: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        pattern = PATTERNS[name]
        starts = np.concatenate([[0], np.cumsum(equal_shards(n, world))])
        q, k, v, grad = _inputs(n, rank, starts)
        scale = DIM ** -0.5
        traffic = Traffic()
        warm = [x[:, :, :BLOCK].clone().requires_grad_() for x in (q, k, v)]     # numba compilation, not counted
        sparse_attention(*warm, pattern, backend="numba").sum().backward()
        layouts = step_layouts(pattern, n, starts, rank, MEASURED_HEADS)
        sparse = _timed_calls(lambda a, b, c: sparse_attention(a, b, c, pattern, backend="numba"),
                              q, k, v, grad, traffic, repeats)
        ring = _timed_calls(lambda a, b, c: ring_attention(a, b, c, layouts, starts, scale),
                            q, k, v, grad, traffic, repeats)
        differences = [float((a - b).abs().max()) for a, b in zip(sparse.pop("result"), ring.pop("result"))]
        result = {"rank": rank, "sparse": sparse, "ring": ring, "ring_vs_sparse_max_abs": differences}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measured_point(name: str, n: int, world: int, repeats: int, limit_s: float) -> dict:
    """Run W gloo workers; per rank bytes (sparse_attn and ring), the plan's and the ring model's, the times."""
    if n % (world * BLOCK):
        return {"name": name, "n": n, "ranks": world, "error": f"N must be a multiple of {world * BLOCK}"}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        context = mp.start_processes(measured_worker, args=(world, _free_port(), name, n, repeats, tmp),
                                     nprocs=world, join=False, start_method="spawn")
        try:
            while not context.join(timeout=5):
                if time.perf_counter() - started > limit_s:
                    raise TimeoutError(f"did not finish within the {limit_s:.0f} s limit")
        except Exception as error:                                                 # a worker failed or hung
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            return {"name": name, "n": n, "ranks": world, "error": str(error).strip().splitlines()[-1][:300]}
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    layout = PATTERNS[name].layout(n, heads=MEASURED_HEADS, block_size=BLOCK)
    plan = ShardPlan.build(layout, equal_shards(n, world), kv_heads=MEASURED_HEADS, itemsize=MEASURED_ITEMSIZE)
    planned = plan.bytes_per_rank(DIM, MEASURED_ITEMSIZE)
    ring_model = ring_bytes(n, world, MEASURED_HEADS, DIM, MEASURED_ITEMSIZE)
    row = {"name": name, "n": n, "ranks": world, "wall_s": time.perf_counter() - started,
           "ring_vs_sparse_max_abs": np.max([r["ring_vs_sparse_max_abs"] for r in ranks], axis=0).tolist()}
    for impl, expected in (("sparse", {d: planned[d].tolist() for d in DIRECTIONS}),
                           ("ring", {d: [ring_model[d]] * world for d in DIRECTIONS})):
        got = {f"{phase}_{way}": [r[impl]["bytes"][phase][way] for r in ranks]
               for phase in ("forward", "backward") for way in ("sent", "received")}
        row[impl] = {"measured": got, "expected": expected, "agree": got == expected,
                     "handshake_sent": [r[impl]["bytes"]["forward"]["handshake_sent"] for r in ranks],
                     **{f"{phase}_samples_s": np.max([r[impl][f"{phase}_s"] for r in ranks], axis=0).tolist()
                        for phase in ("forward", "backward")}}
        row[impl] |= {f"{phase}_s": statistics.median(row[impl][f"{phase}_samples_s"]) for phase in ("forward", "backward")}
    return row


def run_measured(sizes, worlds, repeats: int, limit_s: float) -> list[dict]:
    rows = []
    for n in sizes:
        for world in worlds:
            for name in PATTERNS:
                row = measured_point(name, n, world, repeats, limit_s)
                rows.append(row)
                print(f"measured {name:>22} N={short(n):>4} W={world}: " + (row.get("error") or (
                    f"sparse fwd sent max {_mib(max(row['sparse']['measured']['forward_sent']))} MiB (plan agrees: "
                    f"{row['sparse']['agree']}), ring {_mib(max(row['ring']['measured']['forward_sent']))} MiB "
                    f"(model agrees: {row['ring']['agree']}); fwd+bwd {_seconds(row['sparse'])} s vs "
                    f"{_seconds(row['ring'])} s; ring vs sparse max |diff| {max(row['ring_vs_sparse_max_abs']):.1e}")),
                      flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- results

def _mib(nbytes) -> str:
    return f"{nbytes / 2**20:,.2f}"


def _seconds(impl: dict) -> str:
    return f"{impl['forward_s'] + impl['backward_s']:.2f}"


def _handshake(measured: list[dict]) -> str:
    """The bytes of sparse_attn's all_gather each rank sent to each other rank, over the measured points."""
    sizes = {sent // (r["ranks"] - 1) for r in measured if "error" not in r for sent in r["sparse"]["handshake_sent"]}
    return " or ".join(map(str, sorted(sizes))) or "n/a"


def _ratio_line(rows: list[dict], world: int) -> tuple[float, int, int] | None:
    """Longformer's largest per-rank bytes (forward + backward, sent + received) over N at ``world`` ranks:
    (max/min, min, max), None without two sizes."""
    totals = [r["total_max"] for r in rows if r["ranks"] == world]
    return (max(totals) / min(totals), min(totals), max(totals)) if len(totals) > 1 else None


def target_lines(record: dict) -> list[str]:
    rows = record["computed"].get("Longformer", [])
    lines = []
    for world in record["ranks"]:
        spread = _ratio_line(rows, world)
        if spread:
            ratio, low, high = spread
            lines.append(f"- Longformer bytes per rank per layer, W={world}, N={short(min(record['sizes']))}.."
                         f"{short(max(record['sizes']))}: {_mib(low)}..{_mib(high)} MiB, max/min {ratio:.4f} "
                         f"(target <= 1.05): **{'met' if ratio <= 1.05 else 'missed'}**")
    at = {(r["n"], r["ranks"]): r for r in rows}.get((FIGURE_N, FIGURE_RANKS))
    if at:
        fraction = at["total_max"] / at["ring_total"]
        lines.append(f"- Longformer at {short(FIGURE_N)} over {FIGURE_RANKS} ranks: {_mib(at['total_max'])} MiB per rank "
                     f"per layer against ring attention's {_mib(at['ring_total'])} MiB = 1/{1 / fraction:,.0f} "
                     f"(target <= 1/20): **{'met' if fraction <= 1 / 20 else 'missed'}**")
    measured = [r for r in record["measured"] if "error" not in r]
    if measured:
        agree = all(r["sparse"]["agree"] for r in measured)
        lines.append(f"- Measured gloo bytes equal ShardPlan.bytes_per_rank, every rank and direction, in "
                     f"{sum(r['sparse']['agree'] for r in measured)} of {len(measured)} measured points: "
                     f"**{'yes' if agree else 'no'}**")
    return lines


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        "# Context parallelism: bytes per rank per layer", "",
        f"`{record['command']}`", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, numba {m['numba']}; load average "
        f"{m['loadavg_before']} before, {m['loadavg_after']} after (shared machine: the times are noisy, the bytes "
        f"are exact). Wall time {record['wall_s']:.0f} s.", "",
        "## Targets", "", *target_lines(record), "",
        "## Computed from the plan", "",
        f"B=1, H={HEADS} query and key/value heads, D={DIM}, bf16 (partial results of shipped rows in float32), "
        f"block size {BLOCK}, N split into W equal shards. Bytes from `ShardPlan.bytes_per_rank` for one call "
        "(one layer); **per rank** = the largest over ranks of sent + received, forward + backward, **mean rank** "
        "the mean over ranks of the same (max and mean of each direction are in the JSON). Ring attention, per rank: forward (W-1)·S sent and received, "
        "backward (2W-1)·S (K, V around again, dK, dV with them and one hop home), S = N/W · Hkv · 2D · 2 "
        "bytes; per rank = 2 · (3W-2) · S. **work** = max/mean over ranks of the blocks each rank computes.", "",
    ]
    for name, rows in record["computed"].items():
        lines += [f"### {name}: `{PATTERN_SPECS[name]}`", "",
                  "| N | W | fwd recv max MiB | fwd sent max MiB | bwd recv max MiB | bwd sent max MiB | per rank MiB | "
                  "mean rank MiB | ring per rank MiB | ring / sparse | shipped rows | work max/mean |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            mx = r["max"]
            lines.append(f"| {short(r['n'])} | {r['ranks']} | {_mib(mx['forward_received'])} | "
                         f"{_mib(mx['forward_sent'])} | {_mib(mx['backward_received'])} | {_mib(mx['backward_sent'])} | "
                         f"{_mib(r['total_max'])} | {_mib(r['total_mean'])} | {_mib(r['ring_total'])} | {r['ring_total'] / r['total_max']:,.1f} | "
                         f"{r['shipped_rows']} | {r['work_max_over_mean']:.3f} |")
        lines.append("")
    lines += [
        "## Measured with gloo", "",
        f"B=1, H={MEASURED_HEADS}, D={DIM}, float32, {record['repeats']} calls per implementation; W processes on "
        f"this {m['cores']}-core machine, one thread each. Bytes: what each rank handed to gloo for the other "
        "ranks during one call (`all_to_all_single` chunks for other ranks, `isend`/`irecv`), forward and the "
        "backward of its output separately; the largest over ranks is shown, every rank is compared. **plan** / "
        "**model**: whether every rank's four numbers equal `ShardPlan.bytes_per_rank` (sparse_attn) or the ring "
        "model above. Besides these, sparse_attn's forward does one `all_gather` (shard lengths and a digest of "
        f"the arguments): {_handshake(record['measured'])} bytes to each other rank, not in the plan. Time: forward + backward of the slowest rank, "
        "median over the calls. The ring attends the same pattern (max |ring - sparse_attn| over outputs and "
        "gradients in the last column), but this minimal ring runs each step's kernel over tensors of the whole "
        "sequence's length (only its rows and the visiting keys filled), work that grows with N at every step: "
        "its times are an upper bound for a ring attention, compare the bytes.", "",
        "| pattern | N | W | sparse fwd sent / recv MiB | bwd sent / recv MiB | = plan | ring fwd sent / recv MiB | "
        "bwd sent / recv MiB | = model | ring / sparse bytes | sparse s | ring s | max abs diff |",
        "|---|---:|---:|---:|---:|:---:|---:|---:|:---:|---:|---:|---:|---:|"]
    for r in record["measured"]:
        if "error" in r:
            lines.append(f"| {r['name']} | {short(r['n'])} | {r['ranks']} | n/a ({r['error']}) |" + " |" * 9)
            continue
        cells = []
        for impl in ("sparse", "ring"):
            got = r[impl]["measured"]
            cells += [f"{_mib(max(got['forward_sent']))} / {_mib(max(got['forward_received']))}",
                      f"{_mib(max(got['backward_sent']))} / {_mib(max(got['backward_received']))}",
                      "yes" if r[impl]["agree"] else "**no**"]
        total = {impl: max(sum(r[impl]["measured"][d][i] for d in DIRECTIONS) for i in range(r["ranks"]))
                 for impl in ("sparse", "ring")}
        lines.append(f"| {r['name']} | {short(r['n'])} | {r['ranks']} | " + " | ".join(cells) +
                     f" | {total['ring'] / total['sparse']:,.1f} | {_seconds(r['sparse'])} | {_seconds(r['ring'])} | "
                     f"{max(r['ring_vs_sparse_max_abs']):.1e} |")
    return "\n".join(lines) + "\n"


def figure(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ("o-", "s-", "^-")
    ring_by_n, ring_by_w = {}, {}
    for (name, rows), style in zip(record["computed"].items(), styles):
        by_n = [(r["n"], r["total_max"]) for r in rows if r["ranks"] == FIGURE_RANKS]
        by_w = [(r["ranks"], r["total_max"]) for r in rows if r["n"] == FIGURE_N]
        ring_by_n |= {r["n"]: r["ring_total"] for r in rows if r["ranks"] == FIGURE_RANKS}
        ring_by_w |= {r["ranks"]: r["ring_total"] for r in rows if r["n"] == FIGURE_N}
        for ax, points in ((axes[0], by_n), (axes[1], by_w)):
            if points:
                x, y = zip(*points)
                ax.plot(x, [b / 2**20 for b in y], style, label=name)
    for ax, ring in ((axes[0], ring_by_n), (axes[1], ring_by_w)):
        if ring:
            x = sorted(ring)
            ax.plot(x, [ring[i] / 2**20 for i in x], "k--", label="ring attention")
        ax.set(yscale="log", ylabel="MiB per rank per layer (fwd + bwd, sent + received)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set(xscale="log", xlabel="sequence length N", title=f"W = {FIGURE_RANKS} ranks")
    axes[0].set_xticks(record["sizes"], [short(n) for n in record["sizes"]])
    axes[1].set(xscale="log", xlabel="ranks W", title=f"N = {short(FIGURE_N)}")
    axes[1].set_xticks(record["ranks"], [str(w) for w in record["ranks"]])
    for ax in axes:
        ax.set_xticks([], minor=True)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"sparse_attn.distributed vs ring attention: B=1, H={HEADS}, D={DIM}, bf16 (from ShardPlan)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N=64K and 128K, W=2..8; measured 16K, W=2, 1 call")
    parser.add_argument("--n", type=token_count, nargs="+", default=list(SIZES), help="computed lengths (64K, 1M)")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS), help="computed rank counts")
    parser.add_argument("--measured-n", type=token_count, nargs="+", default=list(MEASURED_SIZES))
    parser.add_argument("--measured-ranks", type=int, nargs="+", default=list(MEASURED_RANKS))
    parser.add_argument("--repeats", type=int, default=3, help="measured calls per implementation")
    parser.add_argument("--limit", type=float, default=900.0, help="seconds per measured point (default 900)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.quick:
        args.n, args.ranks, args.measured_n, args.measured_ranks, args.repeats = [65_536, 131_072], [2, 4, 8], \
            [16_384], [2], 1
    os.environ["NUMBA_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"       # for the spawned workers
    where = header(("torch", "numba"))
    started = time.perf_counter()
    computed = run_computed(sorted(args.n), sorted(args.ranks))
    measured = run_measured(sorted(args.measured_n), sorted(args.measured_ranks), args.repeats, args.limit)
    where["loadavg_after"] = machine.load_average()
    record = {"command": " ".join(["python benchmarks/context_parallel.py", *sys.argv[1:]]), "machine": where,
              "sizes": sorted(args.n), "ranks": sorted(args.ranks), "repeats": args.repeats,
              "wall_s": time.perf_counter() - started, "computed": computed, "measured": measured}
    print(write_results(args.out, "context_parallel", record, markdown, {"context_parallel.png": figure}))


if __name__ == "__main__":
    main()
