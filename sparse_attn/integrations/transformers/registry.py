"""The names given to ``register`` and the pattern each layer of a model runs.

>>> from sparse_attn import Dense, Local
>>> model_pattern(None, (Local(127, 0), Dense()), layer_idx=1)      # registered with one pattern per layer
Dense()
>>> registration("sdpa") is None                                   # not a name given to register()
True

A layer's pattern: ``config.sparse_attn_pattern`` when set, else the one registered for the model's
``attn_implementation`` name, else the model's own sliding windows (:func:`own_patterns`), else
``DEFAULT_PATTERN``. The table is keyed by name only: it holds no model, tensor or cache.
"""
from __future__ import annotations

from typing import NamedTuple

from transformers.cache_utils import get_layer_types_and_kwargs

from ...pattern import Dense, Global, Local, Pattern

DEFAULT_PATTERN = Local(256) | Global(first=1)


class Registration(NamedTuple):
    """What ``register`` was given for one ``attn_implementation`` name."""
    pattern: Pattern | tuple[Pattern, ...] | None  # every layer's, one per layer, or None: the model's own
    backend: str


_REGISTRATIONS: dict[str, Registration] = {}


def record(name: str, pattern: Pattern | tuple[Pattern, ...] | None, backend: str) -> None:
    """Remember ``pattern`` and ``backend`` for ``name`` (checked by the caller), replacing what it had."""
    _REGISTRATIONS[name] = Registration(pattern, backend)


def registration(name) -> Registration | None:
    """What ``name`` was registered with, or None if it never was (``name`` may be any attn_implementation)."""
    return _REGISTRATIONS.get(name) if isinstance(name, str) else None


def registered_names() -> list[str]:
    """The names registered in this process, sorted."""
    return sorted(_REGISTRATIONS)


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
    if isinstance(layer_kwargs, dict):             # transformers 5.17 and older: one dict that every layer shares
        layer_kwargs = [layer_kwargs] * len(layer_types)
    if "sliding_attention" not in layer_types or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        return None
    return [Local(kwargs["sliding_window"] - 1, 0) if kind == "sliding_attention" else Dense()
            for kind, kwargs in zip(layer_types, layer_kwargs)]
