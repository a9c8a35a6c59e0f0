"""The numba backend's workspace: operand copies reused from call to call, per thread, and the memory of dropped
results reused by later ones, never changing a result and never touching a result someone holds."""
from __future__ import annotations

import threading

import numba
import pytest
import torch

import sparse_attn as sa
from sparse_attn.api import sparse_attention
from sparse_attn.backends.numba import workspace

PATTERN = sa.Local(40) | sa.Global(first=3)


@pytest.fixture(autouse=True)
def small_spares(monkeypatch):
    """Results of any size from the spares, so that this file's small shapes run through them."""
    monkeypatch.setattr(workspace, "SMALLEST_SPARE", 0)


def _forward_backward(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """out and the gradients of q, k, v of one numba call over n tokens (B=2, H=2, D=32, float32)."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, 2, n, 32, requires_grad=True) for _ in range(3))
    out = sparse_attention(q, k, v, PATTERN, backend="numba")
    out.backward(torch.randn_like(out))
    return out.detach(), q.grad, k.grad, v.grad


def test_a_later_call_reuses_the_buffers_and_gets_the_same_results(float32_route):
    """After a call over 300 tokens, a call over 200 runs in the same (larger, dirty) buffers: bit for bit what it
    gives from freshly allocated ones, and its results (out, dq, dk, dv) in the longer call's dropped results
    (1.5 times their size). "S" is the transposed K and Q of brgemm's route; "dQ parts" the backward's per-worker
    dQ sums (held with two or more threads)."""
    workspace.release()
    fresh = _forward_backward(200)
    dropped = [t.data_ptr() for t in _forward_backward(300, seed=1)]
    names = ["S", "dP"] if float32_route == "brgemm" else []
    names += ["dQ parts"] if numba.get_num_threads() > 1 else []
    pointers = [_address(name) for name in names]
    reused = _forward_backward(200)
    assert [_address(name) for name in names] == pointers                                        # nothing new
    assert sorted(t.data_ptr() for t in reused) == sorted(dropped)
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
    results = _forward_backward(200)                        # held: no spare results in held_bytes below
    mine = workspace.held_bytes()
    theirs, kept = [], []

    def call():
        workspace.release()
        kept.append(_forward_backward(100))                 # held (past the assert) as the caller's are
        theirs.append(workspace.held_bytes())

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert 0 < theirs[0] < mine == workspace.held_bytes()
    del results
    kept.clear()
    workspace.release()


def _forward(seed: int) -> torch.Tensor:
    """out of one numba forward over 300 tokens (B=1, H=2, D=32, float32)."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 300, 32) for _ in range(3))
    return sparse_attention(q, k, v, PATTERN, backend="numba")


def test_a_result_is_reused_only_once_nothing_shows_it():
    """Held results, and views of them, keep their values through later calls; the memory of a dropped one is
    what the next call returns."""
    workspace.release()
    held = _forward(0)
    expected = held.clone()
    later = _forward(1)
    assert later.data_ptr() != held.data_ptr() and torch.equal(held, expected)
    view = held[0, 1, :5]                                  # the view alone keeps the buffer
    del held
    third = _forward(2)
    assert third.data_ptr() not in (view.data_ptr(), later.data_ptr()) and torch.equal(view, expected[0, 1, :5])
    address = later.data_ptr()
    del later
    assert _forward(3).data_ptr() == address
    del view, third
    workspace.release()


def test_spare_results_are_capped_and_released():
    """At most SPARE_RESULTS dropped results stay held (the oldest go first), whichever thread drops them;
    release frees them."""
    workspace.release()
    results = [workspace.result((256,), torch.float32) for _ in range(workspace.SPARE_RESULTS + 2)]
    thread = threading.Thread(target=results.clear)                # the last views die on another thread
    thread.start()
    thread.join()
    assert workspace.held_bytes() == workspace.SPARE_RESULTS * 1024
    assert workspace.result((128,), torch.float64).data_ptr() != workspace.result((512,), torch.float32).data_ptr()
    workspace.release()
    assert workspace.held_bytes() == 0


def test_a_spare_serves_results_of_half_to_all_its_size_only():
    """A spare of 4 KiB is reused for 2 to 4 KiB, not for 1 KiB (most of it would sit idle under a small
    result), nor for more than it holds; bf16 results are bf16 tensors in it."""
    workspace.release()
    address = workspace.result((1024,), torch.float32).data_ptr()          # dropped at once: a spare
    assert workspace.result((256,), torch.float32).data_ptr() != address
    assert workspace.result((1025,), torch.float32).data_ptr() != address
    half = workspace.result((16, 64), torch.bfloat16)
    assert half.data_ptr() == address and half.dtype == torch.bfloat16 and half.is_contiguous()
    half.fill_(1.5)
    assert half.float().sum().item() == 1.5 * 1024
    del half
    workspace.release()


def test_results_under_the_smallest_spare_are_fresh(monkeypatch):
    """Under SMALLEST_SPARE bytes a result is a plain tensor: dropped, it leaves nothing held."""
    monkeypatch.setattr(workspace, "SMALLEST_SPARE", 4096)
    workspace.release()
    small = workspace.result((1023,), torch.float32)
    assert small.is_contiguous() and small.untyped_storage().nbytes() == 4092
    del small
    assert workspace.held_bytes() == 0
    workspace.result((1024,), torch.float32)                 # 4 KiB, dropped at once: a spare
    assert workspace.held_bytes() == 4096
    workspace.release()
