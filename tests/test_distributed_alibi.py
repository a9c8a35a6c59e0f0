"""sparse_attn.distributed with ``alibi_slopes``: every rank runs the same exchanges in the backward, whatever its
rows hold.

With ALiBi a rank runs one backend call per run of consecutive key blocks and per shipped segment, and a rank
whose rows (or whose keys, for the shipped rows) meet no block makes no call. Its output must still depend on
its q, k and v, or its backward skips the exchanges the other ranks wait in: a right-padded batch whose last
rank attends no key (its ``backward()`` raised, the others waited for the process group's timeout), documents
or ``Local(39) | Global(last=2)`` where a rank's keys serve no shipped row (gloo: "collective mismatch").

The distributed runs reuse tests/test_distributed.py's spawn of gloo ranks (collectives time out after
COLLECTIVE_SECONDS) and its comparison with single-process ``sa.sparse_attention``, float64, to 1e-12.
"""
from __future__ import annotations

import pytest
import torch

import sparse_attn as sa
from sparse_attn import distributed
from tests.test_distributed import (
    WORLDS,
    Case,
    assert_every_rank_passed,
    attend,
    case_plan,
    check_case,
    full_inputs,
    shard_rows,
    spawn,
)

SLOPES = torch.tensor([0.25, 0.5], dtype=torch.float64)            # (Hq,): 2 query heads
CASES = {
    # keys from 56 on are padding: with Local(4), the rows of rank 1 (of 2) and ranks 2, 3 (of 4) attend none
    "right-padded": Case(sa.Local(4), 128, {2: (64, 64), 4: (32, 32, 32, 32)},
                         call={"key_padding_mask": torch.arange(128)[None] >= 56, "alibi_slopes": SLOPES}),
    "right-padded-numba": Case(sa.Local(4), 128, {2: (64, 64)}, backend="numba",
                               call={"key_padding_mask": torch.arange(128)[None] >= 56, "alibi_slopes": SLOPES}),
    # rank 0's one row (a global row: its document's first token) ships; its document ends before rank 3's keys
    "documents": Case(sa.Local(10) | sa.Global(first=1), 300, {4: (1, 99, 100, 100)}, batch=2,
                      call={"documents": sa.documents_from_lengths([[70, 45, 120, 50], [130, 1, 100]], 300),
                            "alibi_slopes": torch.tensor([[0.25, 0.5], [0.125, 1.0]], dtype=torch.float64)}),
    # rank 1's rows (42..52) ship; causal, they attend none of rank 3's keys (66..99)
    "local-39-global-last-causal": Case(sa.Local(39) | sa.Global(last=2), 100, {4: (42, 11, 13, 34)},
                                        call={"causal": True, "alibi_slopes": SLOPES}),
}


def check_zero_loss_where_no_key(case: Case, rank: int, world: int, group) -> None:
    """The docs' remedy: the ranks whose rows attend no key back-propagate ``(out * 0).sum()``, the others their
    loss; every rank's gradients are those of the single-process loss of the other ranks' rows."""
    q, k, v, grad_out = full_inputs(case)
    _, lse = sa.sparse_attention(q, k, v, case.pattern, backend=case.backend, return_lse=True, **case.call)
    empty = [bool(torch.isneginf(lse[:, :, shard_rows(case, world, r)]).all()) for r in range(world)]
    assert any(empty) and not all(empty), f"the case needs ranks with and without keys, got {empty}"
    for r in range(world):
        if empty[r]:
            grad_out[:, :, shard_rows(case, world, r)] = 0
    want = attend(sa.sparse_attention, q, k, v, grad_out, case)[2:]                 # dq, dk, dv
    rows = shard_rows(case, world, rank)
    mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    out = distributed.sparse_attention(*mine, case.pattern, group=group, backend=case.backend, **case.call)
    assert out.requires_grad, "a rank whose rows attend no key returned an output that does not need a gradient"
    ((out * 0).sum() if empty[rank] else (out * grad_out[:, :, rows]).sum()).backward()
    for what, got, ref in zip(("dq", "dk", "dv"), (t.grad for t in mine), want):
        error = (got - ref[:, :, rows]).abs().max().item()
        assert error <= 1e-12, f"{what}: max error {error:.3e}"


def alibi_checks():
    """(world, name, check(rank, world, group)) for the spawn of tests/test_distributed.py."""
    checks = [(world, name, lambda r, w, g, case=case: check_case(case, r, w, g))
              for name, case in CASES.items() for world in WORLDS if world in case.shards]
    return checks + [(world, "zero-loss", lambda r, w, g: check_zero_loss_where_no_key(CASES["right-padded"], r, w, g))
                     for world in WORLDS]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    return spawn(tmp_path_factory.mktemp("ranks"), alibi_checks)


@pytest.mark.slow  # one spawn of 4 gloo ranks runs every check
@pytest.mark.parametrize("world, name", [(w, name) for name, case in CASES.items() for w in WORLDS if w in case.shards])
def test_shards_equal_single_process_with_alibi(ranks, world, name):
    assert_every_rank_passed(ranks, world, name)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_ranks_that_attend_no_key_back_propagate_a_zero_loss(ranks, world):
    assert_every_rank_passed(ranks, world, "zero-loss")


@pytest.mark.parametrize("world, name", [(w, name) for name, case in CASES.items() for w in WORLDS if w in case.shards])
def test_the_cases_have_a_rank_without_a_backend_call(world, name):
    """What the cases are there for: with ALiBi, some rank makes no local call (its rows attend no key) or no
    shipped call (its keys serve no shipped row) while another rank makes one."""
    case = CASES[name]
    plan = case_plan(case._replace(call={key: value for key, value in case.call.items() if key != "alibi_slopes"}),
                     world)
    programs = [plan.program(r, alibi=True) for r in range(world)]
    local = [bool(p.local_calls) for p in programs]
    shipped = [bool(p.shipped_calls) for p in programs if p.shipped_layout is not None]
    assert (any(local) and not all(local)) or (any(shipped) and not all(shipped))
