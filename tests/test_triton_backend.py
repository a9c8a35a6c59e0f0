"""backend="triton" against the float64 reference: values, lse and gradients on the awkward cases.

Without a GPU the same kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, set
by tests/conftest.py before anything imports Triton), so shapes stay tiny and float32/float16 only;
with CUDA the tests run on the GPU, every case also in float16 and bfloat16, plus the workloads users
run (N = 4096 and 4000, head_dim 64 and 128, blocks 64 and 128: Longformer, BigBird, causal sliding
window) against one float64 reference per workload.
"""
import json
import os
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton", reason='needs triton (its interpreter without a GPU): pip install ".[triton]"')

import sparse_attn as sa  # noqa: E402
from sparse_attn.api import sparse_attention  # noqa: E402
from sparse_attn.backends import triton_gpu  # noqa: E402
from tests.helpers import DEVICE, ON_CUDA, assert_matches_oracle, dense_baseline, make_qkv, run_backend  # noqa: E402
from tests.tolerance import FLOORS  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
NO_BF16_REASON = "Triton's interpreter computes tl.dot on bfloat16 wrongly (numpy has no bfloat16)"
HALF_DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not ON_CUDA, reason=NO_BF16_REASON))]
CASE_DTYPES = list(FLOORS) if ON_CUDA else [torch.float32]   # the interpreter's time goes to float32 on CPU


def check_against_reference(q, k, v, layout, grad_lse=False):
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    lse_grad = torch.randn(q.shape[:3], generator=gen, dtype=torch.float64).to(DEVICE) if grad_lse else None
    got = run_backend("triton", q, k, v, layout, grad_out, lse_grad)
    oracle = run_backend("reference", q.double(), k.double(), v.double(), layout, grad_out, lse_grad)
    baseline = dense_baseline(q, k, v, layout, grad_out)
    if grad_lse:  # the dense baseline has no lse term: compare the gradients with the reference in q's dtype
        baseline = baseline[:2] + run_backend("reference", q, k, v, layout, grad_out, lse_grad)[2:]
    assert_matches_oracle(got, oracle, baseline)


# ------------------------------------------------------------------------------------------------
# Values and gradients
# ------------------------------------------------------------------------------------------------
CASES = {
    # name: (batch, q_heads, kv_heads, n_q, n_k, head_dim, pattern, layout kwargs)
    "longformer-ragged-N": (2, 2, 2, 100, 100, 32, sa.Local(16) | sa.Global(first=2), {}),
    "N=1": (1, 2, 2, 1, 1, 16, sa.Local(4), {}),
    "nq<nk-causal": (1, 2, 2, 40, 100, 16, sa.Local(24) | sa.Sink(first=3), {"causal": True}),
    "nq>nk-causal-empty-rows": (1, 2, 2, 100, 40, 16, sa.Dense(), {"causal": True}),
    "gqa": (1, 4, 2, 80, 80, 16, sa.Local(20), {"causal": True}),
    "mqa": (1, 4, 1, 64, 64, 16, sa.Local(8) | sa.Global(first=1), {}),
    "per-head": (1, 4, 2, 96, 96, 16,
                 sa.PerHead([sa.Local(8), sa.Stride(5) | sa.Global(first=1), sa.Random(2, seed=3), sa.Dense()]), {}),
    "random": (2, 2, 2, 112, 112, 16, sa.Random(2, seed=7) | sa.Local(4), {}),
    "block32-d64": (1, 2, 2, 130, 130, 64, sa.Local(32) | sa.Global(first=1), {"block_size": 32}),
    "block128-ragged": (1, 2, 1, 200, 200, 32, sa.Local(40) | sa.Global(first=3), {"block_size": 128}),
    "head-dim-128": (1, 2, 1, 70, 70, 128, sa.Local(16) | sa.Global(first=1), {}),
    "head-dim-24-padded": (1, 2, 2, 50, 50, 24, sa.Local(10), {}),
    "head-dim-8-padded": (1, 2, 2, 40, 40, 8, sa.Local(6), {}),
}


@pytest.mark.parametrize("dtype", CASE_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, dtype):
    batch, q_heads, kv_heads, n_q, n_k, head_dim, pattern, kwargs = CASES[name]
    q, k, v = make_qkv(batch, q_heads, kv_heads, n_q, n_k, head_dim, dtype=dtype)
    layout = pattern.layout(n_q, n_k, heads=q_heads, **{"block_size": 16, **kwargs})
    check_against_reference(q, k, v, layout)


def test_per_example_padding_and_globals():
    """key_padding_mask and global_mask differ per example: the layout is per (example, head)."""
    q, k, v = make_qkv(2, 2, 2, 90, 90, 16)
    padding = torch.zeros(2, 90, dtype=torch.bool)
    padding[1, 61:] = True
    global_mask = torch.zeros(2, 90, dtype=torch.bool)
    global_mask[0, [0, 45]] = True
    global_mask[1, 7] = True
    pattern = sa.PerHead([sa.Local(8), sa.Local(3) | sa.Stride(16)])
    layout = pattern.layout(90, heads=2, block_size=16, key_padding_mask=padding, global_mask=global_mask)
    assert layout.batch == 2 and not layout.shared_heads
    check_against_reference(q, k, v, layout)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision(dtype):
    q, k, v = make_qkv(1, 2, 2, 100, 100, 32, dtype=dtype)
    check_against_reference(q, k, v, (sa.Local(20) | sa.Global(first=2)).layout(100, heads=2, block_size=16,
                                                                                 causal=True))


# ------------------------------------------------------------------------------------------------
# Long rows and columns cut into pieces (work_split), merged by a second kernel
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, blocks", [("longformer-ragged-N", 1), ("per-head", 1), ("nq>nk-causal-empty-rows", 3),
                                         ("gqa", 3), ("block32-d64", 3)])
def test_pieces_match_reference(name, blocks, pieces_of):
    pieces_of(blocks)
    batch, q_heads, kv_heads, n_q, n_k, head_dim, pattern, kwargs = CASES[name]
    q, k, v = make_qkv(batch, q_heads, kv_heads, n_q, n_k, head_dim)
    layout = pattern.layout(n_q, n_k, heads=q_heads, **{"block_size": 16, **kwargs})
    check_against_reference(q, k, v, layout)


@pytest.mark.slow
def test_pieces_with_padding_shared_kv_and_lse_gradient(pieces_of):
    """Per-example layouts (padding, globals), one k, v for both examples and a gradient through lse, with
    pieces; two runs bitwise equal (pieces merge in a fixed order)."""
    pieces_of(2)
    q, k, v = make_qkv(2, 4, 2, 90, 90, 16)
    k, v = k[:1], v[:1]
    padding = torch.arange(90) >= torch.tensor([[90], [50]])
    global_mask = torch.zeros(2, 90, dtype=torch.bool)
    global_mask[0, 3] = global_mask[1, 40] = True
    layout = (sa.Local(10) | sa.Global(first=1)).layout(90, heads=4, block_size=16, key_padding_mask=padding,
                                                         global_mask=global_mask)
    check_against_reference(q, k, v, layout, grad_lse=True)
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=DEVICE)
    first, second = run_backend("triton", q, k, v, layout, grad_out), run_backend("triton", q, k, v, layout, grad_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_a_global_row_is_cut_and_short_rows_are_not():
    layout = (sa.Local(64) | sa.Global(first=1)).layout(4096, heads=2).to(DEVICE)
    plan = triton_gpu._plan((layout.full_ptr, layout.part_ptr), batch=1, heads=2, groups=1, columns=False)
    assert plan.splits[:, 0].tolist() == [0] and plan.n_slots == plan.splits[0, 2] > 1   # query block 0 only
    assert plan.items[:plan.n_slots, 0].tolist() == [0] * plan.n_slots                   # and it starts first


# ------------------------------------------------------------------------------------------------
# The workloads users run: N = 4096 and 4000, B = 2, H = 4, against one float64 reference each
# ------------------------------------------------------------------------------------------------
class Workload(NamedTuple):
    q_heads: int
    kv_heads: int
    kv_batch: int                 # 1: one k, v read by both examples (dk, dv summed over them)
    n: int
    head_dim: int
    block_size: int
    pattern: sa.Pattern
    padding_from: tuple           # example b's keys from padding_from[b] on are padding
    global_tokens: tuple          # example b's global tokens (the call-time global_mask)
    dtypes: tuple


ALL_DTYPES, HALF = tuple(FLOORS), (torch.float16, torch.bfloat16)
LONGFORMER = sa.Local(256) | sa.Global(first=16)
# float32 at one workload: its exact matmuls run on FMA units and are slow to JIT-compile (the 4 kernels
# lowered for sm_90 on a 2-core Xeon, block 64: ~10 s at head_dim 64, ~26 s at 128; block 128: ~70 s and
# ~290 s); CASES cover float32 at head_dim 128 and block 128 on small shapes
WORKLOADS = {
    # runs in the interpreter too: the same path at a size the CPU affords
    "tiny-gqa-shared-kv": Workload(2, 1, 1, 70, 16, 16, sa.Local(8), (62, 40), ((30,), ()),
                                   ALL_DTYPES if ON_CUDA else (torch.float32, torch.float16)),
    "longformer": Workload(4, 4, 2, 4096, 64, 64, LONGFORMER, (4096, 3000), ((2048,), (100, 1500)), ALL_DTYPES),
    "bigbird-gqa-ragged": Workload(4, 2, 2, 4000, 128, 64, sa.bigbird(block=64), (4000, 2600), ((), (999,)), HALF),
    "longformer-gqa-block128": Workload(4, 2, 2, 4096, 128, 128, LONGFORMER, (4096, 3500), ((0, 777), (4000,)),
                                        HALF),
    "causal-sliding-shared-kv-ragged": Workload(4, 2, 1, 4000, 64, 128, sa.Local(1023, 0) & sa.Causal(),
                                                (4000, 2500), ((), ()), HALF),   # example 1: rows >= 3523 see no key
}


def workload_params():
    """(name, dtype) in workload order, so that each workload's float64 reference is computed once."""
    params = []
    for name, workload in WORKLOADS.items():
        marks = [pytest.mark.skipif(not ON_CUDA and workload.n > 100, reason="N = 4000..4096 needs a GPU")]
        params += [pytest.param(name, dtype, marks=marks, id=f"{name}-{DTYPE_IDS[dtype]}") for dtype in workload.dtypes]
    return params


def exact_in_every_dtype(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to values that bfloat16, float16 and float32 all hold exactly, so one float64
    reference serves every dtype."""
    return t.to(torch.bfloat16).to(torch.float16).double()


def workload_inputs(name: str):
    """q (2, Hq, N, D), k, v (kv_batch, Hkv, N, D) and grad_out like q, float64 on DEVICE; the layout."""
    w = WORKLOADS[name]
    gen = torch.Generator().manual_seed(0)
    q_shape, kv_shape = (2, w.q_heads, w.n, w.head_dim), (w.kv_batch, w.kv_heads, w.n, w.head_dim)
    q, k, v, grad_out = (exact_in_every_dtype(torch.randn(shape, generator=gen, dtype=torch.float64)).to(DEVICE)
                         for shape in (q_shape, kv_shape, kv_shape, q_shape))
    padding = torch.arange(w.n) >= torch.tensor(w.padding_from)[:, None]           # (2, N)
    global_mask = torch.zeros(2, w.n, dtype=torch.bool)                            # (2, N)
    for example, tokens in enumerate(w.global_tokens):
        global_mask[example, list(tokens)] = True
    layout = w.pattern.layout(w.n, heads=w.q_heads, block_size=w.block_size, key_padding_mask=padding,
                              global_mask=global_mask).to(DEVICE)
    return (q, k, v, layout), grad_out


@pytest.fixture(scope="module")
def workload_oracles():
    """name -> (inputs, grad_out, float64 reference results): the workload under test, filled by its first
    dtype (one workload at a time, to hold little GPU memory)."""
    return {}


@pytest.mark.parametrize("name, dtype", workload_params())
def test_workload_matches_reference_and_is_deterministic(name, dtype, workload_oracles):
    """out, lse, dq, dk, dv by the tolerance rule (finite where the reference is; rows with no key and keys
    no row reads exactly 0), and two runs bitwise equal."""
    if name not in workload_oracles:
        workload_oracles.clear()
        inputs, grad_out = workload_inputs(name)
        workload_oracles[name] = inputs, grad_out, run_backend("reference", *inputs, grad_out)
    (q, k, v, layout), grad_out, oracle = workload_oracles[name]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    got = run_backend("triton", q, k, v, layout, grad_out)
    assert_matches_oracle(got, oracle, dense_baseline(q, k, v, layout, grad_out))
    again = run_backend("triton", q, k, v, layout, grad_out)              # the backward has no atomics: bitwise equal
    for field, first, second in zip(("out", "lse", "dq", "dk", "dv"), got, again):
        assert torch.equal(first, second), f"{field} differs between two runs"


# ------------------------------------------------------------------------------------------------
# Empty rows, layouts of inputs, determinism
# ------------------------------------------------------------------------------------------------
def test_empty_rows_give_zero_output_minus_inf_lse_and_zero_gradients():
    q, k, v = make_qkv(2, 2, 2, 64, 64, 16)
    padding = torch.zeros(2, 64, dtype=torch.bool)
    padding[1] = True                                             # example 1: every key is padding
    padding[0, :20] = True                                        # example 0: causal rows < 20 see nothing
    layout = sa.Local(64).layout(64, heads=2, block_size=16, causal=True, key_padding_mask=padding)
    grad_out = torch.ones(q.shape, dtype=torch.float64, device=DEVICE)
    out, lse, dq, dk, dv = run_backend("triton", q, k, v, layout, grad_out)
    for t in (out, lse, dq, dk, dv):
        assert not torch.isnan(t).any()
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (out[0, :, :20] == 0).all() and (lse[0, :, :20] == float("-inf")).all() and (dq[0, :, :20] == 0).all()
    assert (dk[0, :, :20] == 0).all() and (dv[0, :, :20] == 0).all()  # padded keys get no gradient
    assert torch.isfinite(lse[0, :, 20:]).all()


def test_non_contiguous_inputs_and_grad_output():
    q, k, v = make_qkv(2, 2, 2, 70, 70, 16)
    layout = (sa.Local(10) | sa.Global(first=1)).layout(70, heads=2, block_size=16)
    # (B, N, H, D) storage seen as (B, H, N, D), the usual layout of projections.
    q_t, k_t, v_t = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q_t.is_contiguous()
    grad_out = torch.randn(2, 70, 2, 16, dtype=torch.float64, device=DEVICE).transpose(1, 2)
    expected = run_backend("triton", q, k, v, layout, grad_out.contiguous())
    actual = run_backend("triton", q_t, k_t, v_t, layout, grad_out)       # dout reaches the kernels non-contiguous
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6)


def test_deterministic():
    q, k, v = make_qkv(1, 4, 2, 96, 96, 16)
    layout = (sa.Local(16) | sa.Global(first=3) | sa.Random(1)).layout(96, heads=4, block_size=16)
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=DEVICE)
    first, second = run_backend("triton", q, k, v, layout, grad_out), run_backend("triton", q, k, v, layout, grad_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph_forward_and_backward():
    q, k, v = make_qkv(1, 2, 1, 48, 48, 16)
    layout = (sa.Local(8) | sa.Global(first=1)).layout(48, heads=2, block_size=16).to(DEVICE)

    def attend(q, k, v):
        return triton_gpu.attention(q, k, v, layout, 0.25)[0]

    compiled = torch.compile(attend, fullgraph=True, backend="inductor" if ON_CUDA else "aot_eager")
    grad_out = torch.randn(q.shape, dtype=torch.float32, device=DEVICE)
    results = []
    for fn in (compiled, attend):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fn(qq, kk, vv)
        (out * grad_out).sum().backward()
        results.append((out, qq.grad, kk.grad, vv.grad))
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6)


def test_torch_compile_through_sparse_attention():
    q, k, v = make_qkv(1, 2, 2, 32, 32, 16)
    layout = sa.Local(8).layout(32, heads=2, block_size=16)
    attend = lambda q, k, v: sparse_attention(q, k, v, layout, backend="triton")  # noqa: E731
    compiled = torch.compile(attend, fullgraph=True, backend="inductor" if ON_CUDA else "aot_eager")
    results = []
    for fn in (compiled, attend):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fn(qq, kk, vv)
        out.square().sum().backward()
        results.append((out, qq.grad, kk.grad, vv.grad))
    for compiled_result, eager_result in zip(*results):
        torch.testing.assert_close(compiled_result, eager_result)


# ------------------------------------------------------------------------------------------------
# GPU code generation without a GPU
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow  # compiles every kernel for sm_90 in a subprocess
@pytest.mark.skipif(ON_CUDA, reason="on CUDA the value tests compile and run the kernels")
@pytest.mark.parametrize("flags", [["--head-dim", "64", "128", "--dtype", "bf16"],
                                   ["--head-dim", "24", "--dtype", "fp16", "fp32", "--ragged"],
                                   ["--head-dim", "64", "--dtype", "bf16", "fp32", "--softcap"]])
def test_kernels_compile_for_an_h100_without_a_gpu(flags, tmp_path):
    """The interpreter runs the kernels' Python; this lowers them to PTX/cubin for sm_90, as a GPU would, with
    the launch settings the backend picks on an H100: they fit in shared memory and their loops are pipelined."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = os.path.join(REPO, "benchmarks", "triton_resources.py")
    result = subprocess.run([sys.executable, script, *flags, "--out", str(tmp_path)], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=600)
    if result.returncode and "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("Triton's bundled ptxas is missing")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "triton_resources.json").read_text())["rows"]
    assert {r["kernel"] for r in rows} == {"forward", "preprocess", "dk_dv", "dq"} and all(r["launched"] for r in rows)
    for r in rows:
        assert r["shared_bytes"] <= 227 * 1024 and (r["pipelined"] or r["kernel"] == "preprocess"), r
        if r["dtype"] != "fp32" and r["head_dim"] <= 64:  # half precision up to head_dim 64 keeps all in registers,
            assert r["spill_bytes"] <= (64 if r["softcap"] else 0), r  # but for 64 bytes of dK/dV's with softcap


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = k = v = torch.randn(1, 1, 16, 16)
    with pytest.raises(RuntimeError, match="CUDA tensors.*backend='numba' or 'reference'.*TRITON_INTERPRET=1"):
        sparse_attention(q, k, v, sa.Local(4), backend="triton")


def test_float64_is_refused():
    q = k = v = torch.randn(1, 1, 16, 16, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="float16, bfloat16 and float32.*torch.float64.*backend='reference'"):
        sparse_attention(q, k, v, sa.Local(4), backend="triton")


def test_large_head_dim_is_refused():
    q = k = v = torch.randn(1, 1, 16, 256, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim up to 128, got head_dim=256"):
        sparse_attention(q, k, v, sa.Local(4), backend="triton")


@pytest.mark.parametrize("block_size", [8, 24, 256])
def test_block_size_must_be_a_power_of_two_tile(block_size):
    q = k = v = torch.randn(1, 1, 32, 16, device=DEVICE)
    layout = sa.Local(4).layout(32, block_size=block_size)
    with pytest.raises(ValueError, match=f"power of two in 16..128.*block_size={block_size}"):
        sparse_attention(q, k, v, layout, backend="triton")


@pytest.mark.skipif(ON_CUDA, reason="the interpreter refuses bfloat16; CUDA runs it")
def test_bfloat16_is_refused_in_the_interpreter():
    q = k = v = torch.randn(1, 1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="interpreter.*bfloat16"):
        sparse_attention(q, k, v, sa.Local(4), backend="triton")


def test_missing_triton_says_pip_install_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "from sparse_attn import backends\n"
            "print(backends.availability('triton')[1])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "pip install triton" in result.stdout, result.stderr[-2000:]


def test_available_reports_the_mode():
    usable, reason = triton_gpu.available()
    assert usable
    assert ON_CUDA or "interpreter" in reason


@pytest.mark.parametrize("text, version", [("3.6.0", (3, 6)), ("3.7.0+git9844da95", (3, 7)), ("2.4.0rc1", (2, 4)),
                                           ("2.10.1", (2, 10))])
def test_versions_compare_by_major_and_minor(text, version):
    assert triton_gpu._version(text) == version


@pytest.mark.skipif(ON_CUDA, reason="the interpreter runs CPU tensors only")
def test_an_old_interpreter_with_a_new_numpy_says_what_to_install(monkeypatch):
    monkeypatch.setattr(triton_gpu, "_INTERPRETER_NUMPY_CLASH", True)
    q = k = v = torch.randn(1, 1, 16, 16)
    with pytest.raises(RuntimeError, match=r"interpreter cannot run with numpy.*'triton>=3.7' or 'numpy<2.4'"):
        sparse_attention(q, k, v, sa.Local(4), backend="triton")


def test_too_little_shared_memory_says_what_to_change(monkeypatch):
    """Triton's OutOfResources (a GPU with less shared memory than the tiles need) gains the fixes in our terms."""
    def too_large(*args):
        raise triton_gpu.triton.runtime.errors.OutOfResources(200704, 166912, "shared memory")

    monkeypatch.setattr(triton_gpu, "_forward", too_large)
    q = k = v = torch.randn(1, 1, 16, 128, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"shared memory.*head_dim=128, torch.float32, block_size=64.*"
                                           r"bfloat16/float16.*smaller block_size.*backend='reference'"):
        sparse_attention(q, k, v, sa.Local(4), backend="triton")
