"""What ``sparse_attention`` runs on the host while torch.compile traces it: the layout of a Pattern without
call-time data, found (cached or built) and moved while tracing and kept as the graph's constants, and the
layouts that only the host can build, a graph break whose reason tells how to keep the graph whole.

The pattern comes as its ``pattern_key``, a value of builtins: Dynamo guards on the values the key was read
from, so an equal pattern rebuilt every step runs the graph already compiled, a different one compiles its
own, and no graph holds a pattern.

``api`` imports this module only inside the code Dynamo traces, where Dynamo runs the import itself:
torch.compiler's decorators below import Dynamo (seconds and 150 MB), which an eager program never pays for.
"""
from __future__ import annotations

import torch

from .compiler import build_layout
from .pattern import pattern_from_key


@torch.compiler.assume_constant_result
def pattern_index(device: torch.device, key: tuple, heads: int, n_q: int, n_k: int, block_size: int,
                  causal: bool) -> tuple:
    """``layout.index`` on ``device`` of the layout of ``pattern_from_key(key)``, from the layout cache (where
    eager calls find it too) or built. No batch: without call-time data a layout has none, so a dynamic batch
    size keeps the graph whole."""
    layout = build_layout(pattern_from_key(key), n_q, n_k, heads, block_size, causal=causal)
    return tuple(layout.to(device).index)


@torch.compiler.assume_constant_result
def moved_index(device: torch.device, *index: torch.Tensor) -> tuple:
    """A prebuilt layout's tensors copied to ``device``."""
    return tuple(tensor.to(device) for tensor in index)


@torch.compiler.disable(reason="key_padding_mask, global_mask and documents decide a Pattern's layout by their "
                               "values, which torch.compile cannot read while it traces: the layout is built on "
                               "the host, a graph break. To compile the call as one graph, build the layout "
                               "outside the compiled function, layout = pattern.layout(n, heads=h, "
                               "key_padding_mask=..., global_mask=..., documents=...), and pass the layout in place "
                               "of the pattern and the masks")
def layout_of_call_data(device, pattern, batch, heads, n_q, n_k, block_size, causal, key_padding_mask, global_mask,
                        documents):
    """The layout of a Pattern with call-time masks or documents, built on the host when the graph runs."""
    return build_layout(pattern, n_q, n_k, heads, block_size, causal=causal, global_mask=global_mask,
                        key_padding_mask=key_padding_mask, documents=documents, batch=batch).to(device)


@torch.compiler.disable(reason="the sequence lengths or the head count are dynamic (torch.compile's dynamic=True, "
                               "or a length that changed between calls), so they have no value while torch.compile "
                               "traces: the Pattern's layout is built on the host, a graph break. To compile the "
                               "call as one graph, compile with dynamic=False (a graph per length), or build the "
                               "layout outside the compiled function, layout = pattern.layout(n_q, n_k, heads=h), "
                               "and pass the layout in place of the pattern")
def layout_of_dynamic_sizes(device, pattern, heads, n_q, n_k, block_size, causal):
    """The layout of a Pattern at sizes that are symbols while tracing, built on the host when the graph runs."""
    return build_layout(pattern, n_q, n_k, heads, block_size, causal=causal).to(device)
