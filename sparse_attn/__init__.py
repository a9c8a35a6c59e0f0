"""sparse_attn: exact attention over only the allowed query/key pairs.

>>> import sparse_attn as sa
>>> p = sa.Local(256) | sa.Global(first=1)
>>> p.layout(4096, heads=12).nnz_blocks
8088
"""
from .pattern import (Causal, Dense, Dilated, Global, Intersection, Local, Pattern, PerHead, Random, Sink, Stride,
                      Union)
from .layout import BlockLayout
from .api import sparse_attention
from .weights import attention_weights
from . import nn
from .presets import bigbird, list_presets, load_pattern, longformer, preset, save_pattern, sparse_transformer, streaming

__all__ = ["Pattern", "Local", "Stride", "Dilated", "Global", "Sink", "Random", "Causal", "Dense", "Union",
           "Intersection", "PerHead", "BlockLayout", "sparse_attention", "attention_weights", "longformer", "bigbird",
           "sparse_transformer", "streaming", "preset", "list_presets", "load_pattern", "save_pattern", "nn"]
