"""The implementations a sweep compares: whether each runs here, and the call it times.

>>> import sparse_attn as sa
>>> availability("sparse_attn-numba", sa.Local(1), "cuda")
(False, 'numba runs CPU tensors only')

torch, transformers and the backends are imported inside the functions that use them.
"""
from __future__ import annotations

import warnings

from ..pattern import Global, Local, Pattern, Union
from .config import IMPLEMENTATIONS


def availability(name: str, pattern: Pattern, device: str, backward: bool = False) -> tuple[bool, str]:
    """(runs, reason) for implementation ``name`` on ``pattern`` and ``device``, forward or also backward."""
    from .. import backends

    if name.startswith("sparse_attn-"):
        backend = name.split("-", 1)[1]
        ok, reason = backends.availability(backend)
        if ok and backend == "triton" and device != "cuda":
            return False, "triton needs a CUDA device"
        if ok and backend == "numba" and device != "cpu":
            return False, "numba runs CPU tensors only"
        return ok, reason
    if name == "flex":
        return _flex_availability(device, backward)
    if name == "hf-longformer":
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            return False, "transformers is not installed: pip install 'sparse-attn[hf]'"
        if _longformer_window(pattern) is None:
            return False, f"HF Longformer has only a symmetric window plus global tokens; {pattern!r} is not"
        return True, ""
    return True, ""


def _flex_availability(device: str, backward: bool) -> tuple[bool, str]:
    import torch

    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return False, f"torch {torch.__version__} has no FlexAttention (needs torch >= 2.5)"
    if backward and device == "cpu":  # torch 2.13 refuses at the call, eager or compiled: ask it with a tiny one
        q = torch.zeros(1, 1, 16, 16, requires_grad=True)                      # (B, H, N, D)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")                                 # "eager flex_attention is slow"
                flex_attention(q, q, q)
        except NotImplementedError as error:
            return False, f"torch {torch.__version__}: {str(error).splitlines()[0]}"
    return True, ""


def unavailable_reasons(patterns: dict[str, Pattern], implementations, device: str,
                        backward: bool = False) -> dict[tuple[str, str], str]:
    """(pattern label, implementation) -> why it cannot run here, for each pair that cannot."""
    reasons = {}
    for label, pattern in patterns.items():
        for name in implementations:
            ok, reason = availability(name, pattern, device, backward)
            if not ok:
                reasons[(label, name)] = reason
    return reasons


def _longformer_window(pattern: Pattern):
    """(one-sided window, Global or None) when ``pattern`` is ``Local(w)`` or ``Local(w) | Global(...)``."""
    parts = pattern.patterns if isinstance(pattern, Union) else (pattern,)
    local = [p for p in parts if isinstance(p, Local)]
    glob = [p for p in parts if isinstance(p, Global)]
    if len(local) != 1 or len(glob) > 1 or len(local) + len(glob) != len(parts):
        return None
    if local[0].before != local[0].after or local[0].block_size != 1 or local[0].before == 0:
        return None
    return local[0].before, (glob[0] if glob else None)


def setup(name: str, pattern: Pattern, q, k, v, block_size: int):
    """A function that runs one attention call of implementation ``name`` and returns its output.

    What the implementation needs from the pattern (a BlockLayout, a dense mask, a FlexAttention
    BlockMask and the compiled kernel, HF's layer) is built here, before the call is timed.
    """
    import torch

    from ..api import sparse_attention

    batch, heads, n, head_dim = q.shape
    if name.startswith("sparse_attn-"):
        layout = pattern.layout(n, heads=heads, block_size=block_size)
        backend = name.split("-", 1)[1]
        return lambda: sparse_attention(q, k, v, layout, backend=backend)
    if name == "sdpa-dense":
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    if name == "sdpa-masked":
        layout = pattern.layout(n, heads=heads, block_size=block_size)
        mask = layout.to_dense().to(q.device)                                    # (1, H, N, N) bool
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if name == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        block_mask = pattern.layout(n, heads=heads, block_size=block_size).to(q.device).to_block_mask()
        compiled = torch.compile(flex_attention, dynamic=False)  # dynamic-shape C++ fails on CPU
        return lambda: compiled(q, k, v, block_mask=block_mask)
    if name == "hf-longformer":
        return _setup_longformer(pattern, q)
    raise ValueError(f"unknown implementation {name!r}; expected one of {list(IMPLEMENTATIONS)}")


def _setup_longformer(pattern: Pattern, q):
    import torch
    from transformers import LongformerConfig
    from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

    batch, heads, n, head_dim = q.shape
    window, glob = _longformer_window(pattern)
    config = LongformerConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                              attention_window=[2 * window], attention_probs_dropout_prob=0.0)
    layer = LongformerSelfAttention(config, layer_id=0).to(q.device).eval()
    hidden = torch.randn(batch, n, heads * head_dim, device=q.device, requires_grad=q.requires_grad)  # (B, N, H*D)
    is_global = torch.zeros(batch, n, dtype=torch.bool, device=q.device)
    if glob is not None:
        is_global[:, torch.from_numpy(glob.positions(n))] = True  # the pattern's own positions
    mask = is_global.to(q.dtype) * 10000.0                                       # HF: +10000 global, 0 local
    is_masked = torch.zeros_like(is_global)
    return lambda: layer(hidden, attention_mask=mask, is_index_masked=is_masked, is_index_global_attn=is_global,
                         is_global_attn=bool(is_global.any()))[0]
