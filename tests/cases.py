"""The case matrix of the conformance tests (tests/test_conformance.py): patterns x call-time data x shapes, each
case with an id and its token mask written from DESIGN's definitions (tests/strategies.py), never from a kernel;
each backend's test picks its dtypes. Below it, the cases of the score modifier tests (tests/test_score_mods*.py).

>>> case = CASES_BY_ID["longformer-gqa-key_padding_mask"]
>>> case.shape.batch, case.shape.q_heads, case.shape.kv_heads, case.shape.n_q, list(case.call_data())
(2, 4, 2, 37, ['key_padding_mask'])
>>> case.mask().shape
torch.Size([2, 4, 37, 37])
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

import sparse_attn as sa
from tests.strategies import document_mask, expected_mask

PATTERNS = {
    "longformer": sa.Local(4) | sa.Global(first=1),
    "bigbird": sa.Local(2) | sa.Global(first=2) | sa.Random(1, seed=3, block_size=8),
    "strided": (sa.Stride(5, offset=1) | sa.Sink(first=2)) & ~sa.Dilated(1, 3),
    "per-head": sa.PerHead([sa.Local(1), sa.Stride(3), sa.Dense() & sa.Causal(), ~sa.Local(2) | sa.Global(first=1)]),
}


class Shape(NamedTuple):
    """q (batch, q_heads, n_q, head_dim); k, v (kv_batch, kv_heads, n_k, head_dim); the layout's block_size."""

    batch: int
    q_heads: int                  # 4 everywhere: the per-head pattern has 4 patterns
    kv_heads: int
    kv_batch: int                 # 1: one k, v read by every example
    n_q: int
    n_k: int
    block_size: int
    head_dim: int = 16


SHAPES = {
    "gqa": Shape(2, 4, 2, 2, 37, 37, 16),                  # 3 blocks a side, the last ragged
    "kv-broadcast": Shape(3, 4, 1, 1, 29, 29, 16),         # MQA, one k, v for 3 examples
    "nq<nk": Shape(2, 4, 2, 1, 7, 45, 16),                 # decode rows at the bottom right, a shared prefix
    "nq>nk": Shape(2, 4, 4, 1, 30, 9, 16),                 # the first rows see no key under causal
    "short": Shape(2, 4, 2, 2, 11, 11, 16),                # the sequence is shorter than a block
}
DATA = ("none", "key_padding_mask", "global_mask", "documents", "causal")
SQUARE_ONLY = {"global_mask", "documents"}                 # global tokens are rows and columns; documents too


@dataclass(frozen=True)
class Case:
    """One cell of the matrix: a pattern, a shape and a call-time data, named by keys of PATTERNS, SHAPES, DATA."""

    pattern_name: str
    shape_name: str
    data: str                     # one of DATA: the call-time argument this case passes

    def __str__(self) -> str:
        return f"{self.pattern_name}-{self.shape_name}-{self.data}"

    @property
    def pattern(self) -> sa.Pattern:
        return PATTERNS[self.pattern_name]

    @property
    def shape(self) -> Shape:
        return SHAPES[self.shape_name]

    def call_data(self) -> dict:
        """The sparse_attention / layout keyword arguments of ``data``: example 0 pads its last quarter of keys,
        example 1 its first third (rows before them see nothing), example 2 all of them; example b makes
        tokens b + 1 and n // 2 + b global; documents of lengths n // 3, 1 and the rest less 2 padding
        tokens, one whole document, 2 and the rest less 2."""
        batch, n_k = self.shape.batch, self.shape.n_k
        if self.data == "key_padding_mask":
            padding = torch.zeros(batch, n_k, dtype=torch.bool)
            padding[0, n_k - n_k // 4:] = True
            padding[1, :n_k // 3] = True
            padding[2:] = True
            return {"key_padding_mask": padding}
        if self.data == "global_mask":
            tokens = torch.zeros(batch, n_k, dtype=torch.bool)
            for b in range(batch):
                tokens[b, [b + 1, n_k // 2 + b]] = True
            return {"global_mask": tokens}
        if self.data == "documents":
            lengths = [[n_k // 3, 1, n_k - n_k // 3 - 3], [n_k], [2, n_k - 4]][:batch]
            return {"documents": sa.documents_from_lengths(lengths, n_k)}
        if self.data == "causal":
            return {"causal": True}
        return {}

    def mask(self) -> torch.Tensor:
        """(B or 1, Hq, Nq, Nk) bool: the allowed pairs by the definitions, not by the compiler."""
        shape, data = self.shape, self.call_data()
        if "documents" in data:
            return document_mask(self.pattern, data["documents"], shape.q_heads)
        return expected_mask(self.pattern, shape.n_q, shape.n_k, shape.q_heads, **data)


def _valid(shape_name: str, data: str) -> bool:
    shape = SHAPES[shape_name]
    return shape.n_q == shape.n_k or data not in SQUARE_ONLY


CASES = [Case(p, s, d) for p, s, d in itertools.product(PATTERNS, SHAPES, DATA) if _valid(s, d)]
CASES_BY_ID = {str(case): case for case in CASES}
# Every shape and every call-time data once, the patterns in turn (Triton's interpreter takes seconds a case).
ONE_OF_EACH = [Case(pattern, shape, data) for pattern, (shape, data) in zip(
    itertools.cycle(PATTERNS), [("gqa", "global_mask"), ("kv-broadcast", "documents"), ("nq<nk", "causal"),
                                ("nq>nk", "key_padding_mask"), ("short", "none")])]


# --- the score modifier cases (tests/test_score_mods.py, tests/test_score_mods_numba.py) ----------------
DOUBLE = torch.float64


def make(shape, seed, grad=True):
    """A float64 tensor of ``shape`` drawn from ``seed``, requiring grad unless ``grad`` is False."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=DOUBLE).requires_grad_(grad)


def case_gqa():
    p = sa.Local(3) | sa.Global(first=1)
    return dict(shapes=(2, 4, 2, 37, 37), pattern=p, options={}, mask=p.mask(37))


def case_kv_broadcast():
    p = sa.Local(4, 1) | sa.Sink(first=2)
    return dict(shapes=(3, 4, 1, 29, 29), kv_batch=1, pattern=p, options={}, mask=p.mask(29))


def case_decode_shape():                         # n_q < n_k: rows at the bottom right
    p = sa.Local(5, 0) | sa.Sink(first=1)
    return dict(shapes=(2, 2, 2, 7, 70), pattern=p, options={}, mask=p.mask(7, 70))


def case_causal_empty_rows():                    # n_q > n_k: the first 8 rows see no key
    p = sa.Local(4)
    causal = torch.ones(20, 12, dtype=torch.bool).tril(12 - 20)
    return dict(shapes=(2, 2, 1, 20, 12), pattern=p, options={"causal": True},
                mask=torch.as_tensor(p.mask(20, 12)) & causal)


def case_key_padding():
    p = sa.Local(6) | sa.Global(first=1)
    padding = torch.zeros(2, 40, dtype=torch.bool)
    padding[1, 25:] = True
    padding[0, :] = True                         # example 0: nothing to attend, every row empty
    return dict(shapes=(2, 2, 2, 40, 40), pattern=p, options={"key_padding_mask": padding},
                mask=torch.as_tensor(p.mask(40))[None] & ~padding[:, None, None, :])


def case_documents():
    p = sa.Local(2, 0) | sa.Global(first=1)
    documents = sa.documents_from_lengths([[10, 15, 8], [30]], n=36)
    return dict(shapes=(2, 2, 1, 36, 36), pattern=p, options={"documents": documents},
                mask=document_mask(p, documents, 2))


def case_per_head():
    p = sa.PerHead([sa.Local(1), sa.Stride(3), sa.Dense() & sa.Causal(), sa.Local(2) | sa.Global(first=3)])
    return dict(shapes=(1, 4, 2, 33, 33), pattern=p, options={}, mask=p.mask(33, heads=4))


SCORE_MOD_CASES = [case_gqa, case_kv_broadcast, case_decode_shape, case_causal_empty_rows, case_key_padding, case_documents,
         case_per_head]
MODS = list(itertools.product([None, 3.0], [None, "heads", "examples"], [False, True]))


def modifiers(softcap, slopes, sinks, batch, heads):
    gen = torch.Generator().manual_seed(7)
    shape = {None: None, "heads": (heads,), "examples": (batch, heads)}[slopes]
    return {"softcap": softcap,
            "alibi_slopes": None if shape is None else torch.rand(shape, generator=gen, dtype=DOUBLE),
            "sinks": (torch.randn(heads, generator=gen, dtype=DOUBLE) * 2).requires_grad_() if sinks else None}


