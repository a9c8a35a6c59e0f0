"""Packed documents: one (B, N) tensor of document ids, one id per token, -1 = padding.

>>> import sparse_attn as sa
>>> sa.documents_from_lengths([[3, 2], [4]], n=6)                  # two examples of 6 tokens
tensor([[ 0,  0,  0,  1,  1, -1],
        [ 0,  0,  0,  0, -1, -1]])
>>> sa.documents_from_cu_seqlens([0, 2, 5])                       # FlashAttention's varlen offsets
tensor([[0, 0, 1, 1, 1]])

Passed as ``documents=`` to ``sparse_attention`` (or ``pattern.layout``), every document attends
as if it were a sequence by itself: positions count from its first token, no pair crosses two
documents, and padding (-1) rows output 0. Each document is one contiguous run of tokens; ids need
not be sorted, but an id must not reappear after another id in the same example.

>>> spans = document_spans(document_values(sa.documents_from_lengths([[3, 2], [4]], n=6)))
>>> spans.example.tolist(), spans.start.tolist(), spans.length.tolist(), spans.id.tolist()
([0, 0, 1], [0, 3, 0], [3, 2, 4], [0, 1, 0])
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .blocks import MAX_LENGTH
from .checks import check_int


class Spans(NamedTuple):
    """The documents of a (B, N) id array, one entry per document, sorted by (example, start); int64."""

    example: np.ndarray
    start: np.ndarray
    length: np.ndarray
    id: np.ndarray


def check_documents(documents, batch: int | None = None, n: int | None = None) -> None:
    """A documents tensor (torch or numpy) checked: its type and shape, and its ids where it has values (a meta
    tensor has none). ``batch``/``n`` None accept any size.

    >>> check_documents(np.array([[0, 0, 1, 0]]))
    Traceback (most recent call last):
    ...
    ValueError: documents: document 0 of example 0 reappears at position 3 after another id; each document ...
    """
    dtype = getattr(documents, "dtype", None)
    integer = (isinstance(dtype, torch.dtype) and not dtype.is_floating_point and not dtype.is_complex
               and dtype != torch.bool) or (isinstance(dtype, np.dtype) and dtype.kind in "iu")
    if not isinstance(documents, (torch.Tensor, np.ndarray)) or not integer:
        raise TypeError(f"documents must be an integer torch.Tensor or numpy array of shape (batch, seq_len), one "
                        f"document id per token (-1 = padding), got {dtype or type(documents).__name__}; build one "
                        f"with sa.documents_from_lengths or sa.documents_from_cu_seqlens")
    shape = f"({'batch' if batch is None else batch}, {'seq_len' if n is None else n})"
    if (documents.ndim != 2 or 0 in documents.shape or batch not in (None, documents.shape[0])
            or n not in (None, documents.shape[1])):
        raise ValueError(f"documents must have shape {shape}, one id per token of each example, "
                         f"got {tuple(documents.shape)}")
    if not (isinstance(documents, torch.Tensor) and documents.device.type == "meta"):
        document_values(documents)


def document_values(documents) -> np.ndarray:
    """The ids of an integer documents tensor or array with values, checked, as int64 numpy (B, N).

    >>> document_values(torch.tensor([[3, 3, -1, 0]], dtype=torch.int32)).tolist()
    [[3, 3, -1, 0]]
    """
    if isinstance(documents, torch.Tensor):
        documents = documents.detach().cpu().numpy()
    ids = documents.astype(np.int64)
    if (documents != ids).any() or (ids < -1).any():                      # uint64 beyond int64, or below -1
        example, position = np.argwhere((documents != ids) | (ids < -1))[0]
        raise ValueError(f"documents must hold ids >= 0, or -1 for padding; example {example} has "
                         f"{documents[example, position]} at position {position}")
    _check_contiguous(ids)
    return ids


def _check_contiguous(ids: np.ndarray) -> None:
    """Each id (other than -1) forms one run per example."""
    example, first = _run_starts(ids)
    run_id = ids[example, first]
    real = run_id != -1
    order = np.lexsort((first[real], run_id[real], example[real]))
    e, s, i = example[real][order], first[real][order], run_id[real][order]
    repeated = np.flatnonzero((e[1:] == e[:-1]) & (i[1:] == i[:-1]))
    if repeated.size:
        # the earliest reappearance: smallest (example, position) among the second runs
        k = repeated[np.lexsort((s[repeated + 1], e[repeated + 1]))[0]] + 1
        raise ValueError(f"documents: document {i[k]} of example {e[k]} reappears at position {s[k]} after another "
                         f"id; each document must be one contiguous run of tokens (give each run its own id, e.g. "
                         f"with documents_from_lengths)")


def _run_starts(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(example, first position) of every run of equal ids, sorted."""
    change = np.ones(ids.shape, dtype=bool)
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    examples, starts = np.nonzero(change)
    return examples, starts


def document_spans(ids: np.ndarray) -> Spans:
    """The documents (runs of one id other than -1) of a checked (B, N) id array."""
    example, start = _run_starts(ids)
    n = ids.shape[1]
    end = np.append(start[1:], n)
    end[np.append(example[1:] != example[:-1], True)] = n                 # a run ends with its example
    run_id = ids[example, start]
    real = run_id != -1
    as_int64 = (np.asarray(a, dtype=np.int64) for a in (example[real], start[real], (end - start)[real], run_id[real]))
    return Spans(*as_int64)


def per_token(spans: Spans, out: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``out`` (B, n) with every token of document d set to ``values[d]``; tokens of no document keep theirs.

    >>> spans = document_spans(np.array([[0, 0, 1, -1]]))
    >>> per_token(spans, np.full((1, 4), -5), np.array([10, 20])).tolist()
    [[10, 10, 20, -5]]
    """
    member = np.repeat(np.arange(len(spans.start)), spans.length)                   # (tokens in documents,)
    offset = np.arange(len(member)) - np.repeat(np.cumsum(spans.length) - spans.length, spans.length)
    out.reshape(-1)[spans.example[member] * out.shape[1] + spans.start[member] + offset] = values[member]
    return out


def document_ids(spans: Spans, batch: int, n: int) -> np.ndarray:
    """The (batch, n) int64 ids that ``document_spans`` read ``spans`` from (-1 where no document).

    >>> document_ids(document_spans(np.array([[3, 3, -1, 7]])), 1, 4).tolist()
    [[3, 3, -1, 7]]
    """
    return per_token(spans, np.full((batch, n), -1, dtype=np.int64), spans.id)


def documents_from_lengths(lengths, n: int | None = None) -> torch.Tensor:
    """(B, n) int64 ids from per-example document lengths: document k of an example has id k.

    ``lengths[b]`` lists example b's document lengths in order (ints >= 0; an empty document takes
    no token); tokens after the last document, up to ``n``, are padding (-1). ``n`` defaults to the
    longest example.

    >>> documents_from_lengths([[2, 0, 3]])                       # the empty document 1 takes no token
    tensor([[0, 0, 2, 2, 2]])
    """
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise TypeError(f"lengths must be a list of per-example lists of document lengths, e.g. [[512, 300], "
                        f"[812]], got {type(lengths).__name__}")
    rows = []
    for b, example in enumerate(lengths):
        if isinstance(example, (str, bytes)) or not hasattr(example, "__iter__"):
            raise TypeError(f"lengths[{b}] must be a list of document lengths (one list per example), got "
                            f"{example!r}; for one example write [[...]]")
        rows.append(np.array([check_int(f"lengths[{b}][{d}]", length, 0, MAX_LENGTH)
                              for d, length in enumerate(example)], dtype=np.int64))
    if not rows:
        raise ValueError("lengths must hold at least one example, got an empty list")
    totals = [int(r.sum()) for r in rows]
    n = _check_n(n, max(totals))
    ids = np.full((len(rows), n), -1, dtype=np.int64)
    for b, row in enumerate(rows):
        ids[b, :totals[b]] = np.repeat(np.arange(len(row), dtype=np.int64), row)
    return torch.from_numpy(ids)


def documents_from_cu_seqlens(cu_seqlens, n: int | None = None) -> torch.Tensor:
    """(1, n) int64 ids of one packed row from FlashAttention-style cumulative offsets.

    ``cu_seqlens`` = [0, end of document 0, end of document 1, ...] (non-decreasing ints, a tensor,
    array or list); document k has id k. Tokens from the last offset up to ``n`` are padding (-1);
    ``n`` defaults to the last offset.

    >>> documents_from_cu_seqlens(torch.tensor([0, 3, 4], dtype=torch.int32), n=6)
    tensor([[ 0,  0,  0,  1, -1, -1]])
    """
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    offsets = np.asarray(cu_seqlens)
    if offsets.ndim != 1 or offsets.size == 0 or offsets.dtype.kind not in "iu":
        raise ValueError(f"cu_seqlens must be a 1-D list or tensor of integer offsets [0, end of document 0, ...], "
                         f"got {cu_seqlens!r}")
    lengths = np.diff(offsets.astype(np.int64))
    if offsets[0] != 0 or (lengths < 0).any():
        raise ValueError(f"cu_seqlens must start at 0 and never decrease (FlashAttention's cumulative sequence "
                         f"lengths), got {offsets.tolist()}")
    return documents_from_lengths([lengths], n)


def _check_n(n, total: int) -> int:
    """``n``, defaulting to ``total`` (the longest example), checked to hold it."""
    if n is None:
        if total == 0:
            raise ValueError("the documents hold no token; give at least one document of length >= 1, or n")
        return total
    n = check_int("n", n, 1, MAX_LENGTH)
    if n < total:
        raise ValueError(f"n={n} is shorter than the longest example ({total} tokens); pass n >= {total}, or None")
    return n
