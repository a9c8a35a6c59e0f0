"""sparse_attn: exact attention over only the allowed query/key pairs.

>>> import sparse_attn as sa
>>> p = sa.Local(256) | sa.Global(first=1)
>>> p.layout(4096, heads=12).nnz_blocks
8088

Patterns and presets import with numpy only; the names that need torch (``BlockLayout``,
``sparse_attention``, ``attention_weights``, ``nn``) import it on first use, so ``sparse-attn --help``
and pattern files load without paying for torch.
"""
from importlib import import_module

from .pattern import (
    Blocks,
    Causal,
    Complement,
    Dense,
    Dilated,
    Global,
    Intersection,
    Local,
    Pattern,
    PerHead,
    Random,
    Sink,
    Stride,
    Union,
)
from .presets import (
    bigbird,
    list_presets,
    load_pattern,
    longformer,
    preset,
    save_pattern,
    sparse_transformer,
    streaming,
)

_LAZY = {"BlockLayout": ".layout", "sparse_attention": ".api", "attention_weights": ".weights", "nn": ".nn",
         "documents_from_lengths": ".documents", "documents_from_cu_seqlens": ".documents",
         "SparseKVCache": ".kv_cache"}

__all__ = ["Pattern", "Local", "Stride", "Dilated", "Global", "Sink", "Random", "Causal", "Dense", "Blocks", "Union",
           "Intersection", "Complement", "PerHead", "BlockLayout", "sparse_attention", "attention_weights",
           "longformer", "bigbird", "sparse_transformer", "streaming", "preset", "list_presets", "load_pattern",
           "save_pattern", "nn", "documents_from_lengths", "documents_from_cu_seqlens", "SparseKVCache"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'sparse_attn' has no attribute {name!r}")
    module = import_module(_LAZY[name], __name__)
    value = module if name == "nn" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
