"""What a model hands its attention function, in sparse_attn's terms: the padding mask and packed documents.

>>> padding_mask(2, 3, 3, attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]))   # the mask function's answer
tensor([[1, 1, 1],
        [0, 1, 1]])
>>> key_padding_mask_of(torch.tensor([[1, 1, 1], [0, 1, 1]]).bool(), 2, 3, causal=True)  # True = padding
tensor([[False, False, False],
        [ True, False, False]])
>>> first_tokens(torch.tensor([[False, False, False], [True, False, False]])).tolist()   # left padding
[0, 1]
>>> packed_documents(1, 5, 5, position_ids=torch.tensor([[0, 1, 2, 0, 1]]))              # two documents
tensor([[0, 0, 0, 1, 1]])

``padding_mask`` is the mask function registered with each name (only padding passes: the pattern, not the
model's mask function, decides which pairs interact); ``key_padding_mask_of`` reads what the model then hands
the attention; ``packed_documents`` finds the documents of a packed batch (``DataCollatorWithFlattening``);
``check_cache_of_packed_batch`` refuses a cached step after a packed prefill.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from ...documents import documents_from_cu_seqlens
from .cache import CACHE_KEYWORD

_PACKED_PREFILLS: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # attention layers whose cache holds a packed batch
_NO_PACKED_CACHE = ("sparse_attn runs packed sequences (several documents in one row) without a KV cache only: pass "
                    "use_cache=False with packed batches, and generate from a padded batch (one document per row)")
_PACKED_WHILE_COMPILING = ("sparse_attn: position_ids restart (a packed batch) in a model compiled with torch.compile "
                           "and no padding mask; compiled, sparse_attn reads packing from cu_seq_lens_q/k only "
                           "(reading the positions would break the graph): pass them, DataCollatorWithFlattening("
                           "return_flash_attn_kwargs=True), or run packed batches uncompiled")


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask function transformers calls: the 2D padding mask (B, n_written), True = real token, or None.

    The pattern (not ``mask_function``) decides which pairs interact; only padding passes through.
    ``n_written = q_offset + q_length`` keys hold tokens (the queries are the last of them); a static
    cache has ``kv_length`` slots, the rest not yet written: then the mask is returned even without
    padding, and its width tells the attention function how many keys to use.
    """
    if kv_offset != 0:
        raise ValueError(f"the model's cache dropped the first {kv_offset} keys (a sliding-window layer: "
                         f"config.sliding_window or layer_types), so key positions no longer start at the sequence "
                         f"start and the keys a pattern may need are gone; build the model with "
                         f"config.sliding_window=None (every layer full attention): the sparse_attn pattern decides "
                         f"which keys each query sees; or generate with {CACHE_KEYWORD}=SparseCache(model), which "
                         f"keeps what each layer's pattern can still reach and tells the attention where it is")
    n_written = int(q_offset) + q_length
    if n_written > kv_length:
        raise ValueError(f"queries at positions {int(q_offset)}..{n_written - 1} but only {kv_length} keys: "
                         f"sparse_attn aligns the queries with the last keys, which this cache does not provide")
    if attention_mask is None:
        return None if n_written == kv_length else torch.ones(batch_size, n_written, dtype=torch.bool,
                                                              device=kwargs.get("device"))
    if attention_mask.shape[-1] < n_written:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} tokens but the model sees {n_written} "
                         f"({int(q_offset)} cached and {q_length} new); pass an attention_mask over all of them "
                         f"(1 = token, 0 = padding), as generate() does")
    attention_mask = attention_mask[:, :n_written]                                  # (B, n_written)
    return None if n_written == kv_length and bool(attention_mask.all()) else attention_mask


def key_padding_mask_of(attention_mask: torch.Tensor | None, batch: int, n_k: int,
                        causal: bool) -> torch.Tensor | None:
    """sparse_attn's key_padding_mask (B, n_written), True = padding, from the mask a model hands the attention.

    n_written = n_k, the positions seen so far, except for a static cache, whose mask (from ``padding_mask``)
    covers the written keys only.
    """
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool:  # additive float mask: 0 = keep, large negative = masked
        attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    if attention_mask.dim() == 4 and attention_mask.shape[-1] == n_k:
        attention_mask = _padding_of_4d_mask(attention_mask, causal)                  # (B, Nk)
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or not 1 <= attention_mask.shape[1] <= n_k:
        raise ValueError(f"sparse_attn needs a padding mask of shape (batch, kv_length) = ({batch}, {n_k}) "
                         f"(or a 4D mask ending in kv_length), got shape {tuple(attention_mask.shape)}; pass the "
                         f"model a 2D attention_mask (1 = token, 0 = padding)")
    return ~attention_mask


def first_tokens(key_padding_mask: torch.Tensor) -> torch.Tensor | None:
    """Each row's first real token (B,) int64 on the CPU, from a padding mask (B, N), True = padding; None without
    left padding.

    >>> first_tokens(torch.tensor([[False, False, False], [True, True, False]])).tolist()
    [0, 2]
    >>> first_tokens(torch.tensor([[False, False, True]])) is None               # right padding: no shift
    True

    A row of padding only (no token yet) gets N: its first token comes later.
    """
    real = ~key_padding_mask                                                          # (B, N)
    starts = torch.where(real.any(1), real.int().argmax(1), real.shape[1])            # (B,)
    return starts.cpu() if bool(starts.any()) else None


def _padding_of_4d_mask(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, 1 or H, Nq, Nk) bool -> (B, Nk): a 4D mask the user passed, accepted if it holds padding only."""
    keep = mask[:, 0, -1, :]                                                        # (B, Nk)
    n_q, n_k = mask.shape[-2:]
    expected = keep[:, None, None, :].expand(mask.shape)                            # (B, 1 or H, Nq, Nk)
    if causal:
        expected = expected & torch.ones(n_q, n_k, dtype=torch.bool, device=mask.device).tril(n_k - n_q)
    if not torch.equal(mask, expected):
        structure = "padding and causality" if causal else "padding"
        raise ValueError(f"a 4D attention_mask of shape {tuple(mask.shape)} that is more than {structure} "
                         f"cannot be honoured: the sparse_attn pattern decides which query/key pairs interact, and "
                         f"only padding passes through; pass the 2D attention_mask (1 = token, 0 = padding) and put "
                         f"the structure in the pattern")
    return keep


def packed_documents(batch: int, n_q: int, n_k: int, key_padding_mask: torch.Tensor | None = None, *,
                     position_ids: torch.Tensor | None = None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                     **kwargs) -> torch.Tensor | None:
    """The documents (B, N) of a packed batch, from what a model hands its attention function; None if not packed.

    >>> packed_documents(1, 5, 5, position_ids=torch.tensor([[0, 1, 2, 0, 1]]))     # batch, n_q, n_k
    tensor([[0, 0, 0, 1, 1]])
    >>> packed_documents(1, 5, 5, cu_seq_lens_q=torch.tensor([0, 3, 5]), cu_seq_lens_k=torch.tensor([0, 3, 5]))
    tensor([[0, 0, 0, 1, 1]])
    >>> packed_documents(1, 3, 3, position_ids=torch.tensor([[7, 8, 9]])) is None      # one sequence
    True

    ``cu_seq_lens_q``/``cu_seq_lens_k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``)
    describe one packed row (batch 1); otherwise a document starts wherever ``position_ids`` (B, N) do not
    continue the previous token's position by 1 (transformers' own rule for packed sequences), among
    real tokens: padding (``key_padding_mask``, True = padding) gets -1 and the positions a generate()
    call gives padding do not split a sequence. Any start value works (RoBERTa-style positions from 2).
    Packing within a cached step (``n_q < n_k``) is refused: the cache's documents are unknown. While
    torch.compile traces a call with no padding mask, the positions are not read: the batch is taken as not
    packed and the graph checks it when it runs (a RuntimeError if the positions restart); pass
    ``cu_seq_lens_q/k`` to run packed batches compiled. Eager calls read them as above.
    """
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        return _documents_of_cu_seq_lens(batch, n_q, n_k, cu_seq_lens_q, cu_seq_lens_k)
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] != n_q:
        return None  # no positions, or a layout that is not (B, N) token positions (multimodal rotary sections)
    positions = position_ids.expand(batch, n_q)                                          # (B, Nq)
    real = torch.ones_like(positions, dtype=torch.bool) if key_padding_mask is None else \
        ~key_padding_mask[:, -n_q:]                                                      # (B, Nq), True = token
    jump = positions[:, 1:] != positions[:, :-1] + 1                                     # (B, Nq - 1)
    restart = real[:, 1:] & real[:, :-1] & jump                                          # a new document
    if torch.compiler.is_compiling() and key_padding_mask is None:
        # Reading restart would break the graph (fullgraph=True fails): a packed batch raises when the graph runs.
        torch._assert_async(~restart.any(), _PACKED_WHILE_COMPILING)
        return None
    if not restart.any():
        return None
    if n_q < n_k:
        raise ValueError(f"position_ids restart within a cached step ({n_k - n_q} cached keys, {n_q} new queries); "
                         f"{_NO_PACKED_CACHE}")
    starts = torch.cat([real[:, :1], real[:, 1:] & (jump | ~real[:, :-1])], dim=1)      # (B, N) first tokens
    return (starts.long().cumsum(1) - 1).masked_fill(~real, -1)                         # (B, N), -1 = padding


def _documents_of_cu_seq_lens(batch: int, n_q: int, n_k: int, cu_seq_lens_q, cu_seq_lens_k) -> torch.Tensor:
    if cu_seq_lens_q is None or cu_seq_lens_k is None or not torch.equal(torch.as_tensor(cu_seq_lens_q).cpu(),
                                                                          torch.as_tensor(cu_seq_lens_k).cpu()):
        raise ValueError(f"packed sequences need cu_seq_lens_q == cu_seq_lens_k (each document attends to "
                         f"itself), got cu_seq_lens_q={cu_seq_lens_q} and cu_seq_lens_k={cu_seq_lens_k}; "
                         f"sparse_attn runs self-attention over packed documents only")
    if n_q != n_k:
        raise ValueError(f"cu_seq_lens_q/k (packed sequences) with {n_k - n_q} cached keys; {_NO_PACKED_CACHE}")
    offsets = torch.as_tensor(cu_seq_lens_q).cpu()                                      # equal to cu_seq_lens_k
    if batch != 1 or offsets.dim() != 1 or int(offsets[-1]) > n_k:
        raise ValueError(f"cu_seq_lens_q/k must describe one packed row of {n_k} tokens (batch 1, offsets up to "
                         f"{n_k}), as DataCollatorWithFlattening produces, got batch {batch} and offsets "
                         f"{offsets.tolist()}; pack each batch into one row, or pass position_ids that restart "
                         f"at each document instead")
    return documents_from_cu_seqlens(offsets, n=n_k)                                    # (1, N)


def check_cache_of_packed_batch(module: nn.Module, n_q: int, n_k: int, documents, use_cache) -> None:
    """Refuse a cached step (n_q < n_k) after a packed forward filled this layer's cache (its documents are lost)."""
    if n_q < n_k and module in _PACKED_PREFILLS:
        raise ValueError(f"{type(module).__name__}'s KV cache was filled by a packed batch, whose documents a cached "
                         f"step cannot tell apart ({n_k - n_q} cached keys, {n_q} new queries); {_NO_PACKED_CACHE}")
    if n_q == n_k and documents is not None and use_cache is not False:
        _PACKED_PREFILLS.add(module)
    elif n_q == n_k:
        _PACKED_PREFILLS.discard(module)
