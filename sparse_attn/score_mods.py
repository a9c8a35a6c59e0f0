"""Score modifiers: logit soft-capping, ALiBi and learned attention sinks.

>>> import torch, sparse_attn as sa
>>> q = k = v = torch.randn(1, 2, 10, 8)                                  # (B, Hq, N, D)
>>> out, lse = sa.sparse_attention(q, k, v, sa.Local(4), softcap=30.0, alibi_slopes=torch.tensor([0.5, 0.25]),
...                                sinks=torch.zeros(2), return_lse=True, backend="reference")
>>> out.shape, lse.shape
(torch.Size([1, 2, 10, 8]), torch.Size([1, 2, 10]))

With ``s = scale * q_i . k_j`` of an allowed pair (DESIGN.md, "Score modifiers"):

- ``softcap=c`` (float > 0): ``s <- c * tanh(s / c)`` (Gemma 2's ``attn_logit_softcapping``);
- ``alibi_slopes`` ((Hq,) or (B, Hq)): ``s <- s - slope[b, h] * |i' - j|``, after the softcap (FlashAttention's
  order). **Positions**: query row i of ``n_q`` rows over ``n_k`` keys sits at ``i' = i + (n_k - n_q)``
  (bottom-right, as every pattern: :func:`query_positions`); with ``documents=`` both positions count from the
  document's start, which leaves ``|i' - j|`` unchanged;
- ``sinks`` ((Hq,), learned): ``exp(sinks[h])`` joins every row's softmax denominator and contributes no value
  (gpt-oss); the row's lse includes it, a row with no allowed key returns 0 with lse = sink.

Who does what: softcap and ALiBi run inside each backend (``attention(q, k, v, layout, scale, mods)`` with a
:class:`ScoreMods`); sinks never enter a kernel: :func:`add_sink` applies them to a backend's (out, lse),
exactly and differentiably, in ``sparse_attention``, the KV cache and the distributed merge alike.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary


@dataclass(frozen=True)
class ScoreMods:
    """The in-kernel score modifiers of one call, as ``check_mods`` normalised them.

    >>> ScoreMods() == NO_MODS, ScoreMods(softcap=30.0) == NO_MODS
    (True, False)
    """

    softcap: float = 0.0                      # 0 = none; else c > 0: s <- c * tanh(s / c)
    alibi_slopes: torch.Tensor | None = None  # (B or 1, Hq) on q's device, contiguous, float32 (float64 for
    # float64 q); None = none. s <- s - slope[b, h] * |i + (n_k - n_q) - j|   (after softcap)

    def __eq__(self, other) -> bool:
        """Equal softcaps and the same slopes tensor (or both None): ``mods == NO_MODS`` never compares a
        tensor's values (``tensor == None`` costs a caught TypeError, about 0.3 ms)."""
        if not isinstance(other, ScoreMods):
            return NotImplemented
        return self.softcap == other.softcap and self.alibi_slopes is other.alibi_slopes


NO_MODS = ScoreMods()
# alibi_slopes tensors found finite -> their version then: a layer's slopes on a GPU are read (a host sync) once,
# not at every call, and again after an in-place change
_FINITE = WeakIdKeyDictionary()
MAX_SLOPE = 1e30  # |slope| at most this: x a distance below 2^28 tokens stays under float32's 3.4e38


def check_mods(q: torch.Tensor, softcap=None, alibi_slopes=None, sinks=None) -> tuple[ScoreMods, torch.Tensor | None]:
    """The score modifiers of a call on q (B, Hq, Nq, D), checked: (the backend's ScoreMods, sinks or None).

    >>> q = torch.zeros(2, 4, 8, 16)
    >>> mods, sinks = check_mods(q, softcap=50.0, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    >>> mods.softcap, tuple(mods.alibi_slopes.shape), sinks
    (50.0, (1, 4), None)
    >>> check_mods(q, softcap=0)
    Traceback (most recent call last):
    ...
    ValueError: softcap must be a finite float > 0 (scores become softcap * tanh(score / softcap)), got 0;
    pass softcap=None for no capping

    Values are checked except on meta tensors and while torch.compile traces (reading them would break the
    graph): non-finite slopes are an error (read once per slopes tensor, and again after an in-place change:
    no host sync at every call), NaN in ``sinks`` propagates to the rows it touches.
    """
    if softcap is None and alibi_slopes is None and sinks is None:
        return NO_MODS, None                                                   # the common call: nothing to do
    mods = ScoreMods(_check_softcap(softcap), _check_slopes(alibi_slopes, q))
    return (NO_MODS if mods == NO_MODS else mods), _check_sinks(sinks, q)


def _check_softcap(softcap) -> float:
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float > 0 or None, got {softcap!r} ({type(softcap).__name__})")
    if not 0 < softcap < math.inf:  # type: ignore[operator]  # typeshed's numbers.Real has no <; a Real has
        raise ValueError(f"softcap must be a finite float > 0 (scores become softcap * tanh(score / softcap)), got "
                         f"{softcap!r}; pass softcap=None for no capping")
    return float(softcap)


def _check_slopes(slopes, q: torch.Tensor) -> torch.Tensor | None:
    """(B or 1, Hq) slopes in q's lse dtype, contiguous, detached; None stays None."""
    if slopes is None:
        return None
    batch, heads = q.shape[:2]
    _check_head_tensor("alibi_slopes", slopes, q, f"(Hq,) = ({heads},) or (B, Hq) = ({batch}, {heads})")
    if slopes.shape not in ((heads,), (1, heads), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape (Hq,) = ({heads},) or (B, Hq) = ({batch}, {heads}), one "
                         f"slope per query head (and example), got {tuple(slopes.shape)}")
    if slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError("alibi_slopes get no gradient (they are fixed per head, as in ALiBi and FlashAttention), "
                         "but requires_grad=True; pass alibi_slopes.detach()")
    if _readable(slopes) and _FINITE.get(slopes) != slopes._version:          # read once per tensor and change
        if not torch.isfinite(slopes).all():
            bad = slopes[~torch.isfinite(slopes)][0].item()
            raise ValueError(f"alibi_slopes must be finite, got {bad} among {slopes.tolist()}")
        if (slopes.abs() > MAX_SLOPE).any():
            bad = slopes[slopes.abs() > MAX_SLOPE][0].item()
            raise ValueError(f"alibi_slopes must be at most {MAX_SLOPE:g} in size (slope x distance must stay finite "
                             f"in float32), got {bad:g}; ALiBi's slopes are 2^-8/H .. 2^-8, and a slope this large "
                             f"only masks every other key: use the pattern for that")
        _FINITE[slopes] = slopes._version
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return slopes.detach().to(dtype).reshape(-1, heads).contiguous()


def _check_sinks(sinks, q: torch.Tensor) -> torch.Tensor | None:
    if sinks is None:
        return None
    heads = q.shape[1]
    _check_head_tensor("sinks", sinks, q, f"(Hq,) = ({heads},)")
    if sinks.shape != (heads,):
        raise ValueError(f"sinks must have shape (Hq,) = ({heads},), one logit per query head, got "
                         f"{tuple(sinks.shape)}")
    return sinks


def _check_head_tensor(name: str, value, q: torch.Tensor, shape: str) -> None:
    """A floating-point tensor on q's device."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape}, got {type(value).__name__}; build it "
                        f"with torch.tensor(..., device=q.device)")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}; convert with .float()")
    if value.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {value.device}; move it with "
                         f"{name}.to(q.device)")


def _readable(t: torch.Tensor) -> bool:
    """Values can be read without breaking a graph: not meta, not while torch.compile traces."""
    return t.device.type != "meta" and not torch.compiler.is_compiling()


def add_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention without sinks -> with them: every row's softmax denominator gains ``exp(sinks[h])``.

    >>> out, lse = torch.ones(1, 2, 3, 4), torch.zeros(1, 2, 3)          # (B, Hq, Nq, D), (B, Hq, Nq)
    >>> out2, lse2 = add_sink(out, lse, torch.zeros(2))                  # the sink weighs as much as the keys
    >>> out2[0, 0, 0, 0].item(), round(lse2[0, 0, 0].item(), 4)
    (0.5, 0.6931)

    ``lse2 = logaddexp(lse, sink)``, ``out2 = out * exp(lse - lse2)``: exact, and differentiable with respect to
    out, lse (so every backend's lse gradient carries dq, dk) and sinks. A row with no key (out 0, lse -inf)
    gives 0 and lse = sink; with a sink of -inf too, 0 and -inf, never NaN. out keeps its dtype; lse's dtype
    (float32, float64 for float64 inputs) is the computation's.
    """
    sink = sinks.to(lse.dtype)[:, None].expand_as(lse)                         # (B, Hq, Nq)
    nothing = torch.isneginf(lse) & torch.isneginf(sink)                       # no key and no sink
    total = torch.logaddexp(lse.masked_fill(nothing, 0.0), sink.masked_fill(nothing, 0.0))
    total = total.masked_fill(nothing, -math.inf)
    kept = torch.exp(torch.where(nothing, 0.0, lse - total))                   # the keys' share of the row
    return (out.to(lse.dtype) * kept[..., None]).to(out.dtype), total


def query_positions(n_q: int, n_k: int, rows: slice = slice(None), device=None) -> torch.Tensor:
    """The key-sequence position of query rows ``rows`` of ``n_q`` over ``n_k`` keys: ``i + (n_k - n_q)``, the
    bottom-right alignment of every pattern (a decode step's row is the last row of the full sequence).

    >>> query_positions(2, 5).tolist(), query_positions(4, 4, slice(1, 3)).tolist()
    ([3, 4], [1, 2])
    """
    return torch.arange(n_q, device=device)[rows] + (n_k - n_q)


def alibi_bias(slopes: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """ALiBi's additive bias ``-slope * |query_pos - key_pos|``: slopes (Bs, Hq), positions (rows,), (keys,)
    -> (Bs, Hq, rows, keys) in the slopes' dtype.

    >>> alibi_bias(torch.tensor([[0.5]]), torch.tensor([3]), torch.tensor([0, 3, 4])).tolist()
    [[[[-1.5, -0.0, -0.5]]]]
    """
    distance = (query_pos[:, None] - key_pos[None, :]).abs().to(slopes.dtype)   # (rows, keys)
    return -slopes[:, :, None, None] * distance


def alibi_alignment(query_start: int, n_q: int, key_start: int, n_k: int) -> tuple[int, int, int]:
    """ALiBi for rows at positions ``[query_start, query_start + n_q)`` over keys at ``[key_start, key_start +
    n_k)`` through a backend, whose distance is the bottom-right ``|i + (n_k' - n_q') - j|`` of its inputs:
    ``(keys to append, rows to append, shift)``. With that padding at the ends (never attended), the backend's
    distance plus ``shift`` is the positions' distance on every pair of real rows and keys, so the true lse is
    the backend's less ``slope * shift`` and out is the backend's. Keys all before the rows (or all after)
    need at most ``n_q - 1`` keys (``n_k - 1`` rows) of padding however far away they are.

    >>> alibi_alignment(100, 1, 0, 4)       # a decode step over 4 sink tokens: no padding, 97 further away
    (0, 0, 97)
    >>> alibi_alignment(96, 4, 90, 10)      # a window that ends with the rows: as it is
    (0, 0, 0)
    """
    query_end, key_end = query_start + n_q, key_start + n_k
    if key_end - 1 <= query_start:          # every key at or before every row: the distance is i - j + const
        return n_q - 1, 0, query_start - (key_end - 1)
    if key_start >= query_end - 1:          # every key at or after every row: j - i + const
        return 0, n_k - 1, key_start - (query_end - 1)
    return max(query_end - key_end, 0), max(key_end - query_end, 0), 0


def combine_partials(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of disjoint key sets from the results over each: out (P, ..., D) and lse
    (P, ...) of P parts -> out (..., D), lse (...) in lse's dtype. A row no part attends gives 0 and -inf
    (gradients 0). Sinks join after the merge, once (:func:`add_sink`).

    >>> out, lse = combine_partials(torch.tensor([[[1.0]], [[3.0]]]), torch.tensor([[0.0], [0.0]]))
    >>> out.item(), round(lse.item(), 4)              # two equal halves: the mean, log 2
    (2.0, 0.6931)
    """
    top = lse.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight = torch.exp(lse - top)                                                  # (P, ...)
    total = weight.sum(0)
    seen = total > 0
    safe = torch.where(seen, total, torch.ones_like(total))
    combined = (weight[..., None] * out).sum(0) / safe[..., None]
    return combined, torch.where(seen, top + torch.log(safe), torch.full_like(top, -torch.inf))


def modified_scores(scores: torch.Tensor, softcap: float, bias: torch.Tensor | None) -> torch.Tensor:
    """Scores ``scale * q . k`` with the in-kernel modifiers applied in their order: softcap, then the bias.

    >>> modified_scores(torch.tensor([0.0, 100.0]), 10.0, torch.tensor([-1.0, 0.0])).tolist()
    [-1.0, 10.0]
    """
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return scores if bias is None else scores + bias
