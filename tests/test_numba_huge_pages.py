"""The numba backend's fresh results on transparent huge pages: advised where the system has them, plain tensors
otherwise, and the values the kernels write unchanged."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import sparse_attn as sa
from sparse_attn.api import sparse_attention
from sparse_attn.backends.numba import huge_pages

_MIB = 1 << 20
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _advised(address: int) -> bool:
    """Whether the mapping holding ``address`` is advised for huge pages ("hg" in its smaps VmFlags)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _THP.exists() or "[never]" in _THP.read_text(),
                    reason="transparent huge pages are Linux's, and off on this system")
def test_a_large_result_is_advised_over_its_whole_huge_pages():
    out = huge_pages.empty((4, 1 << 20), torch.float32)                  # 16 MiB: at least 7 whole 2 MiB pages
    start = out.data_ptr()
    first = -(-start // (2 * _MIB)) * (2 * _MIB)
    assert _advised(first) and _advised(start + 16 * _MIB - 2 * _MIB - 1)


def test_a_result_without_a_whole_huge_page_is_a_plain_tensor():
    small = huge_pages.empty((3, 5), torch.bfloat16)
    assert small.shape == (3, 5) and small.dtype == torch.bfloat16 and small.is_contiguous()


def test_results_on_huge_pages_are_what_the_reference_computes():
    """Large enough that out, dq, dk and dv hold whole huge pages (2 x 4 x 2048 x 64 float32: 8 MiB each)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 2048, 64, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pattern = sa.Local(64) | sa.Global(first=2)
    results = []
    for backend in ("numba", "reference"):
        out = sparse_attention(q, k, v, pattern, backend=backend)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        results.append((out, *grads))
    for ours, oracle in zip(*results):
        torch.testing.assert_close(ours, oracle, rtol=1e-10, atol=1e-10)
