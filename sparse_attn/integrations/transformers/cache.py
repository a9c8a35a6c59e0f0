"""``SparseCache``: a ``transformers.Cache`` whose layers keep only the keys their pattern can still reach.

>>> import sparse_attn as sa
>>> layer = SparseCacheLayer(sa.Local(3, 0) | sa.Sink(first=1), backend="reference")  # one layer of a SparseCache
>>> keys, values = layer.update(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8))  # a prefill of 10 tokens
>>> keys, values = layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))    # a decode step
>>> held_keys(keys, layer.pattern, causal=True, module=None).positions.tolist()  # the sink and the window
[0, 7, 8, 9, 10]

A model generates with ``model.generate(ids, **{CACHE_KEYWORD: SparseCache(model)})``. Each layer is a
:class:`SparseCacheLayer` over a :class:`~sparse_attn.kv_cache.SparseKVCache`. The keys a layer returns
from ``update`` carry a :class:`Held` (their absolute positions, the layer's pattern and cache) as the
attribute ``HELD_ATTRIBUTE``, which the attention function reads with :func:`held_keys`: the record lives
and dies with the keys (no table keyed by ``id()``), so nothing outlives a model or its cache.
"""
from __future__ import annotations

import inspect
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from transformers import GenerationMixin
from transformers.cache_utils import Cache, CacheLayerMixin

from ...kv_cache import SparseKVCache
from ...pattern import Causal, Pattern
from .registry import model_pattern, registration

# The keyword generate() and a model's forward take a KV cache under: `cache` since transformers renamed it in 5.24
# (`past_key_values` still works there, deprecated), `past_key_values` before.
CACHE_KEYWORD = "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters \
    else "past_key_values"
HELD_ATTRIBUTE = "sparse_attn_held"  # the attribute of the keys a SparseCacheLayer returns: their Held
_CANNOT_CROP = ("SparseCache cannot crop (assisted generation, prompt lookup and DoLa take back tokens): the keys the "
                "taken-back tokens let it drop are gone; generate without them, or use a DynamicCache with the same "
                "attn_implementation")


class Held(NamedTuple):
    """What a SparseCacheLayer's update returned: the keys' absolute positions, the layer's pattern and cache."""
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


def held_keys(key: torch.Tensor, pattern: Pattern, causal: bool, module: nn.Module) -> Held | None:
    """The positions of ``key`` if a SparseCacheLayer returned it, after checking it evicts by ``pattern``."""
    held = getattr(key, HELD_ATTRIBUTE, None)
    if held is None:
        return None
    if not causal:
        raise ValueError(f"{type(module).__name__} is not causal (is_causal=False) but its keys come from a "
                         f"SparseCache, which evicts for causal decoding; use SparseCache with decoder models")
    if held.pattern != pattern:
        raise ValueError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) runs {pattern!r} but "
                         f"its SparseCache layer evicts by {held.pattern!r}, so keys the attention needs may be gone; "
                         f"build the SparseCache after setting the model's pattern (SparseCache(model))")
    return held


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
        """Append the new keys/values (B, Hkv, n_new, D); return the held ones, their positions attached.
        Keys that cannot continue the cache raise before anything changes (the layer stays uninitialised)."""
        kv = self.kv if self.kv is not None else self._new_kv()
        keys, values, positions = kv.update(key_states, value_states)                      # (B, Hkv, Nk, D), (Nk,)
        if not self.is_initialized:
            self._initialize(key_states, kv)
        setattr(keys, HELD_ATTRIBUTE, Held(positions, self.pattern, kv))  # a new view or copy at every update
        return keys, values

    def get_seq_length(self) -> int:
        """Tokens seen so far (the next token's position), not the number held."""
        return self.kv.seq_len if self.kv is not None else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The padding mask covers every position from 0: the attention picks the held keys' columns."""
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held."""
        return self.kv.nbytes if self.kv is not None else 0

    def reset(self) -> None:
        self.kv, self.is_initialized = None, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search, after each step: example i continues what example ``beam_idx[i]`` held."""
        if self.kv is not None:
            self.kv.select_examples(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the examples ``indices`` (ints), in that order."""
        if self.kv is not None:
            self.kv.select_examples(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each example ``repeats`` times in a row: ``[a, b]`` -> ``[a, a, b, b]`` for 2."""
        if type(repeats) is not int or repeats < 1:
            raise ValueError(f"repeats must be an int >= 1 (the copies of each example, as num_beams), got "
                             f"{repeats!r}; pass how many times each example is to be repeated")
        if self.kv is not None and self.kv.batch is not None:
            self.kv.select_examples(np.arange(self.kv.batch).repeat(repeats))

    def crop(self, *args, **kwargs) -> None:
        raise ValueError(_CANNOT_CROP)

    def activate_past_recording(self, **kwargs) -> None:
        """transformers asks for this before the prefill of assisted generation (and prompt lookup), which then
        crops: refused here, before the cache holds anything, rather than at the first crop."""
        raise ValueError(_CANNOT_CROP)


class SparseCache(Cache):
    """A ``transformers.Cache`` whose layers keep only the keys their sparse_attn pattern can still reach.

    >>> cache = SparseCache(model)                                               # doctest: +SKIP
    >>> model.generate(ids, cache=cache, max_new_tokens=100_000)                # doctest: +SKIP

    ``model`` (or its config) runs a name registered with ``register`` as its ``attn_implementation``;
    layer ``i`` evicts by the pattern the attention of layer ``i`` runs (``model_pattern``), so generation
    equals generation with a full ``DynamicCache`` and the same patterns, token for token. A layer whose
    pattern reaches every past key (``Dense``, ``Stride``, ...) keeps everything (SparseKVCache says so). Beam
    search works (each beam's held keys follow it); taking tokens back (``crop``: assisted generation, prompt
    lookup) is refused.
    """

    def __init__(self, model_or_config):
        config = getattr(model_or_config, "config", model_or_config)
        name = getattr(config, "_attn_implementation", None)
        registered = registration(name)
        if registered is None:
            raise ValueError(f"SparseCache needs a model built with a sparse_attn attn_implementation (a name given to "
                             f"register(), such as 'sparse_attn'), got attn_implementation={name!r}: its attention "
                             f"would not know where the held keys are; build it with attn_implementation="
                             f"'sparse_attn' after register(), or use a DynamicCache")
        layers = config.get_text_config(decoder=True).num_hidden_layers
        super().__init__(layers=[SparseCacheLayer(model_pattern(config, registered.pattern, i), registered.backend)
                                 for i in range(layers)])

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held by all layers."""
        return sum(layer.nbytes for layer in self.layers)  # type: ignore[union-attr]  # SparseCacheLayers (__init__)
