"""softcap and ALiBi inside the Triton kernels (issue 27): forward and backward against the float64 oracle of
tests/score_mods_oracle.py (written from the formulas), by the tolerance rule of tests/tolerance.py, with torch
in the kernel's dtype as the baseline; sinks on top through sparse_attention.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
so the shapes are tiny: blocks of 16, a few blocks a row.
"""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason='needs triton (its interpreter without a GPU): pip install ".[triton]"')

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import sparse_attn as sa  # noqa: E402
from sparse_attn.backends import triton_gpu  # noqa: E402
from sparse_attn.score_mods import NO_MODS, ScoreMods  # noqa: E402
from tests.helpers import DEVICE, make_qkv  # noqa: E402
from tests.score_mods_oracle import oracle  # noqa: E402
from tests.tolerance import FLOORS, assert_within_rule  # noqa: E402

SCALE = 0.4
SOFTCAP = 2.0      # small enough that tanh bends the scores (scale * q . k reaches ~4 here)

CASES = {
    # name: (batch, q_heads, kv_heads, kv_batch, n_q, n_k, pattern, layout kwargs)
    "gqa-partial-blocks": (2, 4, 2, 2, 37, 37, sa.Local(5) | sa.Global(first=1), {}),
    "kv-batch-1": (2, 2, 1, 1, 33, 33, sa.Local(4, 1) | sa.Sink(first=2), {}),
    "decode-shape-causal": (1, 2, 2, 1, 7, 50, sa.Local(5, 0) | sa.Sink(first=1), {"causal": True}),
    "empty-rows-causal": (1, 2, 1, 1, 40, 20, sa.Local(4), {"causal": True}),
    "documents": (2, 2, 1, 2, 36, 36, sa.Local(2, 0) | sa.Global(first=1),
                  {"documents": sa.documents_from_lengths([[10, 15, 8], [30]], n=36)}),
}
# (softcap, slopes: None, one per head (Hq,) or one per example and head (B, Hq))
MODS = {"softcap": (SOFTCAP, None), "alibi": (None, "heads"), "both": (SOFTCAP, "examples")}


def slopes_for(kind, batch, heads):
    """ALiBi slopes as a model has them: float32 on DEVICE, (Hq,) or (B, Hq); None for no ALiBi."""
    if kind is None:
        return None
    gen = torch.Generator().manual_seed(5)
    shape = (heads,) if kind == "heads" else (batch, heads)
    return (torch.rand(shape, generator=gen) * 0.6).to(DEVICE)


def case_inputs(name, dtype=torch.float32):
    """q, k, v in ``dtype`` on DEVICE and the case's BlockLayout of block 16."""
    batch, q_heads, kv_heads, kv_batch, n_q, n_k, pattern, kwargs = CASES[name]
    q, k, v = make_qkv(batch, q_heads, kv_heads, n_q, n_k, 16, dtype=dtype)
    return q, k[:kv_batch], v[:kv_batch], pattern.layout(n_q, n_k, heads=q_heads, block_size=16, **kwargs).to(DEVICE)


def check_mods(q, k, v, layout, softcap, slopes):
    """out, lse, dq, dk, dv of backend="triton" with the modifiers within the tolerance rule of the oracle's, torch
    in q's dtype computing the same formulas being the baseline; a gradient reaches q and k through lse too."""
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    grad_lse = torch.randn(q.shape[:3], generator=gen, dtype=torch.float64).to(DEVICE)
    mask = layout.to_dense()
    got = with_grads(lambda *qkv: sa.sparse_attention(*qkv, layout, scale=SCALE, softcap=softcap, alibi_slopes=slopes,
                                                      backend="triton", return_lse=True), q, k, v, grad_out, grad_lse)
    mods = dict(softcap=softcap, alibi_slopes=slopes)
    want = with_grads(lambda *qkv: oracle(*qkv, mask, SCALE, **mods), q.double(), k.double(), v.double(),
                      grad_out, grad_lse)
    baseline = with_grads(lambda *qkv: in_dtype(*qkv, mask, SCALE, **mods), q, k, v, grad_out, grad_lse)
    assert_within_rule_all(got, want, baseline)


def with_grads(attend, q, k, v, grad_out, grad_lse):
    """(out, lse, dq, dk, dv) of ``attend`` on fresh leaves, for the loss out . grad_out + finite lse . grad_lse."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attend(q, k, v)
    finite = torch.isfinite(lse)
    loss = (out.double() * grad_out).sum() + (torch.where(finite, lse, 0.0).double() * grad_lse).sum()
    return (out, lse, *torch.autograd.grad(loss, (q, k, v)))


def in_dtype(q, k, v, mask, scale, softcap=None, alibi_slopes=None):
    """The oracle's formulas computed by torch in q's dtype (the tolerance rule's baseline): (out, lse)."""
    batch, heads, n_q, _ = q.shape
    n_k, groups = k.shape[2], heads // k.shape[1]
    k, v = (t.repeat_interleave(groups, 1) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) * scale                                          # (B, Hq, Nq, Nk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        distance = (torch.arange(n_q, device=q.device)[:, None] + n_k - n_q - torch.arange(n_k, device=q.device)).abs()
        s = s - alibi_slopes.reshape(-1, heads, 1, 1).to(q.dtype) * distance.to(q.dtype)
    s = s.masked_fill(~mask.to(q.device), -math.inf)
    top = s.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isinf(top), 0.0, top)                                  # rows with no key: any shift
    weights = torch.exp(s - top)
    total = weights.sum(-1, keepdim=True)
    empty = total == 0
    total = torch.where(empty, 1.0, total)
    lse = torch.where(empty, -math.inf, top + torch.log(total))
    return (weights / total) @ v, lse[..., 0]


def assert_within_rule_all(got, want, baseline):
    """Every field within the rule; rows with no allowed key: out and dq exactly 0, lse -inf."""
    out, lse, dq, dk, dv = got
    floor = FLOORS[out.dtype]
    finite = torch.isfinite(want[1])
    assert torch.equal(torch.isfinite(lse), finite), "lse: the rows with no key differ"
    assert_within_rule("lse", lse[finite], want[1][finite], baseline[1][finite], floor)
    for name, a, w, b in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want[:1] + want[2:],
                             baseline[:1] + baseline[2:]):
        assert a.dtype == out.dtype and a.shape == w.shape, name
        assert_within_rule(name, a, w, b, floor)
    assert (out[~finite] == 0).all() and (dq[~finite] == 0).all(), "rows with no key: out or dq is not 0"


# ------------------------------------------------------------------------------------------------
# Every case x every combination of softcap and ALiBi, forward and backward
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mods", list(MODS))
@pytest.mark.parametrize("name", list(CASES))
def test_modifiers_match_the_oracle(name, mods):
    q, k, v, layout = case_inputs(name)
    softcap, slopes = MODS[mods]
    check_mods(q, k, v, layout, softcap, slopes_for(slopes, q.shape[0], q.shape[1]))


@pytest.mark.parametrize("softcap", [1e-45, 1e-38, 1e34, 1e300])
def test_extreme_softcaps_give_the_oracles_scores_not_nan(softcap):
    """scale / softcap and softcap * log2(e) overflowed float32 (NaN out of 0 * inf): tiny caps make every score
    about 0, huge ones leave the scores as they are. (torch in float32 overflows there too: the oracle alone.)"""
    q, k, v, layout = case_inputs("kv-batch-1")
    q[0, 0, 3] = 0.0                                                              # a score of exactly 0
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=DEVICE)
    grad_lse = torch.randn(q.shape[:3], dtype=torch.float64, device=DEVICE)
    got = with_grads(lambda *qkv: sa.sparse_attention(*qkv, layout, scale=SCALE, softcap=softcap, backend="triton",
                                                      return_lse=True), q, k, v, grad_out, grad_lse)
    want = with_grads(lambda *qkv: oracle(*qkv, layout.to_dense(), SCALE, softcap=softcap), q.double(), k.double(),
                      v.double(), grad_out, grad_lse)
    for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []),
                         ids=lambda d: str(d)[6:])
def test_half_precision_with_both_modifiers(dtype):
    q, k, v, layout = case_inputs("gqa-partial-blocks", dtype)
    check_mods(q, k, v, layout, SOFTCAP, slopes_for("examples", q.shape[0], q.shape[1]))


@pytest.mark.parametrize("name, blocks", [("gqa-partial-blocks", 1), ("decode-shape-causal", 1), ("documents", 2)])
def test_rows_and_columns_cut_into_pieces_merge_by_lse(name, blocks, pieces_of):
    """Split rows (the forward's merge by log-sum-exp, the backward's sums), also a decode-shaped row of 7
    queries over 50 keys cut into 4 pieces: each piece computes its modified scores, the merge is unchanged."""
    pieces_of(blocks)
    q, k, v, layout = case_inputs(name)
    check_mods(q, k, v, layout, SOFTCAP, slopes_for("examples", q.shape[0], q.shape[1]))


def test_sinks_ride_on_top_through_sparse_attention():
    """softcap, ALiBi and sinks at once: the kernels' (out, lse) with add_sink, dsinks included."""
    q, k, v, layout = case_inputs("kv-batch-1")
    slopes = slopes_for("heads", q.shape[0], q.shape[1])
    sinks = torch.tensor([0.5, -1.0], device=DEVICE)
    gen = torch.Generator().manual_seed(2)
    grad_out = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(DEVICE)

    def attend(q, k, v, sinks):
        q, k, v, sinks = (t.detach().clone().requires_grad_() for t in (q, k, v, sinks))
        if q.dtype == torch.float64:
            out, _ = oracle(q, k, v, layout.to_dense(), SCALE, SOFTCAP, slopes, sinks)
        else:
            out = sa.sparse_attention(q, k, v, layout, scale=SCALE, softcap=SOFTCAP, alibi_slopes=slopes, sinks=sinks,
                                      backend="triton")
        return (out, *torch.autograd.grad((out.double() * grad_out).sum(), (q, k, v, sinks)))

    got, want = attend(q, k, v, sinks), attend(q.double(), k.double(), v.double(), sinks.double())
    for name, a, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a.double(), w, atol=2e-5, rtol=2e-5, msg=name)


def test_torch_compile_traces_the_modifiers_forward_and_backward():
    """Inductor, fullgraph=True: the custom ops take the float softcap and the slopes tensor; compiled equals eager."""
    q, k, v, layout = case_inputs("kv-batch-1")
    slopes = slopes_for("examples", q.shape[0], q.shape[1])

    def attend(q, k, v):
        return sa.sparse_attention(q, k, v, layout, softcap=SOFTCAP, alibi_slopes=slopes, backend="triton",
                                   return_lse=True)

    grad_out, grad_lse = torch.randn(q.shape, dtype=torch.float64, device=DEVICE), torch.ones_like(q[..., 0]).double()
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(attend, fullgraph=True, backend="inductor")     # caches off: compiled here, now
        results = [with_grads(fn, q, k, v, grad_out, grad_lse) for fn in (compiled, attend)]
    torch._dynamo.reset()
    for name, compiled_result, eager_result in zip(("out", "lse", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(compiled_result, eager_result, atol=1e-6, rtol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------------
# The pieces: tanh from exp2, the constexpr switches, the slopes the kernels read
# ------------------------------------------------------------------------------------------------
@triton.jit
def _tanh_kernel(X, Y, n, BLOCK: tl.constexpr, HARDWARE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, triton_gpu._tanh(tl.load(X + offs, mask=offs < n), HARDWARE), mask=offs < n)


# (hardware, the largest relative error allowed): the exp2 form to a few float32 ulp (softcap * tanh then errs by
# at most 1e-6 of the score); the GPU's tanh.approx.f32 (compiled kernels only) to its documented 2^-11
TANH_FORMS = [(False, 1e-6)] + ([(True, 2.0 ** -10.9)] if torch.cuda.is_available() else [])


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")   # numpy on the inf and NaN inputs
@pytest.mark.parametrize("hardware, bound", TANH_FORMS, ids=[f"hardware={h}" for h, _ in TANH_FORMS])
def test_tanh_is_accurate(hardware, bound):
    """Within ``bound`` relative of tanh on every float32 from 1e-30 to 1e30, exactly +-1 far out, NaN for NaN."""
    magnitudes = torch.cat([torch.logspace(-30, 30, 20_001), torch.linspace(0, 12, 20_001)])
    x = torch.cat([magnitudes, -magnitudes, torch.tensor([math.inf, -math.inf, math.nan])]).to(DEVICE)
    y = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024, HARDWARE=hardware)
    exact = torch.tanh(x.double())
    finite = torch.isfinite(x)
    relative = ((y.double() - exact).abs() / exact.abs().clamp_min(1e-300))[finite & (x != 0)]
    assert relative.max() < bound, relative.max()
    assert y[x == 0].eq(0).all() and y[x.abs() > 20].abs().eq(1).all() and y[-3:-1].tolist() == [1.0, -1.0]
    assert y[-1].isnan()


def test_without_modifiers_the_kernels_compile_as_before():
    """NO_MODS: both switches off (the kernels' modifier branches are compile-time, not per score)."""
    plain = triton_gpu.kernel_constants(64, torch.bfloat16, 128, 128, 64)
    assert plain == triton_gpu.kernel_constants(64, torch.bfloat16, 128, 128, 64, NO_MODS)
    assert (plain["HAS_SOFTCAP"], plain["HAS_ALIBI"]) == (False, False)
    both = triton_gpu.kernel_constants(64, torch.bfloat16, 128, 128, 64, ScoreMods(50.0, torch.zeros(1, 2)))
    assert (both["HAS_SOFTCAP"], both["HAS_ALIBI"]) == (True, True)


@pytest.mark.parametrize("make, why", [(lambda: torch.ones(1, 2, dtype=torch.float64, device=DEVICE), "float64"),
                                       (lambda: torch.ones(2, device=DEVICE), r"\(2,\)"),
                                       (lambda: torch.ones(1, 3, device=DEVICE), r"\(1, 3\)"),
                                       (lambda: torch.ones(2, 1, device=DEVICE).expand(2, 2).t(), "contiguous=False")])
def test_slopes_the_kernels_would_misread_are_refused(make, why):
    """Called directly (sparse_attention normalises them first), the backend refuses slopes it cannot read (made
    on DEVICE: a copy to CUDA would make the transposed expand contiguous)."""
    q, k, v, layout = case_inputs("kv-batch-1")
    with pytest.raises(ValueError, match=f"contiguous float32.*{why}.*check_mods"):
        triton_gpu.attention(q, k, v, layout, SCALE, ScoreMods(0.0, make()))


# ------------------------------------------------------------------------------------------------
# benchmarks/gpu_kernels.py: the modified kernels as implementations a GPU session times
# ------------------------------------------------------------------------------------------------
def gpu_kernels():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_kernels.py"
    spec = importlib.util.spec_from_file_location("gpu_kernels", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_benchmark_runs_softcap_and_alibi_and_reports_their_cost():
    gk = gpu_kernels()
    assert not set(gk.TRITON_MODS) & set(gk.DEFAULT_IMPLS) and gk.parse_args(["--impls", *gk.TRITON_MODS]).impls
    q, k, v, layout = case_inputs("gqa-partial-blocks")
    plain = sa.sparse_attention(q, k, v, layout, backend="triton")
    alibi = {"alibi_slopes": torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8], device=DEVICE)}   # 2^(-8 (h+1) / 4)
    for impl, mods in (("triton-softcap", {"softcap": 50.0}), ("triton-alibi", alibi)):
        forward, details = gk.make_runner(impl, q, k, v, layout, causal=False)
        out = forward()
        assert details == {} and not torch.equal(out, plain), impl
        torch.testing.assert_close(out, sa.sparse_attention(q, k, v, layout, backend="triton", **mods), msg=impl)
    point = ("longformer", 64, 1, 32768)
    rows = [dict(zip(gk.KEY, (impl, *point)), fwd_ms=ms, fwd_bwd_ms=3 * ms)
            for impl, ms in (("triton", 2.0), ("triton-softcap", 2.3), ("triton-alibi", 2.1))]
    meta = {"device": "GPU", "gpu_memory_gib": 80, "driver": "-", "cuda": "-", "torch": "-", "triton": "-"}
    assert ("- longformer, D=64, B=1, N=32768: softcap forward 2.30 ms (1.15x), forward+backward 6.90 ms (1.15x); "
            "alibi forward 2.10 ms (1.05x), forward+backward 6.30 ms (1.05x)") in gk.to_markdown(rows, meta)
