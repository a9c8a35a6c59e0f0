"""What a sweep measures: the patterns and implementations by name, and the default and ``--quick`` settings.

>>> settings(quick=True, repeats=5, lengths=[4096, 1024, 4096])
Settings(patterns=('longformer',), lengths=(1024, 4096), implementations=('sparse_attn-numba', 'sdpa-dense',
'sdpa-masked'), repeats=5, timeout=60)

Plain data, no torch: ``sparse-attn --help`` prints these.
"""
from __future__ import annotations

import dataclasses

PATTERNS = {  # label -> PATTERN (expression or preset); the CLI parses these like any PATTERN argument
    "longformer": "Local(256) | Global(first=16)",
    "bigbird-itc": "bigbird-itc",
}
IMPLEMENTATIONS = {
    "sparse_attn-numba": "this library, backend='numba' (CPU kernels), layout built once",
    "sparse_attn-triton": "this library, backend='triton' (CUDA kernels), layout built once",
    "sparse_attn-reference": "this library's oracle: dense scores per chunk of query blocks (slow)",
    "sdpa-dense": "torch scaled_dot_product_attention over all pairs, no mask (the dense compute)",
    "sdpa-masked": "torch scaled_dot_product_attention with the pattern as an N x N bool mask",
    "flex": "torch.compile(flex_attention) with layout.to_block_mask() (same pattern, same blocks)",
    "hf-longformer": "transformers LongformerSelfAttention (with its q/k/v projections), Local|Global only",
}

PATTERN_FREE = ("sdpa-dense",)  # implementations that never read the pattern: one point per N serves every pattern
# Implementations whose first call compiles kernels that it caches on disk: the sweep warms them up once, in a process
# of their own without a time limit, so that no point's limit pays for the compile (a cold Numba compile takes minutes
# on a loaded 2-core machine, more than a --quick point's 60 s).
WARM_FIRST = ("sparse_attn-numba", "sparse_attn-triton")
OWN = tuple(name for name in IMPLEMENTATIONS if name.startswith("sparse_attn-"))  # this library's lines


@dataclasses.dataclass(frozen=True)
class Settings:
    """The sweep's choices a user may leave out.

    ``patterns``: labels of ``PATTERNS``, preset names or expressions; ``lengths``: sequence
    lengths, ascending; ``implementations``: names in ``IMPLEMENTATIONS``; ``repeats``: timed calls
    per point; ``timeout``: seconds per point.
    """

    patterns: tuple[str, ...]
    lengths: tuple[int, ...]
    implementations: tuple[str, ...]
    repeats: int
    timeout: float


DEFAULT = Settings(patterns=tuple(PATTERNS), lengths=(1024, 2048, 4096, 8192, 16384, 32768, 65536),
                   implementations=("sparse_attn-numba", "sdpa-dense", "sdpa-masked", "flex", "hf-longformer"),
                   repeats=3, timeout=120)
QUICK = Settings(patterns=("longformer",), lengths=(1024, 2048, 4096, 8192),
                 implementations=("sparse_attn-numba", "sdpa-dense", "sdpa-masked"), repeats=2, timeout=60)


def settings(quick: bool = False, **given) -> Settings:
    """``QUICK`` (``quick=True``) or ``DEFAULT``, with each value in ``given`` that is not None in its
    place; lengths sorted, each once."""
    chosen = {name: value for name, value in given.items() if value is not None}
    merged = dataclasses.replace(QUICK if quick else DEFAULT, **chosen)
    return dataclasses.replace(merged, patterns=tuple(merged.patterns), lengths=tuple(sorted(set(merged.lengths))),
                               implementations=tuple(merged.implementations))
