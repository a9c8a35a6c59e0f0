"""sparse_attn.nn.SparseSelfAttention: against dense masked softmax, nn.MultiheadAttention and Hugging
Face's LongformerSelfAttention (weights copied, outputs and input gradients at atol 1e-5 in fp32); backend
triton in float16 and bfloat16 (CUDA; float16 only in Triton's interpreter on CPU) against the float64
layer by DESIGN's tolerance rule."""

import einops
import pytest
import torch
from torch import nn

import sparse_attn as sa
from sparse_attn import backends
from sparse_attn.nn import SparseSelfAttention
from tests.tolerance import FLOORS, assert_within_rule

# The Numba backend where it can run (numba and scipy BLAS present), else the oracle.
BACKEND = "numba" if backends.availability("numba")[0] else "reference"
E, H = 32, 4


def _inputs(batch=3, n=64, seed=0, embed_dim=E):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, n, embed_dim, generator=gen)                         # (B, N, E)
    lengths = torch.tensor([n, n - 14, n // 2 + 5])[:batch]
    padding = torch.arange(n) >= lengths[:, None]                               # (B, N)
    return x, padding


def _dense_reference(layer: SparseSelfAttention, x, padding=None, causal=False):
    """Plain masked softmax with the layer's weights and the pattern's dense token mask."""
    batch, n, _ = x.shape
    q = layer.q_proj(x).unflatten(-1, (layer.num_heads, -1)).transpose(1, 2)    # (B, H, N, D)
    k = layer.k_proj(x).unflatten(-1, (layer.num_kv_heads, -1)).transpose(1, 2)
    v = layer.v_proj(x).unflatten(-1, (layer.num_kv_heads, -1)).transpose(1, 2)
    groups = layer.num_heads // layer.num_kv_heads
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)       # (B, H, N, D)
    allowed = layer.pattern.mask(n, heads=layer.num_heads)[None].to(x.device)   # (1, H, N, N)
    if causal:
        allowed = allowed & sa.Causal().mask(n)[None].to(x.device)
    if padding is not None:
        allowed = allowed & ~padding[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)) / layer.head_dim ** 0.5
    out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num() @ v
    if padding is not None:
        out = out.masked_fill(padding[:, None, :, None], 0.0)
    return layer.out_proj(out.transpose(1, 2).flatten(2))                      # (B, N, E)


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_dense_masked_softmax(num_kv_heads, causal):
    torch.manual_seed(0)
    pattern = sa.Local(5, 3) | sa.Global(first=1) | sa.Stride(16)
    layer = SparseSelfAttention(E, H, pattern, num_kv_heads=num_kv_heads, backend=BACKEND)
    x, padding = _inputs()
    out = layer(x, key_padding_mask=padding, causal=causal)
    torch.testing.assert_close(out, _dense_reference(layer, x, padding, causal), atol=1e-5, rtol=1e-5)


def test_per_head_pattern_and_no_padding():
    torch.manual_seed(0)
    pattern = sa.PerHead([sa.Local(2), sa.Local(8), sa.Dense(), sa.Global(first=2)])
    layer = SparseSelfAttention(E, H, pattern, backend=BACKEND)
    x, _ = _inputs(n=70)
    torch.testing.assert_close(layer(x), _dense_reference(layer, x), atol=1e-5, rtol=1e-5)


def _multihead_twin(backend=BACKEND):
    """nn.MultiheadAttention and a Dense SparseSelfAttention with the same weights."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    layer = SparseSelfAttention(E, H, sa.Dense(), backend=backend).eval()
    with torch.no_grad():
        for proj, w, b in zip((layer.q_proj, layer.k_proj, layer.v_proj), mha.in_proj_weight.chunk(3),
                              mha.in_proj_bias.chunk(3)):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        layer.out_proj.load_state_dict(mha.out_proj.state_dict())
    return mha, layer


def test_dense_matches_nn_multihead_attention():
    mha, layer = _multihead_twin()
    x, padding = _inputs()
    expected = mha(x, x, x, key_padding_mask=padding, need_weights=False)[0]
    out = layer(x, key_padding_mask=padding)
    # Same everywhere but at padded positions, where this layer returns out_proj.bias (Longformer's rule)
    torch.testing.assert_close(out[~padding], expected[~padding], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[padding], layer.out_proj.bias.expand(int(padding.sum()), -1))


def test_takes_nn_multihead_attention_self_attention_call():
    """attn(x, x, x, ...) as nn.MultiheadAttention is called: (out, None), out as attn(x, ...) gives it; the
    keyword calls of before (x=, masks by keyword) still return the output alone."""
    mha, layer = _multihead_twin(backend="reference")
    x, padding = _inputs()
    expected = layer(x, key_padding_mask=padding)                                  # (B, N, E)
    theirs, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)
    for call in (lambda m: m(x, x, x, key_padding_mask=padding, need_weights=False),
                 lambda m: m(query=x, key=x, value=x, key_padding_mask=padding, need_weights=False)):
        out, weights = call(layer)
        assert weights is None and call(mha)[1] is None
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(out[~padding], theirs[~padding], atol=1e-5, rtol=1e-5)
    out, weights = layer(x, x, x)                                                  # MHA's default need_weights
    assert weights is None
    torch.testing.assert_close(out, layer(x), rtol=0, atol=0)
    torch.testing.assert_close(layer(x=x, key_padding_mask=padding), expected, rtol=0, atol=0)


@pytest.mark.parametrize("call, error, message", [
    (lambda layer, x, padding: layer(x, padding), ValueError,
     r"^key must be the query tensor itself or left out, got a torch.bool tensor of shape \(3, 64\): "
     r"SparseSelfAttention is self-attention, called as attn\(x\) or, as nn.MultiheadAttention, attn\(x, x, x\); "
     r"its masks are keyword-only: attn\(x, key_padding_mask=padding, global_mask=is_global\)"),
    (lambda layer, x, padding: layer(x, x, x.clone()), ValueError,
     r"^value must be the query tensor itself or left out, got a torch.float32 tensor of shape \(3, 64, 32\): .* "
     r"For attention between two sequences project q, k, v yourself and call sparse_attn.sparse_attention"),
    (lambda layer, x, padding: layer(x, x, x, need_weights=True), ValueError,
     r"^need_weights=True: SparseSelfAttention never forms attention weights .*; pass need_weights=False, and the "
     r"call returns \(out, None\) as nn.MultiheadAttention does, or compute chosen weights with "
     r"sa.attention_weights"),
    (lambda layer, x, padding: layer(x, need_weights="no"), TypeError, r"^need_weights must be a bool, got 'no' \(str\)"),
    (lambda layer, x, padding: layer(x, x, x, attn_mask=torch.ones(64, 64, dtype=torch.bool)), ValueError,
     r"^attn_mask must be None, got a torch.bool tensor of shape \(64, 64\): the layer's pattern decides which "
     r"query/key pairs interact; put the structure in the pattern .* pass causal=True for a causal mask and "
     r"key_padding_mask= for padding"),
    (lambda layer, x, padding: layer(), TypeError,
     r"^SparseSelfAttention takes its input once, as the first argument: attn\(x\), or query=x \(x=, its old name, "
     r"works too\); got neither"),
    (lambda layer, x, padding: layer(x, x=x), TypeError, r"takes its input once, .*; got both query= and x="),
])
def test_multihead_call_errors(call, error, message):
    layer = SparseSelfAttention(E, H, sa.Local(4), backend="reference")
    x, padding = _inputs()
    with pytest.raises(error, match=message):
        call(layer, x, padding)


def test_batch_first_false_is_transposed():
    torch.manual_seed(0)
    layer = SparseSelfAttention(E, H, sa.Local(4), backend=BACKEND)
    seq_first = SparseSelfAttention(E, H, sa.Local(4), batch_first=False, backend=BACKEND)
    seq_first.load_state_dict(layer.state_dict())
    x, padding = _inputs()
    out = seq_first(x.transpose(0, 1), key_padding_mask=padding)               # (N, B, E)
    torch.testing.assert_close(out.transpose(0, 1), layer(x, key_padding_mask=padding))


def test_global_mask_without_global_projections_is_symmetric_global():
    torch.manual_seed(0)
    layer = SparseSelfAttention(E, H, sa.Local(3), backend=BACKEND)
    twin = SparseSelfAttention(E, H, sa.Local(3) | sa.Global(tokens=(0, 9)), backend=BACKEND)
    twin.load_state_dict(layer.state_dict())
    x, padding = _inputs()
    is_global = torch.zeros_like(padding)
    is_global[:, [0, 9]] = True
    torch.testing.assert_close(layer(x, key_padding_mask=padding, global_mask=is_global),
                               twin(x, key_padding_mask=padding), atol=1e-6, rtol=1e-6)


def test_global_projections_rows_and_columns():
    torch.manual_seed(0)
    layer = SparseSelfAttention(E, H, sa.Local(3), global_projections=True, backend=BACKEND)
    x, padding = _inputs()
    is_global = torch.zeros_like(padding)
    is_global[0, [2, 40]] = True                                                # 2, 1 and 0 global tokens
    is_global[1, 7] = True
    out = layer(x, key_padding_mask=padding, global_mask=is_global)
    # Non-global rows: Local(3) plus the global columns, ordinary projections.
    plain = SparseSelfAttention(E, H, sa.Local(3), backend=BACKEND)
    plain.load_state_dict(layer.state_dict(), strict=False)
    torch.testing.assert_close(out[~is_global], plain(x, key_padding_mask=padding, global_mask=is_global)[~is_global],
                               atol=1e-6, rtol=1e-6)
    # Global rows: every non-padding key, through the global projections.
    dense = SparseSelfAttention(E, H, sa.Dense(), backend=BACKEND)
    dense.load_state_dict({"q_proj.weight": layer.q_global_proj.weight, "q_proj.bias": layer.q_global_proj.bias,
                           "k_proj.weight": layer.k_global_proj.weight, "k_proj.bias": layer.k_global_proj.bias,
                           "v_proj.weight": layer.v_global_proj.weight, "v_proj.bias": layer.v_global_proj.bias,
                           "out_proj.weight": layer.out_proj.weight, "out_proj.bias": layer.out_proj.bias})
    torch.testing.assert_close(out[is_global], dense(x, key_padding_mask=padding)[is_global], atol=1e-6, rtol=1e-6)


def test_training_step_reaches_every_parameter():
    torch.manual_seed(0)
    layer = SparseSelfAttention(E, H, sa.Local(4), num_kv_heads=2, global_projections=True, dropout=0.1,
                                backend=BACKEND).train()
    x, padding = _inputs()
    x.requires_grad_(True)
    is_global = torch.zeros_like(padding)
    is_global[:, 0] = True
    out = layer(x, key_padding_mask=padding, global_mask=is_global)
    out[~padding].square().mean().backward()
    for name, parameter in layer.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all() and (x.grad[padding] == 0).all()


def test_dropout_only_in_training():
    torch.manual_seed(0)
    layer = SparseSelfAttention(E, H, sa.Local(4), dropout=0.5, backend=BACKEND)
    x, _ = _inputs()
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    assert not torch.allclose(layer(x), layer(x))


def test_rows_without_keys_and_single_token():
    layer = SparseSelfAttention(E, H, sa.Local(2), backend=BACKEND)
    x, _ = _inputs(batch=2, n=1)
    assert layer(x).shape == (2, 1, E)
    all_padding = torch.ones(2, 1, dtype=torch.bool)
    torch.testing.assert_close(layer(x, key_padding_mask=all_padding), layer.out_proj.bias.expand(2, 1, E))


@pytest.mark.parametrize("batch_first", [True, False])
def test_empty_batch_or_sequence_gives_an_empty_output(batch_first):
    """As nn.MultiheadAttention; it used to fail inside sparse_attention with an error about q and k."""
    layer = SparseSelfAttention(E, H, sa.Local(2), global_projections=True, batch_first=batch_first, backend=BACKEND)
    for batch, n in ((0, 16), (2, 0)):
        x = torch.randn(batch, n, E) if batch_first else torch.randn(n, batch, E)
        out = layer(x, key_padding_mask=torch.zeros(batch, n, dtype=torch.bool),
                    global_mask=torch.zeros(batch, n, dtype=torch.bool))
        assert out.shape == x.shape


@pytest.mark.slow
def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    layer = SparseSelfAttention(E, H, sa.Local(4) | sa.Global(first=1), global_projections=True, backend=BACKEND)
    x, padding = _inputs()
    is_global = torch.zeros_like(padding)
    is_global[1, [3, 5]] = True
    expected = layer(x, key_padding_mask=padding, global_mask=is_global)
    torch._dynamo.reset()
    # aot_eager traces what inductor traces (dynamo + AOT autograd) without compiling C++ on CI.
    compiled = torch.compile(layer, backend="aot_eager")
    out = compiled(x, key_padding_mask=padding, global_mask=is_global)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert layer.q_global_proj.weight.grad is not None


def test_head_reshapes_trace_into_one_graph():
    """The einops reshapes add no graph break (fullgraph=True), for static and dynamic shapes."""
    layer = SparseSelfAttention(E, H, sa.Local(4), backend=BACKEND)

    def split_and_merge(t):
        heads = layer._split_heads(t, H)                                        # (B, H, N, D)
        return heads, einops.rearrange(heads, "b h n d -> b n (h d)")           # (B, N, E)

    for dynamic in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(split_and_merge, fullgraph=True, backend="aot_eager", dynamic=dynamic)
        for batch, n in ((2, 10), (3, 17)):
            t = torch.randn(batch, n, E)                                          # (B, N, E)
            heads, merged = compiled(t)
            assert heads.shape == (batch, H, n, E // H) and torch.equal(merged, t)


def test_bfloat16_on_cpu_reference():
    torch.manual_seed(0)
    layer = SparseSelfAttention(E, H, sa.Local(4), backend="reference")
    x, padding = _inputs()
    expected = layer(x, key_padding_mask=padding)                                  # fp32
    out = layer.to(torch.bfloat16)(x.to(torch.bfloat16), key_padding_mask=padding)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_gpu(dtype):
    torch.manual_seed(0)
    layer = SparseSelfAttention(E, H, sa.Local(8) | sa.Global(first=1), global_projections=True).cuda()
    x, padding = _inputs(n=256)
    x, padding = x.cuda().requires_grad_(), padding.cuda()
    is_global = torch.zeros_like(padding)
    is_global[:, 0] = True
    expected = layer(x, key_padding_mask=padding, global_mask=is_global)        # fp32
    with torch.autocast("cuda", dtype=dtype):
        out = layer(x, key_padding_mask=padding, global_mask=is_global)
    out.float().sum().backward()
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    assert torch.isfinite(x.grad).all() and (x.grad[padding] == 0).all()
    for name, parameter in layer.named_parameters():
        assert torch.isfinite(parameter.grad).all(), name


ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
CUDA_ONLY = pytest.mark.skipif(not ON_CUDA, reason="Triton's interpreter has no bfloat16; on CPU the float16 cast "
                                                   "case runs the same path")


def _out_and_grads(forward, layer, x, loss_weights, autocast_dtype=None) -> dict:
    """``forward(x)``'s output and the gradients of x and of ``layer``'s parameters for the loss
    ``sum(out * loss_weights)``, under autocast to ``autocast_dtype`` when given."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)                                           # earlier grads stay intact
    with torch.autocast(x.device.type, dtype=autocast_dtype or torch.float16, enabled=autocast_dtype is not None):
        out = forward(x)
    (out.double() * loss_weights).sum().backward()
    return {"out": out, "x.grad": x.grad, **{f"{name}.grad": p.grad for name, p in layer.named_parameters()}}


@pytest.mark.parametrize("dtype, autocast", [
    (torch.float16, False), pytest.param(torch.float16, True, marks=CUDA_ONLY),
    pytest.param(torch.bfloat16, False, marks=CUDA_ONLY), pytest.param(torch.bfloat16, True, marks=CUDA_ONLY),
], ids=["fp16-cast", "fp16-autocast", "bf16-cast", "bf16-autocast"])
def test_triton_half_precision_within_the_tolerance_rule(dtype, autocast):
    """The layer on backend triton (what "auto" picks on CUDA) in ``dtype`` (cast to it, or float32 weights
    under autocast) against the same layer in float64 on the reference backend: out and the gradients of
    x and of every weight within DESIGN's tolerance rule, torch's error being _dense_reference's in the
    same precision; padded positions get exactly zero x gradient. CPU: Triton's interpreter, smaller."""
    usable, reason = backends.availability("triton")
    if not usable:
        pytest.skip(reason)
    torch.manual_seed(0)
    embed_dim, n = (256, 1000) if ON_CUDA else (64, 100)                        # N % 64 != 0
    pattern = sa.Local(64) | sa.Global(first=2)
    layer = SparseSelfAttention(embed_dim, H, pattern, num_kv_heads=2, backend="auto" if ON_CUDA else "triton")
    layer = layer.to(DEVICE, torch.float32 if autocast else dtype)
    oracle = SparseSelfAttention(embed_dim, H, pattern, num_kv_heads=2, backend="reference").to(DEVICE, torch.float64)
    oracle.load_state_dict(layer.state_dict())                                  # exact: every value fits float64
    x, padding = _inputs(n=n, embed_dim=embed_dim)
    x, padding = x.to(DEVICE, layer.q_proj.weight.dtype), padding.to(DEVICE)
    assert backends.choose(layer.backend, x.device) == "triton"
    loss_weights = torch.randn(x.shape, dtype=torch.float64, device=DEVICE)
    autocast_dtype = dtype if autocast else None
    got = _out_and_grads(lambda x: layer(x, key_padding_mask=padding), layer, x, loss_weights, autocast_dtype)
    baseline = _out_and_grads(lambda x: _dense_reference(layer, x, padding), layer, x, loss_weights, autocast_dtype)
    expected = _out_and_grads(lambda x: oracle(x, key_padding_mask=padding), oracle, x.double(), loss_weights)
    assert got["out"].dtype == dtype
    # k_proj.bias's exact gradient is 0 (softmax ignores a shift shared by a row's scores): rounding noise only
    for name in sorted(set(expected) - {"k_proj.bias.grad"}):
        assert_within_rule(name, got[name], expected[name], baseline[name], FLOORS[dtype])
    assert (got["x.grad"][padding] == 0).all()


def test_default_backend_is_auto():
    assert SparseSelfAttention(E, H, sa.Local(4)).backend == "auto"


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(embed_dim=30, num_heads=4), ValueError, "num_heads=4 must divide embed_dim=30"),
    (dict(num_kv_heads=3), ValueError, "num_kv_heads=3 must divide num_heads=4"),
    (dict(num_heads=0), ValueError, "num_heads must be >= 1, got 0"),
    (dict(num_kv_heads=2.0), TypeError, r"num_kv_heads must be an int, got 2.0 \(float\)"),
    (dict(pattern="local"), TypeError, "pattern must be a sparse_attn Pattern"),
    (dict(dropout=1.0), ValueError, r"dropout must be a finite float in \[0, 1\), got 1.0"),
    (dict(dropout="0.1"), TypeError, "dropout must be a float, got '0.1'"),
    (dict(backend=None), TypeError, "backend must be a str"),
    (dict(backend="trition"), ValueError, r"backend must be one of \['auto', 'reference', 'numba', 'triton'\], got 'trition'"),
])
def test_constructor_errors(kwargs, error, message):
    args = dict(embed_dim=E, num_heads=H, pattern=sa.Local(4)) | kwargs
    with pytest.raises(error, match=message):
        SparseSelfAttention(args.pop("embed_dim"), args.pop("num_heads"), args.pop("pattern"), **args)


def test_forward_errors():
    layer = SparseSelfAttention(E, H, sa.Local(4), global_projections=True, backend=BACKEND)
    x, padding = _inputs()
    with pytest.raises(ValueError, match=r"query \(the input x\) must have shape \(batch, seq_len, embed_dim\) with embed_dim=32"):
        layer(x[..., :16])
    with pytest.raises(TypeError, match="key_padding_mask must be a torch.bool tensor"):
        layer(x, key_padding_mask=padding.float())
    with pytest.raises(ValueError, match="global_projections=True .* causal=True forbids"):
        layer(x, global_mask=padding, causal=True)
    with pytest.raises(TypeError, match=r"query \(the input x\) has dtype torch.float64 but the layer's weights are torch.float32; cast"):
        layer(x.double())
    with pytest.raises(TypeError, match=r"query \(the input x\) must be a floating-point tensor \(torch.float32, the "
                                        r"layer's dtype\), got torch.int64"):
        layer(x.long())


def test_lower_precision_input_under_autocast_on_cpu():
    layer = SparseSelfAttention(E, H, sa.Local(4), backend="reference")
    x, padding = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x.bfloat16(), key_padding_mask=padding).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------
# Equivalence with Hugging Face's LongformerSelfAttention
# ------------------------------------------------------------------------------------------------
_LONGFORMER_NAMES = {"q_proj": "query", "k_proj": "key", "v_proj": "value",
                     "q_global_proj": "query_global", "k_global_proj": "key_global", "v_global_proj": "value_global"}


def _longformer_pair(attention_window):
    transformers = pytest.importorskip("transformers", reason='needs transformers: pip install ".[hf]"')
    from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

    torch.manual_seed(0)
    config = transformers.LongformerConfig(hidden_size=E, num_attention_heads=H, attention_window=[attention_window],
                                           attention_probs_dropout_prob=0.0)
    peer = LongformerSelfAttention(config, layer_id=0).eval()
    # attention_window counts both sides: Longformer applies attention_window // 2 keys each side.
    layer = SparseSelfAttention(E, H, sa.Local(attention_window // 2), global_projections=True, backend=BACKEND)
    with torch.no_grad():
        for ours, theirs in _LONGFORMER_NAMES.items():
            getattr(layer, ours).load_state_dict(getattr(peer, theirs).state_dict())
        # LongformerSelfAttention stops before the output projection (LongformerSelfOutput.dense).
        layer.out_proj.weight.copy_(torch.eye(E))
        layer.out_proj.bias.zero_()
    return peer, layer.eval()


def _longformer_forward(peer, x, padding, is_global):
    """LongformerSelfAttention as LongformerModel calls it: mask < 0 padding, 0 local, > 0 global."""
    mask = torch.zeros(padding.shape)
    mask[padding] = torch.finfo(mask.dtype).min
    mask[is_global] = torch.finfo(mask.dtype).max
    return peer(x, attention_mask=mask, is_index_masked=mask < 0, is_index_global_attn=mask > 0,
                is_global_attn=bool(is_global.any()))[0]


@pytest.mark.parametrize("attention_window, n", [(16, 64), (8, 96)])
def test_longformer_self_attention_equivalence(attention_window, n):
    peer, layer = _longformer_pair(attention_window)
    # LongformerSelfAttention needs n to be a multiple of attention_window (LongformerModel pads to it).
    x, padding = _inputs(batch=4, n=n)
    padding = torch.cat([padding, torch.zeros(1, n, dtype=torch.bool)])[:4]
    is_global = torch.zeros_like(padding)
    is_global[0, 0] = True                                                      # 1, 3, 0 and 2 global tokens
    is_global[1, [0, 5, n // 2]] = True
    is_global[3, [1, n - 1]] = True
    x_peer = x.clone().requires_grad_(True)
    x_ours = x.clone().requires_grad_(True)
    expected = _longformer_forward(peer, x_peer, padding, is_global)
    out = layer(x_ours, key_padding_mask=padding, global_mask=is_global)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)             # padded rows too: 0 in both
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (expected * weights).sum().backward()
    (out * weights).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_peer.grad, atol=1e-5, rtol=1e-5)


def test_longformer_equivalence_without_global_tokens():
    peer, layer = _longformer_pair(16)
    x, padding = _inputs(n=48)
    no_global = torch.zeros_like(padding)
    torch.testing.assert_close(layer(x, key_padding_mask=padding, global_mask=no_global),
                               _longformer_forward(peer, x, padding, no_global), atol=1e-5, rtol=1e-5)
