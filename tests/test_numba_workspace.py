"""The numba backend's workspace: operand copies reused from call to call, per thread, never changing a result."""
from __future__ import annotations

import threading

import numba
import pytest
import torch

import sparse_attn as sa
from sparse_attn.api import sparse_attention
from sparse_attn.backends.numba import workspace

PATTERN = sa.Local(40) | sa.Global(first=3)


def _forward_backward(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """out and the gradients of q, k, v of one numba call over n tokens (B=2, H=2, D=32, float32)."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, 2, n, 32, requires_grad=True) for _ in range(3))
    out = sparse_attention(q, k, v, PATTERN, backend="numba")
    out.backward(torch.randn_like(out))
    return out.detach(), q.grad, k.grad, v.grad


def test_a_later_call_reuses_the_buffers_and_gets_the_same_results(float32_route):
    """After a call over 300 tokens, a call over 200 runs in the same (larger, dirty) buffers: bit for bit what it
    gives from freshly allocated ones. "S" is the transposed K and Q of brgemm's route; "dQ parts" the backward's
    per-worker dQ sums (held with two or more threads)."""
    workspace.release()
    fresh = _forward_backward(200)
    _forward_backward(300, seed=1)
    held = workspace.held_bytes()
    names = ["S", "dP"] if float32_route == "brgemm" else []
    names += ["dQ parts"] if numba.get_num_threads() > 1 else []
    pointers = [_address(name) for name in names]
    assert held > 0 or not names
    reused = _forward_backward(200)
    assert workspace.held_bytes() == held and [_address(name) for name in names] == pointers   # nothing new
    for a, b in zip(fresh, reused):
        assert torch.equal(a, b)
    workspace.release()
    assert workspace.held_bytes() == 0


def _address(name: str) -> int:
    """Where this thread's buffer ``name`` starts (asking for one byte of it neither grows nor moves it)."""
    return workspace.empty(name, (1,), torch.uint8).data_ptr()


def test_each_thread_has_its_own_buffers(float32_route):
    """A call from another thread fills that thread's buffers, not the caller's (two threads may run calls at
    once; each call's copies must stay its own until it returns). Its call is shorter, so its buffers are
    smaller: one set shared by the threads would have changed the caller's."""
    if float32_route == "blas" and numba.get_num_threads() == 1:
        pytest.skip("one thread on the BLAS route: no buffer is held")
    workspace.release()
    _forward_backward(200)
    mine = workspace.held_bytes()
    theirs = []

    def call():
        workspace.release()
        _forward_backward(100)
        theirs.append(workspace.held_bytes())

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert 0 < theirs[0] < mine == workspace.held_bytes()
    workspace.release()
