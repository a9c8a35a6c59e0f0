"""sparse_attn.distributed with softcap, alibi_slopes and sinks (issue 27) against the float64 oracle of
tests/score_mods_oracle.py over the whole sequence: ALiBi at the positions of the whole sequence (key runs
before, around and after a rank's rows, shipped global rows), the sink once per row after the ranks' merge.

One spawn of 3 gloo ranks on this machine's CPU runs every case (each rank compares its shard's out, lse, dq,
dk, dv and its rows' share of dsinks) and writes its outcomes to a file; one pytest test per case reads them.
"""
from __future__ import annotations

import json
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparse_attn as sa
from sparse_attn import distributed
from sparse_attn.shard_plan import ShardPlan
from tests.score_mods_oracle import oracle

WORLD = 3
SPAWN_SECONDS = 300
N = 300
SHARDS = (100, 90, 110)
DOUBLE = torch.float64


def padding_and_documents():
    padding = torch.zeros(2, N, dtype=torch.bool)
    padding[1, 250:] = True
    return {"key_padding_mask": padding, "documents": sa.documents_from_lengths([[120, 100, 80], [170, 130]], n=N)}


CASES = {   # name: (pattern, batch, kv heads (of 4 query heads), call-time data, modifiers)
    "global rows ship, all three": (sa.Local(16) | sa.Global(first=8), 1, 4, {},
                                    dict(softcap=2.0, alibi_slopes="heads", sinks=True)),
    "sink run before the rows": (sa.Local(20, 0) | sa.Sink(first=4), 2, 2, {"causal": True},
                                 dict(alibi_slopes="examples", sinks=True)),
    "a global column after the rows": (sa.Local(6) | sa.Global(tokens=(N - 1,)), 1, 2, {},
                                       dict(alibi_slopes="heads")),
    "key runs before, around and after": ((sa.Local(8) | sa.Sink(tokens=(20, 150, 280))).layout(N, heads=4,
                                                                                             block_size=16), 2, 2, {},
                                 dict(softcap=3.0, alibi_slopes="heads")),
    "documents and padding": (sa.Local(10) | sa.Global(first=1), 2, 2, "padding_and_documents",
                              dict(alibi_slopes="examples", sinks=True)),
    "sinks only": (sa.Local(16) | sa.Global(first=8), 1, 4, {}, dict(sinks=True)),
    "numba, all three": (sa.Local(20, 0) | sa.Sink(first=4), 2, 2, {"causal": True},
                         dict(softcap=2.0, alibi_slopes="examples", sinks=True)),
}
BACKEND = {"numba, all three": "numba"}   # the others: the reference backend


def inputs(name):
    """q, k, v, the output and lse gradients, the modifiers and the call-time data of a case: float64, the same on
    every rank."""
    pattern, batch, kv_heads, call, mods = CASES[name]
    call = globals()[call]() if isinstance(call, str) else call
    gen = torch.Generator().manual_seed(len(name))
    q = torch.randn(batch, 4, N, 16, generator=gen, dtype=DOUBLE)
    k, v = (torch.randn(batch, kv_heads, N, 16, generator=gen, dtype=DOUBLE) for _ in "kv")
    grads = torch.randn(q.shape, generator=gen, dtype=DOUBLE), torch.randn(q.shape[:3], generator=gen, dtype=DOUBLE)
    slope_shape = {"heads": (4,), "examples": (batch, 4)}.get(mods.get("alibi_slopes"))
    modifiers = {"softcap": mods.get("softcap"),
                 "alibi_slopes": None if slope_shape is None else torch.rand(slope_shape, generator=gen, dtype=DOUBLE),
                 "sinks": torch.randn(4, generator=gen, dtype=DOUBLE) if mods.get("sinks") else None}
    return pattern, (q, k, v), grads, modifiers, call


def layout_of(pattern, call) -> sa.BlockLayout:
    return pattern if isinstance(pattern, sa.BlockLayout) else pattern.layout(N, heads=4, **call)


def check(name: str, rank: int, group) -> None:
    pattern, qkv, (g_out, g_lse), mods, call = inputs(name)
    start = sum(SHARDS[:rank])
    rows = slice(start, start + SHARDS[rank])
    mask = layout_of(pattern, call).to_dense()
    full = [t.clone().requires_grad_() for t in qkv]
    sinks = None if mods["sinks"] is None else mods["sinks"].clone().requires_grad_()
    want = oracle(*full, mask, 0.25, mods["softcap"], mods["alibi_slopes"], sinks)
    mine = [t[:, :, rows].clone().requires_grad_() for t in qkv]
    my_sinks = None if sinks is None else mods["sinks"].clone().requires_grad_()
    got = distributed.sparse_attention(*mine, pattern, group=group, backend=BACKEND.get(name, "reference"),
                                       return_lse=True,
                                       softcap=mods["softcap"], alibi_slopes=mods["alibi_slopes"], sinks=my_sinks,
                                       **call)
    close = {"atol": 1e-12, "rtol": 1e-10} if name not in BACKEND else {"atol": 1e-10, "rtol": 1e-8}
    for what, a, b in zip(("out", "lse"), got, want):
        torch.testing.assert_close(a, b[:, :, rows], **close, msg=what)
    # every rank's loss reaches this rank's k, v (their gradients come back from the ranks that read them); the
    # sinks' gradient is this rank's rows' share (as for any replicated parameter, before an all-reduce)
    ours = torch.autograd.grad(loss(*got, g_out[:, :, rows], g_lse[:, :, rows]), mine + [my_sinks][:sinks is not None])
    theirs = torch.autograd.grad(loss(*want, g_out, g_lse), full, retain_graph=True)
    for what, a, b in zip(("dq", "dk", "dv"), ours, theirs):
        torch.testing.assert_close(a, b[:, :, rows], **close, msg=what)
    if sinks is not None:
        share = torch.autograd.grad(loss(want[0][:, :, rows], want[1][:, :, rows], g_out[:, :, rows],
                                         g_lse[:, :, rows]), sinks)[0]
        torch.testing.assert_close(ours[3], share, **close, msg="dsinks")


def loss(out, lse, g_out, g_lse):
    """A random linear function of out and the finite lse (rows without a key and a sink have lse -inf)."""
    return (out * g_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * g_lse).sum()


def worker(rank: int, port: int, folder: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["NUMBA_NUM_THREADS"] = "1"                 # one thread per rank: the ranks share the cores
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=SPAWN_SECONDS))
    with open(Path(folder) / f"rank{rank}.jsonl", "w") as log:
        for name in CASES:
            group = dist.new_group(list(range(WORLD)), backend="gloo", timeout=timedelta(seconds=30))
            try:
                check(name, rank, group)
                error = None
            except Exception:
                error = traceback.format_exc()
            log.write(json.dumps({"case": name, "error": error}) + "\n")
            log.flush()
            dist.barrier()
    dist.destroy_process_group()


def warm_up() -> None:
    """Numba's kernels of the numba case compiled (or loaded from its cache) once, here, not by every rank while
    the others wait in a collective."""
    q = torch.randn(1, 4, 70, 16, dtype=DOUBLE, requires_grad=True)
    kv = torch.randn(1, 2, 70, 16, dtype=DOUBLE)
    out = sa.sparse_attention(q, kv, kv, sa.Local(4), backend="numba", softcap=2.0, alibi_slopes=torch.ones(4,
                              dtype=DOUBLE), return_lse=True)
    (out[0].sum() + out[1].sum()).backward()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """{case: [each rank's error, None if it passed]} from one spawn."""
    folder = tmp_path_factory.mktemp("ranks")
    warm_up()
    context = mp.start_processes(worker, args=(free_port(), str(folder)), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline, crash = time.monotonic() + SPAWN_SECONDS, "it did not finish"
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1), grace_period=5):
            if time.monotonic() > deadline:
                crash = f"the spawn ran past {SPAWN_SECONDS} s and was killed"
                break
    except Exception as exc:
        crash = f"a rank crashed: {exc}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    result = {name: [f"rank {r}: {crash}" for r in range(WORLD)] for name in CASES}
    for r in range(WORLD):
        path = folder / f"rank{r}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else ():
            record = json.loads(line)
            result[record["case"]][r] = record["error"]
    return result


@pytest.mark.slow  # one spawn of gloo ranks runs every case
@pytest.mark.parametrize("name", list(CASES))
def test_shards_equal_the_oracle(outcomes, name):
    failures = [f"rank {r}:\n{error}" for r, error in enumerate(outcomes[name]) if error is not None]
    assert not failures, "\n".join(failures)


def test_the_cases_reach_every_kind_of_key_run():
    """What the cases above exercise: shipped rows, and key runs before, around and after a rank's rows."""
    def calls(name):
        pattern, batch, kv_heads, call, _ = CASES[name]
        call = globals()[call]() if isinstance(call, str) else call
        plan = ShardPlan.build(layout_of(pattern, call), SHARDS, kv_heads=kv_heads, q_batch=batch,
                               itemsize=8)
        return [plan.program(r, alibi=True) for r in range(WORLD)]
    shipped = calls("global rows ship, all three")
    assert any(p.shipped_calls for p in shipped)
    before = calls("sink run before the rows")[2].local_calls              # the sink block, then the window
    assert len(before) == 2 and before[0].pad_keys > 0 and before[0].shift > 0
    after = calls("a global column after the rows")[0].local_calls
    assert any(c.pad_rows > 0 and c.shift > 0 for c in after)
    assert len(calls("key runs before, around and after")[1].local_calls) == 3
