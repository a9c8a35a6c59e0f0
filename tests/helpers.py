"""What several test files share, written once: devices, inputs, runs of a backend and their comparison, the
Numba backend's cases, the markdown code blocks the docs tests run, tiny Hugging Face models.

>>> q, k, v = make_qkv(1, 4, 2, 9, 9, 8, dtype=torch.float64)
>>> out, lse, dq, dk, dv = run_backend("reference", q, k, v, sa.Local(2).layout(9, heads=4), torch.ones(q.shape))
>>> out.shape, lse.shape, dk.shape
(torch.Size([1, 4, 9, 8]), torch.Size([1, 4, 9]), torch.Size([1, 2, 9, 8]))
"""
from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import torch

import sparse_attn as sa
from sparse_attn import backends
from sparse_attn.api import sparse_attention
from tests.tolerance import FLOORS, assert_within_rule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # the device Triton's tests run on (CPU: its interpreter)
ON_CUDA = DEVICE == "cuda"
OUTPUTS = ("out", "lse", "dq", "dk", "dv")


# --- inputs, runs and the tolerance rule over all five outputs -----------------------------------
def release(version: str) -> str:
    """A version without its local label: the installed metadata may say 2.11.0 where torch.__version__ says
    2.11.0+cu130 (as on a GPU image)."""
    return version.split("+")[0]


def make_qkv(batch, q_heads, kv_heads, n_q, n_k, head_dim, dtype=torch.float32, seed=0, kv_batch=None, device=DEVICE):
    """q (B, Hq, Nq, D), k, v (kv_batch or B, Hkv, Nk, D) on ``device``, drawn in float64 then cast to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    kv_batch = batch if kv_batch is None else kv_batch
    q = torch.randn(batch, q_heads, n_q, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(kv_batch, kv_heads, n_k, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(kv_batch, kv_heads, n_k, head_dim, generator=gen, dtype=torch.float64)
    return [t.to(device, dtype) for t in (q, k, v)]


def run_backend(backend, q, k, v, layout, grad_out, grad_lse=None, **call):
    """out, lse, dq, dk, dv of one backend on copies of q, k, v: the gradients of (out * grad_out).sum(), plus
    (lse * grad_lse).sum() over the finite lse when ``grad_lse`` is given; ``call``: more sparse_attention
    arguments. backend="triton" runs on DEVICE (the GPU, else Triton's interpreter on the CPU): tensors go there
    and the five results come back to q's device."""
    home = q.device
    if backend == "triton":
        q, k, v, grad_out, grad_lse, layout = (_to(x, DEVICE) for x in (q, k, v, grad_out, grad_lse, layout))
        call = {name: _to(value, DEVICE) for name, value in call.items()}
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = sparse_attention(q, k, v, layout, backend=backend, return_lse=True, **call)
    loss = (out.double() * grad_out).sum()
    if grad_lse is not None:
        loss = loss + (torch.where(torch.isinf(lse), 0, lse).double() * grad_lse).sum()
    loss.backward()
    return tuple(t.to(home) for t in (out, lse, q.grad, k.grad, v.grad))


def _to(x, device):
    """A tensor or BlockLayout on ``device``; anything else as it is."""
    return x.to(device) if isinstance(x, (torch.Tensor, sa.BlockLayout)) else x


def dense_baseline(q, k, v, layout, grad_out):
    """The same attention as plain dense torch in q's dtype (the tolerance rule's baseline): out, lse, dq, dk, dv."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    mask = layout.to_dense().to(q.device)                                        # (Bl, H, Nq, Nk)
    scores = (q @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    masked = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(masked, -1).nan_to_num(0.0)
    out = weights @ vv
    (out.double() * grad_out).sum().backward()
    return out, masked.detach().logsumexp(-1), q.grad, k.grad, v.grad


def assert_matches_oracle(got, oracle, baseline):
    """(out, lse, dq, dk, dv) of the kernel within the tolerance rule of the float64 reference's (``oracle``),
    ``baseline`` being torch's in the kernel's dtype; every element is finite where the reference's is.
    Rows with no allowed key have out and dq exactly 0 and lse -inf; keys no row reads, dk and dv exactly 0."""
    out, lse, *grads = got
    ref_out, ref_lse, *ref_grads = oracle
    base_out, base_lse, *base_grads = baseline
    floor = FLOORS[out.dtype]
    assert lse.dtype == torch.float32
    assert_within_rule("out", out, ref_out, base_out, floor)
    for name, grad, ref, base in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
        assert grad.dtype == out.dtype and grad.shape == ref.shape
        assert_within_rule(name, grad, ref, base, floor)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse: -inf rows differ"
    finite = torch.isfinite(ref_lse)
    assert_within_rule("lse", lse[finite], ref_lse[finite], base_lse[finite], floor)
    dq, dk, dv = grads
    assert (out[~finite] == 0).all() and (dq[~finite] == 0).all(), "rows with no key: out or dq is not 0"
    unread = (ref_grads[2] == 0).all(-1)                         # (Bkv, Hkv, Nk): keys no row attends
    assert (dk[unread] == 0).all() and (dv[unread] == 0).all(), "keys no row reads: dk or dv is not 0"


# --- the Numba backend's cases (tests/test_numba_backend.py, tests/test_numba_bf16.py) ----------
# (id, pattern, batch, q heads, kv heads, n_q, n_k, head dim, block size, causal, padded keys, globals)
NUMBA_CASES = [
    ("longformer-ragged", sa.Local(20) | sa.Global(first=3), 1, 2, 2, 300, 300, 32, 32, False, 0, 0),
    ("global-row-spans-panels", sa.Local(5) | sa.Global(first=1), 1, 1, 1, 1100, 1100, 16, 16, False, 0, 0),
    ("n1", sa.Local(4), 1, 2, 1, 1, 1, 16, 16, False, 0, 0),
    ("nq-ne-nk-causal", sa.Local(40) | sa.Sink(first=2), 2, 2, 2, 70, 200, 16, 16, True, 0, 0),
    ("gqa", sa.Local(24) | sa.Global(first=2), 1, 4, 2, 150, 150, 32, 32, True, 0, 0),
    ("mqa-block64", sa.Local(70), 1, 3, 1, 200, 200, 64, 64, False, 0, 0),
    ("per-head-random", sa.PerHead([sa.Local(8), sa.Stride(5), sa.Dense(), sa.Random(2, seed=3) | sa.Local(4)]),
     1, 4, 2, 130, 130, 16, 16, False, 0, 0),
    ("bigbird-scattered", sa.Global(first=3) | sa.Local(6) | sa.Random(3, seed=1), 1, 2, 1, 300, 300, 16, 16, False,
     0, 0),                                                      # scattered blocks: runs of one block
    ("padding-and-globals", sa.Local(10), 2, 2, 1, 180, 180, 32, 32, False, 30, 4),
    ("empty-rows", sa.Local(3), 2, 2, 2, 96, 96, 16, 16, True, 40, 0),
]
NUMBA_IDS = [case[0] for case in NUMBA_CASES]


def case_inputs(case, dtype, seed=0):
    """Leaf q, k, v (drawn in float64, cast to ``dtype``) and the layout of a NUMBA_CASES entry."""
    _, pattern, batch, hq, hkv, n_q, n_k, dim, bs, causal, padded, n_global = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, n_q, dim, generator=gen, dtype=torch.float64)    # (B, Hq, Nq, D)
    k = torch.randn(batch, hkv, n_k, dim, generator=gen, dtype=torch.float64)   # (B, Hkv, Nk, D)
    v = torch.randn(batch, hkv, n_k, dim, generator=gen, dtype=torch.float64)
    key_padding_mask = global_mask = None
    if padded:   # example b pads its first `padded` keys (every row before them may be left empty)
        key_padding_mask = torch.zeros(batch, n_k, dtype=torch.bool)
        for b in range(batch):
            key_padding_mask[b, :padded * (b + 1) // batch] = True
    if n_global:  # example b makes tokens b*7 + (0, 13, 26, ...) global
        global_mask = torch.zeros(batch, n_q, dtype=torch.bool)
        for b in range(batch):
            global_mask[b, b * 7::13][:n_global] = True
    layout = pattern.layout(n_q, n_k, heads=hq, block_size=bs, causal=causal, key_padding_mask=key_padding_mask,
                            global_mask=global_mask)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)], layout


def run_case(backend, q, k, v, layout, seed=1, scale=None):
    """out, lse and (dq, dk, dv) of a loss that also flows through the (finite) lse; backend: a
    name, or a function (q, k, v, layout, scale) -> (out, lse)."""
    if callable(backend):
        out, lse = backend(q, k, v, layout, scale)
    else:
        out, lse = sparse_attention(q, k, v, layout, scale=scale, backend=backend, return_lse=True)
    gen = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    w_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64).to(lse.dtype)
    finite_lse = torch.where(torch.isinf(lse), 0.0, lse)
    loss = (out * w_out).sum() + (finite_lse * w_lse).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    return out.detach(), lse.detach(), grads


# --- non-finite and overflowing inputs, compared row by row (issue 11, findings 1 and 2) -----------
def reference_row_by_row(q, k, v, layout, scale=None):
    """The reference backend run on each query row alone, over exactly its allowed keys, stacked:
    attention over the allowed pairs only, for every value, NaN and inf included. (The reference
    backend itself multiplies a chunk's masked pairs by 0 in dense matmuls, so there a NaN also
    reaches rows and keys that never meet it, empty rows included.)"""
    batch, heads, n_q, dim = q.shape
    group = heads // k.shape[1]
    mask = layout.to_dense()                                                    # (B, Hq, Nq, Nk)
    outs, lses = [], []
    for b, h, i in itertools.product(range(batch), range(heads), range(n_q)):
        keys = mask[b, h, i].nonzero().squeeze(1)
        if keys.numel() == 0:
            outs.append(q.new_zeros(dim))
            lses.append(q.new_full((), float("-inf")))
            continue
        out, lse = sparse_attention(q[b, h, i][None, None, None], k[b, h // group, keys][None, None],
                                    v[b, h // group, keys][None, None], sa.Dense(), scale=scale, backend="reference",
                                    return_lse=True)
        outs.append(out.reshape(dim))
        lses.append(lse.reshape(()))
    return torch.stack(outs).reshape(q.shape), torch.stack(lses).reshape(q.shape[:3])


def nonfinite_case(dtype, seed=0):
    """96 tokens in blocks of 16, Local(40) | Global(first=3), causal, the first 40 keys padded:
    rows 0-39 are empty; full and partial blocks; 2 query heads share 1 kv head."""
    n = 96
    padding = torch.zeros(1, n, dtype=torch.bool)
    padding[0, :40] = True
    layout = (sa.Local(40) | sa.Global(first=3)).layout(n, n, heads=2, block_size=16, causal=True,
                                                        key_padding_mask=padding)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, n, 16, generator=gen, dtype=torch.float64).to(dtype)  # (B, Hq, N, D)
    k, v = (torch.randn(1, 1, n, 16, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v, layout


def flat_run(backend, q, k, v, layout, scale=None):
    """(out, lse, dq, dk, dv) of run_case, from leaves q, k, v."""
    out, lse, grads = run_case(backend, *(t.requires_grad_() for t in (q, k, v)), layout, scale=scale)
    return out, lse, *grads


def assert_agrees_row_by_row(q, k, v, layout, scale=None):
    """NaN and inf exactly where the reference, row by row in the inputs' dtype, has them (values,
    lse, dq, dk, dv), the finite rest within the DESIGN tolerance rule against float64."""
    got = flat_run("numba", *(t.clone() for t in (q, k, v)), layout, scale)
    want = flat_run(reference_row_by_row, *(t.clone() for t in (q, k, v)), layout, scale)
    oracle = flat_run(reference_row_by_row, *(t.double() for t in (q, k, v)), layout, scale)
    for name, x, y, z in zip(OUTPUTS, got, want, oracle):
        assert torch.equal(torch.isnan(x), torch.isnan(y)), f"{name}: NaN at {(x.isnan() ^ y.isnan()).nonzero()}"
        assert torch.equal(torch.where(torch.isinf(x), x, 0), torch.where(torch.isinf(y), y, 0)), f"{name}: inf"
        finite = torch.isfinite(y)
        if not finite.any():
            continue
        if x.dtype == torch.float64:
            torch.testing.assert_close(x[finite], y[finite], rtol=1e-9, atol=1e-10, msg=name)
        else:
            assert_within_rule(name, x[finite], z[finite], y[finite])
    return got


# --- the ```python blocks of markdown files (tests/test_docs.py runs them) -----------------------
ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent> *)```(?P<language>[\w+-]*)\s*$")
SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<reason>.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int              # line of the opening fence, 1-based
    source: str
    skip: str | None       # the reason from a <!-- skip: ... --> marker

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a markdown file, dedented by their fence's indentation."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, opened, previous = [], None, ""       # opened: (fence line, indent, language, skip reason)
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if fence and opened is None:
            marker = SKIP.match(previous)
            opened = (number, fence["indent"], fence["language"], marker["reason"] if marker else None)
        elif fence and not fence["language"]:
            start, indent, language, skip = opened
            if language == "python":
                body = [text.removeprefix(indent) for text in lines[start:number - 1]]
                blocks.append(Block(path, start, "\n".join(body) + "\n", skip))
            opened = None
        if line.strip():
            previous = line
    return blocks


# --- tiny Hugging Face models (transformers imported on use: tests/test_hf_*.py skip without it) -----
CPU_BACKEND = "numba" if backends.availability("numba")[0] else "reference"
VOCAB = 100


def tiny_config(kind: str, **kwargs):
    """A two-layer, 32-wide config of ``kind`` ("bert", "roberta" or "llama": GQA, 4 query and 2 kv heads)."""
    from transformers import BertConfig, LlamaConfig, RobertaConfig

    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
                  max_position_embeddings=128, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    common |= kwargs
    if kind == "bert":
        return BertConfig(**common)
    if kind == "roberta":
        return RobertaConfig(**common, pad_token_id=1)
    common = {k: v for k, v in common.items() if "dropout" not in k}
    return LlamaConfig(**common, num_key_value_heads=2, pad_token_id=0)  # GQA: 4 query, 2 kv heads


def twins(config, implementation: str, model_class=None, reference: str = "eager"):
    """The same random weights under ``reference`` attention and under ``implementation``; ``model_class``:
    transformers' AutoModel unless given."""
    if model_class is None:
        from transformers import AutoModel as model_class
    torch.manual_seed(0)
    theirs = model_class.from_config(config, attn_implementation=reference).eval()
    ours = model_class.from_config(copy.deepcopy(theirs.config), attn_implementation=implementation).eval()
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours
