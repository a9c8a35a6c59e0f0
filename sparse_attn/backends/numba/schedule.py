"""Which worker runs which task: task costs (block counts), the forward's heaviest-first order (taken from
a shared counter) and the backward's static deal (reproducible dQ sums).

>>> import numpy as np
>>> from sparse_attn.backends.numba.schedule import heaviest_first, static_schedule
>>> costs = np.array([1, 5, 2, 5], np.int64)
>>> order = heaviest_first(costs)
>>> order.tolist()
[1, 3, 2, 0]
>>> ptr, tasks = static_schedule(order, costs, 2)
>>> ptr.tolist(), tasks.tolist()
([0, 2, 4], [1, 2, 0, 3])
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit


def task_costs(ptr: torch.Tensor, part_ptr: torch.Tensor, batch: int, heads: int,
                kv_shape: tuple[int, int] | None = None) -> np.ndarray:
    """Block count of every task (example, head, block), flat in task-id order.

    With ``kv_shape`` = (kv batch, kv heads) the tasks are (kv example, kv head, block) and a task sums
    the query examples that read it (all of them for kv batch 1) and the heads of its group.
    """
    counts = np.diff(ptr.numpy(), axis=-1) + np.diff(part_ptr.numpy(), axis=-1)  # (Bl, Hl, n_blocks)
    counts = np.broadcast_to(counts, (batch, heads, counts.shape[-1]))
    if kv_shape is not None:
        kv_batch, kv_heads = kv_shape
        counts = counts.reshape(kv_batch, batch // kv_batch, kv_heads, heads // kv_heads, -1).sum((1, 3))
    return counts.reshape(-1).astype(np.int64)


def heaviest_first(costs: np.ndarray) -> np.ndarray:
    """Task ids sorted by cost, heaviest first (stable)."""
    return np.argsort(-costs, kind="stable").astype(np.int64)


@njit(cache=True)
def static_schedule(order, costs, n_workers):
    """Tasks of ``order`` (heaviest first) dealt to the least-loaded worker so far (LPT, ties to
    the lowest worker): worker w runs ``tasks[ptr[w]:ptr[w + 1]]``, in task-id order (example, head,
    block), so consecutive tasks read the same head's rows while they are in cache; run heaviest
    first, they walked every head at each cost (BigBird-ITC forward+backward 1.03x-1.04x slower, in
    benchmarks/results/numba_ab). Depends only on the layout and n_workers, so the dQ sums of every
    worker's buffer are reproducible."""
    load = np.zeros(n_workers, np.int64)
    owner = np.empty(order.size, np.int64)
    ptr = np.zeros(n_workers + 1, np.int64)
    for t in range(order.size):
        w = np.argmin(load)
        owner[t] = w
        load[w] += costs[order[t]] + 1                                           # +1: a task's fixed cost
        ptr[w + 1] += 1
    ptr = np.cumsum(ptr)
    tasks = np.empty(order.size, np.int64)
    fill = ptr[:-1].copy()
    for t in range(order.size):
        tasks[fill[owner[t]]] = order[t]
        fill[owner[t]] += 1
    for w in range(n_workers):
        tasks[ptr[w]:ptr[w + 1]] = np.sort(tasks[ptr[w]:ptr[w + 1]])
    return ptr, tasks
