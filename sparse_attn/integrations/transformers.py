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
model's ``attn_implementation`` name (default ``Local(256) | Global(first=1)``, Longformer's
``attention_window=512`` with a global first token). Register several names to bind several
patterns. Only the padding mask and causality come from the model: the model's own mask function
(sliding windows, packed sequences, prefix-LM) is replaced by the pattern.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel

from ..api import sparse_attention
from ..pattern import Global, Local, Pattern

try:  # transformers >= 4.53 builds masks through a per-implementation mask function
    from transformers.masking_utils import AttentionMaskInterface
except ImportError:  # older versions hand the attention function a 4D mask
    AttentionMaskInterface = None

DEFAULT_PATTERN = Local(256) | Global(first=1)
_REGISTERED: dict[str, tuple[Pattern, str]] = {}  # name -> (default pattern, backend)


def register(pattern: Pattern | None = None, *, name: str = "sparse_attn", backend: str = "auto") -> str:
    """Make ``attn_implementation=name`` run sparse_attn with ``pattern``; returns ``name``.

    >>> register(sa.Local(128) | sa.Global(first=1), name="longformer-128")  # doctest: +SKIP
    'longformer-128'

    Registers the attention function (``AttentionInterface``) and, on transformers >= 4.53, the mask
    function (``AttentionMaskInterface``) that hands it the model's padding mask. Calling it again
    with the same name replaces the pattern.
    """
    pattern = DEFAULT_PATTERN if pattern is None else pattern
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must be a sparse_attn Pattern such as sa.Local(256) | sa.Global(first=1), "
                        f"got {type(pattern).__name__}: {pattern!r}")
    if not isinstance(name, str) or not name or name in ("eager", "sdpa") or name.startswith(("flash", "flex")):
        raise ValueError(f"name must be a new attn_implementation name such as 'sparse_attn', got {name!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str ('auto', 'reference', 'numba' or 'triton'), got {backend!r}")
    _REGISTERED[name] = (pattern, backend)
    AttentionInterface.register(name, _attention_function(name))
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(name, padding_mask)
    return name


def _attention_function(name: str):
    def sparse_attn_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
        """query (B, Hq, Nq, D), key/value (B, Hkv, Nk, D) -> ((B, Nq, Hq, D), None), as transformers expects."""
        pattern, backend = _REGISTERED[name]
        pattern = model_pattern(getattr(module, "config", None), pattern)
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        # With a KV cache the n_q queries are the last positions: sparse_attn aligns them bottom-right.
        out = sparse_attention(query, key, value, pattern, causal=causal,
                               key_padding_mask=_key_padding_mask(attention_mask, key), scale=scaling,
                               backend=backend)                                    # (B, Hq, Nq, D)
        if dropout > 0:
            out = nn.functional.dropout(out, dropout)  # transformers passes dropout > 0 only in training
        return out.transpose(1, 2).contiguous(), None

    sparse_attn_forward.__qualname__ = sparse_attn_forward.__name__ = f"sparse_attn_forward[{name}]"
    return sparse_attn_forward


def model_pattern(config, default: Pattern) -> Pattern:
    """The pattern of a model: ``config.sparse_attn_pattern`` (a Pattern or its dict) if set, else ``default``."""
    chosen = getattr(config, "sparse_attn_pattern", None)
    if chosen is None or isinstance(chosen, Pattern):
        return default if chosen is None else chosen
    if isinstance(chosen, dict):
        return Pattern.from_dict(chosen)
    raise TypeError(f"config.sparse_attn_pattern must be a sparse_attn Pattern or its to_dict() dict, got "
                    f"{type(chosen).__name__}: {chosen!r}")


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask function transformers calls: the 2D padding mask (B, kv_length), True = real token, or None.

    The pattern (not ``mask_function``) decides which pairs interact; only padding passes through.
    """
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]                                # (B, Nk)
    return None if bool(attention_mask.all()) else attention_mask


def _key_padding_mask(attention_mask: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor | None:
    """sparse_attn's key_padding_mask (B, Nk), True = padding, from the mask a model hands the attention."""
    if attention_mask is None:
        return None
    batch, n_k = key.shape[0], key.shape[2]
    if attention_mask.dim() == 4:
        # A prepared 4D mask (older transformers, or a model that builds its own): its last query row
        # sees every key but the padding, whether the mask is bidirectional or causal.
        attention_mask = attention_mask[:, 0, -1, :]                               # (B, Nk)
    if attention_mask.dtype != torch.bool:  # additive float mask: 0 = keep, large negative = masked
        attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, n_k):
        raise ValueError(f"sparse_attn needs a padding mask of shape (batch, kv_length) = ({batch}, {n_k}) "
                         f"(or a 4D mask ending in kv_length), got shape {tuple(attention_mask.shape)}; pass the "
                         f"model a 2D attention_mask (1 = token, 0 = padding)")
    return ~attention_mask


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
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"max_positions must be a positive int, got {max_positions!r}")
    offset = 0 if table.padding_idx is None else table.padding_idx + 1
    if max_positions <= table.num_embeddings - offset:
        raise ValueError(f"max_positions={max_positions} must exceed the model's {table.num_embeddings - offset} "
                         f"positions; to_long_model only extends")
    if pattern is not None and not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must be a sparse_attn Pattern or None, got {type(pattern).__name__}: {pattern!r}")
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
    repeats = -(-(size - offset) // learned.shape[0])
    weight = torch.cat([table.weight.data[:offset], learned.repeat(repeats, 1)[:size - offset]])  # (size, E)
    return nn.Embedding.from_pretrained(weight.clone(), freeze=False, padding_idx=table.padding_idx)
