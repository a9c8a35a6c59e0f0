"""``torch.nn`` layers built on :func:`~sparse_attn.api.sparse_attention`.

>>> import torch, sparse_attn as sa
>>> from sparse_attn.nn import SparseSelfAttention
>>> attn = SparseSelfAttention(64, 4, sa.Local(16) | sa.Global(first=1), backend="reference")
>>> x = torch.randn(2, 100, 64)                                   # (B, N, E)
>>> padding = torch.arange(100) >= torch.tensor([[100], [70]])    # (B, N), True = padding
>>> attn(x, key_padding_mask=padding).shape
torch.Size([2, 100, 64])

It also takes ``nn.MultiheadAttention``'s self-attention call, key and value being the query tensor itself,
and then answers as that layer does with ``need_weights=False``, ``(out, None)`` (no attention weights exist):

>>> out, weights = attn(x, x, x, key_padding_mask=padding, need_weights=False)
>>> out.shape, weights
(torch.Size([2, 100, 64]), None)

Longformer-style global attention, with separate projections for the global tokens:

>>> attn = SparseSelfAttention(64, 4, sa.Local(16), global_projections=True, backend="reference")
>>> is_global = torch.zeros(2, 100, dtype=torch.bool)
>>> is_global[0, 0] = is_global[1, :3] = True                    # 1 and 3 global tokens
>>> attn(x, key_padding_mask=padding, global_mask=is_global).shape
torch.Size([2, 100, 64])

Score modifiers (``sparse_attention``'s): soft-capped scores, ALiBi and learned attention sinks:

>>> slopes = 2.0 ** (-8.0 * torch.arange(1, 5) / 4)                # ALiBi's slopes for 4 heads
>>> attn = SparseSelfAttention(64, 4, sa.Local(16, 0), softcap=30.0, alibi_slopes=slopes, sinks=True,
...                            backend="reference")
>>> attn(x).shape, attn.sinks.shape                               # sinks: a learned parameter per head
(torch.Size([2, 100, 64]), torch.Size([4]))
"""
from __future__ import annotations

import torch
from einops import rearrange, repeat
from torch import nn

from . import backends
from ._host import host_only
from .api import sparse_attention
from .checks import check_bool, check_float, check_int
from .pattern import Dense, Local, Pattern, check_pattern
from .score_mods import check_mods


class SparseSelfAttention(nn.Module):
    """Multi-head self-attention over the pairs that ``pattern`` allows, with q/k/v/out projections.

    Args:
        embed_dim: model width E; ``num_heads`` must divide it (head_dim = E // num_heads).
        num_heads: query heads.
        pattern: a sparse_attn Pattern, e.g. ``sa.Local(256) | sa.Global(first=1)``.
        num_kv_heads: key/value heads for grouped-query attention (default ``num_heads``); must
            divide ``num_heads``.
        bias: bias in the projections.
        dropout: dropout on the attention output before ``out_proj`` (the sparse kernels do not drop
            individual attention probabilities as ``nn.MultiheadAttention`` does).
        batch_first: inputs and outputs are (B, N, E) when True, (N, B, E) when False.
        backend: passed to ``sparse_attention``: "auto", "reference", "numba" or "triton".
        global_projections: Longformer's global attention. Tokens marked in the call-time
            ``global_mask`` attend every (non-padding) key through their own projections
            ``q_global_proj``, ``k_global_proj``, ``v_global_proj``; every token attends them with the
            ordinary projections. Global tokens of the *pattern* (``sa.Global``) use the ordinary
            projections.
        softcap: a float > 0: scores become ``softcap * tanh(score / softcap)`` (as ``sparse_attention``).
        alibi_slopes: ``num_heads`` floats (a tensor or a sequence), ALiBi's slope per head, kept as the
            buffer ``alibi_slopes`` (it follows ``.to(device)``, gets no gradient).
        sinks: True for a learned attention sink per head (gpt-oss), the parameter ``sinks`` of shape
            (num_heads,), initialised to 0: ``exp(sinks[h])`` joins every row's softmax denominator.

    ``forward(query, key=None, value=None, *, key_padding_mask=None, global_mask=None, causal=False,
    documents=None, need_weights=None, attn_mask=None)``: ``query`` (B, N, E) is the input (``x=``, its old
    name, is taken too); ``key_padding_mask`` (B, N) bool, True = padding: never attended, and the attention
    output at padded positions is 0 (so the layer returns ``out_proj.bias`` there, as Longformer does);
    ``global_mask`` (B, N) bool, True = global token in that example; ``causal=True`` keeps keys ``j <= i``;
    ``documents`` (B, N) int ids of packed documents, -1 = padding (as in ``sparse_attention``): each
    document attends as a sequence by itself, global tokens (with ``global_projections`` too) within
    their own document. An empty batch or sequence gives an empty output, as in ``nn.MultiheadAttention``.
    Everything after ``value`` is keyword-only.

    ``attn(x)`` returns the output. ``nn.MultiheadAttention``'s call, ``attn(x, x, x, ...)`` or any call with
    ``key``, ``value`` or ``need_weights``, returns ``(out, None)``, what that layer returns with
    ``need_weights=False``: ``key`` and ``value`` must be the query tensor itself (self-attention only),
    ``need_weights=True`` and ``attn_mask`` are refused with a ValueError saying what to pass instead (the
    kernels never form the weights; the pattern, ``causal`` and ``key_padding_mask`` are the masks).
    """

    def __init__(self, embed_dim: int, num_heads: int, pattern: Pattern, *, num_kv_heads: int | None = None,
                 bias: bool = True, dropout: float = 0.0, batch_first: bool = True, backend: str = "auto",
                 global_projections: bool = False, softcap: float | None = None, alibi_slopes=None,
                 sinks: bool = False):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        embed_dim, num_heads, num_kv_heads = _check_sizes(embed_dim, num_heads, num_kv_heads)
        check_pattern("pattern", pattern)
        dropout = check_float("dropout", dropout, low=0.0, high=1.0, high_open=True)
        backends.check_name(backend)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.pattern, self.dropout, self.batch_first, self.backend = pattern, dropout, batch_first, backend
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.global_projections = global_projections
        if global_projections:
            self.q_global_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
            self.k_global_proj = nn.Linear(embed_dim, kv_dim, bias=bias)
            self.v_global_proj = nn.Linear(embed_dim, kv_dim, bias=bias)
        self.softcap = softcap
        self.register_buffer("alibi_slopes", _check_slopes(alibi_slopes, num_heads))
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if check_bool("sinks", sinks) else None
        check_mods(torch.empty(1, num_heads, 1, 1, device="meta"), softcap)

    def extra_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        mods = "".join([f", softcap={self.softcap}" if self.softcap is not None else "",
                        ", alibi_slopes=..." if self.alibi_slopes is not None else "",
                        ", sinks=True" if self.sinks is not None else ""])
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}, pattern={self.pattern!r}, "
                f"global_projections={self.global_projections}{mods}, backend={self.backend!r}")

    def forward(self, query: torch.Tensor | None = None, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, *, key_padding_mask: torch.Tensor | None = None,
                global_mask: torch.Tensor | None = None, causal: bool = False, documents: torch.Tensor | None = None,
                need_weights: bool | None = None, attn_mask: torch.Tensor | None = None,
                x: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, None]:
        """(B, N, E) -> (B, N, E), or (N, B, E) -> (N, B, E) with ``batch_first=False``; ``(out, None)`` when
        called as ``nn.MultiheadAttention`` is (with ``key``, ``value`` or ``need_weights``)."""
        x = _one_input(query, x)
        _check_multihead_call(x, key, value, need_weights, attn_mask)
        out = self._attend(x, key_padding_mask, global_mask, causal, documents)
        return out if key is None and value is None and need_weights is None else (out, None)

    def _attend(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, global_mask: torch.Tensor | None,
                causal: bool, documents: torch.Tensor | None) -> torch.Tensor:
        """The layer's output for the input ``x`` (B, N, E), or (N, B, E) with ``batch_first=False``."""
        self._check_input(x)
        if causal and self.global_projections and global_mask is not None:
            raise ValueError("global_projections=True gives global tokens attention over the whole sequence, "
                             "which causal=True forbids; pass causal=False, or build the layer with "
                             "global_projections=False to let global_mask follow the causal rule")
        if not self.batch_first:
            x = x.transpose(0, 1)                                                  # (B, N, E)
        if x.shape[0] == 0 or x.shape[1] == 0:  # an empty batch or sequence: an empty output, as nn.MultiheadAttention
            return self.out_proj(x) if self.batch_first else self.out_proj(x).transpose(0, 1)
        q = self._split_heads(self.q_proj(x), self.num_heads)                      # (B, H, N, D)
        k = self._split_heads(self.k_proj(x), self.num_kv_heads)                   # (B, Hkv, N, D)
        v = self._split_heads(self.v_proj(x), self.num_kv_heads)                   # (B, Hkv, N, D)
        out = sparse_attention(q, k, v, self.pattern, causal=causal, key_padding_mask=key_padding_mask,
                               global_mask=global_mask, documents=documents, backend=self.backend,
                               **self._mods())                                            # (B, H, N, D)
        if self.global_projections and global_mask is not None:
            out = self._global_rows(x, out, key_padding_mask, global_mask, documents)
        if key_padding_mask is not None:
            out = out.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        out = nn.functional.dropout(out, self.dropout, self.training)
        out = self.out_proj(rearrange(out, "b h n d -> b n (h d)"))                # (B, N, E)
        return out if self.batch_first else out.transpose(0, 1)

    def _mods(self) -> dict:
        """The score modifiers as ``sparse_attention``'s keywords."""
        return {"softcap": self.softcap, "alibi_slopes": self.alibi_slopes, "sinks": self.sinks}

    def _global_rows(self, x, out, key_padding_mask, global_mask, documents):
        """Replace the rows of global tokens by attention through the global projections (over their own
        document when ``documents`` is given, or at their positions for ALiBi: every row is projected, and a
        pattern of global rows only, ``Local(0)`` plus ``global_mask``, gives each global row its whole
        document or sequence)."""
        index = _global_positions(global_mask)                                    # (B, G)
        if index is None:
            return out
        k = self._split_heads(self.k_global_proj(x), self.num_kv_heads)            # (B, Hkv, N, D)
        v = self._split_heads(self.v_global_proj(x), self.num_kv_heads)            # (B, Hkv, N, D)
        if documents is not None or self.alibi_slopes is not None:
            q = self._split_heads(self.q_global_proj(x), self.num_heads)           # (B, H, N, D)
            rows = sparse_attention(q, k, v, Local(0), key_padding_mask=key_padding_mask, global_mask=global_mask,
                                    documents=documents, backend=self.backend, **self._mods())  # (B, H, N, D)
            return torch.where(global_mask[:, None, :, None], rows, out)
        heads, head_dim = out.shape[1], out.shape[3]
        x_global = x.gather(1, repeat(index, "b g -> b g e", e=x.shape[-1]))        # (B, G, E)
        q = self._split_heads(self.q_global_proj(x_global), self.num_heads)        # (B, H, G, D)
        rows = sparse_attention(q, k, v, Dense(), key_padding_mask=key_padding_mask, backend=self.backend,
                                **self._mods())                                   # (B, H, G, D)
        index = repeat(index, "b g -> b h g d", h=heads, d=head_dim)               # (B, H, G, D)
        rows = torch.zeros_like(out).scatter(2, index, rows)                       # (B, H, N, D)
        return torch.where(global_mask[:, None, :, None], rows, out)

    def _split_heads(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        return rearrange(t, "b n (h d) -> b h n d", h=heads)                      # (B, heads, N, D)

    def _check_input(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"query (the input x) must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            layout = "(batch, seq_len, embed_dim)" if self.batch_first else "(seq_len, batch, embed_dim)"
            raise ValueError(f"query (the input x) must have shape {layout} with embed_dim={self.embed_dim}, got "
                             f"{tuple(x.shape)}")
        weight = self.q_proj.weight
        if not x.is_floating_point():
            raise TypeError(f"query (the input x) must be a floating-point tensor ({weight.dtype}, the layer's "
                            f"dtype), got {x.dtype}")
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"query (the input x) has dtype {x.dtype} but the layer's weights are {weight.dtype}; "
                            f"cast one to the other (x.to({weight.dtype}) or layer.to({x.dtype})), or run under "
                            f"torch.autocast")


def _one_input(query, x):
    """The layer's input, given once: as ``query`` (first argument, ``nn.MultiheadAttention``'s name) or ``x=``."""
    if (query is None) == (x is None):
        given = "neither" if query is None else "both query= and x="
        raise TypeError(f"SparseSelfAttention takes its input once, as the first argument: attn(x), or query=x "
                        f"(x=, its old name, works too); got {given}")
    return query if x is None else x


def _check_multihead_call(query: torch.Tensor, key, value, need_weights, attn_mask) -> None:
    """What ``nn.MultiheadAttention``'s call passes beyond the input, checked: key and value must be the query
    itself (self-attention), need_weights False, attn_mask None; each refusal says what to pass instead."""
    for name, tensor in (("key", key), ("value", value)):
        if tensor is not None and tensor is not query:
            raise ValueError(f"{name} must be the query tensor itself or left out, got {_described(tensor)}: "
                             f"SparseSelfAttention is self-attention, called as attn(x) or, as nn.MultiheadAttention, "
                             f"attn(x, x, x); its masks are keyword-only: attn(x, key_padding_mask=padding, "
                             f"global_mask=is_global). For attention between two sequences project q, k, v yourself "
                             f"and call sparse_attn.sparse_attention(q, k, v, pattern)")
    if need_weights is not None and check_bool("need_weights", need_weights):
        raise ValueError("need_weights=True: SparseSelfAttention never forms attention weights (its kernels compute "
                         "the allowed pairs only); pass need_weights=False, and the call returns (out, None) as "
                         "nn.MultiheadAttention does, or compute chosen weights with sa.attention_weights(q, k, "
                         "layer.pattern)")
    if attn_mask is not None:
        raise ValueError(f"attn_mask must be None, got {_described(attn_mask)}: the layer's pattern decides which "
                         f"query/key pairs interact; put the structure in the pattern (sa.Local(w), sa.Blocks(...), "
                         f"...), and pass causal=True for a causal mask and key_padding_mask= for padding")


def _described(value) -> str:
    """A value as an error message names it: a tensor by dtype and shape."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{value!r} ({type(value).__name__})"


@host_only  # a data-dependent size: a quiet graph break
def _global_positions(global_mask: torch.Tensor) -> torch.Tensor | None:
    """(B, G): each example's global positions in order, then non-global ones; G = the largest count."""
    count = int(global_mask.sum(1).max())
    if count == 0:
        return None
    return torch.sort(global_mask.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :count]


def _check_slopes(slopes, num_heads: int) -> torch.Tensor | None:
    """``num_heads`` ALiBi slopes as a float32 tensor (checked as ``sparse_attention`` checks them), or None."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        try:
            slopes = torch.tensor(slopes, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"alibi_slopes must be {num_heads} floats (a tensor or a sequence), got "
                            f"{slopes!r}") from error
    slopes = slopes.detach().cpu()
    check_mods(torch.empty(2, num_heads, 1, 1), alibi_slopes=slopes)
    if slopes.dim() != 1:
        raise ValueError(f"alibi_slopes of a layer must have shape (num_heads,) = ({num_heads},), got "
                         f"{tuple(slopes.shape)}")
    return slopes.float().clone()


def _check_sizes(embed_dim, num_heads, num_kv_heads) -> tuple[int, int, int]:
    """The three sizes as ints >= 1, heads dividing the width and kv heads dividing the heads."""
    embed_dim, num_heads, num_kv_heads = (check_int(name, value, 1) for name, value in (
        ("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)))
    if embed_dim % num_heads:
        raise ValueError(f"num_heads={num_heads} must divide embed_dim={embed_dim} (head_dim = embed_dim // "
                         f"num_heads); choose e.g. num_heads={_divisor_near(embed_dim, num_heads)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads} for grouped-query "
                         f"attention; choose e.g. num_kv_heads={_divisor_near(num_heads, num_kv_heads)}")
    return embed_dim, num_heads, num_kv_heads


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - k), d))
