"""BlockLayout agrees with the token mask exactly, at every size and block size, and scales."""
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import sparse_attn as sa
from sparse_attn import assembly, compiler
from sparse_attn import layout as layout_module
from sparse_attn.blocks import MAX_LENGTH
from sparse_attn.layout import KernelIndex
from tests.strategies import (
    EXTREME_CASES,
    EXTREME_RANDOM,
    EXTREMES,
    N,
    check_layout_matches_mask,
    has_random,
    leaves,
    pattern_trees,
    patterns,
    patterns_for,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n_q=st.integers(1, 70), n_k=st.integers(1, 70), heads=st.integers(1, 2),
       block_size=st.sampled_from([1, 2, 3, 4, 8, 16, 32, 64, 100]))
def test_layout_agrees_with_mask(data, n_q, n_k, heads, block_size):
    pattern = data.draw(patterns_for(n_q, n_k, heads), label="pattern")
    check_layout_matches_mask(pattern, n_q, n_k, heads, block_size)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(1, 50), batch=st.integers(1, 3), block_size=st.sampled_from([4, 8, 16]),
       causal=st.booleans(), seed=st.integers(0, 2**16))
def test_per_example_layout_agrees_with_mask(data, n, batch, block_size, causal, seed):
    pattern = data.draw(patterns_for(n, n, heads=2), label="pattern")
    gen = torch.Generator().manual_seed(seed)
    global_mask = torch.rand(batch, n, generator=gen) < 0.1
    key_padding_mask = torch.arange(n)[None, :] >= torch.randint(1, n + 1, (batch, 1), generator=gen)
    check_layout_matches_mask(pattern, n, n, 2, block_size, causal=causal, global_mask=global_mask,
                              key_padding_mask=key_padding_mask)


@pytest.mark.parametrize("n_q, n_k", [(1, 1), (1, 100), (100, 1), (65, 63), (128, 128)])
def test_awkward_sizes(n_q, n_k):
    check_layout_matches_mask(sa.Local(5) | sa.Global(first=2) | sa.Random(1, block_size=16), n_q, n_k, 3, 16)
    check_layout_matches_mask(sa.Causal(), n_q, n_k, 1, 16)


def test_per_head_layout_stores_every_head_and_shared_stores_one():
    shared = (sa.Local(4) | sa.Global(first=1)).layout(64, heads=8, block_size=16)
    assert shared.shared_heads and shared.full_ptr.shape == (1, 1, 5)
    per_head = sa.PerHead([sa.Local(h) for h in range(4)]).layout(64, heads=4, block_size=16)
    assert not per_head.shared_heads and per_head.full_ptr.shape == (1, 4, 5)
    assert sa.Random(1, block_size=16).layout(64, heads=3, block_size=16).full_ptr.shape == (1, 3, 5)


def test_counts_density_and_flops():
    layout = sa.Local(1, block_size=16).layout(64, heads=2, block_size=16)     # 4 rows: 2, 3, 3, 2 blocks
    assert layout.nnz_blocks == 2 * 10
    assert layout.computed_pairs() == layout.allowed_pairs() == 2 * 10 * 256
    assert layout.density == pytest.approx(10 / 16)
    assert layout.block_density == pytest.approx(10 / 16)
    assert layout.flops(64) == 4 * 64 * 2 * 10 * 256
    partial = sa.Local(0).layout(10, block_size=4)                             # diagonal, last block 2 x 2
    assert partial.allowed_pairs() == 10 and partial.computed_pairs() == 16 + 16 + 4
    assert partial.density == pytest.approx(10 / 100)


def test_block_grid_distinguishes_full_and_partial_and_bins():
    assert sa.Local(64).layout(256, block_size=64).block_grid().tolist() == \
        [[2, 1, 0, 0], [1, 2, 1, 0], [0, 1, 2, 1], [0, 0, 1, 2]]
    layout = (sa.Local(256) | sa.Global(first=16)).layout(1 << 16, block_size=64)   # 1024 x 1024 blocks
    grid = layout.block_grid(max_side=256)
    assert grid.shape == (256, 256) and grid[0].min() >= 1 and grid[100, 100] == 2 and grid[100, 200] == 0
    wide = sa.Dense().layout(5 * 64, 2000 * 64, block_size=64)                       # 5 x 2000 blocks
    assert wide.bin_factor(512) == 4 and wide.block_grid(max_side=512).shape == (2, 500)


def test_to_scipy_block_and_token_level():
    layout = (sa.Local(2) | sa.Global(first=1)).layout(20, block_size=8)
    blocks = layout.to_scipy(level="block")
    assert blocks.shape == (3, 3) and blocks.sum() == layout.allowed_pairs()
    tokens = layout.to_scipy(level="token")
    assert np.array_equal(tokens.toarray(), layout.to_dense()[0, 0].numpy())
    with pytest.raises(ValueError, match="level must be 'block' or 'token'"):
        layout.to_scipy(level="pair")
    with pytest.raises(ValueError, match=r"head must be in \[0, 1\), got 3"):
        layout.to_scipy(head=3)


def test_str_shows_counts_and_grid():
    text = str((sa.Local(16) | sa.Global(first=1)).layout(128, heads=2, block_size=32))
    assert "blocks 4 x 4" in text and "token density" in text
    grid = text.splitlines()[-4:]
    assert grid[0].strip() == "++++" and grid[3].strip().startswith("+.")


def test_layouts_are_cached():
    p = sa.Local(8) | sa.Global(first=1)
    assert p.layout(256, heads=4, block_size=32) is (sa.Local(8) | sa.Global(first=1)).layout(256, heads=4, block_size=32)


def test_layouts_with_masks_are_cached_by_mask_values():
    padding = torch.arange(100)[None, :] >= torch.tensor([[100], [60]])
    first = sa.Local(4).layout(100, heads=2, block_size=16, key_padding_mask=padding)
    assert sa.Local(4).layout(100, heads=2, block_size=16, key_padding_mask=padding.clone()) is first
    other = padding.clone()
    other[0, 99] = True
    changed = sa.Local(4).layout(100, heads=2, block_size=16, key_padding_mask=other)
    assert changed is not first and not torch.equal(changed.to_dense(), first.to_dense())
    assert torch.equal(changed.to_dense()[0, 0, :, 99], torch.zeros(100, dtype=torch.bool))


def test_the_layout_cache_is_bounded_by_bytes_least_recently_used_out_first():
    layouts = {n: compiler.build_layout(sa.Local(8), n, cache=False) for n in (256, 512, 1024, 4096)}
    size = {n: compiler.layout_bytes(layout) + compiler.LayoutCache.ENTRY_BYTES for n, layout in layouts.items()}
    cache = compiler.LayoutCache(budget=size[256] + size[512] + size[1024])
    for n in (256, 512, 1024):
        cache.put(n, layouts[n], call_data=None)
    assert cache.get(256) is layouts[256] and len(cache) == 3 and cache.nbytes == cache.budget
    cache.put(4096, layouts[4096], call_data=None)                 # 512, the least recently used, goes first
    assert cache.get(512) is None and cache.get(256) is layouts[256] and cache.get(4096) is layouts[4096]
    assert cache.nbytes <= cache.budget and cache.nbytes == sum(size[n] for n in (256, 1024, 4096) if cache.get(n))
    cache.budget = size[4096] - 1                      # lowered: drops at once; the latest alone is over it, kept
    assert len(cache) == 1 and cache.get(4096) is layouts[4096] and cache.nbytes == size[4096]
    with pytest.raises(ValueError, match="budget must be >= 0, got -1"):
        cache.budget = -1


def test_packed_training_keeps_only_the_latest_packings_and_every_layer_shares_one():
    """Issue 23, item 7: every step's packing added a layout to a 64-entry cache that was never hit again."""
    rng = np.random.default_rng(0)
    pattern = sa.Local(4) | sa.Random(1, seed=3, block_size=8)
    static = pattern.layout(256, heads=2, block_size=16)
    for _ in range(70):                                            # 70 training steps, each with a new packing
        ids = sa.documents_from_lengths([np.diff(np.sort(np.append(rng.choice(255, 6, replace=False) + 1, [0, 256])))
                                         .tolist()])
        first = pattern.layout(256, heads=2, block_size=16, documents=ids)
        assert pattern.layout(256, heads=2, block_size=16, documents=ids.clone()) is first   # the next layer's
    assert pattern.layout(256, heads=2, block_size=16) is static, "per-call layouts pushed out a static one"
    cache = compiler.LAYOUT_CACHE
    packed = [layout for layout in cache.layouts if layout.call_data.documents is not None]
    assert len(packed) == cache.recent and packed[-1] is first and cache.nbytes <= cache.budget


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # tiny N: eager is the point
def test_to_block_mask_matches_layout():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    pattern = sa.Local(20) | sa.Global(first=3) | sa.Random(1, block_size=16)
    layout = pattern.layout(100, heads=2, block_size=16)
    block_mask = layout.to_block_mask()
    q, k, v = (torch.randn(1, 2, 100, 16) for _ in range(3))
    ours = sa.sparse_attention(q, k, v, layout, backend="reference")
    theirs = flex.flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


# every kind but Global(last=...) and Blocks (defined from the sequence's end, and by a grid of its size)
length_free_leaves = st.one_of(
    leaves.filter(lambda leaf: leaf.kind != "global"),
    st.builds(sa.Global, st.lists(st.integers(0, 60), max_size=4), st.integers(0, 5)),
)


def test_a_union_of_a_blocks_grid_and_a_random_resolves_at_the_grids_own_lengths():
    """The union's other members are resolved from the Random rows' first position for its choice, but a Blocks grid
    only at the call's lengths (its rows are the call's queries): one query over 2 keys resolves, as before."""
    pattern = sa.Blocks([[0, 0]], 1) | sa.Random(1, block_size=4)
    assert pattern.mask(1, 2, 1).tolist() == [[[False, False]]]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=pattern_trees(length_free_leaves), n=st.integers(1, 90), m=st.integers(1, 90),
       block_size=st.sampled_from([4, 16]))
@example(pattern=sa.Random(2, block_size=4) | sa.Local(1), n=40, m=20, block_size=4)
@example(pattern=sa.Random(1, block_size=7) | (sa.Stride(1) & sa.Random(1, block_size=4)), n=9, m=9, block_size=4)
def test_a_position_sees_the_same_keys_in_every_length(pattern, n, m, block_size):
    """Issue 23, item 6: Random drew by the length. No kind but Global(last=...) and Blocks depends on it, so the
    first m positions of a longer sequence see, among themselves, what a sequence of m tokens sees, and a decode
    step (one query over the keys up to it) sees with Causal what the row of the full sequence sees."""
    m = min(m, n)
    full = pattern.mask(n, heads=2)
    assert torch.equal(full[:, :m, :m], pattern.mask(m, heads=2))
    causal = pattern & sa.Causal()
    step = causal.layout(1, m, heads=2, block_size=block_size).to_dense()[0, :, 0]                # (H, m)
    assert torch.equal(step, causal.mask(n, heads=2)[:, m - 1, :m])


def test_layout_validation():
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        sa.Local(1).layout(16, block_size=0)
    with pytest.raises(ValueError, match=r"global_mask must have shape \(batch, 16\) with batch >= 1, got \(2, 15\)"):
        sa.Local(1).layout(16, global_mask=torch.zeros(2, 15, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be a torch.bool tensor"):
        sa.Local(1).layout(16, key_padding_mask=torch.zeros(2, 16))
    with pytest.raises(ValueError, match="global_mask needs n_q == n_k"):
        sa.Local(1).layout(16, 8, global_mask=torch.zeros(2, 16, dtype=torch.bool))


# --- scale: analytic, no N x N and no n_blocks x n_blocks anywhere ---------------------------------
@pytest.mark.parametrize("pattern, n, heads, per_row", [
    (sa.Local(256) | sa.Global(first=16), 1 << 20, 12, 10),
    (sa.bigbird(), 1 << 17, 12, 8),
])
def test_long_layouts_build_in_memory_proportional_to_blocks(pattern, n, heads, per_row):
    tracemalloc.start()
    layout = pattern.layout(n, heads=heads, block_size=64)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rows = n // 64
    stored_heads = 1 if layout.shared_heads else heads
    assert layout.full_idx.numel() + layout.part_idx.numel() <= stored_heads * rows * (per_row + 2) + rows * 8
    assert layout.masks.shape[0] <= 64
    assert peak < 400e6, f"layout build peaked at {peak / 1e6:.0f} MB"


@settings(max_examples=80, deadline=None)
@given(a=patterns.filter(lambda p: not has_random(p)), b=patterns.filter(lambda p: not has_random(p)),
       n_q=st.integers(1, 40), n_k=st.integers(1, 40))
def test_union_and_intersection_laws(a, b, n_q, n_k):
    """Without Random (whose blocks depend on their union siblings), | and & are mask or / and."""
    ma, mb = a.mask(n_q, n_k), b.mask(n_q, n_k)
    assert torch.equal((a | b).mask(n_q, n_k), ma | mb)
    assert torch.equal((a & b).mask(n_q, n_k), ma & mb)
    assert torch.equal((b | a).mask(n_q, n_k), (a | b).mask(n_q, n_k))
    assert torch.equal((a & (a | b)).mask(n_q, n_k), ma)


# --- extreme pattern arguments: layout and mask agree for every accepted value --------------------
SHAPES = [(N, N, 4), (5, N, 4), (2 * N, N, 4), (N, N, 16), (N, 5, 64)]  # (n_q, n_k, block_size), some blocks > N


@pytest.mark.parametrize("x", EXTREMES)
def test_layout_agrees_with_mask_for_extreme_arguments(x):
    leaves = [make(x) for make, _ in EXTREME_CASES] + [make(x) for make in EXTREME_RANDOM]
    for index, leaf in enumerate(leaves):
        for combined in (leaf, leaf | sa.Local(1), leaf & sa.Local(3), (leaf | sa.Random(1, block_size=4)) & sa.Causal(),
                         sa.Stride(2, offset=1) | (leaf & sa.Global(first=2))):
            n_q, n_k, block_size = SHAPES[index % len(SHAPES)]
            check_layout_matches_mask(combined, n_q, n_k, 2, block_size)


# --- block_size larger than the sequence: cost follows N -----------------------------------------
@pytest.mark.parametrize("pattern, n, block_size", [
    (sa.Random(1, block_size=2**16), 256, 64),
    (sa.Local(1), 64, 20000),
    (sa.Local(1, block_size=2**40) | sa.Random(2, block_size=2**70), 64, 2**70),
    (sa.Random(1, block_size=1), 1024, 64),                            # random tiles much smaller than blocks
    (sa.Sink(period=10**9, width=10**9 - 5) | sa.Global(last=2**62), 64, 16),
    (sa.Random(10**9, block_size=4), 2048, 64),                        # every tile, without 512 draws
])
def test_huge_block_sizes_cost_what_the_sequence_needs(pattern, n, block_size):
    """Memory follows the sequence, not the block size or the pattern's arguments (the build allocates what it
    works on: a block of 2**70 tokens or 10**9 random tiles would not fit)."""
    tracemalloc.start()
    layout = pattern.layout(n, heads=2, block_size=block_size)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 60e6, f"{peak / 1e6:.0f} MB"
    assert layout.block_size == block_size and layout.masks.shape[1:] == (min(block_size, n),) * 2
    assert torch.equal(layout.to_dense()[0], pattern.mask(n, heads=2))


@pytest.mark.parametrize("n_q, n_k", [(20, 20), (7, 30), (30, 7)])
def test_every_view_of_a_layout_with_blocks_larger_than_the_sequence(n_q, n_k):
    pattern = sa.Local(2) | sa.Global(first=1)
    layout = pattern.layout(n_q, n_k, block_size=128)
    assert (layout.n_q_blocks, layout.n_k_blocks) == (1, 1) and layout.masks.shape[1:] == (n_q, n_k)
    mask = pattern.mask(n_q, n_k)[0]
    assert torch.equal(layout.row_mask(0, 1)[0, 0], mask)
    assert layout.allowed_pairs() == int(mask.sum()) and layout.computed_pairs() == n_q * n_k
    assert np.array_equal(layout.to_scipy(level="token").toarray(), mask.numpy())
    assert layout.to_scipy().toarray().tolist() == [[int(mask.sum())]] and layout.block_grid().tolist() == [[1]]
    assert "blocks 1 x 1" in str(layout)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # tiny N: eager is the point
def test_to_block_mask_with_blocks_larger_than_the_sequence():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    layout = (sa.Local(3) | sa.Global(first=1)).layout(20, heads=2, block_size=128)
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    torch.testing.assert_close(flex.flex_attention(q, k, v, block_mask=layout.to_block_mask()),
                               sa.sparse_attention(q, k, v, layout, backend="reference"), atol=1e-5, rtol=1e-5)


def test_more_blocks_than_int32_indices_hold_is_refused(monkeypatch):
    monkeypatch.setattr(assembly, "_INT32_MAX", 10)
    with pytest.raises(ValueError, match=r"the layout has 16 \(example, head, block\) entries, more than its int32 "
                                         r"indices hold \(10\); use a larger block_size \(got 4\)"):
        sa.Dense().layout(16, block_size=4)


# --- hand-built layouts are checked ---------------------------------------------------------------
def built(pattern=sa.Local(9) | sa.Global(first=1), n=40, heads=2, block_size=8):
    """The tensors and arguments of a layout built by the library (a valid hand-built layout)."""
    layout = pattern.layout(n, heads=heads, block_size=block_size)
    tensors = {name: getattr(layout, name).clone() for name in KernelIndex._fields}
    return dict(pattern=pattern, n_q=n, n_k=n, heads=heads, block_size=block_size, causal=False, **tensors)


def test_a_consistent_hand_built_layout_is_accepted_and_runs():
    fields = built(sa.PerHead([sa.Local(3), sa.Local(5) | sa.Random(1, block_size=8)]))
    fields["full_idx"] = fields["full_idx"].repeat_interleave(2)[::2]              # non-contiguous views are fine
    layout = sa.BlockLayout(**fields)
    expected = fields["pattern"].layout(40, heads=2, block_size=8)
    assert torch.equal(layout.to_dense(), expected.to_dense()) and layout.full_idx.is_contiguous()
    q = torch.randn(1, 2, 40, 8)
    torch.testing.assert_close(sa.sparse_attention(q, q, q, layout, backend="numba"),
                               sa.sparse_attention(q, q, q, expected, backend="reference"))
    assert sa.BlockLayout(**dict(built(), pattern=None)).pattern is None


def _corrupt(change):
    fields = built()
    change(fields)
    return fields


CORRUPTIONS = [
    # the case: an empty transposed index made the numba backward return a wrong dK
    (lambda f: f.update(full_t_ptr=torch.zeros_like(f["full_t_ptr"]), full_t_idx=f["full_t_idx"][:0]),
     ValueError, "BlockLayout full_t_ptr/full_t_idx must be exactly the transpose of full_ptr/full_idx"),
    (lambda f: f.update(full_t_ptr=torch.zeros_like(f["full_t_ptr"])), ValueError,
     "BlockLayout full_t_ptr must be non-decreasing row pointers into full_t_idx, from 0 to its length 5, each"),
    (lambda f: f.update(full_t_idx=f["full_t_idx"].flip(0)), ValueError,
     "BlockLayout full_t_ptr/full_t_idx must be exactly the transpose of full_ptr/full_idx"),
    (lambda f: f.update(part_t_mask=f["part_t_mask"].roll(1)), ValueError,
     "BlockLayout part_t_ptr/part_t_idx/part_t_mask must be exactly the transpose of part_ptr/part_idx/part_mask"),
    (lambda f: f.update(full_idx=f["full_idx"].long()), TypeError,
     "BlockLayout full_idx must be a torch.int32 tensor, got torch.int64"),
    (lambda f: f.update(masks=f["masks"].int()), TypeError, "BlockLayout masks must be a torch.bool tensor, got torch.int32"),
    (lambda f: f.update(part_idx=f["part_idx"].tolist()), TypeError, "BlockLayout part_idx must be a torch.int32 tensor, got list"),
    (lambda f: f.update(full_ptr=f["full_ptr"][0]), ValueError, r"BlockLayout full_ptr must have shape \(Bl, Hl, n_q_blocks \+ 1\)"),
    (lambda f: f.update(full_ptr=f["full_ptr"].expand(1, 3, 6)), ValueError, "with Bl >= 1 and Hl 1 or heads=2, got"),
    (lambda f: f.update(part_ptr=f["part_ptr"][..., :-1]), ValueError, r"BlockLayout part_ptr must have shape \(1, 1, 6\), got \(1, 1, 5\)"),
    (lambda f: f.update(full_t_ptr=f["full_t_ptr"][..., :-1]), ValueError, r"BlockLayout full_t_ptr must have shape \(1, 1, 6\)"),
    (lambda f: f.update(masks=f["masks"][:, :4]), ValueError, r"BlockLayout masks must have shape \(\d+, 8, 8\), got \(\d+, 4, 8\)"),
    (lambda f: f.update(part_mask=f["part_mask"][:-1]), ValueError, r"BlockLayout part_mask must have shape"),
    (lambda f: f.update(full_idx=f["full_idx"][None]), ValueError, "BlockLayout full_idx must be one-dimensional"),
    (lambda f: f["full_ptr"].__setitem__((0, 0, 2), 0), ValueError, "BlockLayout full_ptr must be non-decreasing"),
    (lambda f: f["part_idx"].__setitem__(0, 5), ValueError, "BlockLayout part_idx must hold block indices in \\[0, 5\\), got"),
    (lambda f: f["full_t_idx"].__setitem__(0, -1), ValueError, "BlockLayout full_t_idx must hold block indices in"),
    (lambda f: f["part_idx"].__setitem__(slice(0, 2), torch.tensor([2, 1], dtype=torch.int32)), ValueError,
     "BlockLayout part_idx must be sorted and without duplicates within each row"),
    (lambda f: f["part_idx"].__setitem__(1, 1), ValueError, "BlockLayout part_idx must be sorted and without duplicates"),
    (lambda f: f["part_mask"].__setitem__(0, 99), ValueError,
     r"BlockLayout part_mask and part_t_mask must hold tile ids in \[0, \d+\) \(the length of masks\)"),
    (lambda f: f.update(masks=f["masks"].to("meta")), ValueError, r"BlockLayout tensors must be on one device, got \['cpu', 'meta'\]"),
    (lambda f: f.pop("part_t_mask"), TypeError, r"BlockLayout needs the tensors .*; missing \['part_t_mask'\], unexpected \[\]"),
    (lambda f: f.update(n_q=0), ValueError, "n_q must be >= 1, got 0"),
    (lambda f: f.update(block_size=8.0), TypeError, "block_size must be an int, got 8.0"),
    (lambda f: f.update(causal=1), TypeError, r"causal must be a bool, got 1 \(int\)"),
    (lambda f: f.update(pattern="Local(5)"), TypeError, "BlockLayout pattern must be a sparse_attn Pattern, got str"),
]


@pytest.mark.parametrize("change, error, message", CORRUPTIONS, ids=[m[:60] for _, _, m in CORRUPTIONS])
def test_hand_built_layouts_are_checked_field_by_field(change, error, message):
    with pytest.raises(error, match=message):
        sa.BlockLayout(**_corrupt(change))


def test_tiles_must_be_false_outside_the_sequence():
    fields = built(n=37)                                  # the last block row and column hold 5 of 8 tokens
    fields["masks"][:, 7, 7] = True
    with pytest.raises(ValueError, match=r"BlockLayout masks\[\d+\] allows pairs outside the sequence \(query rows >= "
                                         r"37 or keys >= 37\) in a block of the last row or column"):
        sa.BlockLayout(**fields)


def test_a_block_both_full_and_partial_is_refused():
    fields = built(sa.Dense(), n=16, block_size=8)       # 2 x 2 full blocks, listed again as partial ones
    full = dict(full_ptr=fields["full_ptr"], full_idx=fields["full_idx"], full_t_ptr=fields["full_t_ptr"],
                full_t_idx=fields["full_t_idx"])
    part = {"part" + name[4:]: tensor for name, tensor in full.items()}
    masks = torch.zeros(1, 8, 8, dtype=torch.bool)
    masks[0, 0, 0] = True
    tile_ids = torch.zeros(len(fields["full_idx"]), dtype=torch.int32)
    with pytest.raises(ValueError, match="BlockLayout lists a block both in full_idx and in part_idx"):
        sa.BlockLayout(**{**fields, **full, **part, "masks": masks, "part_mask": tile_ids, "part_t_mask": tile_ids})


def test_pattern_layout_and_to_skip_the_checks(monkeypatch):
    def fail(tensors, **sizes):
        raise AssertionError("a layout built by the library was checked again")
    monkeypatch.setattr(layout_module, "checked_tensors", fail)
    layout = (sa.Local(7) | sa.Random(1, block_size=16)).layout(100, heads=2, block_size=16, causal=True)
    assert layout.to("meta").device.type == "meta"


# --- call-time masks and flags --------------------------------------------------------------------
def test_a_meta_mask_cannot_build_a_layout():
    with pytest.raises(ValueError, match="key_padding_mask is a meta tensor: its values, which decide the layout, "
                                         "cannot be read"):
        sa.Local(1).layout(8, key_padding_mask=torch.zeros(1, 8, dtype=torch.bool, device="meta"))


def test_numpy_masks_and_flags_work_like_torch_ones():
    padding = np.arange(12)[None, :] >= np.array([[12], [7]])
    layout = sa.Local(2).layout(12, heads=2, block_size=4, causal=np.bool_(True), key_padding_mask=padding)
    assert layout is sa.Local(2).layout(12, heads=2, block_size=4, causal=True, key_padding_mask=torch.from_numpy(padding))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, 12\) with batch >= 1, got \(0, 12\)"):
        sa.Local(2).layout(12, key_padding_mask=np.zeros((0, 12), dtype=bool))
    with pytest.raises(ValueError, match=f"n_q must be <= {MAX_LENGTH}"):
        sa.Local(2).layout(MAX_LENGTH + 1)


def test_views_check_their_arguments():
    layout = sa.Local(2).layout(40, heads=2, block_size=8)
    with pytest.raises(TypeError, match=r"head must be an int, got 0.5 \(float\)"):
        layout.to_scipy(head=0.5)
    with pytest.raises(ValueError, match="max_side must be >= 1, got 0"):
        layout.block_grid(max_side=0)
    with pytest.raises(ValueError, match=r"row_mask needs 0 <= r0 < r1 <= n_q_blocks=5, got r0=2, r1=1"):
        layout.row_mask(2, 1)
    with pytest.raises(ValueError, match="this BlockLayout is on the meta device, which holds no values to move to cpu"):
        layout.to("meta").to("cpu")
