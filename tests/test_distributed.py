"""sparse_attn.distributed against single-process ``sparse_attention``, and the ShardPlan it runs.

The distributed cases run on gloo ranks on this machine's CPU: ONE spawn of 4 processes (a process costs
seconds: torch, the reference backend's checkpoint and numba load) runs every case of CASES and the error
checks, for world size 2 on ranks 0 and 1, then for 4 on all of them, each check in its own process group
with a collective timeout, and appends each rank's outcome to a file; one pytest test per (world, case)
reads it. The spawn is bounded in time (a hung collective fails its check, never hangs the run). On each rank a
case builds the whole q, k, v from a seed, runs the single-process ``sa.sparse_attention`` (same backend,
autograd) as the oracle, runs the distributed call on the rank's shard, back-propagates the same
gradient and compares out, lse, dq, dk and dv of the shard: float64 to 1e-12 relative, float32 by
DESIGN's tolerance rule (tests/tolerance.py: error against the float64 single-process result at most
2x that of the float32 single-process result, plus a floor).

The ShardPlan tests need no processes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparse_attn as sa
from sparse_attn import distributed
from sparse_attn.shard_plan import ShardPlan
from tests.tolerance import assert_within_rule

WORLDS = (2, 4)
SPAWN_SECONDS = 300          # the whole spawn (imports, every case and check of both world sizes)
COLLECTIVE_SECONDS = 15      # one collective that waits for a rank that never comes
BLOCK = 64                   # the block size of the reference and numba backends' layouts


class Case(NamedTuple):
    """One distributed run: ``pattern`` over ``n`` tokens split into ``shards[world]`` (rank order)."""

    pattern: sa.Pattern
    n: int
    shards: dict[int, tuple[int, ...]]
    batch: int = 1
    heads: int = 2
    kv_heads: int = 2
    kv_batch: int | None = None            # None: the batch of q
    dtype: torch.dtype = torch.float64
    backend: str = "reference"
    call: dict | None = None                # causal, key_padding_mask, global_mask, documents (whole sequence)
    strided: bool = False                   # shards stored (B, n, H, D)-major: non-contiguous q, k, v


def even(n: int, *worlds: int) -> dict[int, tuple[int, ...]]:
    """Shards as equal as can be, for each world size: even(10, 4) -> {4: (3, 3, 2, 2)}."""
    return {w: tuple(len(part) for part in np.array_split(np.arange(n), w)) for w in worlds}


def masks(batch: int, n: int, seed: int, *, padding=None, global_tokens=None):
    """key_padding_mask / global_mask (B, n) bool: ``padding`` a fraction drawn from ``seed`` plus, in example
    0, token 0 and a run of 20 (rows of a short window inside it see no key), ``global_tokens`` per-example tokens."""
    call = {}
    if padding is not None:
        mask = torch.rand(batch, n, generator=torch.Generator().manual_seed(seed)) < padding
        mask[0, 0] = mask[0, 40:60] = True
        call["key_padding_mask"] = mask
    if global_tokens is not None:
        mask = torch.zeros(batch, n, dtype=torch.bool)
        for example, tokens in enumerate(global_tokens):
            mask[example, list(tokens)] = True
        call["global_mask"] = mask
    return call


LONGFORMER = sa.Local(24) | sa.Global(first=3)
BIGBIRD = sa.bigbird(block=16, window_blocks=3, global_blocks=2, random_blocks=2, seed=1)   # small random blocks
CASES = {
    "longformer": Case(LONGFORMER, 512, even(512, 2, 4)),
    "longformer-float32": Case(LONGFORMER, 512, even(512, 2, 4), dtype=torch.float32),
    "longformer-global-tokens": Case(sa.longformer(window=16, global_tokens=(0, 130, 333)), 400, even(400, 2, 4)),
    "bigbird": Case(BIGBIRD, 256, even(256, 2, 4)),
    "bigbird-float32": Case(BIGBIRD, 256, even(256, 2, 4), dtype=torch.float32),
    "random-blocks": Case(sa.Random(2, seed=5, block_size=16) | sa.Local(4), 256, even(256, 2, 4)),
    "causal-window": Case(sa.Local(20, 0) & sa.Causal(), 300, {2: (130, 170), 4: (75, 75, 70, 80)}),
    "causal-argument": Case(sa.Local(20) | sa.Global(first=2), 300, even(300, 2, 4), call={"causal": True}),
    "per-head": Case(sa.PerHead([sa.Local(8), sa.Global(first=2) | sa.Local(3, 0), sa.Stride(17) & sa.Causal(),
                                 sa.Random(1, seed=3, block_size=16) | sa.Local(1)]), 200, even(200, 2, 4),
                     heads=4, kv_heads=4),
    "per-head-global": Case(sa.PerHead([sa.Local(24) | sa.Global(first=2), sa.Local(5, 0)]), 512, even(512, 2, 4)),
    "gqa": Case(LONGFORMER, 300, even(300, 2, 4), heads=4, kv_heads=1),
    "gqa-per-head-scale": Case(sa.PerHead([sa.Local(5), sa.Local(30, 0), sa.Global(last=4) | sa.Local(2),
                                           sa.Stride(40)]), 260, even(260, 2, 4), heads=4, kv_heads=2,
                               call={"scale": 0.3}),
    "kv-batch-1": Case(LONGFORMER, 300, even(300, 2, 4), batch=3, kv_batch=1),
    "global-mask-kv-batch-1": Case(sa.Local(6), 512, even(512, 2, 4), batch=2, kv_batch=1, heads=2, kv_heads=1,
                                   call=masks(2, 512, 1, global_tokens=[(5, 150, 400), (90,)])),
    "key-padding": Case(sa.Local(3) | sa.Global(first=1), 512, even(512, 2, 4), batch=2,
                        call=masks(2, 512, 0, padding=0.2)),
    # example 0's globals 5 and 150 are on rank 0 and rank 1 (of 2) / rank 0 and 3 (of 4); example 1's 90 on
    # rank 0 / rank 1: rows on every rank see them, and they see every rank's keys
    "global-mask": Case(sa.Local(6), 200, {2: (100, 100), 4: (50, 50, 50, 50)}, batch=2,
                        call=masks(2, 200, 1, global_tokens=[(5, 150), (90,)])),
    "global-mask-and-padding": Case(sa.Local(6, 0), 200, {2: (77, 123), 4: (1, 64, 70, 65)}, batch=2,
                                    call=masks(2, 200, 2, padding=0.1, global_tokens=[(199,), (3, 64, 120)])),
    "documents": Case(sa.Local(10) | sa.Global(first=1), 300, even(300, 2, 4), batch=2,
                      call={"documents": sa.documents_from_lengths([[70, 45, 120, 50], [130, 1, 100]], 300)}),
    "documents-causal-random": Case(sa.Random(1, seed=2, block_size=16) | sa.Local(7, 0), 300, {2: (90, 210),
                                    4: (90, 13, 100, 97)}, batch=2, call={"causal": True, "documents":
                                    sa.documents_from_lengths([[95, 200], [31, 31, 31, 200]], 300)}),
    "unequal-shards": Case(LONGFORMER, 300, {2: (237, 63), 4: (1, 130, 6, 163)}),
    "one-token-last": Case(sa.bigbird(block=16, window_blocks=3, global_blocks=2, random_blocks=1), 200,
                           {2: (199, 1), 4: (64, 1, 70, 65)}),
    # rank 0's rows need no remote key (test_a_rank_that_needs_nothing_remote checks its plan)
    "documents-at-shard-boundary": Case(sa.Local(20) | sa.Global(first=1), 200, {2: (100, 100), 4: (100, 50, 25, 25)},
                                        call={"documents": sa.documents_from_lengths([[100, 100]], 200)}),
    "causal-window-rank-0-alone": Case(sa.Local(16, 0) & sa.Causal(), 256, even(256, 2, 4)),
    "non-contiguous": Case(LONGFORMER, 300, {2: (150, 150), 4: (1, 99, 100, 100)}, batch=2, heads=4, kv_heads=2,
                           strided=True),
    "prebuilt-layout": Case(LONGFORMER.layout(300, heads=2), 300, {2: (130, 170), 4: (64, 64, 64, 108)}),
    "prebuilt-layout-block-32": Case(sa.bigbird(block=16, random_blocks=2).layout(300, heads=2, block_size=32), 300,
                                     {2: (130, 170), 4: (1, 127, 64, 108)}),
    "prebuilt-layout-block-128": Case(LONGFORMER.layout(300, heads=2, block_size=128), 300,
                                      {2: (130, 170), 4: (1, 127, 64, 108)}),
    "one-token-per-rank": Case(sa.Local(1) | sa.Global(first=1), 4, {2: (1, 3), 4: (1, 1, 1, 1)}),
    "a-rank-all-padding": Case(sa.Local(6) | sa.Global(first=1), 200, {2: (150, 50), 4: (50, 50, 50, 50)}, batch=2,
                               call={"key_padding_mask": torch.arange(200).repeat(2, 1) >= 150}),
    "two-ranks-ship": Case(sa.Dilated(4, 3) | sa.Stride(50), 300, {4: (70, 80, 90, 60)}),
    "kv-batch-1-shipped": Case(sa.Global(first=64) | sa.Local(2), 1024, {4: (256, 256, 256, 256)}, batch=2,
                               kv_batch=1),
    "short-sequence": Case(sa.Local(5) | sa.Global(first=1), 40, {2: (25, 15), 4: (10, 10, 10, 10)}),
    "numba": Case(LONGFORMER, 512, {2: (200, 312), 4: (100, 150, 62, 200)}, backend="numba"),
    "numba-float32": Case(BIGBIRD, 256, even(256, 2, 4), dtype=torch.float32, backend="numba"),
    "numba-float32-shipped": Case(LONGFORMER, 512, {4: (100, 150, 62, 200)}, dtype=torch.float32, backend="numba"),
    # a sequence shorter than one block over more ranks than blocks: every rank's rows share the one block
    "shorter-than-a-block-causal": Case(sa.Causal(), 20, {2: (10, 10), 4: (10, 5, 1, 4)}),
    "shorter-than-a-block-global": Case(sa.Global(first=3) | sa.Local(2), 39, {2: (20, 19), 4: (1, 6, 19, 13)},
                                        batch=2, call=masks(2, 39, 3, padding=0.2)),
    "one-block-numba": Case(sa.Dense(), 64, {2: (40, 24), 4: (16, 16, 16, 16)}, dtype=torch.float32, backend="numba"),
    "numba-documents-gqa": Case(sa.Local(10) | sa.Global(first=1), 300, {2: (100, 200), 4: (1, 99, 100, 100)},
                                batch=2, heads=4, kv_heads=2, backend="numba",
                                call={"documents": sa.documents_from_lengths([[70, 45, 120, 50], [130, 1]], 300)}),
}


# --- one case on one rank ---------------------------------------------------------------------------------
def full_inputs(case: Case):
    """q (B, Hq, n, D), k, v (Bk, Hkv, n, D) and the output gradient, float64, the same on every rank."""
    gen = torch.Generator().manual_seed(case.n)
    kv_batch = case.batch if case.kv_batch is None else case.kv_batch
    q = torch.randn(case.batch, case.heads, case.n, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(kv_batch, case.kv_heads, case.n, 16, generator=gen, dtype=torch.float64) for _ in "kv")
    return q, k, v, torch.randn(q.shape, generator=gen, dtype=torch.float64)


def attend(attention, q, k, v, grad_out, case: Case, **options):
    """out, lse, dq, dk, dv of ``attention`` (single-process or distributed) on copies of q, k, v."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(q, k, v, case.pattern, backend=case.backend, return_lse=True, **(case.call or {}),
                         **options)
    (out.double() * grad_out).sum().backward()
    return out, lse, q.grad, k.grad, v.grad


def shard_rows(case: Case, world: int, rank: int) -> slice:
    start = sum(case.shards[world][:rank])
    return slice(start, start + case.shards[world][rank])


def check_case(case: Case, rank: int, world: int, group) -> None:
    """This rank's shard of the distributed run equals its part of the single-process one."""
    rows = shard_rows(case, world, rank)
    q, k, v, grad_out = full_inputs(case)
    oracle = attend(sa.sparse_attention, q, k, v, grad_out, case)                  # float64
    baseline = attend(sa.sparse_attention, *(t.to(case.dtype) for t in (q, k, v)), grad_out, case)
    shards = [t[:, :, rows].to(case.dtype) for t in (q, k, v)]
    if case.strided:
        shards = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in shards]    # (B, H, n_rank, D) views
        assert shards[0].shape[2] == 1 or not shards[0].is_contiguous()
    got = attend(distributed.sparse_attention, *shards, grad_out[:, :, rows], case, group=group)
    for what, mine, ref, base in zip(("out", "lse", "dq", "dk", "dv"), got, oracle, baseline):
        ref, base = ref[:, :, rows], base[:, :, rows]
        assert mine.dtype == base.dtype and mine.shape == ref.shape, f"{what}: {mine.dtype} {tuple(mine.shape)}"
        if what == "lse":
            assert torch.equal(torch.isneginf(mine), torch.isneginf(ref)), "lse: -inf rows differ"
            finite = torch.isfinite(ref)
            mine, ref, base = mine[finite], ref[finite], base[finite]
        if case.dtype == torch.float64:
            error = (mine - ref).abs().max().item() if ref.numel() else 0.0
            allowed = 1e-12 * max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
            assert error <= allowed, f"{what}: max error {error:.3e} > {allowed:.3e}"
        else:
            assert_within_rule(what, mine, ref, base)


def check_repeatable(rank: int, world: int, group) -> None:
    """A second call (its plan from the cache) gives the same bits, out, lse and gradients."""
    case, rows = CASES["longformer"], shard_rows(CASES["longformer"], world, rank)
    q, k, v, grad_out = (t[:, :, rows] for t in full_inputs(case))
    first, second = (attend(distributed.sparse_attention, q, k, v, grad_out, case, group=group) for _ in "12")
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def check_different_patterns(rank: int, world: int, group) -> None:
    """Ranks passing different patterns: a ValueError on every rank, no hang."""
    q = torch.randn(1, 2, 32, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"different arguments: pattern on ranks \[1"):
        distributed.sparse_attention(q, q, q, sa.Local(4 + rank), group=group)


def check_part_of_a_mask(name: str, whose: str, rank: int, world: int, group) -> None:
    """A mask of this rank's length (its part of the whole sequence's; shards of unequal length) on ``whose``
    ranks ("every" or "rank-1"): a ValueError naming it there, and on the ranks that pass the whole mask a
    ValueError saying that the ranks' arguments differ."""
    sizes = [24 + 8 * r for r in range(world)]
    n, start = sum(sizes), sum(sizes[:rank])
    q = torch.randn(2, 2, sizes[rank], 8, dtype=torch.float64)
    whole = (sa.documents_from_lengths([[n // 2, n // 2]] * 2, n) if name == "documents"
             else torch.arange(n).repeat(2, 1) % 7 == 0)                          # (2, n)
    part = whose == "every" or rank == 1
    message = f"{name} covers the whole sequence" if part else rf"different arguments: {name} on ranks \[1\] differ"
    with pytest.raises(ValueError, match=message):
        distributed.sparse_attention(q, q, q, sa.Local(4), group=group,
                                     **{name: whole[:, start:start + sizes[rank]] if part else whole})


# --- the ranks agree on their arguments before any data moves ----------------------------------------------
def blocks_pattern(wrapped: str, flipped: bool) -> sa.Pattern:
    """A Blocks grid of 10 x 10 blocks of 8 tokens (80 tokens) that prints only its shape and block count, the
    same for both grids (``flipped``: the mirror image), alone or inside |, &, ~ or PerHead."""
    grid = np.eye(10, dtype=bool) | np.eye(10, k=1, dtype=bool)
    blocks = sa.Blocks(grid[::-1, ::-1] if flipped else grid, 8)
    return {"alone": blocks, "union": blocks | sa.Local(1), "complement": ~blocks & sa.Local(8),
            "per-head": sa.PerHead([sa.Local(1), blocks])}[wrapped]


def check_different_blocks_grids(wrapped: str, rank: int, world: int, group) -> None:
    """The last rank's grid is the mirror image of the others' (same shape, same count, same printed form):
    a ValueError naming the pattern on every rank."""
    assert repr(blocks_pattern(wrapped, True)) == repr(blocks_pattern(wrapped, False))
    q = torch.randn(1, 2, 80 // world, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"different arguments: pattern on ranks \[{world - 1}\] differ"):
        distributed.sparse_attention(q, q, q, blocks_pattern(wrapped, rank == world - 1), group=group)


def check_different_requires_grad(rank: int, world: int, group) -> None:
    """Rank 1's q needs no gradient, the others' do: every rank raises before the forward (else the others'
    backward would wait for rank 1's forever)."""
    q = torch.randn(1, 2, 32, 8, dtype=torch.float64)
    k = q.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"different arguments: requires_grad on ranks \[1\] differ"):
        distributed.sparse_attention(q if rank == 1 else q.clone().requires_grad_(), k, k, sa.Local(4), group=group)


def check_documents_of_another_dtype(rank: int, world: int, group) -> None:
    """Rank 1 passes the same document ids as an int32 numpy array: the ranks agree, and the result is the
    single-process one."""
    case = Case(sa.Local(5) | sa.Global(first=1), 120, even(120, world), call={
        "documents": sa.documents_from_lengths([[50, 70]], 120)})
    if rank == 1:
        case = case._replace(call={"documents": case.call["documents"].numpy().astype(np.int32)})
    check_case(case, rank, world, group)


INVALID_ON_RANK_1 = {        # what rank 1 alone passes: (arguments, the error it raises there, its message's start)
    "scale": ({"scale": -1.0}, ValueError, "scale must be a finite positive float, got -1.0"),
    "dtype": ({"q": torch.float32}, TypeError, "q, k, v must share one dtype"),
    "heads": ({"pattern": sa.PerHead([sa.Local(1)] * 3)}, ValueError, "PerHead has 3 patterns but heads=2"),
    "backend": ({"backend": "flash"}, ValueError, "backend must be one of"),
    "pattern-type": ({"pattern": "Local(4)"}, TypeError, "pattern must be a sparse_attn Pattern or BlockLayout"),
    "shard-length": ({"k_rows": 20}, ValueError, "q, k and v must be this rank's shard of one sequence"),
    "empty-shard": ({"rows": 0}, ValueError, "q and k need batch, heads, seq_len and head_dim >= 1"),
}


def check_invalid_on_rank_1(what: str, rank: int, world: int, group) -> None:
    """Rank 1's arguments fail a check the others cannot see: rank 1 raises its error, every other rank a
    ValueError naming rank 1 and that error, within seconds (a rank left waiting would time out after
    COLLECTIVE_SECONDS with another error)."""
    change, error, message = INVALID_ON_RANK_1[what]
    change = change if rank == 1 else {}
    q = torch.randn(1, 2, change.get("rows", 16), 8, dtype=change.get("q", torch.float64))
    k = torch.randn(1, 2, change.get("k_rows", q.shape[2]), 8, dtype=torch.float64)
    arguments = {name: value for name, value in change.items() if name in ("scale", "backend")}
    with pytest.raises(error if rank == 1 else ValueError,
                       match=re.escape(message if rank == 1 else f"rank 1 of {world}: {error.__name__}: {message}")):
        distributed.sparse_attention(q, k, k, change.get("pattern", sa.Local(4)), group=group, **arguments)


def all_checks():
    """(world, name, check(rank, world, group)) for every check the spawn runs, in order."""
    checks = [(name, lambda r, w, g, case=case: check_case(case, r, w, g), case.shards) for name, case in CASES.items()]
    checks += [("repeatable", check_repeatable, WORLDS), ("different-patterns", check_different_patterns, WORLDS)]
    checks += [(f"part-of-{name}-on-{whose}", lambda r, w, g, name=name, whose=whose:
                check_part_of_a_mask(name, whose, r, w, g), WORLDS)
               for name in ("key_padding_mask", "global_mask", "documents") for whose in ("every", "rank-1")]
    checks += [(f"blocks-grids-{wrapped}", lambda r, w, g, wrapped=wrapped:
                check_different_blocks_grids(wrapped, r, w, g), WORLDS)
               for wrapped in ("alone", "union", "complement", "per-head")]
    checks += [("different-requires-grad", check_different_requires_grad, WORLDS),
               ("documents-of-another-dtype", check_documents_of_another_dtype, WORLDS)]
    checks += [(f"invalid-{what}-on-rank-1", lambda r, w, g, what=what: check_invalid_on_rank_1(what, r, w, g), WORLDS)
               for what in INVALID_ON_RANK_1]
    return [(world, name, check) for world in WORLDS for name, check, worlds in checks if world in worlds]


def warm_up() -> None:
    """The first calls' costs (imports, numba's compiled kernels from its cache), paid before any collective
    waits for them: in the parent, it writes numba's cache once instead of every rank compiling."""
    for backend in ("reference", "numba"):
        for dtype in (torch.float64, torch.float32):
            q = torch.randn(1, 1, 8, 4, dtype=dtype, requires_grad=True)
            sa.sparse_attention(q, q, q, sa.Local(1), backend=backend).sum().backward()


def worker(rank: int, port: int, folder: str, checks) -> None:
    """One rank of the spawn: for each world size, every check of ``checks()`` on ranks 0 .. world - 1, each in a
    new process group of those ranks whose collectives time out after COLLECTIVE_SECONDS, then a barrier of all
    ranks; one JSON line per world size, check and rank."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["NUMBA_NUM_THREADS"] = "1"                 # one thread per rank (numba is not imported yet):
    torch.set_num_threads(1)                              # the ranks share the machine's cores
    warm_up()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=max(WORLDS),
                            timeout=timedelta(seconds=SPAWN_SECONDS))
    with open(Path(folder) / f"rank{rank}.jsonl", "w") as log:
        for world, name, check in checks():
            group = dist.new_group(list(range(world)), backend="gloo", timeout=timedelta(seconds=COLLECTIVE_SECONDS))
            if rank < world:
                began = time.perf_counter()
                try:
                    check(rank, world, group)
                    error = None
                except Exception:                                # recorded, the parent's test fails with it
                    error = traceback.format_exc()
                log.write(json.dumps({"world": world, "check": name, "error": error,
                                      "seconds": time.perf_counter() - began}) + "\n")
                log.flush()
            dist.barrier()             # the next check starts together, even after a rank timed out in this one
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(folder: Path, checks=all_checks) -> dict:
    """Run every check of ``checks()`` (a module-level function: the ranks import it), like ``all_checks``:
    {(world, check): [each rank's error, None if it passed]}."""
    warm_up()
    context = mp.start_processes(worker, args=(free_port(), str(folder), checks), nprocs=max(WORLDS), join=False,
                                 start_method="spawn")
    deadline, crash = time.monotonic() + SPAWN_SECONDS, None
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1), grace_period=5):
            if time.monotonic() > deadline:
                crash = f"the spawn ran past {SPAWN_SECONDS} s and was killed"
                break
    except Exception as exc:                                      # a rank died (its traceback is in exc)
        crash = f"a rank crashed: {exc}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    outcomes = {(world, name): [f"rank {r} did not finish {name!r}: {crash}" for r in range(world)]
                for world, name, _ in checks()}
    for r in range(max(WORLDS)):
        path = folder / f"rank{r}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else ():
            record = json.loads(line)
            outcomes[record["world"], record["check"]][r] = record["error"]
    return outcomes


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """The outcomes of every check (one spawn per module: minutes, so the tests that take it are marked slow)."""
    return spawn(tmp_path_factory.mktemp("ranks"))


def assert_every_rank_passed(outcomes: dict, world: int, check: str) -> None:
    failures = [f"rank {r}:\n{error}" for r, error in enumerate(outcomes[world, check]) if error is not None]
    assert not failures, "\n".join(failures)


# --- distributed: one test per (world, case) ------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("world, name", [(w, name) for name, case in CASES.items() for w in WORLDS
                                         if w in case.shards])
def test_shards_equal_single_process(ranks, world, name):
    assert_every_rank_passed(ranks, world, name)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_a_second_call_gives_the_same_bits(ranks, world):
    assert_every_rank_passed(ranks, world, "repeatable")


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_ranks_with_different_patterns_all_raise(ranks, world):
    assert_every_rank_passed(ranks, world, "different-patterns")


@pytest.mark.slow
@pytest.mark.parametrize("wrapped", ["alone", "union", "complement", "per-head"])
@pytest.mark.parametrize("world", WORLDS)
def test_ranks_with_blocks_grids_that_print_alike_all_raise(ranks, world, wrapped):
    assert_every_rank_passed(ranks, world, f"blocks-grids-{wrapped}")


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_ranks_that_differ_in_requires_grad_all_raise(ranks, world):
    assert_every_rank_passed(ranks, world, "different-requires-grad")


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_document_ids_of_another_integer_dtype_agree(ranks, world):
    assert_every_rank_passed(ranks, world, "documents-of-another-dtype")


@pytest.mark.slow
@pytest.mark.parametrize("what", list(INVALID_ON_RANK_1))
@pytest.mark.parametrize("world", WORLDS)
def test_an_invalid_call_on_one_rank_raises_on_every_rank(ranks, world, what):
    assert_every_rank_passed(ranks, world, f"invalid-{what}-on-rank-1")


@pytest.mark.slow
@pytest.mark.parametrize("whose", ["every", "rank-1"])
@pytest.mark.parametrize("name", ["key_padding_mask", "global_mask", "documents"])
@pytest.mark.parametrize("world", WORLDS)
def test_a_mask_of_the_shard_raises_naming_it(ranks, world, name, whose):
    assert_every_rank_passed(ranks, world, f"part-of-{name}-on-{whose}")


def test_needs_an_initialised_process_group():
    assert not dist.is_initialized()
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.sparse_attention(q, q, q, sa.Local(2))


# --- the plans of the cases -----------------------------------------------------------------------------
def case_plan(case: Case, world: int) -> ShardPlan:
    call = case.call or {}
    layout = case.pattern.layout(case.n, heads=case.heads, block_size=BLOCK, **call)
    kv_batch = case.batch if case.kv_batch is None else case.kv_batch
    return ShardPlan.build(layout, case.shards[world], kv_heads=case.kv_heads, q_batch=case.batch, kv_batch=kv_batch,
                           itemsize=torch.finfo(case.dtype).bits // 8)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["documents-at-shard-boundary", "causal-window-rank-0-alone"])
def test_a_rank_that_needs_nothing_remote(name, world):
    plan = case_plan(CASES[name], world)
    assert plan.kv_rows[0].sum() == 0 and plan.shipped_rows.sum() == 0
    assert plan.program(0).kv_recv_counts == [0] * world


def test_the_cases_fetch_across_shards_and_ship_global_rows():
    """The cases exercise what they are there for: random blocks fetched from ranks that are not
    neighbours, and rows shipped and combined by log-sum-exp."""
    far = case_plan(CASES["random-blocks"], 4).kv_rows
    assert any(far[r, p] for r in range(4) for p in range(4) if abs(r - p) >= 2)
    shipping = [("longformer", 2), ("longformer", 4), ("longformer-float32", 4), ("numba", 4), ("global-mask", 2),
                ("documents", 2), ("unequal-shards", 4), ("one-token-last", 2), ("key-padding", 4),
                ("per-head-global", 2), ("kv-batch-1-shipped", 4), ("numba-float32-shipped", 4)]
    assert (case_plan(CASES["two-ranks-ship"], 4).shipped_rows > 0).sum() == 2
    for name, world in shipping:
        assert case_plan(CASES[name], world).shipped_rows.sum() > 0, (name, world)


# --- ShardPlan alone -------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [4, 8])
def test_longformer_receives_the_halo_and_the_global_tokensindependent_of_n(world):
    kv_heads, plans = 2, []
    for n in (1 << 16, 1 << 18):
        layout = (sa.Local(256) | sa.Global(first=16)).layout(n, heads=kv_heads)
        plans.append(ShardPlan.build(layout, [n // world] * world, kv_heads=kv_heads))
    for plan in plans:
        expected = np.zeros((world, world), dtype=np.int64)
        for r in range(world):
            if r > 0:
                expected[r, r - 1] = 256
            if r + 1 < world:
                expected[r, r + 1] = 256
            if r > 0:
                expected[r, 0] += 16                             # the global columns, on rank 0
        np.testing.assert_array_equal(plan.kv_rows, expected * kv_heads)
        assert plan.shipped_rows.tolist() == [64] + [0] * (world - 1)    # block 0, holding the global rows, ships
        assert plan.lse_rows is plan.shipped_rows                            # its first name, still public
    np.testing.assert_array_equal(plans[0].kv_rows, plans[1].kv_rows)
    for key, value in plans[0].bytes_per_rank(64, 4).items():
        np.testing.assert_array_equal(value, plans[1].bytes_per_rank(64, 4)[key], err_msg=key)


PLANS = {
    "longformer": (sa.Local(16) | sa.Global(first=1), 512, (128, 128, 256), {}),
    "bigbird": (sa.bigbird(block=16, random_blocks=2, seed=3), 400, (1, 150, 64, 185), {"heads": 2}),
    "per-head-gqa": (sa.PerHead([sa.Local(5), sa.Global(first=70), sa.Stride(33), sa.Local(40, 0)]), 333,
                     (100, 33, 200), {"heads": 4, "kv_heads": 2}),
    "documents-batch": (sa.Local(9) | sa.Global(first=1), 300, (70, 70, 70, 90),
                        {"q_batch": 2, "documents": sa.documents_from_lengths([[100, 200], [1, 150, 149]], 300)}),
    "global-mask-shared-kv": (sa.Local(4), 256, (64, 100, 92),
                              {"q_batch": 2, "kv_batch": 1, **masks(2, 256, 0, global_tokens=[(3, 200), (130,)])}),
}


def plan_of(name: str) -> ShardPlan:
    pattern, n, shards, options = PLANS[name]
    options = dict(options)
    heads, kv_heads = options.pop("heads", 1), options.pop("kv_heads", None)
    q_batch, kv_batch = options.pop("q_batch", 1), options.pop("kv_batch", None)
    layout = pattern.layout(n, heads=heads, **options)
    return ShardPlan.build(layout, shards, kv_heads=kv_heads or heads, q_batch=q_batch,
                           kv_batch=q_batch if kv_batch is None else kv_batch)


@pytest.mark.parametrize("name", list(PLANS))
def test_what_one_rank_sends_the_other_receives(name):
    plan = plan_of(name)
    world = len(plan.shard_sizes)
    programs = [plan.program(r) for r in range(world)]
    for r, program in enumerate(programs):
        assert program.kv_recv_counts == plan.kv_rows[r].tolist()
        assert len(program.kv_recv_slots) == sum(program.kv_recv_counts)
        assert len(program.kv_send_index) == sum(program.kv_send_counts)
        assert len(program.shipped_rows) == plan.shipped_rows[r]
        for p in range(world):
            assert programs[p].kv_send_counts[r] == program.kv_recv_counts[p], (p, r)
            assert program.shipped_recv_counts[p] == len(programs[p].shipped_rows), (p, r)   # shipped rows, p -> r
    traffic = plan.bytes_per_rank(head_dim=32, itemsize=2)
    for phase in ("forward", "backward"):
        assert traffic[f"{phase}_sent"].sum() == traffic[f"{phase}_received"].sum(), phase
    np.testing.assert_array_equal(traffic["forward_sent"], traffic["backward_received"])
    assert plan.kv_rows.trace() == 0 and plan.kv_rows.sum() > 0


def test_plan_errors():
    layout = sa.Local(4).layout(100)
    with pytest.raises(ValueError, match=r"whole sequence: n_q == n_k == sum\(shard_sizes\) = 90"):
        ShardPlan.build(layout, (50, 40), kv_heads=1)
    with pytest.raises(ValueError, match=r"at least one token, got shard sizes \[100, 0\]"):
        ShardPlan.build(layout, (100, 0), kv_heads=1)
    with pytest.raises(ValueError, match="batch 1 and 1 heads does not fit q batch 1 with k, v of batch 1 and 2 heads"):
        ShardPlan.build(layout, (50, 50), kv_heads=2)


def blocks_computed(pattern: sa.Pattern, plan: ShardPlan, heads: int) -> list[int]:
    """What ``plan.work`` should be, from the dense mask: each rank computes every nonzero block of the query
    blocks it holds rows of, except a shipped block row, whose blocks every rank owning some of their keys
    computes; per head, times the examples."""
    n = sum(plan.shard_sizes)
    n_blocks = -(-n // BLOCK)
    mask = torch.zeros(heads, n_blocks * BLOCK, n_blocks * BLOCK, dtype=torch.bool)
    mask[:, :n, :n] = pattern.mask(n, heads=heads)
    blocks = mask.view(heads, n_blocks, BLOCK, n_blocks, BLOCK).any(4).any(2).numpy()   # (H, query, key blocks)
    starts = np.cumsum([0, *plan.shard_sizes])
    owners = [set(np.searchsorted(starts, np.arange(b * BLOCK, min(b * BLOCK + BLOCK, n)), side="right") - 1)
              for b in range(n_blocks)]
    work = np.zeros(len(plan.shard_sizes), dtype=np.int64)
    for r, (start, stop) in enumerate(zip(starts[:-1], starts[1:])):
        shipped = set((start + plan.program(r).shipped_rows.numpy()) // BLOCK)
        for row in range(start // BLOCK, (stop - 1) // BLOCK + 1):
            if row not in shipped:
                work[r] += blocks[:, row].sum()
                continue
            for key_block in np.nonzero(blocks[:, row])[1]:
                work[list(owners[key_block])] += 1
    return (work * plan.q_batch).tolist()


@pytest.mark.parametrize("pattern, shards, heads", [
    (sa.Local(40), (1, 300, 400, 299), 1),                                         # the 1-token shard ships
    (sa.PerHead([sa.Local(40), sa.Stride(90) & sa.Causal()]), (100, 200, 300, 400), 2),
    (sa.bigbird(block=16, random_blocks=2), (128, 256, 256, 360), 2),
    (sa.Local(40) | sa.Global(first=3), (100, 200, 300, 400), 2)], ids=repr)
def test_work_counts_the_blocks_each_rank_computes(pattern, shards, heads):
    plan = ShardPlan.build(pattern.layout(1000, heads=heads), shards, kv_heads=heads, q_batch=2, kv_batch=2)
    assert plan.work.tolist() == blocks_computed(pattern, plan, heads)


@pytest.mark.parametrize("pattern, shards", [
    (sa.Causal(), (10, 5, 1, 4)),                                        # two rows of one block shipped before
    (sa.Global(first=3) | sa.Local(2), (1, 6, 19, 13)),
    (sa.Dense(), (1, 1, 1)),
    (sa.PerHead([sa.Stride(3), sa.Global(first=2) | sa.Local(1, 0)]), (7, 9, 2, 11, 11)),
    (sa.Dense(), (16, 16, 16, 16))], ids=repr)                           # exactly one block
def test_a_sequence_of_one_block_splits_over_more_ranks_than_blocks(pattern, shards):
    """Every rank fetches exactly the keys of other shards that its rows may attend (per head); none ships."""
    n, heads = sum(shards), 2
    plan = ShardPlan.build(pattern.layout(n, heads=heads), shards, kv_heads=heads)
    mask = pattern.mask(n, heads=heads).numpy()                                    # (H, n, n)
    starts = np.cumsum([0, *shards])
    expected = [[0 if r == p else int(mask[:, starts[r]:starts[r + 1], starts[p]:starts[p + 1]].any(1).sum())
                 for p in range(len(shards))] for r in range(len(shards))]
    assert plan.kv_rows.tolist() == expected and plan.shipped_rows.sum() == 0
    for r in range(len(shards)):
        assert plan.program(r).kv_recv_counts == expected[r]


# --- the digest the ranks compare ------------------------------------------------------------------------
def every_pattern_kind() -> set[type]:
    kinds, todo = set(), [sa.Pattern]
    while todo:
        for cls in todo.pop().__subclasses__():
            todo.append(cls)
            if "kind" in cls.__dict__:
                kinds.add(cls)
    return kinds


GRID = np.eye(9, dtype=bool)
# one pattern of every kind and, for each of its fields, another value of that field
CHANGED_FIELDS = {
    sa.Local: (sa.Local(4, 2, block_size=2), {"before": 5, "after": 3, "block_size": 1}),
    sa.Stride: (sa.Stride(4, 1), {"stride": 5, "offset": 2}),
    sa.Dilated: (sa.Dilated(2, 3, 1), {"before": 1, "dilation": 2, "after": 2}),
    sa.Global: (sa.Global((3, 9), first=1, last=2), {"tokens": (3, 8), "first": 2, "last": 1}),
    sa.Sink: (sa.Sink((5,), first=1, period=8, width=2), {"tokens": (6,), "first": 2, "period": 9, "width": 1}),
    sa.Causal: (sa.Causal(), {}),
    sa.Dense: (sa.Dense(), {}),
    sa.Random: (sa.Random(2, seed=1, block_size=16), {"blocks": 3, "seed": 2, "block_size": 32}),
    sa.Blocks: (sa.Blocks(GRID, 8), {"blocks": GRID[::-1], "block_size": 16}),
    sa.Union: (sa.Local(1) | sa.Blocks(GRID, 8), {"patterns": (sa.Local(1), sa.Blocks(GRID[::-1], 8))}),
    sa.Intersection: (sa.Local(1) & sa.Blocks(GRID, 8), {"patterns": (sa.Local(1), sa.Blocks(GRID[::-1], 8))}),
    sa.Complement: (~sa.Blocks(GRID, 8), {"pattern": sa.Blocks(GRID[::-1], 8)}),
    sa.PerHead: (sa.PerHead([sa.Blocks(GRID, 8), sa.Dense()]), {"patterns": (sa.Blocks(GRID[::-1], 8), sa.Dense())}),
}


def test_every_pattern_kind_and_field_is_in_the_digest_test():
    assert set(CHANGED_FIELDS) == every_pattern_kind(), "add the new kind to CHANGED_FIELDS"
    for cls, (_, changes) in CHANGED_FIELDS.items():
        assert set(changes) == {field.name for field in dataclasses.fields(cls)}, cls.__name__


@pytest.mark.parametrize("cls", list(CHANGED_FIELDS), ids=lambda cls: cls.__name__)
def test_the_digest_reads_every_field(cls):
    pattern, changes = CHANGED_FIELDS[cls]
    same = sa.Pattern.from_dict(pattern.to_dict())                 # an equal pattern, built again
    assert same is not pattern and distributed.content_digest(same) == distributed.content_digest(pattern)
    for name, value in changes.items():
        if cls in (sa.Union, sa.Intersection):
            changed = cls(*value)
        elif cls is sa.PerHead:
            changed = cls(value)
        else:
            fields = {field.name: getattr(pattern, field.name) for field in dataclasses.fields(cls)}
            changed = cls(**{**fields, name: value})
        assert distributed.content_digest(changed) != distributed.content_digest(pattern), (cls.__name__, name)


def test_blocks_grids_that_print_alike_have_different_digests():
    a, b = sa.Blocks(GRID, 8), sa.Blocks(GRID[::-1], 8)
    assert repr(a) == repr(b) and a != b
    assert distributed.content_digest(sa.Local(2) | ~a) != distributed.content_digest(sa.Local(2) | ~b)
    assert distributed.content_digest(sa.Blocks(np.stack([GRID, GRID]), 8)) != \
        distributed.content_digest(sa.Blocks(np.stack([GRID, GRID[::-1]]), 8))


def test_the_digest_of_layouts_arrays_and_scalars():
    digest = distributed.content_digest
    left, right = (sa.Blocks(grid, 8).layout(72, heads=2, block_size=8) for grid in (GRID, GRID[::-1]))
    assert digest(left) != digest(right)
    assert digest(left) == digest(sa.Blocks(GRID.copy(), 8).layout(72, heads=2, block_size=8))
    ids = np.array([[0, 0, 1, 1]])
    assert digest(ids) == digest(torch.from_numpy(ids)) != digest(ids.astype(np.int32))
    assert digest(ids) != digest(ids.reshape(2, 2)) and digest(ids) != digest(ids[:, :3])
    assert len({digest(value) for value in (1, True, 1.0, "1", None, (1,), [1, 1], ((1,), 1))}) == 8
    assert digest(torch.ones(3, dtype=torch.bfloat16)) != digest(torch.ones(3, dtype=torch.float16))
    with pytest.raises(TypeError, match="content_digest takes patterns.*got object"):
        digest(object())
