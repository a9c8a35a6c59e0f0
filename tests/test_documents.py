"""documents=: packed documents attend as sequences by themselves, in the layout and in every backend."""
import importlib.util

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparse_attn as sa
from sparse_attn import packing
from sparse_attn.documents import document_spans, document_values
from sparse_attn.rules import resolve
from tests.helpers import dense_baseline, run_backend
from tests.strategies import check_blocks_exact, document_mask, patterns
from tests.tolerance import assert_within_rule


def check_documents_layout(pattern, ids, heads=1, block_size=8, **call):
    layout = pattern.layout(ids.shape[1], heads=heads, block_size=block_size, documents=ids, **call)
    expected = document_mask(pattern, ids, heads, **call)
    dense = layout.to_dense()
    assert torch.equal(dense.expand_as(expected), expected)
    check_blocks_exact(layout, expected.expand(layout.batch, heads, *expected.shape[2:]))
    return layout


def ids_from(lengths, n=None):
    return sa.documents_from_lengths(lengths, n).numpy()


# --- layout semantics ---------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", [sa.Local(3) | sa.Global(first=1), sa.Local(2, 0) | sa.Sink(first=2),
                                     sa.Global(last=2) & sa.Local(5), sa.Stride(3), sa.Causal(), sa.Dense(),
                                     sa.Random(1, seed=3, block_size=4) | sa.Local(1)])
@pytest.mark.parametrize("lengths,n", [
    ([[1, 1, 1, 5, 1, 9, 3]], None),               # documents of length 1, crossing block boundaries
    ([[40, 7], [3, 3, 3, 3, 30]], 50),             # longer than the window; padding after the last
    ([[8, 8, 8], [16, 8]], 27),                    # aligned to the blocks, n not a multiple of the block
    ([[0], [13]], 13),                             # an all-padding example
])
def test_layout_is_each_document_alone_on_the_diagonal(pattern, lengths, n):
    check_documents_layout(pattern, ids_from(lengths, n), heads=2)


def test_padding_between_documents_and_unsorted_ids():
    ids = np.array([[5, 5, -1, -1, 2, 2, 2, -1, 9], [-1, 0, 0, 0, 0, 0, 0, 7, 7]])
    for block_size in (1, 2, 4, 64):
        check_documents_layout(sa.Local(1) | sa.Global(first=1), ids, block_size=block_size)


def test_global_first_is_each_documents_first_token():
    ids = ids_from([[3, 4]])
    dense = sa.Global(first=1).layout(7, documents=ids).to_dense()[0, 0]
    assert dense[:, 0].tolist() == [True] * 3 + [False] * 4 and dense[:, 3].tolist() == [False] * 3 + [True] * 4
    assert dense[0].tolist() == [True] * 3 + [False] * 4


def test_documents_with_causal_padding_and_global_mask():
    gen = torch.Generator().manual_seed(0)
    ids = ids_from([[5, 12, 1, 9], [30]], n=31)
    global_mask = torch.rand(2, 31, generator=gen) < 0.15
    key_padding_mask = torch.rand(2, 31, generator=gen) < 0.15
    for pattern in (sa.Local(2) | sa.Global(first=1), sa.Random(1, block_size=4), sa.Causal()):
        check_documents_layout(pattern, ids, heads=2, causal=True, global_mask=global_mask,
                               key_padding_mask=key_padding_mask)
        check_documents_layout(pattern, ids, global_mask=global_mask)


def test_random_draws_in_each_document_as_in_a_sequence_alone():
    """A document draws what the same tokens draw alone (training, evaluation and decoding of that document see
    one set of keys), whatever its id or place: documents of one length draw alike, and are classified once."""
    pattern = sa.Random(1, seed=5, block_size=4) | sa.Local(1)
    ids = ids_from([[16] * 6 + [13, 16]])
    dense = pattern.layout(125, block_size=16, documents=ids).to_dense()[0, 0]
    alone = pattern.mask(16)[0]
    assert alone.sum() > sa.Local(1).mask(16)[0].sum()                   # the document draws random tiles
    for start in (0, 16, 32, 48, 64, 80, 109):
        assert torch.equal(dense[start:start + 16, start:start + 16], alone), start
    assert torch.equal(dense[96:109, 96:109], pattern.mask(13)[0])
    relabelled = np.where(ids == 2, 70, ids)
    assert torch.equal(pattern.layout(125, block_size=16, documents=relabelled).to_dense()[0, 0], dense)


def test_random_in_many_documents_is_classified_once_per_length_and_offset(monkeypatch):
    """256 documents of 16 tokens in blocks of 64: one class per offset (0, 16, 32, 48) and head, resolved once,
    not one per document (milliseconds each: 4,096 documents took seconds)."""
    resolved = []
    monkeypatch.setattr(packing, "resolve", lambda spec, ctx: resolved.append(ctx) or resolve(spec, ctx))
    packing.DOCUMENT_CLASSES.clear()                                   # nothing classified by an earlier test
    check_documents_layout(sa.Random(1, seed=23, block_size=4) | sa.Local(1), ids_from([[16] * 256]), heads=2,
                           block_size=64)
    assert len(resolved) == 2 * 4 and {ctx.n_q for ctx in resolved} == {16}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=patterns, lengths=st.lists(st.lists(st.integers(0, 25), min_size=1, max_size=6), min_size=1,
                                          max_size=2),
       extra=st.integers(0, 9), padded=st.sets(st.integers(0, 5)), block_size=st.sampled_from([1, 3, 4, 8, 16, 64]),
       causal=st.booleans(), mask_seed=st.one_of(st.none(), st.integers(0, 2**16)))
def test_layout_matches_definition_for_random_patterns_and_splits(pattern, lengths, extra, padded, block_size,
                                                                  causal, mask_seed):
    """Random documents (some of them turned into padding), random call-time masks."""
    n = max(sum(example) for example in lengths) + extra
    if n == 0:
        return
    ids = ids_from(lengths, n)
    ids[np.isin(ids, list(padded))] = -1
    call = {"causal": causal}
    if mask_seed is not None:
        rng = np.random.default_rng(mask_seed)
        call.update(global_mask=rng.random(ids.shape) < 0.1, key_padding_mask=rng.random(ids.shape) < 0.2)
    check_documents_layout(pattern, ids, heads=2, block_size=block_size, **call)


def test_layout_cache_keys_documents_by_value():
    pattern = sa.Local(2) | sa.Global(first=1)
    ids = ids_from([[5, 7, 4]])
    first = pattern.layout(16, block_size=4, documents=ids)
    assert pattern.layout(16, block_size=4, documents=torch.from_numpy(ids.copy())) is first
    assert pattern.layout(16, block_size=4, documents=ids_from([[5, 7, 3]], 16)) is not first
    assert pattern.layout(16, block_size=4) is not first


# --- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("call,error,message", [
    (lambda: sa.Local(1).layout(4, documents=np.array([[0, 1, 0, 0]])), ValueError,
     "document 0 of example 0 reappears at position 2 after another id"),
    (lambda: sa.Local(1).layout(4, documents=np.array([[0, 0, 0, 0], [1, -1, 1, 1]])), ValueError,
     "document 1 of example 1 reappears at position 2"),
    (lambda: sa.Local(1).layout(4, documents=np.zeros((1, 5), dtype=np.int64)), ValueError,
     r"documents must have shape \(batch, 4\)"),
    (lambda: sa.Local(1).layout(4, documents=np.zeros(4, dtype=np.int64)), ValueError, "documents must have shape"),
    (lambda: sa.Local(1).layout(4, documents=np.zeros((1, 4))), TypeError, "documents must be an integer"),
    (lambda: sa.Local(1).layout(4, documents=torch.zeros(1, 4, dtype=torch.bool)), TypeError,
     "documents must be an integer"),
    (lambda: sa.Local(1).layout(4, documents=[[0, 0, 0, 0]]), TypeError, "documents must be an integer"),
    (lambda: sa.Local(1).layout(4, documents=np.array([[0, 0, -2, 1]])), ValueError,
     "documents must hold ids >= 0, or -1 for padding; example 0 has -2 at position 2"),
    (lambda: sa.Local(1).layout(4, 3, documents=np.zeros((1, 4), dtype=np.int64)), ValueError,
     "documents needs n_q == n_k"),
    (lambda: sa.Local(1).layout(4, documents=np.zeros((2, 4), dtype=np.int64),
                                key_padding_mask=np.zeros((1, 4), dtype=bool)), ValueError,
     r"documents must have shape \(1, 4\)"),
    (lambda: sa.Local(1).layout(4, documents=torch.zeros(1, 4, dtype=torch.long, device="meta")), ValueError,
     "documents is a meta tensor"),
    (lambda: sa.sparse_attention(*[torch.randn(1, 1, 8, 4)] * 3, sa.Local(1).layout(8),
                                 documents=np.zeros((1, 8), dtype=np.int64)), ValueError,
     "and so are documents: build it with pattern.layout"),
    (lambda: sa.sparse_attention(*[torch.randn(2, 1, 8, 4)] * 3, sa.Local(1), documents=np.zeros((1, 8), int)),
     ValueError, r"documents must have shape \(2, 8\)"),
    (lambda: sa.Blocks(np.eye(2, dtype=bool), 4).layout(12, block_size=4, documents=np.array([[0] * 8 + [1] * 4])),
     ValueError, "the pattern is resolved for each document by itself, and a document of 4 tokens fails: Blocks grid"),
    (lambda: sa.documents_from_lengths([[3, 4]], n=5), ValueError, "n=5 is shorter than the longest example"),
    (lambda: sa.documents_from_lengths([3, 4]), TypeError, r"lengths\[0\] must be a list of document lengths"),
    (lambda: sa.documents_from_lengths([[3, -1]]), ValueError, r"lengths\[0\]\[1\] must be >= 0"),
    (lambda: sa.documents_from_lengths([[0]]), ValueError, "the documents hold no token"),
    (lambda: sa.documents_from_cu_seqlens([0, 3, 2]), ValueError, "cu_seqlens must start at 0 and never decrease"),
    (lambda: sa.documents_from_cu_seqlens([[0, 3]]), ValueError, "cu_seqlens must be a 1-D"),
])
def test_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_meta_inputs_check_documents_without_values():
    q = torch.randn(2, 1, 8, 4, device="meta")
    meta_ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    assert sa.sparse_attention(q, q, q, sa.Local(1), documents=meta_ids).shape == (2, 1, 8, 4)
    with pytest.raises(ValueError, match=r"documents must have shape \(2, 8\)"):
        sa.sparse_attention(q, q, q, sa.Local(1), documents=meta_ids[:1])


def test_helpers():
    assert sa.documents_from_lengths([[2, 1], [3]]).tolist() == [[0, 0, 1], [0, 0, 0]]
    assert sa.documents_from_lengths([np.array([2]), torch.tensor([1])], n=3).tolist() == [[0, 0, -1], [0, -1, -1]]
    assert sa.documents_from_cu_seqlens(torch.tensor([0, 1, 1, 4])).tolist() == [[0, 2, 2, 2]]
    ids = document_values(torch.tensor([[3, 3, -1, 0]], dtype=torch.int32))
    assert ids.dtype == np.int64 and document_spans(ids).start.tolist() == [0, 3]


# --- backends -----------------------------------------------------------------------------------
BACKENDS = ["numba", pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason='needs triton (its interpreter without a GPU): pip install ".[triton]"'))]
PACKED = {  # name: (document lengths per example, n, pattern, call-time data)
    "awkward": ([[1, 17, 1, 6, 14], [0], [16, 16, 3]], 41, sa.Local(4) | sa.Global(first=1), {}),
    "causal-padding-globals": ([[9, 20, 1, 11], [40]], 41, sa.Local(6) | sa.Sink(first=1),
                               {"causal": True, "key_padding_mask": 0.15, "global_mask": 0.1}),
    "random-per-document": ([[30, 3, 8], [12, 29]], 41, sa.Random(1, seed=2, block_size=8) | sa.Local(2), {}),
}


def packed_case(name, heads=2, kv_heads=1, dim=16, dtype=torch.float64):
    lengths, n, pattern, call = PACKED[name]
    gen = torch.Generator().manual_seed(0)
    batch = len(lengths)
    call = {key: torch.rand(batch, n, generator=gen) < value if key.endswith("mask") else value
            for key, value in call.items()}
    q = torch.randn(batch, heads, n, dim, generator=gen, dtype=torch.float64)          # (B, H, N, D)
    k, v = (torch.randn(batch, kv_heads, n, dim, generator=gen, dtype=torch.float64) for _ in "kv")
    ids = sa.documents_from_lengths(lengths, n)
    layout = pattern.layout(n, heads=heads, block_size=16, documents=ids, **call)
    return [t.to(dtype) for t in (q, k, v)], ids, pattern, call, layout


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(PACKED))
def test_backend_matches_float64_reference(backend, name):
    (q, k, v), ids, _, _, layout = packed_case(name, dtype=torch.float32)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = run_backend(backend, q, k, v, layout, grad_out)
    oracle = run_backend("reference", q.double(), k.double(), v.double(), layout, grad_out)
    baseline = dense_baseline(q, k, v, layout, grad_out)
    for what, got, ref, base in zip(("out", "lse", "dq", "dk", "dv"), results, oracle, baseline):
        if what == "lse":
            assert torch.equal(torch.isinf(got), torch.isinf(ref)), "lse: -inf rows differ"
            finite = torch.isfinite(ref)
            got, ref, base = got[finite], ref[finite], base[finite]
        assert_within_rule(what, got, ref, base)
    padding = torch.as_tensor(ids == -1)                                          # (B, N)
    out, lse, dq, dk, dv = results
    assert (out[padding[:, None].expand_as(out[..., 0])] == 0).all()
    assert torch.isneginf(lse.masked_select(padding[:, None])).all()
    assert (dq.permute(0, 2, 1, 3)[padding] == 0).all() and (dk.permute(0, 2, 1, 3)[padding] == 0).all()
    assert (dv.permute(0, 2, 1, 3)[padding] == 0).all()


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_each_document_gives_what_it_gives_alone(backend):
    """A packed batch through sparse_attention(documents=...) == every document run by itself (Random included),
    outputs and gradients; padding rows output 0."""
    lengths, n = [[1, 37, 9, 70], [64, 17, 30]], 120
    pattern = sa.Local(5) | sa.Global(first=1) | sa.Random(1, seed=4, block_size=8)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 16, generator=gen, dtype=torch.float64).requires_grad_() for _ in "qkv")
    ids = sa.documents_from_lengths(lengths, n)
    out = sa.sparse_attention(q, k, v, pattern, documents=ids, backend=backend)
    out.square().sum().backward()
    spans = document_spans(ids.numpy())
    for b, s, length, _ in zip(*spans):
        e = s + length
        parts = [t[b:b + 1, :, s:e].detach().clone().requires_grad_() for t in (q, k, v)]
        alone = sa.sparse_attention(*parts, pattern, backend=backend)
        alone.square().sum().backward()
        torch.testing.assert_close(out[b:b + 1, :, s:e], alone, rtol=1e-9, atol=1e-9)
        for packed, part in zip((q, k, v), parts):
            torch.testing.assert_close(packed.grad[b:b + 1, :, s:e], part.grad, rtol=1e-9, atol=1e-9)
    assert (out[1, :, 111:] == 0).all() and (q.grad[1, :, 111:] == 0).all() and (k.grad[1, :, 111:] == 0).all()


def test_weights_and_layer_take_documents():
    ids = sa.documents_from_lengths([[5, 9], [14]], 15)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 2, 15, 8, generator=gen) for _ in "qk")
    weights = sa.attention_weights(q, k, sa.Local(2) | sa.Global(first=1), documents=ids)
    expected = document_mask(sa.Local(2) | sa.Global(first=1), ids.numpy())
    for b in range(2):
        assert torch.equal(torch.from_numpy(weights[b][1].toarray() != 0), expected[b, 0])
    layer = sa.nn.SparseSelfAttention(16, 2, sa.Local(2), global_projections=True, backend="reference").double()
    x = torch.randn(2, 15, 16, generator=gen, dtype=torch.float64)
    global_mask = torch.zeros(2, 15, dtype=torch.bool)
    global_mask[0, [0, 5]] = global_mask[1, 3] = True
    packed = layer(x, global_mask=global_mask, documents=ids)
    for b, s, length, _ in zip(*document_spans(ids.numpy())):
        alone = layer(x[b:b + 1, s:s + length], global_mask=global_mask[b:b + 1, s:s + length])
        torch.testing.assert_close(packed[b:b + 1, s:s + length], alone)
    torch.testing.assert_close(packed[0, 14], layer.out_proj.bias)               # padding: the output bias
