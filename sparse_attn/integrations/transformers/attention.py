"""Hugging Face ``transformers`` integration: ``attn_implementation="sparse_attn"`` and long-document conversion.

>>> import sparse_attn as sa
>>> from sparse_attn.integrations.transformers import register, to_long_model
>>> from transformers import AutoModel, BertConfig
>>> register(pattern=sa.Local(64) | sa.Global(first=1))              # once per process
'sparse_attn'
>>> config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
>>> model = AutoModel.from_config(config, attn_implementation="sparse_attn")
>>> model = to_long_model(model, max_positions=4096, pattern=sa.Local(128) | sa.Global(first=1))
>>> model.config.max_position_embeddings
4096

Which pattern a model uses: ``model.config.sparse_attn_pattern`` (a ``Pattern.to_dict()`` dict, saved
with the config by ``save_pretrained``) when set, else the pattern given to ``register`` for the
model's ``attn_implementation`` name, else the model's own sliding windows where its config has them
(:func:`own_patterns`), else ``DEFAULT_PATTERN`` = ``Local(256) | Global(first=1)`` (Longformer's
``attention_window=512`` with a global first token), with a warning when the model is built. Register
several names to bind several patterns. Only the padding mask, causality and packed documents come from
the model: the model's own mask function (sliding windows, prefix-LM) is replaced by the pattern. In a
left-padded batch the pattern's positions count from each row's first token (as the model's
``position_ids`` do), so a row computes what its prompt alone computes.

Importing this module wraps transformers' check of a model's ``attn_implementation`` (see
``_check_models_when_built``): a model loaded with ``from_pretrained(path)`` whose saved config holds
``sparse_attn_pattern`` runs ``"sparse_attn"`` again, and a sparse_attn-like name that was never given
to :func:`register` raises an error saying so.

Packed batches (``DataCollatorWithFlattening``: one row whose ``position_ids`` restart at each
document, and with ``return_flash_attn_kwargs=True`` its ``cu_seq_lens_q/k``) run every document as a
sequence by itself (sparse_attention's ``documents=``, from :func:`packed_documents`): the pattern
applies per document, ``Global(first=1)`` is each document's first token, nothing crosses documents.
Decoders (Llama, ...) and encoders (BERT, RoBERTa, ...) hand the attention the ``position_ids`` they
are called with. Packed batches with a KV cache are refused at the cached step.

Generation in bounded memory: ``model.generate(..., cache=SparseCache(model))`` (``past_key_values=`` before
transformers 5.x renamed it: ``CACHE_KEYWORD`` is the installed one's) keeps, in each
layer, only the keys that layer's pattern can still reach (:class:`SparseCache`); the attention function
finds the absolute positions of the keys it receives through :class:`SparseCacheLayer` (see ``_held_keys``).

Score modifiers a model hands its attention function run in sparse_attention: Gemma 2's ``softcap=``
(``attn_logit_softcapping``) and gpt-oss's ``s_aux=`` (one learned sink per query head) become its
``softcap=`` and ``sinks=``, in the prefill and in every cached step (:func:`_score_mods`); with their
sliding-window and full layers each running the model's own attention (:func:`own_patterns`) these models
compute what their eager attention computes.

Models that sparse_attn cannot run are refused when they are built with a registered name: models
whose layers compute attention themselves instead of calling transformers' ``AttentionInterface``
(Longformer, BigBird, DeBERTa, ALiBi models such as BLOOM and MPT, ...) and encoder-decoder models (their
cross-attention relates two sequences). What the attention function is handed and sparse_attn does not
compute is refused at the first forward (``_NOT_COMPUTED``): a position-bias tensor (T5-style
``position_bias=``), sinks computed per token (``sinks=``, or an ``s_aux`` that is not one per head) and an
indexer's choice of keys (``indices=``, ``block_indices=``: DeepSeek V3.2-style sparse attention).

Under ``torch.compile`` a call with no padding mask reads no tensor's values (``fullgraph=True`` works): the
positions' restarts that mark a packed batch are checked inside the graph, and a packed batch raises when the
graph runs unless ``cu_seq_lens_q/k`` say where its documents are (see :func:`packed_documents`).
"""
from __future__ import annotations

import difflib
import functools
import inspect
import re
import sys
import warnings
import weakref
from typing import NamedTuple

import torch
from einops import rearrange
from torch import nn
from transformers import AttentionInterface, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import backends
from ..blocks import ceil_div
from ..checks import check_int
from ..documents import documents_from_cu_seqlens
from ..kv_cache import SparseKVCache, left_padded_attention
from ..pattern import Causal, Dense, Global, Local, Pattern, check_pattern

DEFAULT_PATTERN = Local(256) | Global(first=1)
# The keyword generate() and a model's forward take a KV cache under: `cache` since transformers renamed it in 5.x
# (`past_key_values` still works there, deprecated), `past_key_values` before.
CACHE_KEYWORD = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters \
    else "past_key_values"
# name -> (the pattern given to register: one, one per layer, or None for the model's own; backend)
_REGISTERED: dict[str, tuple[Pattern | tuple[Pattern, ...] | None, str]] = {}
_PACKED_PREFILLS: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # attention layers whose cache holds a packed batch
_NO_PACKED_CACHE = ("sparse_attn runs packed sequences (several documents in one row) without a KV cache only: pass "
                    "use_cache=False with packed batches, and generate from a padded batch (one document per row)")
_PACKED_WHILE_COMPILING = ("sparse_attn: position_ids restart (a packed batch) in a model compiled with torch.compile "
                           "and no padding mask; compiled, sparse_attn reads packing from cu_seq_lens_q/k only "
                           "(reading the positions would break the graph): pass them, DataCollatorWithFlattening("
                           "return_flash_attn_kwargs=True), or run packed batches uncompiled")
# Arguments transformers hands attention functions that change what attention computes, beyond what sparse_attn
# computes (softcap= and s_aux=, which it takes: _score_mods): the model would silently get something else.
_NOT_COMPUTED = {"position_bias": "adds a position bias tensor to the attention scores",   # T5, Inkling, ...
                 "sinks": "adds attention sinks computed per token to the softmax",      # Inkling 2
                 "indices": "attends only the keys its indexer selects",                 # DeepSeek V3.2, HY V4
                 "block_indices": "attends only the key blocks its indexer selects"}     # MiniMax M3


def register(pattern: Pattern | list[Pattern] | None = None, *, name: str = "sparse_attn",
             backend: str = "auto") -> str:
    """Make ``attn_implementation=name`` run sparse_attn with ``pattern``; returns ``name``.

    >>> register(sa.Local(128) | sa.Global(first=1), name="longformer-128")  # doctest: +SKIP
    'longformer-128'
    >>> register([Local(127, 0), Dense()], name="two-layers")            # one pattern per decoder layer
    'two-layers'

    ``pattern``: one Pattern for every layer, a list with one Pattern per decoder layer, or None: the
    model's own attention per layer where its config has sliding-window layers (``model_pattern``),
    else ``DEFAULT_PATTERN``.

    Registers the attention function (``AttentionInterface``) and the mask function
    (``AttentionMaskInterface``) that hands it the model's padding mask, and makes building a model
    with ``attn_implementation=name`` raise a ValueError for models sparse_attn cannot run (see the
    module docstring). Calling it again with the same name replaces the pattern.
    """
    if isinstance(pattern, (list, tuple)):
        for layer_idx, layer_pattern in enumerate(pattern):
            check_pattern(f"pattern[{layer_idx}]", layer_pattern)
        pattern = tuple(pattern)
    elif pattern is not None:
        check_pattern("pattern", pattern)
    if not isinstance(name, str) or not name or name in ("eager", "sdpa") or name.startswith(("flash", "flex")):
        raise ValueError(f"name must be a new attn_implementation name such as 'sparse_attn', got {name!r}")
    backends.check_name(backend)
    _REGISTERED[name] = (pattern, backend)
    AttentionInterface.register(name, _attention_function(name))
    AttentionMaskInterface.register(name, padding_mask)
    return name


def _attention_function(name: str):
    def sparse_attn_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
        """query (B, Hq, Nq, D), key/value (B, Hkv, Nk, D) -> ((B, Nq, Hq, D), None), as transformers expects."""
        mods = _score_mods(module, query.shape[1], kwargs)
        if kwargs.get("output_attentions"):
            warnings.warn(f"attn_implementation={name!r} does not support output_attentions=True: sparse_attn never "
                          f"materialises attention weights, so none are returned (as with 'sdpa'); build the model "
                          f"with attn_implementation='eager' to get them", stacklevel=2)
        pattern, backend = _REGISTERED[name]
        pattern = model_pattern(getattr(module, "config", None), pattern, getattr(module, "layer_idx", None))
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        held = _held_keys(key, pattern, causal, module)
        n_k = key.shape[2] if held is None else held.kv.seq_len                        # every position so far
        key_padding_mask = _key_padding_mask(attention_mask, key.shape[0], n_k, causal)  # (B, n_written) or None
        if key_padding_mask is not None and held is None:
            # A static cache hands over all its slots; only the first n_written hold keys.
            n_k = key_padding_mask.shape[1]
            key, value = key[:, :, :n_k], value[:, :, :n_k]                             # (B, Hkv, Nk, D)
        documents = packed_documents(query.shape[0], query.shape[2], n_k, key_padding_mask, **kwargs)  # (B, N)
        _check_cache_of_packed_batch(module, query.shape[2], n_k, documents, kwargs.get("use_cache"))
        # Left padding: positions count from each row's first token, as the model's own position_ids do.
        starts = None if documents is not None or key_padding_mask is None else first_tokens(key_padding_mask)
        if held is not None and starts is not None:
            held.kv.set_starts(starts)
        if held is None or held.contiguous:
            # With a KV cache the n_q queries are the last positions: sparse_attn aligns them bottom-right.
            out = left_padded_attention(query, key, value, pattern, starts, causal=causal,
                                        key_padding_mask=key_padding_mask, documents=documents, scale=scaling,
                                        backend=backend, **mods)                      # (B, Hq, Nq, D)
        else:  # a SparseCache evicted keys: the pattern applies at the held keys' absolute positions
            held_padding = None if key_padding_mask is None else key_padding_mask[:, held.positions]  # (B, Nk)
            out = held.attend(query, key, value, held_padding, scaling, **mods)           # (B, Hq, Nq, D)
        if dropout > 0:
            out = nn.functional.dropout(out, dropout)  # transformers passes dropout > 0 only in training
        return rearrange(out, "b h n d -> b n h d").contiguous(), None

    sparse_attn_forward.__qualname__ = sparse_attn_forward.__name__ = f"sparse_attn_forward[{name}]"
    return sparse_attn_forward


def _score_mods(module: nn.Module, q_heads: int, kwargs: dict) -> dict:
    """sparse_attention's ``softcap`` and ``sinks`` from what a model hands its attention function: Gemma 2's
    ``softcap`` (a float), gpt-oss's ``s_aux`` (one learned sink per query head, (Hq,)). A ValueError for what
    sparse_attn does not compute (``_NOT_COMPUTED``, an ``s_aux`` of another shape), naming it.

    >>> _score_mods(None, 2, {"softcap": 50.0, "s_aux": torch.zeros(2), "sliding_window": 4096})
    {'softcap': 50.0, 'sinks': tensor([0., 0.])}
    """
    for argument, what in _NOT_COMPUTED.items():
        if kwargs.get(argument) is not None:
            raise ValueError(f"{type(module).__name__} {what} (it passes {argument}= to the attention function), "
                             f"which sparse_attn does not compute: the result would silently differ from the "
                             f"model's; use attn_implementation='sdpa' or 'eager' for this model")
    sinks = kwargs.get("s_aux")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (q_heads,)):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"{type(module).__name__} passes s_aux= of shape {shape} to the attention function; "
                         f"sparse_attn computes one learned sink per query head (s_aux of shape ({q_heads},), as "
                         f"gpt-oss passes it), not sinks per token; use attn_implementation='eager' for this model")
    return {"softcap": kwargs.get("softcap"), "sinks": sinks}


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


def _check_cache_of_packed_batch(module: nn.Module, n_q: int, n_k: int, documents, use_cache) -> None:
    """Refuse a cached step (n_q < n_k) after a packed forward filled this layer's cache (its documents are lost)."""
    if n_q < n_k and module in _PACKED_PREFILLS:
        raise ValueError(f"{type(module).__name__}'s KV cache was filled by a packed batch, whose documents a cached "
                         f"step cannot tell apart ({n_k - n_q} cached keys, {n_q} new queries); {_NO_PACKED_CACHE}")
    if n_q == n_k and documents is not None and use_cache is not False:
        _PACKED_PREFILLS.add(module)
    elif n_q == n_k:
        _PACKED_PREFILLS.discard(module)


def model_pattern(config, default: Pattern | tuple[Pattern, ...] | None = None,
                  layer_idx: int | None = None) -> Pattern:
    """The pattern of decoder layer ``layer_idx``: ``config.sparse_attn_pattern`` if set, else ``default``.

    >>> from transformers import Qwen2Config
    >>> config = Qwen2Config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
    ...                      use_sliding_window=True, sliding_window=512)
    >>> [model_pattern(config, layer_idx=i) for i in range(2)]      # the model's own attention per layer
    [Local(511, 0), Dense()]
    >>> model_pattern(config, Local(64), layer_idx=1)                    # the registered pattern wins
    Local(64)

    Each of the two may be a Pattern (every layer), a list or tuple of Patterns (one per layer) or their
    ``to_dict()`` dicts. With neither, a model whose config has sliding-window layers
    (``config.layer_types``/``config.sliding_window``, as transformers reads them) runs its own attention:
    a sliding layer of window ``w`` sees the current token and the ``w - 1`` before it, ``Local(w - 1, 0)``
    (transformers' ``kv_idx > q_idx - w``), a full layer ``Dense()`` (causal in a decoder). Any other model
    gets ``DEFAULT_PATTERN``.
    """
    chosen = getattr(config, "sparse_attn_pattern", None)
    chosen = default if chosen is None else chosen
    if chosen is None:
        chosen = own_patterns(config) or DEFAULT_PATTERN
    if isinstance(chosen, (list, tuple)):
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(chosen):
            raise ValueError(f"{len(chosen)} patterns (one per layer) but the attention layer's layer_idx is "
                             f"{layer_idx!r}; give one pattern per decoder layer of the model "
                             f"(config.num_hidden_layers), or one Pattern for every layer")
        chosen = chosen[layer_idx]
    if isinstance(chosen, dict):
        return Pattern.from_dict(chosen)
    if isinstance(chosen, Pattern):
        return chosen
    raise TypeError(f"config.sparse_attn_pattern must be a sparse_attn Pattern, its to_dict() dict, or a list of "
                    f"them (one per layer), got {type(chosen).__name__}: {chosen!r}")


def own_patterns(config) -> list[Pattern] | None:
    """The model's own attention as one Pattern per decoder layer if ``config`` has sliding-window layers, else None.

    >>> from transformers import MistralConfig
    >>> own_patterns(MistralConfig(num_hidden_layers=2, sliding_window=4096))
    [Local(4095, 0), Local(4095, 0)]
    >>> own_patterns(MistralConfig(num_hidden_layers=2, sliding_window=None)) is None
    True

    Only models whose layers are all ``"sliding_attention"`` or ``"full_attention"`` (transformers'
    ``get_layer_types_and_kwargs``) are read; others (chunked attention, ...) return None.
    """
    if config is None or not hasattr(config, "get_text_config"):
        return None
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if "sliding_attention" not in layer_types or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        return None
    return [Local(kwargs["sliding_window"] - 1, 0) if kind == "sliding_attention" else Dense()
            for kind, kwargs in zip(layer_types, layer_kwargs)]


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


def _key_padding_mask(attention_mask: torch.Tensor | None, batch: int, n_k: int,
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


class SparseCacheLayer(CacheLayerMixin):
    """One decoder layer's KV cache: a :class:`~sparse_attn.kv_cache.SparseKVCache` that keeps only the keys
    ``pattern`` still lets a future query reach; what :class:`SparseCache` holds per layer."""

    is_sliding = False

    def __init__(self, pattern: Pattern, backend: str = "auto"):
        super().__init__()
        self.pattern, self.backend = pattern, backend
        self.kv: SparseKVCache | None = None

    def __repr__(self) -> str:
        return f"SparseCacheLayer({self.pattern!r}, {self.get_seq_length()} tokens seen, {self.nbytes} bytes held)"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._initialize(key_states, self._new_kv())

    def _new_kv(self) -> SparseKVCache:
        # transformers caches keys in decoders, whose attention is causal (the queries of a chunk see no later key)
        return SparseKVCache(self.pattern & Causal(), backend=self.backend)

    def _initialize(self, key_states: torch.Tensor, kv: SparseKVCache) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.kv, self.is_initialized = kv, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new keys/values (B, Hkv, n_new, D); return the held ones, their positions remembered.
        Keys that cannot continue the cache raise before anything changes (the layer stays uninitialised)."""
        kv = self.kv if self.is_initialized else self._new_kv()
        keys, values, positions = kv.update(key_states, value_states)                      # (B, Hkv, Nk, D), (Nk,)
        if not self.is_initialized:
            self._initialize(key_states, kv)
        _HELD_KEYS[id(keys)] = _Held(weakref.ref(keys, _forget(id(keys))), positions, self.pattern, kv)
        return keys, values

    def get_seq_length(self) -> int:
        """Tokens seen so far (the next token's position), not the number held."""
        return self.kv.seq_len if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The padding mask covers every position from 0: the attention picks the held keys' columns."""
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held."""
        return self.kv.nbytes if self.is_initialized else 0

    def reset(self) -> None:
        self.kv, self.is_initialized = None, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("SparseCache does not support beam search (num_beams > 1) or other reordering of its batch; "
                         "generate greedily or by sampling, or use a DynamicCache for beam search")

    def crop(self, *args, **kwargs) -> None:
        raise ValueError("SparseCache cannot crop (assisted generation, prompt lookup and DoLa take back tokens): "
                         "the keys the taken-back tokens let it drop are gone; generate without them, or use a "
                         "DynamicCache with the same attn_implementation")


class SparseCache(Cache):
    """A ``transformers.Cache`` whose layers keep only the keys their sparse_attn pattern can still reach.

    >>> cache = SparseCache(model)                                               # doctest: +SKIP
    >>> model.generate(ids, cache=cache, max_new_tokens=100_000)                # doctest: +SKIP

    ``model`` (or its config) runs a name registered with :func:`register` as its ``attn_implementation``;
    layer ``i`` evicts by the pattern the attention of layer ``i`` runs (``model_pattern``), so generation
    equals generation with a full ``DynamicCache`` and the same patterns, token for token. A layer whose
    pattern reaches every past key (``Dense``, ``Stride``, ...) keeps everything (SparseKVCache says so).
    """

    def __init__(self, model_or_config):
        config = getattr(model_or_config, "config", model_or_config)
        name = getattr(config, "_attn_implementation", None)
        if name not in _REGISTERED:
            raise ValueError(f"SparseCache needs a model built with a sparse_attn attn_implementation (a name given to "
                             f"register(), such as 'sparse_attn'), got attn_implementation={name!r}: its attention "
                             f"would not know where the held keys are; build it with attn_implementation="
                             f"'sparse_attn' after register(), or use a DynamicCache")
        default, backend = _REGISTERED[name]
        layers = config.get_text_config(decoder=True).num_hidden_layers
        super().__init__(layers=[SparseCacheLayer(model_pattern(config, default, i), backend) for i in range(layers)])

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held by all layers."""
        return sum(layer.nbytes for layer in self.layers)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.reorder_cache(None)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(None)


class _Held(NamedTuple):
    """What a SparseCacheLayer's update returned: the keys' absolute positions, the layer's pattern and cache."""
    keys: weakref.ref
    positions: torch.Tensor                                                          # (Nk,) int64
    pattern: Pattern
    kv: SparseKVCache

    @property
    def contiguous(self) -> bool:
        """The keys are positions 0 .. Nk - 1 (nothing evicted): plain bottom-right aligned attention."""
        return torch.equal(self.positions, torch.arange(len(self.positions)))

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               key_padding_mask: torch.Tensor | None, scale: float | None, **mods) -> torch.Tensor:
        """The new queries (B, Hq, Nq, D) over the held keys at their absolute positions -> (B, Hq, Nq, D);
        ``mods``: ``softcap`` and ``sinks`` as ``sparse_attention`` takes them."""
        return self.kv.attention(query, key, value, self.positions, scale=scale, key_padding_mask=key_padding_mask,
                                 **mods)


_HELD_KEYS: dict[int, _Held] = {}  # id(keys returned by a SparseCacheLayer) -> their positions (while they live)


def _forget(ident: int):
    return lambda _: _HELD_KEYS.pop(ident, None)


def _held_keys(key: torch.Tensor, pattern: Pattern, causal: bool, module: nn.Module) -> _Held | None:
    """The positions of ``key`` if a SparseCacheLayer returned it, after checking it evicts by ``pattern``."""
    held = _HELD_KEYS.get(id(key))
    if held is None or held.keys() is not key:
        return None
    if not causal:
        raise ValueError(f"{type(module).__name__} is not causal (is_causal=False) but its keys come from a "
                         f"SparseCache, which evicts for causal decoding; use SparseCache with decoder models")
    if held.pattern != pattern:
        raise ValueError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) runs {pattern!r} but "
                         f"its SparseCache layer evicts by {held.pattern!r}, so keys the attention needs may be gone; "
                         f"build the SparseCache after setting the model's pattern (SparseCache(model))")
    return held


def to_long_model(model: PreTrainedModel, max_positions: int, pattern: Pattern | None = None, *,
                  name: str = "sparse_attn") -> PreTrainedModel:
    """Extend a BERT/RoBERTa-style model to ``max_positions`` tokens and switch it to sparse_attn, in place.

    >>> model = to_long_model(AutoModel.from_config(BertConfig()), 4096, sa.Local(256) | sa.Global(first=1))
    ... # doctest: +SKIP

    The Longformer recipe: the new absolute position embeddings repeat the learned ones
    (``[e_0 .. e_511, e_0 .. e_511, ...]``), so every position starts from an embedding the model
    already knows. RoBERTa-style tables, whose positions start after ``padding_idx``, keep their
    first ``padding_idx + 1`` rows and tile the rest (a RoBERTa model gets ``max_positions + 2`` rows,
    like Longformer's 4098). ``pattern`` is stored in ``model.config.sparse_attn_pattern`` (saved by
    ``save_pretrained``); ``None`` uses the pattern registered under ``name``.
    """
    embeddings = getattr(getattr(model, "base_model", model), "embeddings", None)
    table = getattr(embeddings, "position_embeddings", None)
    if not isinstance(table, nn.Embedding):
        raise ValueError(f"to_long_model needs a BERT/RoBERTa-style model with absolute position embeddings "
                         f"(model.base_model.embeddings.position_embeddings), got {type(model).__name__}; models "
                         f"with rotary or relative positions need no conversion: use attn_implementation={name!r}")
    max_positions = check_int("max_positions", max_positions, 1)
    offset = 0 if table.padding_idx is None else table.padding_idx + 1
    if max_positions <= table.num_embeddings - offset:
        raise ValueError(f"max_positions={max_positions} must exceed the model's {table.num_embeddings - offset} "
                         f"positions; to_long_model only extends")
    if pattern is not None:
        check_pattern("pattern", pattern)
    check_model(model, name)
    embeddings.position_embeddings = _tiled(table, offset + max_positions, offset)
    size = embeddings.position_embeddings.num_embeddings
    for buffer in ("position_ids", "token_type_ids"):
        old = getattr(embeddings, buffer, None)
        if isinstance(old, torch.Tensor):
            new = torch.arange(size, device=old.device) if buffer == "position_ids" else old.new_zeros(size)
            setattr(embeddings, buffer, new.to(old.dtype).expand(1, -1))
    model.config.max_position_embeddings = size
    if pattern is not None:
        model.config.sparse_attn_pattern = pattern.to_dict()
    if name not in _REGISTERED:
        register(name=name)
    model.set_attn_implementation(name)
    return model


def _tiled(table: nn.Embedding, size: int, offset: int) -> nn.Embedding:
    """A (size, E) embedding whose rows from ``offset`` on repeat ``table``'s rows from ``offset`` on."""
    learned = table.weight.data[offset:]                                           # (P, E)
    repeats = ceil_div(size - offset, learned.shape[0])
    weight = torch.cat([table.weight.data[:offset], learned.repeat(repeats, 1)[:size - offset]])  # (size, E)
    return nn.Embedding.from_pretrained(weight.clone(), freeze=False, padding_idx=table.padding_idx)


def _check_models_when_built() -> None:
    """Wrap ``PreTrainedModel._check_and_adjust_attn_implementation`` (run when a model is built, loaded or
    switched to a new attn_implementation; wrapped once, when this module is imported) so that

    - a registered name raises for models sparse_attn cannot run, instead of being ignored by them or
      crashing inside them, and warns when it gives the model ``DEFAULT_PATTERN`` unasked;
    - a model whose config holds ``sparse_attn_pattern`` (saved by ``save_pretrained``) and is loaded without
      an attn_implementation runs sparse_attn again, not transformers' default;
    - a name that looks like sparse_attn's but was never given to ``register`` says so."""
    adjust = PreTrainedModel._check_and_adjust_attn_implementation
    if getattr(adjust, "checks_sparse_attn", False):
        return

    @functools.wraps(adjust)
    def check_and_adjust(model, attn_implementation, *args, **kwargs):
        chosen = adjust(model, _requested(model, attn_implementation), *args, **kwargs)
        if chosen in _REGISTERED:
            check_model(model, chosen)
            _warn_if_default_pattern(model.config, chosen)
        return chosen

    check_and_adjust.checks_sparse_attn = True
    PreTrainedModel._check_and_adjust_attn_implementation = check_and_adjust


def _requested(model: PreTrainedModel, attn_implementation):
    """The attn_implementation to build ``model`` with: 'sparse_attn' for a config with a saved pattern when none
    is asked for; a ValueError pointing at ``register`` for a sparse_attn-like name that is not registered."""
    if attn_implementation is None and getattr(model.config, "sparse_attn_pattern", None) is not None:
        return "sparse_attn" if "sparse_attn" in _REGISTERED else register(name="sparse_attn")
    if not isinstance(attn_implementation, str) or attn_implementation in _REGISTERED or \
            attn_implementation == "eager" or attn_implementation in ALL_ATTENTION_FUNCTIONS:
        return attn_implementation
    close = difflib.get_close_matches(attn_implementation, [*_REGISTERED, "sparse_attn"], n=1, cutoff=0.75)
    if close or "sparse" in attn_implementation.lower():
        registered = f" (registered in this process: {sorted(_REGISTERED)})" if _REGISTERED else ""
        suggestion = f", or did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"attn_implementation={attn_implementation!r} is not registered{registered}. sparse_attn's "
                         f"attention runs under a name given to sparse_attn.integrations.transformers.register(), "
                         f"called once per process before the model is built or loaded: register(pattern, "
                         f"name={attn_implementation!r}){suggestion}")
    return attn_implementation


def _warn_if_default_pattern(config, name: str) -> None:
    registered, _ = _REGISTERED[name]
    if registered is None and getattr(config, "sparse_attn_pattern", None) is None and own_patterns(config) is None:
        warnings.warn(f"attn_implementation={name!r} runs this {getattr(config, 'model_type', '')} model with "
                      f"sparse_attn's default pattern {DEFAULT_PATTERN!r} (256 tokens each side and a global first "
                      f"token): register() got no pattern and model.config.sparse_attn_pattern is not set. Choose "
                      f"one for the model with register(pattern, name={name!r}) or model.config.sparse_attn_pattern "
                      f"= pattern.to_dict() (docs/integrations.md, 'Choosing the pattern per model')", UserWarning,
                      stacklevel=2)


def check_model(model: PreTrainedModel, name: str = "sparse_attn") -> None:
    """Raise a ValueError if ``attn_implementation=name`` would not run sparse_attn correctly in ``model``.

    >>> check_model(AutoModel.from_config(LongformerConfig()))                       # doctest: +SKIP
    ValueError: LongformerModel computes attention in its own layers (LongformerSelfAttention) ...
    """
    model_class, config = type(model), model.config
    own_attention = _own_attention_class(model_class)
    if own_attention is not None or getattr(config, "attention_type", None) == "block_sparse":
        layer = own_attention or "its block_sparse attention"
        raise ValueError(f"{model_class.__name__} computes attention in its own layers ({layer}) instead of calling "
                         f"transformers' AttentionInterface, so attn_implementation={name!r} would never run "
                         f"sparse_attn. Build it with attn_implementation='eager' and swap each layer's "
                         f"self-attention for sparse_attn.nn.SparseSelfAttention with the weights copied: for "
                         f"Longformer, SparseSelfAttention(hidden_size, num_heads, sa.Local(attention_window // 2), "
                         f"global_projections=True) computes exactly what LongformerSelfAttention computes "
                         f"(docs/integrations.md, 'Longformer equivalence')")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"{model_class.__name__} has cross-attention (config.is_encoder_decoder or "
                         f"config.add_cross_attention), which transformers would run with attn_implementation="
                         f"{name!r} too; there query i and key j are positions in two different sequences, which a "
                         f"sparse_attn pattern does not describe. Use sparse_attn in an encoder-only or decoder-only "
                         f"model, or attn_implementation='sdpa' here")


@functools.lru_cache(maxsize=None)
def _own_attention_class(model_class: type) -> str | None:
    """The name of an attention layer in ``model_class``'s modeling code if that code never calls the
    AttentionInterface (transformers' own heuristic for ``set_attn_implementation``), else None."""
    try:
        source = inspect.getsource(sys.modules[model_class.__module__])
    except (KeyError, OSError, TypeError):  # no source (a notebook class): nothing to tell
        return None
    layer = re.search(r"^class (\w*Attention\w*)\(nn\.Module\):", source, re.MULTILINE)
    return layer.group(1) if layer and "ALL_ATTENTION_FUNCTIONS" not in source else None


_check_models_when_built()
