"""softcap and ALiBi inside the Numba kernels (issue 27), sinks through sparse_attention(..., backend="numba"):
against the float64 oracle of tests/score_mods_oracle.py (written from the formulas), forward and backward, every
combination, in float64, float32 (the DESIGN tolerance rule) and bfloat16; large logits, non-finite inputs (the
exact path) and the custom ops."""
import itertools

import numba
import pytest
import torch

import sparse_attn as sa
from sparse_attn.backends.numba import backend as numba_backend
from sparse_attn.backends.numba import bf16 as numba_bf16
from sparse_attn.backends.numba.mods import call_modifiers
from sparse_attn.backends.numba.panels import PANEL_KEYS
from sparse_attn.score_mods import ScoreMods
from tests.cases import MODS, make, modifiers
from tests.cases import SCORE_MOD_CASES as CASES
from tests.score_mods_oracle import oracle
from tests.tolerance import FLOORS, assert_within_rule

BLOCK = 16                      # the cases' 29-70 tokens make 2-5 blocks a side: full and partial blocks
SCALE = 0.7
NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def numba_layout(c, block_size=BLOCK):
    """The case's layout in blocks of ``block_size`` (the oracle reads the case's own mask)."""
    batch, q_heads, _, n_q, n_k = c["shapes"]
    return c["pattern"].layout(n_q, n_k, heads=q_heads, block_size=block_size, **c["options"])


def case_inputs(c, seed=0, dim=8):
    """float64 q, k, v of a case of tests/test_score_mods.py."""
    batch, q_heads, kv_heads, n_q, n_k = c["shapes"]
    kv_batch = c.get("kv_batch", batch)
    return make((batch, q_heads, n_q, dim), seed), make((kv_batch, kv_heads, n_k, dim), seed + 1), \
        make((kv_batch, kv_heads, n_k, dim), seed + 2)


def outputs(attend, q, k, v, mods, seed=3):
    """(out, lse, dq, dk, dv[, dsinks]) of ``attend(q, k, v, **mods) -> (out, lse)`` and a random linear loss of
    out and the finite lse (weights from ``seed``, the same for every dtype)."""
    out, lse = attend(q, k, v, **mods)
    weight_out, weight_lse = make(out.shape, seed, grad=False), make(lse.shape, seed + 1, grad=False)
    loss = (out * weight_out.to(out.dtype)).sum() + (torch.where(torch.isfinite(lse), lse, 0.0)
                                                     * weight_lse.to(lse.dtype)).sum()
    leaves = [q, k, v] + ([mods["sinks"]] if mods.get("sinks") is not None else [])
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves))


def through(backend, layout, **options):
    def attend(q, k, v, **mods):
        return sa.sparse_attention(q, k, v, layout, backend=backend, return_lse=True, scale=SCALE, **options, **mods)
    return attend


def with_oracle(mask):
    return lambda q, k, v, **mods: oracle(q, k, v, mask, SCALE, **mods)


def leaves(tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


def cast(mods, dtype):
    """The modifiers for inputs of ``dtype``: slopes and sinks in float32 (float64 for float64 inputs)."""
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return {name: (value.detach().to(dtype).requires_grad_(value.requires_grad) if isinstance(value, torch.Tensor)
                   else value) for name, value in mods.items()}


@pytest.mark.parametrize("softcap, slopes, sinks", MODS, ids=lambda m: str(m))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_float64_equals_the_oracle(case, softcap, slopes, sinks):
    c = case()
    q, k, v = case_inputs(c)
    mods = modifiers(softcap, slopes, sinks, c["shapes"][0], c["shapes"][1])
    got = outputs(through("numba", numba_layout(c)), q, k, v, mods)
    want = outputs(with_oracle(c["mask"]), q, k, v, mods)
    for name, x, y in zip(NAMES, got, want):
        assert x.dtype == torch.float64, name
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-9, msg=name)    # lse: -inf where the oracle's is


def assert_rule(got, base, want, floors=None):
    """got (numba) within the DESIGN rule: its error against the float64 oracle ``want`` at most twice torch's
    (``base``: the reference backend in the same dtype) plus a floor; -inf lse where the oracle has it."""
    assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1]))
    finite = torch.isfinite(want[1])
    for name, x, y, z in zip(NAMES, got, base, want):
        if name == "lse":
            x, y, z = x[finite], y[finite], z[finite]
        assert_within_rule(name, x, z, y, (floors or {}).get(name, FLOORS[torch.float32]))


@pytest.mark.parametrize("softcap, slopes, sinks", MODS, ids=lambda m: str(m))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_float32_within_the_tolerance_rule(case, softcap, slopes, sinks, float32_route):
    c = case()
    inputs = case_inputs(c)
    mods = modifiers(softcap, slopes, sinks, c["shapes"][0], c["shapes"][1])
    layout = numba_layout(c)
    got = outputs(through("numba", layout), *leaves(inputs, torch.float32), cast(mods, torch.float32))
    base = outputs(through("reference", layout), *leaves(inputs, torch.float32), cast(mods, torch.float32))
    want = outputs(with_oracle(c["mask"]), *inputs, mods)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_rule(got, base, want)


def test_panels_and_a_global_row_over_many_blocks():
    """PANEL_KEYS + 76 tokens in blocks of 16, Local(5) | Global(first=1): the global row's keys span two panels
    (PANEL_KEYS keys each), the band rows meet the global column's partial block; softcap and ALiBi, float64 and float32."""
    pattern = sa.Local(5) | sa.Global(first=1)
    n = PANEL_KEYS + 76
    inputs = [make((1, 2, n, 16), seed) for seed in range(3)]
    mods = {"softcap": 4.0, "alibi_slopes": torch.tensor([0.25, 0.003], dtype=torch.float64)}
    layout = pattern.layout(n, heads=2, block_size=BLOCK)
    want = outputs(with_oracle(pattern.mask(n)), *inputs, mods)
    got = outputs(through("numba", layout), *inputs, mods)
    for name, x, y in zip(NAMES, got, want):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-9, msg=name)
    got, base = (outputs(through(backend, layout), *leaves(inputs, torch.float32), cast(mods, torch.float32))
                 for backend in ("numba", "reference"))
    assert_rule(got, base, want)


def bf16_floor(oracle_value):
    """FlashAttention's floor for half precision (as tests/test_numba_bf16.py): twice what rounding to bf16
    loses at the oracle's magnitude."""
    x = oracle_value.double()
    return 2 * ((x.bfloat16() + 0.3 - 0.3).double() - x).abs().max().item() if x.numel() else 0.0


@pytest.mark.parametrize("softcap, slopes", [(3.0, None), (None, "examples"), (3.0, "heads")], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_bfloat16_within_the_tolerance_rule(case, softcap, slopes):
    """bf16 q, k, v: bf16 matmuls where the CPU has native bf16 (``bf16.native()``), else computed in
    float32; against the oracle within 2x torch's bf16 error plus FlashAttention's half-precision floor.
    torch's bf16 error is the oracle's formulas run in bf16 (DESIGN's baseline: the same computation by torch
    in the kernel's dtype); the reference backend, which computes bf16 inputs in float32, gives lse's (numba's
    lse is float32). With the reference's as the baseline, dsinks (summed over every row of a head) failed on
    a CPU with native bf16: the bf16 matmuls round P to bf16 before P V, as torch's bf16 attention does."""
    c = case()
    inputs = [t.detach().bfloat16().double().requires_grad_() for t in case_inputs(c, dim=16)]   # bf16-exact
    mods = modifiers(softcap, slopes, True, c["shapes"][0], c["shapes"][1])
    layout = numba_layout(c)
    assert numba_backend.bf16_matmuls(inputs[0].bfloat16(), BLOCK) == numba_bf16.native()[0]
    got = outputs(through("numba", layout), *leaves(inputs, torch.bfloat16), cast(mods, torch.bfloat16))
    in_bf16 = outputs(lambda q, k, v, **m: oracle(q, k, v, c["mask"], SCALE, dtype=torch.bfloat16, **m),
                      *leaves(inputs, torch.bfloat16), cast(mods, torch.bfloat16))
    reference = outputs(through("reference", layout), *leaves(inputs, torch.bfloat16), cast(mods, torch.bfloat16))
    base = (in_bf16[0], reference[1], *in_bf16[2:])
    want = outputs(with_oracle(c["mask"]), *inputs, mods)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    floors = {name: bf16_floor(value) for name, value in zip(NAMES, want)}
    assert_rule(got, base, want, floors | {"lse": FLOORS[torch.float32], "dsinks": FLOORS[torch.float32]})


@pytest.mark.parametrize("softcap", [None, 3000.0], ids=["alibi", "softcap-3000-alibi"])
@pytest.mark.parametrize("pattern, n", [(sa.Dense(), 256), (sa.Local(100) | sa.Global(first=3), 1000)],
                         ids=["dense-256", "longformer-1000"])
def test_large_logits_within_the_rule(pattern, n, softcap):
    """float32 logits with std ~900 (the forward makes the scores near each row's max exact and the backward
    pins each row's maximum: with modifiers, those are the modified scores), ALiBi with slopes up to 2, and a
    softcap that still leaves logits of thousands."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 64, generator=gen, dtype=torch.float64) for _ in range(3))
    inputs = [(t * 900 ** 0.5 if i < 2 else t).requires_grad_() for i, t in enumerate((q, k, v))]
    mods = {"softcap": softcap, "alibi_slopes": torch.tensor([2.0, 0.01], dtype=torch.float64)}
    layout = pattern.layout(n, heads=2)
    want = outputs(lambda q, k, v, **m: oracle(q, k, v, pattern.mask(n), 1 / 8, **m), *inputs, mods)
    got, base = (outputs(lambda q, k, v, backend=backend, **m: sa.sparse_attention(q, k, v, layout, backend=backend,
                                                                                   return_lse=True, **m), *leaves(inputs, torch.float32),
                         cast(mods, torch.float32)) for backend in ("numba", "reference"))
    assert_rule(got, base, want)


def row_by_row(q, k, v, mask, scale, softcap=None, alibi_slopes=None):
    """Attention over exactly the allowed pairs, from the formulas, one row at a time (NaN and inf reach only
    what meets them, also in the gradients), with the reference backend's softmax: shifted by the row's max
    score, by 0 where that is infinite (a +inf score gives that pair's weight NaN, the others 0). (out, lse)
    differentiable; q (1, H, N, D), k, v (1, 1, N, D)."""
    n_q, n_k = q.shape[2], k.shape[2]
    outs, lses = [], []
    for h, i in itertools.product(range(q.shape[1]), range(n_q)):
        keys = mask[i].nonzero()[:, 0]
        if keys.numel() == 0:
            outs.append(q.new_zeros(q.shape[3]))
            lses.append(q.new_full((), float("-inf")))
            continue
        s = scale * (k[0, 0, keys] @ q[0, h, i])
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if alibi_slopes is not None:
            s = s - alibi_slopes[h] * (i + n_k - n_q - keys).abs().to(s.dtype)
        shift = s.max().detach()
        shift = torch.where(torch.isinf(shift), 0.0, shift)
        weights = torch.exp(s - shift)
        total = weights.sum()
        lses.append(shift + torch.log(total))
        outs.append((weights / total) @ v[0, 0, keys])
    return torch.stack(outs).reshape(q.shape), torch.stack(lses).reshape(q.shape[:3])


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["alibi", "softcap-alibi"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_non_finite_inputs_take_the_exact_path_with_the_modifiers(tensor, value, softcap):
    """A NaN or inf at token 60 of q, k or v (full and partial blocks, causal, the first 40 keys padded: empty
    rows): the rows and keys whose result is not finite are recomputed by the exact path, which applies the
    modifiers too (with softcap an inf score is capped: finite rows). NaN, inf and values as row by row."""
    n = 96
    padding = torch.zeros(1, n, dtype=torch.bool)
    padding[0, :40] = True
    pattern = sa.Local(40) | sa.Global(first=3)
    layout = pattern.layout(n, n, heads=2, block_size=BLOCK, causal=True, key_padding_mask=padding)
    mask = layout.to_dense()[0, 0]
    q, k, v = make((1, 2, n, 16), 0, grad=False), make((1, 1, n, 16), 1, grad=False), make((1, 1, n, 16), 2, grad=False)
    {"q": q, "k": k, "v": v}[tensor][0, 0, 60, 3] = value
    mods = {"softcap": softcap, "alibi_slopes": torch.tensor([0.3, 0.05], dtype=torch.float64)}
    got = outputs(through("numba", layout), *leaves((q, k, v), torch.float64), mods)
    want = outputs(lambda q, k, v, **m: row_by_row(q, k, v, mask, SCALE, **m), *leaves((q, k, v), torch.float64),
                   mods)
    assert not torch.isfinite(got[0]).all() or softcap                     # it reached something
    for name, x, y in zip(NAMES, got, want):
        assert torch.equal(x.isnan(), y.isnan()), f"{name}: NaN differs at {(x.isnan() ^ y.isnan()).nonzero()[:4]}"
        torch.testing.assert_close(x[~y.isnan()], y[~y.isnan()], atol=1e-10, rtol=1e-9, msg=name)


def op_args(dtype, softcap, slopes):
    c = CASES[0]()
    q, k, v = leaves(case_inputs(c), dtype)
    layout = numba_layout(c)
    return (q, k, v, list(layout.index), layout.block_size, SCALE, softcap, slopes)


@pytest.mark.parametrize("softcap, slopes", [(0.0, None), (3.0, torch.tensor([[0.5, 0.25, 0.125, 0.0625]])),
                                             (0.0, torch.tensor([[0.5, 0.25, 0.125, 0.0625]] * 2))], ids=str)
def test_the_custom_ops_take_softcap_and_slopes(softcap, slopes):
    """sparse_attn::numba_attention and its backward with softcap: float and alibi_slopes: Tensor | None
    (opcheck: schema, fakes, autograd registration), and gradcheck in float64 through them."""
    args = op_args(torch.float32, softcap, slopes)
    torch.library.opcheck(numba_backend.numba_attention, args)
    q, k, v, *rest = op_args(torch.float64, softcap, None if slopes is None else slopes.double())
    out, lse, stats, argmax = (t.detach() for t in numba_backend.numba_attention(q, k, v, *rest))
    torch.library.opcheck(numba_backend.numba_attention_backward,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, stats, argmax,
                           torch.randn_like(lse), *rest))
    small = [t[:1, :2, :20].detach().requires_grad_() for t in (q, k, v)]
    layout = sa.Local(3).layout(20, heads=2, block_size=8)
    mods = ScoreMods(softcap, None if slopes is None else slopes[:1, :2].double().contiguous())
    assert torch.autograd.gradcheck(lambda q, k, v: numba_backend.attention(q, k, v, layout, SCALE, mods), small)


def test_every_modifier_combination_runs_the_same_kernels():
    """Without modifiers the kernels' Config holds a softcap of 0 and empty slopes; with them, a float64 softcap and
    (B or 1, Hq) slopes: the same types, so one compiled forward and backward per dtype serve every combination (a
    specialisation each cost a cold compile)."""
    none = call_modifiers(0.0, None, torch.float32, 4, 4)
    cap = call_modifiers(2.0, None, torch.float32, 4, 6)
    alibi = call_modifiers(0.0, torch.ones(1, 2, dtype=torch.float64), torch.float32, 4, 6)
    assert (none.softcap, none.slopes.shape, none.shift) == (0.0, (1, 0), 0)
    assert (cap.softcap, cap.slopes.shape, cap.shift) == (2.0, (1, 0), 2)
    assert alibi.softcap == 0.0 and alibi.slopes.dtype == "float32" and alibi.slopes.shape == (1, 2)
    assert len({tuple(numba.typeof(field) for field in mods) for mods in (none, cap, alibi)}) == 1


@pytest.mark.parametrize("dtype, softcap", [(torch.float32, 1e-45), (torch.float32, 1e-38), (torch.float32, 1e34),
                                            (torch.float32, 1e300), (torch.float64, 5e-324), (torch.float64, 1e-310),
                                            (torch.float64, 1.7e308)], ids=str)
def test_extreme_softcaps_give_the_oracles_scores_not_nan(dtype, softcap):
    """ln 2 / c or c log2(e) overflowed the dtype (NaN out of 0 * inf): tiny caps make every score about 0, huge
    ones leave the scores as they are. A query of zeros has scores of exactly 0 (the softcap's derivative 1).
    The gradients' oracle clips the cap to [1e-300, 1e300]: torch's autograd multiplies by c and divides by it
    again, which keeps a few bits of a subnormal c and overflows at 1.7e308 (NaN); the derivative is the same
    to double precision."""
    c = CASES[0]()
    q, k, v = case_inputs(c)
    with torch.no_grad():
        q[0, 0, 3] = 0.0
    got = outputs(through("numba", numba_layout(c)), *leaves((q, k, v), dtype), {"softcap": softcap})
    want = outputs(with_oracle(c["mask"]), q, k, v, {"softcap": softcap})[:2] + \
        outputs(with_oracle(c["mask"]), q, k, v, {"softcap": min(max(softcap, 1e-300), 1e300)})[2:]
    tolerance = 1e-5 if dtype == torch.float32 else 1e-10
    for name, x, y in zip(NAMES, got, want):
        torch.testing.assert_close(x.double(), y, atol=tolerance, rtol=tolerance, msg=name)
