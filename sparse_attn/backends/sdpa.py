"""The route ``backend="auto"`` takes for short sequences on the CPU: torch's ``scaled_dot_product_attention``
with the layout's token mask, where that is faster than the numba kernels.

>>> import torch, sparse_attn as sa
>>> q = torch.randn(1, 8, 100, 64)
>>> layout = sa.Local(16).layout(100, heads=8)
>>> takes(q, q, q, layout, NO_MODS, sinks=None, return_lse=False)    # 8 x 100 x 100 pairs: SDPA is faster
True
>>> out = attention(q, q, q, layout, scale=0.125)
>>> bool(torch.allclose(out, sa.sparse_attention(q, q, q, layout, backend="numba"), atol=1e-5))
True

Below about 256 x 256 pairs a head, a numba call is mostly its fixed cost (checks, the custom op's dispatch, the
kernels' parallel launches: at N=64, a few microseconds of work, it took 0.45-0.79 ms), where SDPA over every pair
takes less: at B=1, H=8, D=64, float32 on a 2-core AMD EPYC (Zen 4), SDPA with the mask was 3-4x faster at N=64,
1.2-1.4x at N=256, level at N=320 and slower from N=384 on, forward and forward+backward, for a wide window, a
narrow one and a causal window alike (``benchmarks/results/short_sequences/``). So "auto" takes this route when the
call's attention has at most ``MAX_PAIRS`` (query, key) pairs over every example and head, is float32 on the CPU,
has no softcap, ALiBi or sinks, does not ask for the log-sum-exp, is not being traced by torch.compile (whose graphs
keep the kernels' route), and has finite q, k and v (SDPA lets a NaN of a pair the mask leaves out into its row; the
kernels keep it to the pairs that meet it). The mask is the layout's (call-time masks and documents included),
computed once per layout and kept for the layouts used last. A row with no allowed key returns 0 with zero
gradients, as the kernels do. A backend named explicitly never takes this route. The logger ``sparse_attn.dispatch``
says at DEBUG which route a call took.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch
import torch.nn.functional as F

from ..layout import BlockLayout
from ..score_mods import NO_MODS, ScoreMods

MAX_PAIRS = 8 * 256 * 256      # B * Hq * Nq * Nk at which SDPA with the mask still beat numba (see above)
LOGGER = logging.getLogger("sparse_attn.dispatch")
_MASKS: OrderedDict[int, tuple[BlockLayout, torch.Tensor, torch.Tensor | None]] = OrderedDict()
_MASKS_KEPT = 16               # layouts whose masks stay (each <= MAX_PAIRS bools); the entry holds its layout alive,
                               # so a key (the layout's id) is never another layout's while it is in here
_MASKS_LOCK = threading.Lock()


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, mods: ScoreMods,
          sinks: torch.Tensor | None, return_lse: bool) -> bool:
    """Whether ``backend="auto"`` runs this call as SDPA with the layout's mask (see the module docstring)."""
    if torch.compiler.is_compiling():                                # graphs keep the kernels' route
        return False
    pairs = q.shape[0] * q.shape[1] * layout.n_q * layout.n_k
    chosen = (pairs <= MAX_PAIRS and q.device.type == "cpu" and q.dtype == torch.float32 and mods == NO_MODS
              and sinks is None and not return_lse and all(bool(torch.isfinite(t).all()) for t in (q, k, v)))
    if LOGGER.isEnabledFor(logging.DEBUG):
        LOGGER.debug("backend='auto': %s (%d query/key pairs; SDPA at most %d)",
                     "SDPA with the pattern's mask" if chosen else "the kernels", pairs, MAX_PAIRS)
    return chosen


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, scale: float) -> torch.Tensor:
    """out (B, Hq, Nq, D): softmax attention over the layout's allowed pairs, by SDPA with its token mask; rows with
    no allowed key 0. k, v (B or 1, Hkv, Nk, D)."""
    mask, keep = _mask(layout)                                       # (Bl, Hl, Nq, Nk), (Bl, Hl, Nq, 1) or None
    if k.shape[0] != q.shape[0]:                                     # one k, v for the batch: a view, no copy
        k, v = (t.expand(q.shape[0], *t.shape[1:]) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out if keep is None else out * keep


def _mask(layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layout's token mask for SDPA, with every key allowed in rows that have none (SDPA would return NaN
    there), and the rows to keep (1.0 where a row has a key; None when every row does)."""
    key = id(layout)
    with _MASKS_LOCK:                                                # calls may come from several threads
        if key in _MASKS:
            _MASKS.move_to_end(key)
            return _MASKS[key][1:]
    mask = layout.to_dense()                                         # (Bl, Hl, Nq, Nk)
    has_key = mask.any(-1, keepdim=True)                             # (Bl, Hl, Nq, 1)
    entry = (mask, None) if bool(has_key.all()) else (mask | ~has_key, has_key.float())
    with _MASKS_LOCK:
        _MASKS[key] = (layout, *entry)
        if len(_MASKS) > _MASKS_KEPT:
            _MASKS.popitem(last=False)
    return entry
