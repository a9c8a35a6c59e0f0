"""The attention function transformers calls for a registered name; ``register`` and ``to_long_model``.

>>> import sparse_attn as sa
>>> from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
>>> name = register(sa.Local(2) | sa.Global(first=1), name="sparse_attn_doc_local", backend="reference")
>>> q = k = v = torch.randn(1, 2, 6, 8)                        # (B, H, N, D), as a layer hands them over
>>> out, weights = ALL_ATTENTION_FUNCTIONS[name](torch.nn.Module(), q, k, v, None, scaling=0.5)
>>> out.shape, weights                                        # (B, N, H, D), as transformers expects
(torch.Size([1, 6, 2, 8]), None)

The function gets the model's padding mask (from ``masks.padding_mask``, registered with it), causality
(``is_causal``), the packed documents, the keys a ``SparseCache`` holds (``cache.held_keys``) and the score
modifiers the model passes (:func:`_score_mods`), and runs ``sparse_attention`` with the layer's pattern
(``registry.model_pattern``).
"""
from __future__ import annotations

import difflib
import warnings

import torch
from einops import rearrange
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ... import backends
from ...blocks import ceil_div
from ...checks import check_int
from ...kv_cache import left_padded_attention
from ...pattern import Pattern, check_pattern
from .cache import held_keys
from .masks import check_cache_of_packed_batch, first_tokens, key_padding_mask_of, packed_documents, padding_mask
from .model_checks import check_model
from .registry import model_pattern, record, registered_names, registration

# Arguments transformers hands attention functions that change what attention computes, beyond what sparse_attn
# computes (softcap= and s_aux=, which it takes: _score_mods): the model would silently get something else.
_NOT_COMPUTED = {"position_bias": "adds a position bias tensor to the attention scores",   # T5, Inkling, ...
                 "sinks": "adds attention sinks computed per token to the softmax",      # Inkling 2
                 "indices": "attends only the keys its indexer selects",                 # DeepSeek V3.2, HY V4
                 "block_indices": "attends only the key blocks its indexer selects"}     # MiniMax M3


def register(pattern: Pattern | list[Pattern] | tuple[Pattern, ...] | None = None, *, name: str = "sparse_attn",
             backend: str = "auto") -> str:
    """Make ``attn_implementation=name`` run sparse_attn with ``pattern``; returns ``name``.

    >>> import sparse_attn as sa
    >>> register(sa.Local(128) | sa.Global(first=1), name="longformer-128")
    'longformer-128'
    >>> register([sa.Local(127, 0), sa.Dense()], name="two-layers")      # one pattern per decoder layer
    'two-layers'

    ``pattern``: one Pattern for every layer, a list with one Pattern per decoder layer, or None: the
    model's own attention per layer where its config has sliding-window layers (``model_pattern``),
    else ``DEFAULT_PATTERN``.

    Registers the attention function (``AttentionInterface``) and the mask function
    (``AttentionMaskInterface``) that hands it the model's padding mask, and makes building a model
    with ``attn_implementation=name`` raise a ValueError for models sparse_attn cannot run (see
    ``model_checks``). Calling it again with the same name replaces the pattern.
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
    record(name, pattern, backend)
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
        registered = registration(name)
        assert registered is not None, name  # register() recorded the name before making this function
        layer_idx = getattr(module, "layer_idx", None)
        pattern = model_pattern(getattr(module, "config", None), registered.pattern, layer_idx)
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        held = held_keys(key, pattern, causal, module)
        n_k = key.shape[2] if held is None else held.kv.seq_len                        # every position so far
        key_padding_mask = key_padding_mask_of(attention_mask, key.shape[0], n_k, causal)  # (B, n_written) or None
        if key_padding_mask is not None and held is None:
            # A static cache hands over all its slots; only the first n_written hold keys.
            n_k = key_padding_mask.shape[1]
            key, value = key[:, :, :n_k], value[:, :, :n_k]                             # (B, Hkv, Nk, D)
        documents = packed_documents(query.shape[0], query.shape[2], n_k, key_padding_mask, **kwargs)  # (B, N)
        check_cache_of_packed_batch(module, query.shape[2], n_k, documents, kwargs.get("use_cache"))
        # Left padding: positions count from each row's first token, as the model's own position_ids do.
        starts = None if documents is not None or key_padding_mask is None else first_tokens(key_padding_mask)
        if held is not None and starts is not None:
            held.kv.set_starts(starts)
        if held is None or held.contiguous:
            # With a KV cache the n_q queries are the last positions: sparse_attn aligns them bottom-right.
            out = left_padded_attention(query, key, value, pattern, starts, causal=causal,
                                        key_padding_mask=key_padding_mask, documents=documents, scale=scaling,
                                        backend=registered.backend, **mods)           # (B, Hq, Nq, D)
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
    if embeddings is None or not isinstance(table, nn.Embedding):
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
    if registration(name) is None:
        register(name=name)
    model.set_attn_implementation(name)
    return model


def _tiled(table: nn.Embedding, size: int, offset: int) -> nn.Embedding:
    """A (size, E) embedding whose rows from ``offset`` on repeat ``table``'s rows from ``offset`` on."""
    learned = table.weight.data[offset:]                                           # (P, E)
    repeats = ceil_div(size - offset, learned.shape[0])
    weight = torch.cat([table.weight.data[:offset], learned.repeat(repeats, 1)[:size - offset]])  # (size, E)
    return nn.Embedding.from_pretrained(weight.clone(), freeze=False, padding_idx=table.padding_idx)


def requested_implementation(model: PreTrainedModel, attn_implementation):
    """The attn_implementation to build ``model`` with: 'sparse_attn' for a config with a saved pattern when none
    is asked for; a ValueError pointing at ``register`` for a sparse_attn-like name that is not registered."""
    if attn_implementation is None and getattr(model.config, "sparse_attn_pattern", None) is not None:
        return "sparse_attn" if registration("sparse_attn") is not None else register(name="sparse_attn")
    if not isinstance(attn_implementation, str) or registration(attn_implementation) is not None or \
            attn_implementation == "eager" or attn_implementation in ALL_ATTENTION_FUNCTIONS:
        return attn_implementation
    names = registered_names()
    close = difflib.get_close_matches(attn_implementation, [*names, "sparse_attn"], n=1, cutoff=0.75)
    if not close and "sparse" not in attn_implementation.lower():
        return attn_implementation
    registered = f" (registered in this process: {names})" if names else ""
    if attn_implementation == "sparse_attn":  # the default name, asked for before register(): nothing to suggest
        fix = "call register(pattern) first, which registers the name 'sparse_attn'"
    else:
        fix = f"register(pattern, name={attn_implementation!r})" + (f", or did you mean {close[0]!r}?" if close else "")
    raise ValueError(f"attn_implementation={attn_implementation!r} is not registered{registered}. sparse_attn's "
                     f"attention runs under a name given to sparse_attn.integrations.transformers.register(), "
                     f"called once per process before the model is built or loaded: {fix}")
