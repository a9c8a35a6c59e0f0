"""A fingerprint of compiled layouts: sha256 of every tensor of ``layout.index`` for a fixed list of cases, to show
that a refactor leaves the layouts byte-identical.

    python benchmarks/layout_identity.py OUT.json          # in each checkout; then compare the two files

Cases: eleven patterns (windows, causal, dilated, stride, BigBird, Random, a complement, PerHead, Blocks, block-unit
windows, explicit and trailing globals) x (n_q, n_k, block_size) in (64, 64, 16), (50, 70, 16), (100, 100, 32),
(1, 64, 16), (37, 37, 64) x call-time data (none, causal, a key padding mask, a global mask, documents), 4 heads;
the masks and documents are drawn from a seeded generator. A case the API refuses records its error message.
"""
from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

import sparse_attn as sa

PATTERNS = [sa.Local(7) | sa.Global(first=2), sa.Local(3, 0) & sa.Causal(), sa.Dilated(4, 3) | sa.Sink(first=1),
            sa.Stride(5) | sa.Local(2), sa.bigbird(block=16, window_blocks=3, global_blocks=1, random_blocks=2),
            sa.Random(2, seed=3) & sa.Causal(), ~sa.Local(5),
            sa.PerHead([sa.Local(3), sa.Stride(4), sa.Dense(), sa.Sink(first=3)]),
            sa.Blocks(np.eye(4, dtype=bool) | np.eye(4, k=-1, dtype=bool), block_size=16), sa.Local(2, 1, block_size=3),
            sa.Global(tokens=(5, 40), last=3) | sa.Local(9, 0)]
SHAPES = [(64, 64, 16), (50, 70, 16), (100, 100, 32), (1, 64, 16), (37, 37, 64)]
DATA = ["none", "causal", "kpm", "global", "documents"]


def call_data(kind: str, n_q: int, n_k: int, rng: np.random.Generator) -> dict | None:
    """The keyword arguments of one kind of call-time data (None: not defined for these lengths)."""
    if kind == "causal":
        return {"causal": True}
    if kind == "kpm":
        return {"key_padding_mask": rng.random((2, n_k)) < 0.2}
    if kind == "global":
        return {"global_mask": rng.random((2, n_q)) < 0.1}
    if kind == "documents":
        return {"documents": np.sort(rng.integers(0, 3, size=(2, n_q)), axis=1)} if n_q == n_k else None
    return {}


def fingerprints() -> dict[str, object]:
    rng = np.random.default_rng(0)
    out: dict[str, object] = {}
    for pattern in PATTERNS:
        for n_q, n_k, block_size in SHAPES:
            for kind in DATA:
                kwargs = call_data(kind, n_q, n_k, rng)
                if kwargs is None:
                    continue
                key = f"{pattern!r} {n_q}x{n_k} block {block_size} {kind}"
                try:
                    layout = pattern.layout(n_q, n_k, heads=4, block_size=block_size, **kwargs)
                except ValueError as error:
                    out[key] = f"ValueError: {error}"
                    continue
                out[key] = {name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]
                            + f" {tuple(t.shape)} {t.dtype}" for name, t in layout.index._asdict().items()}
    return out


if __name__ == "__main__":
    prints = fingerprints()
    with open(sys.argv[1], "w") as f:
        json.dump(prints, f, indent=1)
    print(f"{len(prints)} cases written to {sys.argv[1]}")
