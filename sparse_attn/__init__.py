"""sparse_attn: exact attention over only the allowed query/key pairs.

>>> import sparse_attn as sa
>>> p = sa.Local(256) | sa.Global(first=1)
>>> p.layout(4096, heads=12).nnz_blocks
13572
"""
from .pattern import (Causal, Dense, Dilated, Global, Intersection, Local, Pattern, PerHead, Random, Sink, Stride,
                      Union)
from .layout import BlockLayout

__all__ = ["Pattern", "Local", "Stride", "Dilated", "Global", "Sink", "Random", "Causal", "Dense", "Union",
           "Intersection", "PerHead", "BlockLayout"]
