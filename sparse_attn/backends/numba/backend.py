"""The Numba backend's interface (``BLOCK_SIZE``, ``available``, ``check``, ``attention``), what
``sparse_attn.backends.load("numba")`` returns, and the two torch custom ops that run its kernels
(autograd, torch.compile and opcheck see them as two opaque ops taking the layout's ``KernelIndex`` as
``index: list[Tensor]``, as the Triton backend's do).

>>> import torch, sparse_attn as sa
>>> from sparse_attn.backends.numba import backend
>>> q = torch.randn(1, 2, 100, 16)
>>> out, lse = backend.attention(q, q, q, sa.Local(16).layout(100, block_size=backend.BLOCK_SIZE), 0.25)
>>> out.shape, lse.shape
(torch.Size([1, 2, 100, 16]), torch.Size([1, 2, 100]))
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch

from ...layout import BlockLayout, KernelIndex
from ...score_mods import NO_MODS, ScoreMods
from . import notice, workspace
from .backward import backward_kernel, delta_rows, maxima_by_key_block, sum_parts
from .bf16 import backward_operands, bits, float32_brgemm, forward_operands
from .bf16 import native as native_bf16
from .bundles import Config, ForwardResult, Gradients, Incoming, block_index
from .exact import exact_dq_rows
from .forward import forward_kernel
from .lowlevel import KERNELS, matmul_blas
from .mods import call_modifiers
from .panels import PANEL_KEYS, panel_capacity
from .schedule import heaviest_first, static_schedule, task_costs

BLOCK_SIZE = 64
notice.announce_compiles()
_LOG2E = 1.0 / math.log(2.0)
_HALF = (torch.float16, torch.bfloat16)


def available() -> tuple[bool, str]:
    try:
        blas = matmul_blas()
    except ValueError as error:
        return False, f"backend='numba' has no BLAS for its matmuls: {error}"
    bf16, why = native_bf16()
    float32, route = float32_brgemm()
    return True, f"numba {numba.__version__}, {numba.get_num_threads()} threads; matmuls on {blas.name}; " \
                 f"float32: " + (f"matmuls on {route}" if float32 else f"matmuls on the BLAS ({route})") + \
                 "; bfloat16: " + (why if bf16 else f"computed in float32 ({why})")


def check(q, k, v, layout: BlockLayout) -> None:
    """Raise a ValueError if these inputs cannot run on this backend, saying what to do."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cpu":
            raise ValueError(f"backend='numba' runs on CPU tensors, got {name} on {t.device}; "
                             f"use backend='triton' for CUDA tensors or move the inputs with .cpu()")
    if layout.device.type != "cpu":
        raise ValueError(f"backend='numba' needs a CPU BlockLayout, got one on {layout.device}; use layout.to('cpu')")


def attention(q, k, v, layout: BlockLayout, scale: float, mods: ScoreMods = NO_MODS):
    """out (B, Hq, Nq, D) in q's dtype, lse (B, Hq, Nq) float32 (float64 for float64 inputs). ``mods``:
    softcap, then ALiBi, on every allowed score, inside the kernels (slopes as ``score_mods.check_mods``
    gives them: (B or 1, Hq), contiguous)."""
    dtype = q.dtype
    if dtype in _HALF and not bf16_matmuls(q, layout.block_size):
        q, k, v = q.float(), k.float(), v.float()
    out, lse, _, _ = numba_attention(q, k, v, list(layout.index), layout.block_size, scale, mods.softcap,
                                     mods.alibi_slopes)
    return out.to(dtype), lse


def bf16_matmuls(q: torch.Tensor, block_size: int) -> bool:
    """Whether the kernels run q's matmuls in bfloat16: q is bf16, the CPU has native bf16 dot products
    (``bf16.native``), and the head dim and block size are even (brgemm reads pairs of rows)."""
    return q.dtype == torch.bfloat16 and q.shape[-1] % 2 == 0 and block_size % 2 == 0 and native_bf16()[0]


def _brgemm_operands(q: torch.Tensor) -> bool:
    """Whether the kernels run the matmuls of contiguous q (float32 or bf16 as computed) on brgemm operands:
    bf16 ones (``bf16_matmuls`` chose them), or float32 ones where ``bf16.float32_brgemm``."""
    return q.dtype == torch.bfloat16 or (q.dtype == torch.float32 and float32_brgemm()[0])


@torch.library.custom_op("sparse_attn::numba_attention", mutates_args=())
def numba_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: list[torch.Tensor], block_size: int,
                    scale: float, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor]:
    """Forward kernel on float32/float64 CPU tensors, or bf16 ones where ``bf16_matmuls``: (out, lse,
    stats, argmax), out in q's dtype and the others float32 for bf16. index: the layout's ``KernelIndex`` as a
    list (``list(layout.index)``); softcap (0: none) and alibi_slopes ((B or 1, Hq), or None) as in
    ``score_mods.ScoreMods``.

    ``stats`` (2, B, Hq, Nq) and ``argmax`` (B, Hq, Nq) int64 are for the backward: each row's base-2
    score maximum and log2 of its sum, and the key holding the maximum."""
    dtype = _computed_in(q)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = workspace.result(q.shape, q.dtype)                                    # (B, Hq, Nq, D), q's dtype
    lse = q.new_empty(q.shape[:3], dtype=dtype)                                  # (B, Hq, Nq)
    stats = q.new_empty((2, *q.shape[:3]), dtype=dtype)                          # (2, B, Hq, Nq)
    argmax = torch.empty(q.shape[:3], dtype=torch.int64)                         # (B, Hq, Nq)
    idx = KernelIndex(*index)
    order = heaviest_first(task_costs(idx.full_ptr, idx.part_ptr, q.shape[0], q.shape[1]))
    rows = _row_index(idx)
    result = ForwardResult(_array(out), lse.numpy(), stats[0].numpy(), stats[1].numpy(), argmax.numpy())
    with KERNELS.running():                             # the float32 operands' transposition is a parallel kernel
        ops = forward_operands(q, k, v, numba.get_num_threads(), min(block_size, q.shape[2]),
                               panel_capacity(block_size, k.shape[2]), scale * _LOG2E) if _brgemm_operands(q) else None
        forward_kernel((_array(q), _array(k), _array(v)), ops, rows,
                       _config(dtype, block_size, scale, softcap, alibi_slopes, q.shape[2], k.shape[2]), order,
                       numba.get_num_threads(), result)
    return out, lse, stats, argmax


@numba_attention.register_fake
def _(q, k, v, index, block_size, scale, softcap=0.0, alibi_slopes=None):
    """Contiguous outputs whatever q's strides, as the kernel writes them (Inductor checks the strides)."""
    rows, dtype = q.shape[:3], _computed_in(q)
    return (q.new_empty(q.shape), q.new_empty(rows, dtype=dtype), q.new_empty((2, *rows), dtype=dtype),
            q.new_empty(rows, dtype=torch.int64))


@torch.library.custom_op("sparse_attn::numba_attention_backward", mutates_args=())
def numba_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, stats: torch.Tensor, argmax: torch.Tensor,
                             dlse: torch.Tensor, index: list[torch.Tensor], block_size: int, scale: float,
                             softcap: float = 0.0,
                             alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """Backward kernel: (dq, dk, dv) in q's dtype from dout and dlse, the gradients of out and lse;
    out (q's dtype; bf16 read as float32), lse, stats and argmax are the forward's (float32 with bf16 q, k, v:
    bf16 matmuls); index, softcap and alibi_slopes the forward's (the slopes get no gradient)."""
    dtype = _computed_in(q)
    idx = KernelIndex(*index)
    dout = dout.to(q.dtype)                                       # out and dout as q: bf16 ones read as float32
    dout, q, k, v, out, lse, dlse = (t.contiguous() for t in (dout, q, k, v, out, lse, dlse))
    batch, heads, n_q, dim = q.shape
    workers = numba.get_num_threads()
    costs = task_costs(idx.full_t_ptr, idx.part_t_ptr, batch, heads, (k.shape[0], k.shape[1]))
    schedule = static_schedule(heaviest_first(costs), costs, workers)
    # Written (dq zeroed, worker by worker) inside the kernels: no serial memset of fresh pages.
    delta = torch.empty_like(lse)                                                # (B, Hq, Nq)
    dq = workspace.result(q.shape, dtype)                                        # contiguous, as the fake
    dk, dv = workspace.result(k.shape, q.dtype), workspace.result(v.shape, q.dtype)  # stored by the kernel
    dq_parts = workspace.empty("dQ parts", (workers - 1, *q.shape), dtype)        # (W-1, B, Hq, Nq, D)
    rows = batch * heads * n_q
    not_finite = np.empty(rows, np.bool_)                                        # dq rows to recompute exactly
    qkv = (_array(q), _array(k), _array(v))
    row_max, row_sum = stats.contiguous().numpy()
    result = ForwardResult(_array(out), lse.numpy(), row_max, row_sum, argmax.contiguous().numpy())
    incoming = Incoming(_array(dout), dlse.numpy(), delta.numpy())
    columns = block_index(idx.full_t_ptr, idx.full_t_idx, idx.part_t_ptr, idx.part_t_idx, idx.part_t_mask,
                          idx.masks, transposed=True)
    config = _config(dtype, block_size, scale, softcap, alibi_slopes, n_q, k.shape[2])
    with KERNELS.running():
        ops = backward_operands(q, k, v, dout, workers, min(block_size, k.shape[2]),
                                panel_capacity(block_size, n_q), scale * _LOG2E) if _brgemm_operands(q) else None
        delta_rows(result.out.reshape(rows, dim), incoming.dout.reshape(rows, dim), lse.view(rows).numpy(),
                   dlse.view(rows).numpy(), _as(dtype, 0), delta.view(rows).numpy())
        maxima = maxima_by_key_block(result.argmax, block_size, idx.full_t_ptr.shape[2] - 1)
        backward_kernel(qkv, ops, result, incoming, maxima, columns, config, schedule,
                        Gradients(dq.numpy(), dq_parts.numpy(), _array(dk), _array(dv)))
        sum_parts(dq.view(rows, dim).numpy(), dq_parts.view(workers - 1, rows, dim).numpy(), not_finite)
        if not_finite.any():
            exact_dq_rows(np.flatnonzero(not_finite), qkv, result, incoming, _row_index(idx), config, dq.numpy())
    return _returned(dq, q.dtype), dk, dv


@numba_attention_backward.register_fake
def _(dout, q, k, v, out, lse, stats, argmax, dlse, index, block_size, scale, softcap=0.0, alibi_slopes=None):
    """Contiguous gradients whatever the strides of q, k, v, as the kernel writes them."""
    return tuple(t.new_empty(t.shape) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, index, block_size, scale, softcap, alibi_slopes = inputs
    out, lse, stats, argmax = output
    ctx.mark_non_differentiable(stats, argmax)
    ctx.save_for_backward(q, k, v, out, lse, stats, argmax, alibi_slopes, *index)
    ctx.block_size, ctx.scale, ctx.softcap = block_size, scale, softcap


def _autograd_backward(ctx, dout, dlse, _dstats, _dargmax):
    q, k, v, out, lse, stats, argmax, alibi_slopes, *index = ctx.saved_tensors  # an unused lse gets zeros
    dq, dk, dv = numba_attention_backward(dout, q, k, v, out, lse, stats, argmax, dlse, index, ctx.block_size,
                                          ctx.scale, ctx.softcap, alibi_slopes)
    after_index = len(ctx.needs_input_grad) - 4     # block_size, scale, softcap, slopes: those the call holds
                                                    # (the dispatcher drops trailing ones left at their default)
    return (dq, dk, dv, [None] * len(index)) + (None,) * after_index


numba_attention.register_autograd(_autograd_backward, setup_context=_setup_context)


def _returned(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dq computed in t's dtype as the op returns it, in ``dtype`` (a result from the workspace for bf16)."""
    return t if t.dtype == dtype else workspace.result(t.shape, dtype).copy_(t)


def _computed_in(q: torch.Tensor) -> torch.dtype:
    """The dtype the kernels compute in for q: its own, float32 for bf16 (bf16 matmuls, float32 softmax)."""
    return torch.float32 if q.dtype == torch.bfloat16 else q.dtype


def _row_index(index: KernelIndex):
    """The layout's row BlockIndex (each query block's key blocks), as the kernels walk it."""
    return block_index(index.full_ptr, index.full_idx, index.part_ptr, index.part_idx, index.part_mask, index.masks,
                       transposed=False)


def _array(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as the kernels read it: a numpy view, bf16 as its bits (uint16)."""
    return bits(t) if t.dtype == torch.bfloat16 else t.numpy()


def _config(dtype: torch.dtype, block_size: int, scale: float, softcap: float, alibi_slopes: torch.Tensor | None,
            n_q: int, n_k: int) -> Config:
    """Sizes, scales and score modifiers of a call of n_q queries over n_k keys, the scales in the dtype
    computed in (float32 stays float32); the modifiers neutral where the call has none (``mods.call_modifiers``),
    so every call of a dtype runs the same compiled kernels."""
    return Config(block_size, max(1, PANEL_KEYS // block_size), _as(dtype, scale), _as(dtype, scale * _LOG2E),
                  *call_modifiers(softcap, alibi_slopes, dtype, n_q, n_k))


def _as(dtype: torch.dtype, x: float):
    """x as a numpy scalar of a float32 or float64 dtype."""
    return np.float32(x) if dtype == torch.float32 else np.float64(x)
