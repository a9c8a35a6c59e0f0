"""The implementations every benchmark compares, defined once: ``sparse-attn bench`` and the scripts in
``benchmarks/`` run these. Each is built once from its inputs (a layout, a block mask, a compiled kernel, a
mask, a layer: made here, before anything is timed) and returned as a zero-argument callable that computes the
attention output: the call a benchmark times.

>>> import torch
>>> import sparse_attn as sa
>>> q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))                # (B, H, N, D)
>>> layout = sa.Local(16).layout(128, heads=2, block_size=64)
>>> ours = sparse_attn(q, k, v, layout, backend="reference")
>>> masked = masked_sdpa(q, k, v, token_mask(layout, q.device))
>>> torch.allclose(ours(), masked(), atol=1e-5)
True

- ``sparse_attn``: ``sparse_attention`` on a prebuilt ``BlockLayout``, any backend;
- ``flex``: FlexAttention as its users run it, compiled (``compiled_flex``), on ``layout.to_block_mask()``
  (block lists from the layout, ``mask_mod`` the pattern's own predicate), with an optional compile ``mode``
  (``AUTOTUNE``) and kernel options (``FLEX_TILES``: tiles that suit a block on a GPU);
- ``sdpa``: dense ``scaled_dot_product_attention`` over every pair, optionally causal and restricted to the
  flash kernel;
- ``masked_sdpa``: dense SDPA with the pattern's token mask (``token_mask``);
- ``hf_longformer``: Hugging Face's ``LongformerSelfAttention`` (``longformer_window`` says which patterns it
  can run);

and ``passes``, the forward and forward+backward calls the CPU scripts time. torch, FlexAttention and
transformers are imported inside the functions that use them.
"""
from __future__ import annotations

from collections.abc import Callable

from ..pattern import Global, Local, Pattern, Union

AUTOTUNE = "max-autotune-no-cudagraphs"  # torch.compile mode: Flex picks tiles, warps and stages by timing them
FLEX_TILES = {64: {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64,  # block: GPU kernel tiles that divide it (Flex's default
                   "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64}}  # tiles: 128)


def sparse_attn(q, k, v, layout, backend: str) -> Callable:
    """``sparse_attention(q, k, v, layout, backend=backend)``: this library on a layout built once."""
    from ..api import sparse_attention

    return lambda: sparse_attention(q, k, v, layout, backend=backend)


def score_mods(kind: str, heads: int, device) -> dict:
    """The modifier a benchmark times, as ``sparse_attention`` keywords: ``"softcap"`` (Gemma 2's, 50) or
    ``"alibi"`` (ALiBi's geometric slopes ``2^(-8 (h + 1) / heads)``: 1/4, 1/16, 1/64, 1/256 for 4 heads).

    >>> score_mods("alibi", 4, "cpu")["alibi_slopes"].tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    import torch

    if kind == "softcap":
        return {"softcap": 50.0}
    if kind == "alibi":
        return {"alibi_slopes": torch.exp2(-8.0 * torch.arange(1, heads + 1, device=device) / heads)}
    raise ValueError(f"kind must be 'softcap' or 'alibi', got {kind!r}")


def compiled_flex(mode: str | None = None, *, fresh: bool = True):
    """``torch.compile(flex_attention, dynamic=False, fullgraph=True, mode=mode)``: static shapes, and compiled
    or an error, never silently eager.

    Dynamo caches compiled code per code object, and every new shape or block mask compiles
    ``flex_attention`` again, so past ``recompile_limit`` (8) entries Dynamo would run it eagerly,
    materialising the N x N scores; ``fullgraph=True`` turns that fall-back (or a graph break) into an error.
    ``fresh`` empties Dynamo's cache first (``torch._dynamo.reset()``): right where each point compiles its own
    and the earlier ones are done with; wrong where several compiled peers are timed in turns in one process,
    which the reset would send back to compiling (those raise ``recompile_limit`` instead).
    """
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    if fresh:
        torch._dynamo.reset()
    return torch.compile(flex_attention, dynamic=False, fullgraph=True, mode=mode)


def flex(q, k, v, layout, *, mode: str | None = None, kernel_options: dict | None = None,
         fresh: bool = True) -> Callable:
    """Compiled FlexAttention (``compiled_flex(mode, fresh=fresh)``) on ``layout.to_block_mask()`` on q's device:
    the layout's block lists and the pattern's own predicate as ``mask_mod``, as a FlexAttention user writes it.
    ``kernel_options`` go to every call (e.g. ``FLEX_TILES[64]``; None: Flex's defaults). A layout built by hand
    (no ``call_data``) would give Flex a table lookup instead of the predicate: a ValueError."""
    if layout.call_data is None:
        raise ValueError("flex needs a layout built from a pattern (pattern.layout(...)): this one was built by "
                         "hand, so its to_block_mask() looks pairs up in a table, which no FlexAttention user "
                         "writes; build the layout from the pattern")
    block_mask = layout.to(q.device).to_block_mask()
    compiled = compiled_flex(mode, fresh=fresh)
    return lambda: compiled(q, k, v, block_mask=block_mask, kernel_options=kernel_options)


def sdpa(q, k, v, *, causal: bool = False, flash: bool = False) -> Callable:
    """Dense ``scaled_dot_product_attention`` over every pair (``is_causal=causal``); ``flash``: restricted to the
    flash kernel (an error where it cannot run), the dense speed-of-light on a GPU."""
    import torch

    attend = torch.nn.functional.scaled_dot_product_attention
    if not flash:
        return lambda: attend(q, k, v, is_causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash_attention():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return attend(q, k, v, is_causal=causal)
    return flash_attention


def token_mask(layout, device, *, expand_heads: bool = False):
    """The layout's token mask on ``device``, bool: (Bl, 1, N, N) when its heads share the pattern, else
    (Bl, H, N, N); ``expand_heads``: always (Bl, H, N, N) (``layout.to_dense()``, heads expanded without a copy
    on the layout's device), from which SDPA builds its float bias per head."""
    mask = layout.to_dense() if expand_heads else layout.row_mask(0, layout.n_q_blocks)
    return mask.to(device)


def masked_sdpa(q, k, v, mask) -> Callable:
    """Dense ``scaled_dot_product_attention`` with a bool token mask (``token_mask``): every pair computed, the
    pattern's masked out; torch picks the kernel."""
    import torch

    attend = torch.nn.functional.scaled_dot_product_attention
    return lambda: attend(q, k, v, attn_mask=mask)


def longformer_window(pattern: Pattern):
    """(one-sided window, Global or None) when ``pattern`` is ``Local(w)`` or ``Local(w) | Global(...)``, the
    patterns HF Longformer has; else None.

    >>> import sparse_attn as sa
    >>> longformer_window(sa.Local(256) | sa.Global(first=16)), longformer_window(sa.Local(4, 2))
    ((256, Global(first=16)), None)
    """
    parts = pattern.patterns if isinstance(pattern, Union) else (pattern,)
    local = [p for p in parts if isinstance(p, Local)]
    glob = [p for p in parts if isinstance(p, Global)]
    if len(local) != 1 or len(glob) > 1 or len(local) + len(glob) != len(parts):
        return None
    if local[0].before != local[0].after or local[0].block_size != 1 or local[0].before == 0:
        return None
    return local[0].before, (glob[0] if glob else None)


def hf_longformer(pattern: Pattern, q) -> Callable:
    """transformers' ``LongformerSelfAttention`` on ``pattern`` (see ``longformer_window``), with its own q/k/v
    projections of a random (B, N, H*D) input shaped like ``q``; global tokens where the pattern has them."""
    import torch
    from transformers import LongformerConfig
    from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

    batch, heads, n, head_dim = q.shape
    window, glob = longformer_window(pattern)
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


def passes(attend: Callable, *inputs) -> tuple[Callable, Callable]:
    """(forward, forward+backward) of ``attend``: the forward under ``no_grad``; the forward and the backward of
    a gradient of ones, then the gradients of ``inputs`` dropped, so that every call starts alike."""
    import torch

    def forward():
        with torch.no_grad():
            attend()

    def forward_backward():
        out = attend()
        out.backward(torch.ones_like(out))
        for tensor in inputs:
            tensor.grad = None

    return forward, forward_backward
