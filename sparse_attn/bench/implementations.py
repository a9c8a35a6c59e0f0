"""The implementations a sweep compares: whether each runs here, and the call it times.

>>> import sparse_attn as sa
>>> availability("sparse_attn-numba", sa.Local(1), "cuda")
(False, 'numba runs CPU tensors only')

torch, transformers and the backends are imported inside the functions that use them.
"""
from __future__ import annotations

import functools
import warnings

from ..pattern import Pattern
from . import peers
from .config import IMPLEMENTATIONS
from .peers import longformer_window


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
        if longformer_window(pattern) is None:
            return False, f"HF Longformer has only a symmetric window plus global tokens; {pattern!r} is not"
        return True, ""
    return True, ""


@functools.cache  # the same for every pattern: asked once per (device, backward), not once per pattern
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


def setup(name: str, pattern: Pattern, q, k, v, block_size: int):
    """A function that runs one attention call of implementation ``name`` and returns its output: the peer of
    ``peers`` that ``name`` stands for, built here (its layout, mask, block mask and compiled kernel, HF's
    layer), before the call is timed."""
    if name == "sdpa-dense":
        return peers.sdpa(q, k, v)
    if name == "hf-longformer":
        return peers.hf_longformer(pattern, q)
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {name!r}; expected one of {list(IMPLEMENTATIONS)}")
    batch, heads, n, head_dim = q.shape
    layout = pattern.layout(n, heads=heads, block_size=block_size)
    if name.startswith("sparse_attn-"):
        return peers.sparse_attn(q, k, v, layout, backend=name.split("-", 1)[1])
    if name == "sdpa-masked":  # every head's mask: SDPA builds its float bias per head, as this bench measured
        return peers.masked_sdpa(q, k, v, peers.token_mask(layout, q.device, expand_heads=True))
    # one point per process: its warm-up compile at N <= 1024 is kept (no reset), as this bench measured
    return peers.flex(q, k, v, layout, fresh=False)
