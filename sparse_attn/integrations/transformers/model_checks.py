"""Which models ``attn_implementation=name`` can run: refusals when a model is built, and the default's warning.

>>> from transformers import AutoModel, BertConfig, LongformerConfig
>>> check_model(AutoModel.from_config(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
...                                              intermediate_size=64)))     # BERT calls the AttentionInterface
>>> check_model(AutoModel.from_config(LongformerConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
...                                                    intermediate_size=64, attention_window=8)))
Traceback (most recent call last):
ValueError: LongformerModel computes attention in its own layers (LongformerSelfAttention) ...

:func:`check_built_model` runs whenever transformers builds, loads or switches a model (``build_hook``).
"""
from __future__ import annotations

import functools
import inspect
import re
import sys
import warnings
import weakref

from transformers import PreTrainedModel

from .registry import DEFAULT_PATTERN, own_patterns, registration


def check_built_model(model: PreTrainedModel, attn_implementation) -> None:
    """For a model just given a registered ``attn_implementation``: refuse it if sparse_attn cannot run it
    (:func:`check_model`), and warn if it gets ``DEFAULT_PATTERN`` unasked. Other implementations pass."""
    if registration(attn_implementation) is not None:
        check_model(model, attn_implementation)
        warn_if_default_pattern(model.config, attn_implementation)


def warn_if_default_pattern(config, name: str) -> None:
    """Warn that ``name`` runs ``DEFAULT_PATTERN`` in this model if neither ``register`` nor the config chose one
    and the model has no sliding windows of its own: once per model and name (a model and the base model inside
    it, a ``LlamaForCausalLM`` and its ``LlamaModel``, share one config, and each runs the build check)."""
    registered = registration(name)
    assert registered is not None, name  # the build hook checks registered names only
    chosen = registered.pattern is not None or getattr(config, "sparse_attn_pattern", None) is not None
    if not chosen and own_patterns(config) is None and _first_time(config, name):
        warnings.warn(f"attn_implementation={name!r} runs this {getattr(config, 'model_type', '')} model with "
                      f"sparse_attn's default pattern {DEFAULT_PATTERN!r} (256 tokens each side and a global first "
                      f"token): register() got no pattern and model.config.sparse_attn_pattern is not set. Choose "
                      f"one for the model with register(pattern, name={name!r}) or model.config.sparse_attn_pattern "
                      f"= pattern.to_dict() (docs/integrations.md, 'Choosing the pattern per model')", UserWarning,
                      stacklevel=3)


# name -> weak references to the configs warned about (configs are not hashable: no WeakSet), dead ones dropped as
# they are met
_WARNED: dict[str, list[weakref.ref]] = {}


def _first_time(config, name: str) -> bool:
    """Whether ``config`` (the object, not its values) meets ``name``'s default-pattern warning for the first time."""
    alive = [ref for ref in _WARNED.get(name, []) if ref() is not None]
    first = all(ref() is not config for ref in alive)
    _WARNED[name] = [*alive, weakref.ref(config)] if first else alive
    return first


def check_model(model: PreTrainedModel, name: str = "sparse_attn") -> None:
    """Raise a ValueError if ``attn_implementation=name`` would not run sparse_attn correctly in ``model`` (see the
    module's example): models whose layers compute attention themselves, and models with cross-attention."""
    model_class, config = type(model), model.config
    own_attention = _own_attention_class(model_class)  # type: ignore[arg-type]  # a class is hashable
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


@functools.cache
def _own_attention_class(model_class: type) -> str | None:
    """The name of an attention layer in ``model_class``'s modeling code if that code never calls the
    AttentionInterface (transformers' own heuristic for ``set_attn_implementation``), else None."""
    try:
        source = inspect.getsource(sys.modules[model_class.__module__])
    except (KeyError, OSError, TypeError):  # no source (a notebook class): nothing to tell
        return None
    layer = re.search(r"^class (\w*Attention\w*)\(nn\.Module\):", source, re.MULTILINE)
    return layer.group(1) if layer and "ALL_ATTENTION_FUNCTIONS" not in source else None
