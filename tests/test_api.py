"""sparse_attention(): every bad input is a clear error naming the argument, the value and the fix."""
import numpy as np
import pytest
import torch

import sparse_attn as sa


def tensors(b=2, h=4, n=32, d=8, kv_heads=None, n_k=None, dtype=torch.float32):
    q = torch.randn(b, h, n, d).to(dtype)
    k = torch.randn(b, kv_heads or h, n_k or n, d).to(dtype)
    return q, k, k.clone()


def padding_from(example, start, b=2, n=32):
    """key_padding_mask (b, n): the keys of ``example`` from ``start`` on are padding."""
    padding = torch.zeros(b, n, dtype=torch.bool)
    padding[example, start:] = True
    return padding


def call(*args, **kwargs):
    kwargs.setdefault("backend", "reference")
    return sa.sparse_attention(*args, **kwargs)


@pytest.mark.parametrize("make, error, message", [
    (lambda: call(torch.randn(2, 32, 8), *tensors()[1:], sa.Local(1)), ValueError,
     r"q must have shape \(batch, heads, seq_len, head_dim\), got \(2, 32, 8\)"),
    (lambda: call([1.0], *tensors()[1:], sa.Local(1)), TypeError, "q must be a torch.Tensor, got list"),
    (lambda: call(*tensors(dtype=torch.int64), sa.Local(1)), TypeError,
     "q must be float16, bfloat16, float32 or float64, got torch.int64"),
    (lambda: call(tensors()[0], *tensors(dtype=torch.float64)[1:], sa.Local(1)), TypeError,
     "q, k, v must share one dtype"),
    (lambda: call(*tensors(kv_heads=3), sa.Local(1)), ValueError,
     r"the number of k/v heads \(3\) must divide the number of q heads \(4\)"),
    (lambda: call(tensors()[0], tensors()[1], tensors(n=31)[2], sa.Local(1)), ValueError,
     "k and v must have the same shape"),
    (lambda: call(*tensors(), "local"), TypeError, "pattern must be a sparse_attn Pattern or BlockLayout, got str"),
    (lambda: call(*tensors(), sa.Local(1), backend="cuda"), ValueError,
     r"backend must be one of \['auto', 'reference', 'numba', 'triton'\], got 'cuda'"),
    (lambda: call(*tensors(), sa.Local(1), scale=-1.0), ValueError, "scale must be a finite positive float, got -1.0"),
    (lambda: call(*tensors(), sa.Local(1), key_padding_mask=torch.zeros(2, 32)), TypeError,
     r"key_padding_mask must be a torch.bool tensor of shape \(2, 32\), got torch.float32; convert with .bool\(\)"),
    (lambda: call(*tensors(), sa.Local(1), key_padding_mask=torch.zeros(3, 32, dtype=torch.bool)), ValueError,
     r"key_padding_mask must have shape \(2, 32\), got \(3, 32\)"),
    (lambda: call(*tensors(), sa.Local(1), global_mask=torch.zeros(2, 31, dtype=torch.bool)), ValueError,
     r"global_mask must have shape \(2, 32\), got \(2, 31\)"),
    (lambda: call(*tensors(), sa.Local(1).layout(64, heads=4)), ValueError,
     r"the BlockLayout was built for n_q=64, n_k=64 but the inputs have n_q=32, n_k=32"),
    (lambda: call(*tensors(), sa.Local(1).layout(32, heads=2)), ValueError,
     "the BlockLayout was built for heads=2 but q has 4 heads"),
    (lambda: call(*tensors(), sa.Local(1).layout(32, heads=4), causal=True), ValueError,
     "causal, key_padding_mask and global_mask are part of a prebuilt BlockLayout"),
    (lambda: call(*tensors(), sa.PerHead([sa.Local(1)] * 3)), ValueError, "PerHead has 3 patterns but heads=4"),
    (lambda: call(*tensors(), sa.Local(1), scale=float("inf")), ValueError, "scale must be a finite positive float, got inf"),
    (lambda: call(*tensors(), sa.Local(1), scale="0.5"), ValueError, "scale must be a finite positive float, got '0.5'"),
    (lambda: call(torch.randn(2, 0, 32, 8), *tensors(kv_heads=1)[1:], sa.Local(1)), ValueError,
     r"q and k need batch, heads, seq_len and head_dim >= 1, got q \(2, 0, 32, 8\)"),
    (lambda: call(*tensors(), sa.Local(1), causal="yes"), TypeError, "causal must be a bool, got 'yes'"),
    (lambda: call(*tensors(), sa.Local(1), return_lse=1), TypeError, r"return_lse must be a bool, got 1 \(int\)"),
    (lambda: call(*tensors(), sa.Local(1), key_padding_mask=torch.zeros(2, 32, dtype=torch.bool, device="meta")),
     ValueError, "key_padding_mask is a meta tensor: its values, which decide the layout, cannot be read"),
])
def test_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_prebuilt_layout_is_reused_and_equals_the_pattern_call():
    q, k, v = tensors()
    pattern = sa.Local(4) | sa.Global(first=1)
    layout = pattern.layout(32, heads=4, block_size=16)
    torch.testing.assert_close(call(q, k, v, layout), call(q, k, v, pattern))


def test_per_example_layout_with_matching_batch():
    q, k, v = tensors()
    padding = padding_from(1, 20)
    layout = sa.Local(4).layout(32, heads=4, key_padding_mask=padding)
    torch.testing.assert_close(call(q, k, v, layout), call(q, k, v, sa.Local(4), key_padding_mask=padding))
    with pytest.raises(ValueError, match="the BlockLayout was built for a batch of 2 but q has batch 3"):
        call(*tensors(b=3), layout)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = tensors(d=16)
    torch.testing.assert_close(call(q, k, v, sa.Local(3)), call(q, k, v, sa.Local(3), scale=0.25))


def test_auto_picks_numba_on_cpu(monkeypatch):
    from sparse_attn import backends

    loaded, load = [], backends.load
    monkeypatch.setattr(backends, "load", lambda name: loaded.append(name) or load(name))
    for backend in ("auto", "reference"):
        call(*tensors(), sa.Local(1), backend=backend)
    assert loaded == ["numba", "reference"]


def test_building_a_layout_inside_torch_compile_is_a_graph_break_not_an_error():
    q, k, v = tensors()
    padding = padding_from(0, 25)
    def attend(q, k, v, padding):
        return call(q, k, v, sa.Local(4) | sa.Global(first=1), key_padding_mask=padding)

    compiled = torch.compile(attend, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, padding), attend(q, k, v, padding))


def test_import_does_not_load_dynamo_or_triton():
    import subprocess
    import sys
    code = "import sys, sparse_attn; print(sorted(m for m in ('torch._dynamo', 'triton', 'numba') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


@pytest.mark.parametrize("backend", ["reference", "numba", "triton", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_meta_inputs_give_meta_outputs_with_the_right_shapes(backend, dtype):
    """As torch's scaled_dot_product_attention: shapes, dtypes and an autograd graph, no values, no layout."""
    if backend == "triton":
        pytest.importorskip("triton")
    q = torch.empty(2, 4, 5, 8, device="meta", dtype=dtype, requires_grad=True)
    k = torch.empty(2, 2, 7, 8, device="meta", dtype=dtype, requires_grad=True)
    padding = torch.empty(2, 7, device="meta", dtype=torch.bool)
    out, lse = sa.sparse_attention(q, k, k, sa.Local(2) | sa.Random(1), key_padding_mask=padding, causal=True,
                                   backend=backend, return_lse=True)
    assert out.device.type == lse.device.type == "meta" and out.shape == q.shape and lse.shape == (2, 4, 5)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    (out.sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert sa.sparse_attention(q, k, k, sa.Local(2).layout(5, 7, heads=4), backend=backend).shape == q.shape


def test_meta_inputs_are_still_checked():
    q = torch.empty(2, 4, 16, 8, device="meta")
    with pytest.raises(ValueError, match="PerHead has 3 patterns but heads=4"):
        call(q, q, q, sa.PerHead([sa.Local(1)] * 3))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(2, 16\), got \(2, 15\)"):
        call(q, q, q, sa.Local(1), key_padding_mask=torch.empty(2, 15, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="the BlockLayout was built for heads=2 but q has 4 heads"):
        call(q, q, q, sa.Local(1).layout(16, heads=2))
    with pytest.raises(ValueError, match="global_mask needs n_q == n_k"):
        call(q, q[:, :, :8], q[:, :, :8], sa.Local(1), global_mask=torch.empty(2, 16, dtype=torch.bool))


def test_numpy_values_where_torch_ones_are_expected():
    q, k, v = tensors()
    padding = padding_from(1, 20).numpy()
    expected = call(q, k, v, sa.Local(4), key_padding_mask=torch.from_numpy(padding), causal=True, scale=0.25)
    torch.testing.assert_close(call(q, k, v, sa.Local(np.int64(4)), key_padding_mask=padding, causal=np.bool_(True),
                                    scale=np.float32(0.25)), expected)
