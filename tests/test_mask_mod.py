"""Pattern.mask_mod (the pattern's own FlexAttention predicate) and BlockLayout.to_block_mask.

create_mask(p.mask_mod(...)) equals p.mask(...) / the layout's token mask for random trees of every kind
(hypothesis), with call-time data and packed documents; the predicate runs under create_block_mask (eager
and compiled), torch.compile and vmap; the exported BlockMask holds exactly the layout's block lists and
FlexAttention on it (eager float64, compiled float32) equals the reference backend; bad arguments raise
what layout() raises.
"""
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparse_attn as sa
from sparse_attn.layout import BlockLayout, KernelIndex
from tests.strategies import block_grids, leaves, pattern_trees

flex = pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile",
                                        "ignore:.*_compile flag.*:DeprecationWarning")

# leaves test_layout's trees lack: long token lists (a lookup, not constants), periods past the sequence
more_leaves = st.one_of(
    leaves,
    st.builds(sa.Global, st.lists(st.integers(0, 60), min_size=9, max_size=20), st.integers(0, 3),
              st.integers(0, 3)),
    st.builds(sa.Sink, st.lists(st.integers(0, 60), min_size=9, max_size=12), st.integers(0, 2),
              st.sampled_from([3, 50, 10**20]), st.sampled_from([1, 2])),
    st.builds(sa.Local, st.sampled_from([0, 2, 10**30]), st.sampled_from([1, 10**30]), st.sampled_from([1, 4, 2**70])),
    st.builds(sa.Stride, st.sampled_from([1, 3, 10**20]), st.sampled_from([0, -1, 10**19])),
)
randoms = st.builds(sa.Random, st.integers(1, 3), st.integers(0, 9), st.sampled_from([1, 4, 7, 16, 2**70]))


def trees(n_q, n_k, heads, grids=True):
    """Random trees of every kind (Blocks grids fit (n_q, n_k); none with ``grids=False``), PerHead members
    among them, and often a Random beside other members of a union (it draws among the tiles they leave)."""
    leaf = st.one_of(more_leaves, randoms, *([block_grids(n_q, n_k, heads)] * 2 if grids else []))
    per_head = st.lists(pattern_trees(leaf), min_size=heads, max_size=heads).map(sa.PerHead)
    tree = pattern_trees(st.one_of(leaf, per_head))
    return st.one_of(tree, st.builds(lambda a, r: a | r, tree, randoms))


def flex_mask(mask_mod, batch, heads, n_q, n_k):
    """(batch, heads, n_q, n_k) bool: FlexAttention's create_mask (vmap over b, h, q_idx, kv_idx)."""
    return flex.create_mask(mask_mod, batch, heads, n_q, n_k, device="cpu")


# --- the predicate equals the pattern's mask ------------------------------------------------------
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n_q=st.integers(1, 40), n_k=st.integers(1, 40), heads=st.integers(1, 3))
def test_create_mask_of_the_predicate_is_the_mask(data, n_q, n_k, heads):
    p = data.draw(trees(n_q, n_k, heads), label="p")
    assert torch.equal(flex_mask(p.mask_mod(n_q, n_k, heads), 1, heads, n_q, n_k)[0], p.mask(n_q, n_k, heads))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), lengths=st.lists(st.lists(st.integers(0, 25), min_size=1, max_size=5), min_size=1, max_size=2),
       extra=st.integers(0, 6), padded=st.sets(st.integers(0, 4)), heads=st.integers(1, 2), causal=st.booleans(),
       packed=st.booleans(), mask_seed=st.one_of(st.none(), st.integers(0, 2**16)))
def test_create_mask_with_documents_padding_and_globals_is_the_layout(data, lengths, extra, padded, heads, causal,
                                                                      packed, mask_seed):
    """Call-time data and documents: the predicate allows what the layout (tested against the definition in
    test_documents and test_layout) allows."""
    n = max(sum(example) for example in lengths) + extra
    if n == 0:
        return
    ids = sa.documents_from_lengths(lengths, n)
    ids[torch.isin(ids, torch.tensor(sorted(padded), dtype=torch.long))] = -1
    call = {"causal": causal, "documents": ids if packed else None}
    if mask_seed is not None:
        gen = torch.Generator().manual_seed(mask_seed)
        call.update(global_mask=torch.rand(ids.shape, generator=gen) < 0.1,
                    key_padding_mask=torch.rand(ids.shape, generator=gen) < 0.2)
    p = data.draw(trees(n, n, heads, grids=not packed), label="p")  # a grid fits documents of some lengths only
    expected = p.layout(n, heads=heads, block_size=8, **call).to_dense()                       # (Bl, H, n, n)
    got = flex_mask(p.mask_mod(n, heads=heads, **call), len(lengths), heads, n, n)             # (B, H, n, n)
    assert torch.equal(got, expected.expand_as(got))


@pytest.mark.parametrize("pattern, n_q, n_k, heads", [
    (sa.Random(2, seed=1, block_size=4) | sa.Local(1), 37, 37, 3),
    (sa.Random(1, block_size=4) | sa.Global(first=2) | sa.Random(1, seed=2, block_size=3), 30, 17, 2),  # two draws
    (sa.Random(1, block_size=4) | sa.Causal(), 1, 50, 2),                                                # decode row
    (sa.Random(2, block_size=5) & ~sa.Local(3), 50, 21, 2),                                              # n_q > n_k
    (sa.PerHead([sa.Random(1, block_size=4) | sa.Local(2), sa.Local(2), sa.Random(1, block_size=4) | sa.Local(2)])
     | sa.Sink(first=1), 40, 40, 3),
    (sa.Blocks(np.random.default_rng(0).random((2, 5, 3)) < 0.5, 8), 33, 20, 2),                        # per head
    (sa.bigbird(block=8, window_blocks=3, global_blocks=1, random_blocks=2), 100, 100, 2),
    # a decode row whose Random draws around a sibling holding a Random, resolved from the row's first position
    # (found by CI's hypothesis run of the test above: the predicate resolved the sibling at the queries only)
    ((sa.Stride(1) & sa.Random(1, block_size=4)) | sa.Random(1, block_size=16), 1, 21, 1),
    ((sa.Local(2) & sa.Random(1, block_size=4)) | sa.Random(1, block_size=8), 3, 40, 2),
])
def test_random_and_blocks_are_the_layouts_tiles(pattern, n_q, n_k, heads):
    """Random draws as the layout draws (among the tiles its union siblings leave free, per head)."""
    assert torch.equal(flex_mask(pattern.mask_mod(n_q, n_k, heads), 1, heads, n_q, n_k)[0],
                       pattern.mask(n_q, n_k, heads))


def test_random_and_blocks_per_document():
    """Each document draws its own tiles (by its id), and a Blocks grid is each document's."""
    for pattern, lengths in ((sa.Random(1, seed=4, block_size=4) | sa.Local(1), [[16, 16, 9, 16], [32, 3]]),
                             (sa.Blocks(np.eye(2, dtype=bool), 8), [[16, 9, 16], [12, 15]])):   # 2 x 2 blocks each
        ids = sa.documents_from_lengths(lengths, 60)
        got = flex_mask(pattern.mask_mod(60, heads=2, documents=ids), 2, 2, 60, 60)
        assert torch.equal(got, pattern.layout(60, heads=2, block_size=16, documents=ids).to_dense().expand_as(got))


def test_the_predicates_are_what_a_flex_user_writes():
    """Longformer is its arithmetic (no table), and a decode row is bottom-right aligned."""
    n = 300
    p = sa.Local(256) | sa.Global(first=16)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    by_hand = ((i - j).abs() <= 256) | (i < 16) | (j < 16)
    assert torch.equal(p.mask_mod(n)(0, 0, i, j), by_hand)
    decode = sa.Local(4, 0).mask_mod(1, n)(0, 0, torch.tensor([[0]]), j)                       # i' = n - 1
    assert decode.nonzero()[:, 1].tolist() == list(range(n - 5, n))
    f = p.mask_mod(n)
    assert f.__code__.co_freevars and not any(isinstance(c, torch.Tensor) for c in _closed_over(f))


def _closed_over(fn, seen=None):
    """Every value a function's closures hold, recursively."""
    seen = set() if seen is None else seen
    out = []
    for cell in fn.__closure__ or ():
        value = cell.cell_contents
        if id(value) in seen:
            continue
        seen.add(id(value))
        out.append(value)
        for inner in (value if isinstance(value, (list, tuple)) else [value]):
            if callable(inner) and getattr(inner, "__closure__", None):
                out += _closed_over(inner, seen)
    return out


def test_lookup_tables_are_per_token_or_per_block_never_per_pair():
    n = 4096
    ids = sa.documents_from_lengths([[1000, 3000, 96]], n)
    padding = torch.zeros(1, n, dtype=torch.bool)
    p = sa.PerHead([sa.Local(64) | sa.Random(2, block_size=64), sa.Global(tokens=tuple(range(0, 4096, 100)))])
    tensors = [v for v in _closed_over(p.mask_mod(n, heads=2, documents=ids, key_padding_mask=padding))
               if isinstance(v, torch.Tensor)]
    assert tensors and max(t.numel() for t in tensors) <= 2 * (n // 64) ** 2        # Random: tiles per head
    assert sum(t.numel() for t in tensors) < 2 * (n // 64) ** 2 + 10 * n


# --- where FlexAttention runs it -------------------------------------------------------------------
CASES = {
    "longformer": (sa.Local(6) | sa.Global(first=2), {}),
    "documents": (sa.Local(5) | sa.Global(first=1) | sa.Random(1, block_size=8),
                  {"documents": sa.documents_from_lengths([[30, 21, 13], [64]], 64),
                   "key_padding_mask": torch.arange(64) >= torch.tensor([[60], [64]])}),
    "per_head_blocks": (sa.PerHead([sa.Blocks(np.eye(4, dtype=bool), 16) | sa.Causal(), ~sa.Local(3) & sa.Stride(3)]),
                        {"global_mask": torch.arange(64)[None, :] % 17 == 3, "causal": True}),
}


@pytest.mark.parametrize("compile_, names", [(False, list(CASES)), (True, ["documents"])])   # compiling: ~10 s each
def test_create_block_mask_takes_the_predicate(compile_, names):
    """create_block_mask (eager and compiled) builds from the predicate the blocks the layout lists."""
    for pattern, call in (CASES[name] for name in names):
        batch = next((v.shape[0] for v in call.values() if isinstance(v, torch.Tensor)), 1)
        layout = pattern.layout(64, heads=2, block_size=16, **call)
        mine = layout.to_block_mask()
        theirs = flex.create_block_mask(pattern.mask_mod(64, heads=2, **call), batch, 2, 64, 64, device="cpu",
                                        BLOCK_SIZE=16, _compile=compile_)
        assert torch.equal(theirs.to_dense(), mine.to_dense().expand_as(theirs.to_dense()))


def test_torch_compile_and_vmap():
    pattern, call = CASES["documents"]
    mask_mod = pattern.mask_mod(64, heads=2, **call)
    b, h = torch.tensor(1), torch.tensor(0)
    q, kv = torch.arange(64)[:, None], torch.arange(64)[None, :]
    compiled = torch.compile(mask_mod, fullgraph=True, backend="eager")(b, h, q, kv)
    vmapped = torch.vmap(torch.vmap(mask_mod, in_dims=(None, None, None, 0)), in_dims=(None, None, 0, None))(
        b, h, torch.arange(64), torch.arange(64))
    assert torch.equal(compiled, mask_mod(b, h, q, kv)) and torch.equal(vmapped, compiled)


def test_the_predicates_tables_live_on_the_device_asked_for():
    ids = sa.documents_from_lengths([[5, 3]])
    assert sa.Local(1).mask_mod(8, documents=ids, device="meta")(0, 0, torch.arange(8, device="meta"),
                                                                 torch.arange(8, device="meta")).is_meta
    with pytest.raises(ValueError, match=r"this mask_mod holds its lookup tables on meta but was called with "
                                         r"indices on cpu; build it with mask_mod\(\.\.\., device='cpu'\)"):
        sa.Local(1).mask_mod(8, documents=ids, device="meta")(0, 0, torch.arange(8), torch.arange(8))
    sa.Local(1).mask_mod(8, device="meta")(0, 0, torch.arange(8), torch.arange(8))   # arithmetic: any device


# --- to_block_mask ---------------------------------------------------------------------------------
def exported_cases():
    n = 100
    gen = torch.Generator().manual_seed(0)
    ids = sa.documents_from_lengths([[40, 25, 30], [7, 80]], n)
    padding = torch.rand(2, n, generator=gen) < 0.1
    return {
        "longformer": ((sa.Local(20) | sa.Global(first=3)), n, n, 2, 16, {}),
        "bigbird": (sa.bigbird(block=16, window_blocks=3, global_blocks=1, random_blocks=1), n, n, 2, 16, {}),
        "documents_padding": (sa.Local(8) | sa.Global(first=1) | sa.Random(1, block_size=8), n, n, 2, 16,
                              {"documents": ids, "key_padding_mask": padding}),
        "documents_causal_globals": (sa.Local(8, 0) | sa.Sink(first=2), n, n, 2, 32,
                                     {"documents": ids, "causal": True, "global_mask": padding}),
        "per_head_complement": (sa.PerHead([~sa.Local(4), sa.Dilated(3, 2) | sa.Causal()]), n, n, 2, 16,
                                {"key_padding_mask": padding}),
        "decode_rows": (sa.Local(30, 0) | sa.Random(1, block_size=16), 7, n, 2, 16, {}),
        "more_queries": (sa.Local(5) & ~sa.Blocks(np.eye(7, 4, dtype=bool), 16), n, 60, 2, 16, {}),
        "block_past_the_sequence": (sa.Local(3) | sa.Global(first=1), 20, 20, 2, 2**40, {}),
    }


def expected_lists(layout):
    """(partial, full) bool block grids (Bl, Hl, n_q_blocks, n_k_blocks) from the layout's CSR index."""
    out = []
    for ptr, idx in ((layout.part_ptr, layout.part_idx), (layout.full_ptr, layout.full_idx)):
        grid = torch.zeros(*ptr.shape[:2], layout.n_q_blocks, layout.n_k_blocks, dtype=torch.bool)
        for b in range(ptr.shape[0]):
            for h in range(ptr.shape[1]):
                for r in range(layout.n_q_blocks):
                    grid[b, h, r, idx[ptr[b, h, r]:ptr[b, h, r + 1]].long()] = True
        out.append(grid)
    return out


def as_grid(num, indices, n_cols):
    """A FlexAttention (num_blocks, indices) pair as a bool grid; entries past num_blocks are ignored."""
    grid = torch.zeros(*indices.shape[:-1], n_cols, dtype=torch.bool)
    used = torch.arange(indices.shape[-1]) < num[..., None]
    b, h, r, slot = used.nonzero(as_tuple=True)
    grid[b, h, r, indices[b, h, r, slot].long()] = True
    return grid


@pytest.mark.parametrize("name", list(exported_cases()))
def test_to_block_mask_holds_the_layouts_blocks_and_flex_on_it_is_the_reference(name):
    pattern, n_q, n_k, heads, block_size, call = exported_cases()[name]
    layout = pattern.layout(n_q, n_k, heads=heads, block_size=block_size, **call)
    block_mask = layout.to_block_mask()
    partial, full = expected_lists(layout)
    n_qb, n_kb = layout.n_q_blocks, layout.n_k_blocks
    assert torch.equal(as_grid(block_mask.kv_num_blocks, block_mask.kv_indices, n_kb), partial)
    assert torch.equal(as_grid(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_kb), full)
    assert torch.equal(as_grid(block_mask.q_num_blocks, block_mask.q_indices, n_qb), partial.transpose(-1, -2))
    assert torch.equal(as_grid(block_mask.full_q_num_blocks, block_mask.full_q_indices, n_qb), full.transpose(-1, -2))
    for indices, n_cols in ((block_mask.kv_indices, n_kb), (block_mask.q_indices, n_qb)):
        assert indices.dtype == torch.int32 and indices.shape[-1] == n_cols          # FlexAttention's format
    assert block_mask.seq_lengths == (n_q, n_k) and block_mask.shape[:2] == layout.full_ptr.shape[:2]
    batch = layout.batch
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, heads, n_q, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, heads, n_k, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    ours = sa.sparse_attention(q, k, v, layout, backend="reference")
    theirs = flex.flex_attention(q, k, v, block_mask=block_mask)                 # eager: the mask_mod per pair
    rows = layout.to_dense().any(-1, keepdim=True).expand(batch, heads, n_q, 1)  # rows with no key: Flex gives 0
    torch.testing.assert_close(torch.where(rows, theirs, 0), ours, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["documents_padding", "per_head_complement"])
def test_compiled_flex_on_to_block_mask_is_the_reference(name):
    """Compiled FlexAttention skips every block the lists leave out and runs full blocks unmasked."""
    pattern, n_q, n_k, heads, block_size, call = exported_cases()[name]
    layout = pattern.layout(n_q, n_k, heads=heads, block_size=block_size, **call)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(layout.batch, heads, n, 16, generator=gen) for n in (n_q, n_k, n_k))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torch.compile(flex.flex_attention)(q, k, v, block_mask=layout.to_block_mask())
    ours = sa.sparse_attention(q.double(), k.double(), v.double(), layout, backend="reference").float()
    torch.testing.assert_close(theirs, ours, atol=2e-6, rtol=2e-6)


def test_hand_built_layouts_keep_a_lookup():
    """A layout built by hand (its pattern a label, maybe wrong) exports its own tiles."""
    layout = (sa.Local(9) | sa.Global(first=1)).layout(40, heads=2, block_size=8)
    fields = {name: getattr(layout, name).clone() for name in KernelIndex._fields}
    for label in (None, sa.Dense()):
        hand = BlockLayout(pattern=label, n_q=40, n_k=40, heads=2, block_size=8, causal=False, **fields)
        assert hand.call_data is None
        block_mask = hand.to_block_mask()
        assert torch.equal(flex_mask(block_mask.mask_mod, 1, 2, 40, 40), layout.to_dense())
    assert layout.call_data is not None and layout.to("meta").call_data is layout.call_data


def test_a_million_token_longformer_exports_without_evaluating_a_pair(monkeypatch):
    """The export copies the layout's block lists (its cost is in blocks): the pattern's predicate is built and
    never called (a per-pair evaluation would be 2**40 calls)."""
    calls, build = [], sa.Pattern.mask_mod

    def counted(self, *args, **kwargs):
        predicate = build(self, *args, **kwargs)
        return lambda *pair: (calls.append(pair), predicate(*pair))[1]

    monkeypatch.setattr(sa.Pattern, "mask_mod", counted)
    layout = (sa.Local(256) | sa.Global(first=16)).layout(1 << 20, heads=16, block_size=128)
    block_mask = layout.to_block_mask()
    assert calls == []
    assert block_mask.shape == (1, 1, 1 << 20, 1 << 20) and block_mask.kv_indices.shape == (1, 1, 8192, 8192)
    assert int(block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum()) == layout.nnz_blocks // 16
    assert block_mask.mask_mod(0, 0, torch.tensor(0), torch.tensor(5)) and calls      # the predicate is the counted one


# --- bad input -------------------------------------------------------------------------------------
IDS = np.zeros((2, 8), dtype=np.int64)
BAD = [
    (sa.PerHead([sa.Local(1), sa.Dense()]), (8,), {"heads": 3}, ValueError, "PerHead has 2 patterns but heads=3"),
    (sa.Blocks(np.ones((2, 2, 2), bool), 4), (8,), {"heads": 3}, ValueError, "Blocks has a grid for 2 heads"),
    (sa.Blocks(np.eye(2, dtype=bool), 4), (9,), {}, ValueError, "Blocks grid of 2 x 2 blocks of 4 tokens does not fit"),
    (sa.Blocks(np.eye(2, dtype=bool), 4), (12,), {"documents": np.array([[0] * 8 + [1] * 4])}, ValueError,
     "the pattern is resolved for each document by itself, and a document of 4 tokens fails: Blocks grid"),
    (sa.Local(1), (8,), {"documents": IDS, "key_padding_mask": np.zeros((1, 8), dtype=bool)}, ValueError,
     r"documents must have shape \(1, 8\)"),
    (sa.Local(1), (8,), {"documents": np.zeros((2, 7), dtype=np.int64)}, ValueError,
     r"documents must have shape \(batch, 8\)"),
    (sa.Local(1), (8,), {"documents": np.zeros((1, 8))}, TypeError, "documents must be an integer torch.Tensor"),
    (sa.Local(1), (8,), {"documents": np.array([[0, 0, 1, 0, 0, 0, 0, 0]])}, ValueError,
     "document 0 of example 0 reappears at position 3"),
    (sa.Local(1), (8, 4), {"documents": np.zeros((1, 8), dtype=np.int64)}, ValueError, "documents needs n_q == n_k"),
    (sa.Local(1), (8, 4), {"global_mask": torch.zeros(1, 8, dtype=torch.bool)}, ValueError,
     "global_mask needs n_q == n_k"),
    (sa.Local(1), (8,), {"key_padding_mask": torch.zeros(2, 8)}, TypeError,
     "key_padding_mask must be a torch.bool tensor"),
    (sa.Local(1), (8,), {"global_mask": torch.zeros(2, 7, dtype=torch.bool)}, ValueError,
     r"global_mask must have shape \(batch, 8\) with batch >= 1, got \(2, 7\)"),
    (sa.Local(1), (8,), {"documents": torch.zeros(1, 8, dtype=torch.long, device="meta")}, ValueError,
     "documents is a meta tensor"),
    (sa.Local(1), (0,), {}, ValueError, "n_q must be >= 1, got 0"),
    (sa.Local(1), (8,), {"heads": 0}, ValueError, "heads must be >= 1, got 0"),
    (sa.Local(1), (8,), {"causal": 1}, TypeError, r"causal must be a bool, got 1 \(int\)"),
]


@pytest.mark.parametrize("pattern, sizes, kwargs, error, message", BAD)
def test_bad_arguments_raise_what_layout_raises(pattern, sizes, kwargs, error, message):
    with pytest.raises(error, match=message) as from_layout:
        pattern.layout(*sizes, **kwargs)
    with pytest.raises(error, match=message) as from_mask_mod:
        pattern.mask_mod(*sizes, **kwargs)
    if "meta" not in message:                    # the layout reads the values, the predicate looks them up
        assert str(from_mask_mod.value) == str(from_layout.value)


def test_bad_device_and_layouts_flex_cannot_take(monkeypatch):
    with pytest.raises(TypeError, match=r"device must be a torch.device or a string such as 'cuda', got 3 \(int\)"):
        sa.Local(1).mask_mod(8, device=3)
    with pytest.raises(ValueError, match="this BlockLayout is on the meta device, which holds no block lists"):
        sa.Local(1).layout(8).to("meta").to_block_mask()
    layout = sa.Local(1).layout(64, block_size=24)
    monkeypatch.setattr(BlockLayout, "device", property(lambda self: torch.device("cuda")))
    with pytest.raises(ValueError, match=r"FlexAttention's Triton kernels split each block .* this layout's "
                                         r"block_size=24 has none\. Build it with a block_size that is a multiple "
                                         r"of 16: 128"):
        layout.to_block_mask()


def test_docstring_examples():
    import doctest

    from sparse_attn import flex as flex_module

    result = doctest.testmod(flex_module, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
