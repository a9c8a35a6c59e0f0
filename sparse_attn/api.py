"""``sparse_attention()``: validation, the layout to run and dispatch to a backend.

A Pattern's layout comes from ``compiler.build_layout``, which keeps layouts in ``compiler.LAYOUT_CACHE``
and packed documents' block classes in ``compiler.DOCUMENT_CLASSES``; this module holds no cache.

>>> import torch, sparse_attn as sa
>>> q = k = v = torch.randn(1, 2, 100, 16)
>>> sa.sparse_attention(q, k, v, sa.Local(8), backend="reference").shape
torch.Size([1, 2, 100, 16])
"""
from __future__ import annotations

import math
import numbers
import operator

import numpy as np
import torch
from einops import rearrange

from . import backends
from .backends import sdpa
from .checks import check_bool
from .compiler import build_layout, check_call_masks
from .layout import BlockLayout, KernelIndex
from .pattern import Pattern, pattern_key
from .score_mods import add_sink, check_mods

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: Pattern | BlockLayout,
                     causal: bool = False, key_padding_mask: torch.Tensor | None = None,
                     global_mask: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                     scale: float | None = None, softcap: float | None = None,
                     alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                     backend: str = "auto", return_lse: bool = False):
    """Exact softmax attention over the (query, key) pairs that ``pattern`` allows.

    Args:
        q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D) with Hkv dividing Hq (grouped-query attention), or (1, Hkv,
            Nk, D): one k, v read by every example, never copied (a shared prefix; dk, dv sum over the batch).
        pattern: a Pattern, or a BlockLayout built once with ``pattern.layout(...)`` and reused.
        causal: also require ``j <= i + (Nk - Nq)``.
        key_padding_mask: (B, Nk) bool, True = padding (never attended).
        global_mask: (B, N) bool, True = that token is global in that example (needs Nq == Nk); with
            ``documents``, global within its own document.
        documents: (B, N) int (torch or numpy), one document id per token, -1 = padding (needs Nq == Nk).
            Each document is one contiguous run and attends as a sequence by itself: positions count
            from its first token, no pair crosses documents, padding rows output 0. Build it with
            ``sa.documents_from_lengths`` or ``sa.documents_from_cu_seqlens``.
        scale: score scale, default ``1 / sqrt(D)``.
        softcap: a float > 0: each allowed score ``s = scale * q_i . k_j`` becomes ``softcap * tanh(s / softcap)``
            (Gemma 2's logit soft-capping).
        alibi_slopes: (Hq,) or (B, Hq) float tensor on q's device: ``s`` becomes ``s - slope * |i + (Nk - Nq) - j|``
            (ALiBi, bottom-right positions as every pattern; within its document with ``documents``), after
            the softcap. The slopes get no gradient.
        sinks: (Hq,) float tensor on q's device, learned attention sinks (gpt-oss): ``exp(sinks[h])`` joins every
            row's softmax denominator with no value; differentiable.
        backend: "auto" (triton for CUDA tensors, numba for CPU, and for short float32 sequences on the CPU,
            without score modifiers or lse, torch's SDPA with the pattern's token mask, measured faster there:
            ``sparse_attn.backends.sdpa``), "reference", "numba" or "triton".
        return_lse: also return the log-sum-exp of each query row, (B, Hq, Nq) float32 (float64
            for float64 inputs); -inf for rows with no allowed key (whose output is 0). With ``sinks`` it
            includes the sink's term (a row with no allowed key: lse = its head's sink).

    Returns:
        out (B, Hq, Nq, D) in the dtype of q, or ``(out, lse)`` with ``return_lse=True``.

    Meta tensors (no values) give meta results of these shapes and dtypes, with an autograd graph, as
    torch's ``scaled_dot_product_attention`` does; the pattern and masks are checked but no layout is
    built, since a mask's values cannot be read.
    """
    batch, q_heads, n_q, head_dim = check_inputs(q, k, v)
    n_k = k.shape[2]
    return_lse = check_bool("return_lse", return_lse)
    module = backends.load(backends.choose(backend, q.device))
    scale = resolve_scale(scale, head_dim)
    mods, sinks = check_mods(q, softcap, alibi_slopes, sinks)
    if q.device.type == "meta":
        check_pattern_arg(pattern, batch, q_heads, n_q, n_k, causal, key_padding_mask, global_mask, documents)
        out, lse = _meta_attention(q, k, v)
    else:
        layout = _layout_on(q.device, pattern, batch, q_heads, n_q, n_k, module.BLOCK_SIZE, causal,
                            key_padding_mask, global_mask, documents)
        if backend == "auto" and sdpa.takes(q, k, v, layout, mods, sinks, return_lse):    # short sequences on the CPU
            return sdpa.attention(q, k, v, layout, scale)
        module.check(q, k, v, layout)
        out, lse = module.attention(q, k, v, layout, scale, mods)
    if sinks is not None:
        out, lse = add_sink(out, lse, sinks)
    return (out, lse) if return_lse else out


def resolve_layout(pattern, batch: int, heads: int, n_q: int, n_k: int, block_size: int, causal: bool,
                   key_padding_mask, global_mask, documents=None) -> BlockLayout:
    """The layout to run: a prebuilt one checked against the inputs, or one built from the pattern (the
    compiler checks the call-time masks and documents against the inputs' batch, once)."""
    if isinstance(pattern, Pattern):
        return build_layout(pattern, n_q, n_k, heads, block_size, causal=causal, global_mask=global_mask,
                            key_padding_mask=key_padding_mask, documents=documents, batch=batch)
    check_pattern_arg(pattern, batch, heads, n_q, n_k, causal, key_padding_mask, global_mask, documents)
    return pattern


def _layout_on(device: torch.device, pattern, batch: int, heads: int, n_q: int, n_k: int, block_size: int, causal,
               key_padding_mask, global_mask, documents) -> BlockLayout:
    """The layout to run, on ``device``.

    Under torch.compile the layout stays out of the graph (``sparse_attn.tracing`` holds the host code). A prebuilt
    layout, and a Pattern without call-time data at static sizes, are found (built, cached, moved) while Dynamo
    traces, and the graph reads their tensors as constants: no graph break, so ``fullgraph=True`` works. The pattern
    crosses to the host as its ``pattern_key``, so Dynamo guards on its values, not its identity: an equal pattern
    made anew every step, outside the compiled function or inside it, runs the same graph. Call-time masks and
    documents are data, and dynamic sizes have no value while tracing: their layout is built on the host when the
    graph runs, a graph break (an error under ``fullgraph=True`` that says how to keep the graph whole)."""
    if not torch.compiler.is_compiling():
        return resolve_layout(pattern, batch, heads, n_q, n_k, block_size, causal, key_padding_mask, global_mask,
                              documents).to(device)
    from . import tracing  # only while Dynamo traces, which runs the import itself

    if isinstance(pattern, Pattern) and not (key_padding_mask is None and global_mask is None and documents is None):
        return tracing.layout_of_call_data(device, pattern, batch, heads, n_q, n_k, block_size, causal,
                                            key_padding_mask, global_mask, documents)  # their checks read values
    check_pattern_arg(pattern, batch, heads, n_q, n_k, causal, key_padding_mask, global_mask, documents)
    if isinstance(pattern, BlockLayout):
        if pattern.device == device:
            return pattern                             # its tensors are the graph's inputs
        moved = tracing.moved_index(device, *pattern.index)
        return BlockLayout.trusted(pattern=pattern.pattern, n_q=pattern.n_q, n_k=pattern.n_k, heads=pattern.heads,
                                   block_size=pattern.block_size, causal=pattern.causal,
                                   **dict(zip(KernelIndex._fields, moved)))
    if not (_static(n_q) and _static(n_k) and _static(heads)):
        return tracing.layout_of_dynamic_sizes(device, pattern, heads, n_q, n_k, block_size, causal)
    index = tracing.pattern_index(device, _constants(pattern_key(pattern)), int(heads), int(n_q), int(n_k),
                                   block_size, causal)
    return BlockLayout.trusted(pattern=pattern, n_q=n_q, n_k=n_k, heads=heads, block_size=block_size,
                               causal=causal, **dict(zip(KernelIndex._fields, index)))


def _static(size) -> bool:
    """Whether a size has one value while Dynamo traces (a dynamic size is a symbol). Dynamo shows a SymInt to
    ``isinstance`` as an int, so a type test cannot tell; ``has_static_value`` is torch's test, which Dynamo
    answers while tracing (sympy comes with Dynamo: imported here, not with the package)."""
    from torch.fx.experimental.symbolic_shapes import has_static_value

    return has_static_value(size)


def _constants(key):
    """A ``pattern_key`` with every int a constant. Dynamo traces an int read from a pattern passed as an argument
    as a symbol once its value has changed between calls; ``operator.index`` makes it the int it is (and guards on
    it), so each pattern compiles once and its key reaches the host as values."""
    if isinstance(key, tuple):
        return tuple(_constants(part) for part in key)
    return operator.index(key) if isinstance(key, int) else key


def check_pattern_arg(pattern, batch: int, heads: int, n_q: int, n_k: int, causal, key_padding_mask,
                      global_mask, documents=None) -> None:
    """The pattern (or prebuilt layout), causal and the call-time masks, against the inputs' shapes."""
    causal = check_bool("causal", causal)
    if isinstance(pattern, BlockLayout):
        if causal or key_padding_mask is not None or global_mask is not None or documents is not None:
            raise ValueError("causal, key_padding_mask and global_mask are part of a prebuilt BlockLayout, and so "
                             "are documents: build it with pattern.layout(..., causal=..., key_padding_mask=..., "
                             "global_mask=..., documents=...) or pass the Pattern instead")
        _check_layout(pattern, batch, heads, n_q, n_k)
    elif isinstance(pattern, Pattern):
        check_call_masks(n_q, n_k, global_mask, key_padding_mask, batch, documents)
        pattern.check_heads(heads)
    else:
        raise TypeError(f"pattern must be a sparse_attn Pattern or BlockLayout, got {type(pattern).__name__}")


def _meta_attention(q, k, v):
    """out (B, Hq, Nq, D) and lse (B, Hq, Nq) as meta tensors: the reference computation with every pair
    allowed, which on meta tensors only propagates shapes, dtypes and the autograd graph (k, v of batch 1
    broadcast over q's batch in the einsums, so dk, dv keep batch 1)."""
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q = rearrange(q, "b (h g) q d -> b h g q d", h=k.shape[1])                                 # (B, Hkv, G, Nq, D)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k).to(lse_dtype)                             # (B, Hkv, G, Nq, Nk)
    out = torch.einsum("bhgqk,bhkd->bhgqd", scores.softmax(-1).to(v.dtype), v)                 # (B, Hkv, G, Nq, D)
    return rearrange(out, "b h g q d -> b (h g) q d"), rearrange(scores.logsumexp(-1), "b h g q -> b (h g) q")


def resolve_scale(scale, head_dim: int) -> float:
    """``scale``, defaulting to 1 / sqrt(head_dim); any finite positive real (numpy scalars included)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real) or not 0 < scale < math.inf:  # type: ignore[operator]
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    return float(scale)


def check_inputs(q, k, v=None) -> tuple[int, int, int, int]:
    """Types, shapes, dtypes and devices of q, k (and v): returns (batch, q_heads, n_q, head_dim) of q.

    k and v have q's batch or batch 1 (one k, v shared by every example of q)."""
    named = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq_len, head_dim), got {tuple(t.shape)}; "
                             f"for (batch, seq_len, heads, head_dim) inputs use .transpose(1, 2)")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    names = ", ".join(name for name, _ in named)
    if len({t.dtype for _, t in named}) > 1:
        raise TypeError(f"{names} must share one dtype, got {', '.join(str(t.dtype) for _, t in named)}")
    if len({t.device for _, t in named}) > 1:
        raise ValueError(f"{names} must be on one device, got {', '.join(str(t.device) for _, t in named)}")
    if v is not None and k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same batch (both 1 to share them with every example of q, or both "
                         f"q's batch {q.shape[0]}), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if v is not None and k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (batch, kv_heads, n_k, head_dim), "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, q_heads, n_q, head_dim = q.shape
    if k.shape[0] not in (1, batch) or k.shape[3] != head_dim:
        batches = "1" if batch == 1 else f"1 or {batch}"
        raise ValueError(f"k must have batch {batches} and head_dim {head_dim} like q {tuple(q.shape)}, got shape "
                         f"{tuple(k.shape)}; batch 1 shares one k, v with every example of q")
    if k.shape[1] == 0 or q_heads % k.shape[1] != 0:
        raise ValueError(f"the number of k/v heads ({k.shape[1]}) must divide the number of q heads ({q_heads}) "
                         f"for grouped-query attention")
    if min(n_q, k.shape[2], head_dim, batch, q_heads) == 0:
        raise ValueError(f"q and k need batch, heads, seq_len and head_dim >= 1, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    return batch, q_heads, n_q, head_dim


def _check_layout(layout: BlockLayout, batch: int, heads: int, n_q: int, n_k: int) -> None:
    if (layout.n_q, layout.n_k) != (n_q, n_k):
        raise ValueError(f"the BlockLayout was built for n_q={layout.n_q}, n_k={layout.n_k} but the inputs have "
                         f"n_q={n_q}, n_k={n_k}; build it with pattern.layout({n_q}, {n_k}, heads={heads})")
    if layout.heads != heads:
        raise ValueError(f"the BlockLayout was built for heads={layout.heads} but q has {heads} heads; build it with "
                         f"pattern.layout({n_q}, {n_k}, heads={heads})")
    if layout.batch not in (1, batch):
        raise ValueError(f"the BlockLayout was built for a batch of {layout.batch} but q has batch {batch}; build it "
                         f"from masks or documents of batch {batch}, or without them (one layout for every example)")
