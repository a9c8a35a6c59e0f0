"""work_split: every row's blocks covered once, pieces no longer than asked, longest first, slots consistent."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sparse_attn.backends import work_split


@settings(max_examples=100, deadline=None)
@given(counts=arrays(np.int64, st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 12)),
                     elements=st.integers(0, 40)),
       piece=st.integers(1, 20))
def test_items_cover_every_row_once_in_pieces_of_at_most_piece_blocks(counts, piece):
    plan = work_split.split_rows(counts, piece)
    row, start, end, slot, b, h = plan.items.T.astype(np.int64)
    assert (end - start <= piece).all() and (start <= end).all()
    assert (np.diff(end - start) <= 0).all(), "items are not longest first"
    covered = np.zeros(counts.shape, dtype=np.int64)
    np.add.at(covered, (b, h, row), end - start)
    assert np.array_equal(covered, counts)
    items_per_row = np.zeros(counts.shape, dtype=np.int64)
    np.add.at(items_per_row, (b, h, row), 1)
    assert np.array_equal(items_per_row, np.maximum(1, -(-counts // piece)))
    for b_, h_, r in zip(*np.nonzero(items_per_row == 1)):          # one piece: written directly, no slot
        assert slot[(b == b_) & (h == h_) & (row == r)][0] == -1
    assert plan.n_slots == (slot >= 0).sum() and sorted(slot[slot >= 0]) == list(range(plan.n_slots))
    for r, first, pieces, b_, h_ in plan.splits:                    # a split row's pieces: its consecutive slots,
        mine = (b == b_) & (h == h_) & (row == r)                   # in the order of its blocks
        order = np.argsort(start[mine])
        assert list(slot[mine][order]) == list(range(first, first + pieces))
        assert list(start[mine][order][1:]) == list(end[mine][order][:-1])


def test_piece_length_spreads_the_work_and_keeps_a_minimum():
    longformer = np.full((1, 1, 512), 10)
    longformer[0, 0, 0] = 512                                       # the global row
    assert work_split.piece_length(longformer, fanout=16, programs=1056) == 86
    decode = np.array([[[65]]])                                     # one query block over 65 key blocks
    assert work_split.piece_length(decode, fanout=64, programs=1056) == work_split.MIN_PIECE_BLOCKS
    plan = work_split.split_rows(longformer, 86)
    assert plan.splits.tolist() == [[0, 0, 6, 0, 0]] and plan.items[0, 0] == 0


def test_column_counts_sum_the_query_heads_of_each_kv_head():
    full = np.array([[[0, 1, 3], [3, 3, 3], [3, 5, 6], [6, 6, 8]]])  # (Bl=1, Hl=4, n_k_blocks + 1)
    part = np.zeros_like(full)
    assert work_split.column_counts(full, part, groups=2).tolist() == [[[1, 2], [2, 3]]]
    assert work_split.column_counts(full[:, :1], part[:, :1], groups=3).tolist() == [[[3, 6]]]
