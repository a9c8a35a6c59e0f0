"""SparseKVCache: a whole generation through the cache equals attention over the full past with the same
pattern, in memory that stops growing once the window is full."""
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparse_attn as sa
from sparse_attn.kv_cache import SparseKVCache, left_padded_attention
from sparse_attn.layout import BlockLayout
from sparse_attn.positions import layout_at_positions, over_held_keys
from sparse_attn.retention import retention
from sparse_attn.rules import Context
from tests.strategies import patterns
from tests.tolerance import FLOORS, assert_within_rule

W = 8  # the window of the bounded patterns below: Local(W - 1, 0) reaches W keys
BOUNDED = [
    sa.Local(W - 1, 0) | sa.Sink(first=4),
    (sa.Local(W - 1, 0) | sa.Sink(first=4)) & sa.Causal(),
    sa.Global(first=2) | sa.Local(W - 1, 0),
    sa.Local(3, 2) | sa.Sink(tokens=(5, 9)),                       # looks ahead inside a chunk; sinks arrive late
    sa.Dilated(3, 2) | sa.Global(tokens=(20,)),                    # a global query in the middle of the run
    sa.Local(1, 0, block_size=3) & sa.Causal(),
]
SCHEDULES = {                                  # chunk sizes: token by token, prefill + tokens, chunks around W
    "tokens": [1] * 40,
    "prefill": [13] + [1] * 27,
    "straddle": [W - 1, 1, W + 1, 1, 1, 2 * W + 3, 1, W, 1, 1, 5],
}


def generation(pattern, chunks, backend="reference", dtype=torch.float64, batch=2, q_heads=4, kv_heads=2, dim=8,
               seed=0, device="cpu"):
    """(cache outputs, full-past reference outputs in float64, the same in ``dtype`` by the reference backend,
    the cache) for one generation in ``chunks``."""
    g = torch.Generator().manual_seed(seed)
    n = sum(chunks)
    q = torch.randn(batch, q_heads, n, dim, generator=g, dtype=torch.float64)                  # (B, Hq, N, D)
    k, v = (torch.randn(batch, kv_heads, n, dim, generator=g, dtype=torch.float64) for _ in range(2))
    cache = SparseKVCache(pattern, backend=backend)
    outs, oracle, baseline, start = [], [], [], 0
    for size in chunks:
        new = slice(start, start + size)
        outs.append(cache.attend(*(x[:, :, new].to(device, dtype) for x in (q, k, v))).cpu())
        past = slice(0, start + size)
        oracle.append(sa.sparse_attention(q[:, :, new], k[:, :, past], v[:, :, past], pattern, backend="reference"))
        baseline.append(sa.sparse_attention(q[:, :, new].to(dtype), k[:, :, past].to(dtype), v[:, :, past].to(dtype),
                                            pattern, backend="reference"))
        start += size
    return torch.cat(outs, 2), torch.cat(oracle, 2), torch.cat(baseline, 2), cache


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("pattern", BOUNDED, ids=repr)
def test_generation_equals_attention_over_the_full_past_float64(pattern, schedule, backend):
    out, oracle, _, cache = generation(pattern, SCHEDULES[schedule], backend)
    assert (out - oracle).abs().max().item() <= 1e-12
    assert cache.bounded and cache.seq_len == sum(SCHEDULES[schedule])
    # held: the fixed tokens and the window of the last chunk's first query (t), nothing more
    r, t = cache.retention, cache.seq_len - SCHEDULES[schedule][-1]
    assert t > r.dense_until and len(cache.positions) < cache.seq_len
    expected = {p for p in r.fixed if p < cache.seq_len} | set(range(max(t - r.window, 0), cache.seq_len))
    assert sorted(cache.positions.tolist()) == sorted(expected)


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("pattern", BOUNDED[:3], ids=repr)
def test_generation_float32_within_the_tolerance_rule(pattern, backend):
    out, oracle, baseline, _ = generation(pattern, SCHEDULES["straddle"], backend, dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_within_rule("out", out, oracle, baseline)


@pytest.mark.parametrize("pattern", BOUNDED[:3], ids=repr)
def test_generation_bfloat16_within_the_tolerance_rule(pattern):
    """The numba decode step (a dense attention over the held keys) and its chunks in bfloat16."""
    out, oracle, baseline, _ = generation(pattern, SCHEDULES["straddle"], "numba", dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert_within_rule("out", out, oracle, baseline, FLOORS[torch.bfloat16])


def _no_held_mask(*args, **kwargs):
    raise AssertionError("a decode step evaluated the pattern at the held keys")


@pytest.mark.parametrize("pattern", [p for p in BOUNDED if retention(p).sees_all_held], ids=repr)
def test_a_decode_step_that_attends_every_held_key_evaluates_no_mask(pattern, monkeypatch):
    """Retention.sees_all_held: the step is one dense attention over the held keys, with no mask built."""
    monkeypatch.setattr("sparse_attn.kv_cache.held_mask", _no_held_mask)
    out, oracle, _, cache = generation(pattern, SCHEDULES["tokens"], "numba")
    assert (out - oracle).abs().max().item() <= 1e-12
    assert len(cache.positions) < cache.seq_len


def test_a_decode_step_over_positions_the_update_did_not_return_evaluates_the_mask(monkeypatch):
    """attention() over other positions than the last update's (here the same values in a new tensor) cannot
    rely on what the cache holds, so it evaluates the pattern there."""
    cache, x = SparseKVCache(BOUNDED[0], backend="numba"), torch.randn(1, 2, 40, 8, dtype=torch.float64)
    cache.attend(x[:, :, :39], x[:, :, :39], x[:, :, :39])
    keys, values, positions = cache.update(x[:, :, 39:], x[:, :, 39:])
    expected = cache.attention(x[:, :, 39:], keys, values, positions)
    monkeypatch.setattr("sparse_attn.kv_cache.held_mask", _no_held_mask)
    with pytest.raises(AssertionError, match="evaluated the pattern"):
        cache.attention(x[:, :, 39:], keys, values, positions.clone())
    assert torch.equal(cache.attention(x[:, :, 39:], keys, values, positions), expected)


def test_generation_with_the_triton_backend():
    """On a GPU where one is lent, else in Triton's interpreter (tests/conftest.py) with tiny shapes."""
    pytest.importorskip("triton", reason='needs triton (its interpreter without a GPU): pip install ".[triton]"')
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out, oracle, baseline, cache = generation(sa.Local(W - 1, 0) | sa.Sink(first=2), [W + 3, 1, 1, W + 1, 1],
                                              "triton", torch.float32, batch=1, q_heads=2, kv_heads=1, dim=16,
                                              device=device)
    assert_within_rule("out", out, oracle, baseline)
    assert len(cache.positions) == 2 + W - 1 + 1


def test_unbounded_pattern_warns_once_keeps_everything_and_stays_exact():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, oracle, _, cache = generation(sa.Stride(3) | sa.Local(W - 1, 0), SCHEDULES["straddle"], "numba")
    messages = [str(w.message) for w in caught if "SparseKVCache" in str(w.message)]
    assert len(messages) == 1 and "Stride(3) can reach any past key" in messages[0]
    assert (out - oracle).abs().max().item() <= 1e-12
    assert not cache.bounded and cache.positions.tolist() == list(range(cache.seq_len))


@pytest.mark.parametrize("pattern", [sa.Random(1, seed=3, block_size=4) | sa.Local(2, 0),
                                     sa.Global(last=2) | sa.Local(W - 1, 0),
                                     sa.Global(last=2) & sa.Local(W - 1, 0)], ids=repr)
def test_patterns_that_depend_on_the_sequence_length_stay_exact(pattern):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, oracle, _, _ = generation(pattern, SCHEDULES["straddle"])
    assert (out - oracle).abs().max().item() <= 1e-12


def test_per_head_patterns_keep_the_union_over_heads():
    pattern = sa.PerHead([sa.Local(2, 0), sa.Local(W - 1, 0) | sa.Sink(first=1), sa.Local(0), sa.Global(first=3)
                          & sa.Local(5, 0)])
    out, oracle, _, cache = generation(pattern, SCHEDULES["straddle"], "numba")
    assert (out - oracle).abs().max().item() <= 1e-12
    last = cache.seq_len - SCHEDULES["straddle"][-1]                   # the last chunk's first position
    # fixed: the sink and the global tokens (kept though the window has passed them: a safe superset)
    assert sorted(cache.positions.tolist()) == [0, 1, 2, *range(last - (W - 1), cache.seq_len)]


@pytest.mark.parametrize("chunks", [[1] * 60, [W + 5] + [1] * 50])
def test_memory_stops_growing_once_the_window_is_full(chunks):
    pattern = sa.Local(W - 1, 0) | sa.Sink(first=4)
    cache = SparseKVCache(pattern, backend="reference")
    sizes, storage = [], []
    for size in chunks:
        x = torch.randn(1, 2, size, 4)
        keys, values, positions = cache.update(x, x)
        cache.attention(x.repeat(1, 2, 1, 1), keys, values, positions)
        sizes.append(cache.nbytes)
        storage.append(keys.untyped_storage().data_ptr())                 # the buffer the held keys live in
        assert len(cache.positions) <= 4 + W + size
    after = [i for i in range(len(chunks)) if sum(chunks[:i]) >= W + 4 + 1][1:]   # one step to settle a prefill
    assert len({sizes[i] for i in after}) == 1 and len({storage[i] for i in after}) == 1
    # k and v, (4 sinks + W - 1 past keys + the new token) x 2 heads x D 4 x 4 bytes
    assert sizes[after[0]] == 2 * (4 + W) * 2 * 4 * 4
    assert sorted(cache.positions.tolist()) == [0, 1, 2, 3, *range(cache.seq_len - W, cache.seq_len)]


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_a_key_padding_mask_over_the_held_keys_equals_the_one_over_the_full_past(backend):
    pattern, g = sa.Local(W - 1, 0) | sa.Sink(tokens=(3,), first=1), torch.Generator().manual_seed(1)
    n = 30
    q = torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64)                               # (B, Hq, N, D)
    k, v = (torch.randn(2, 1, n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    padding = torch.zeros(2, n, dtype=torch.bool)
    padding[1, :5] = True                                      # example 1 is left-padded, sinks included
    cache = SparseKVCache(pattern, backend=backend)
    for start, end in [(0, 6), *((p, p + 1) for p in range(6, n))]:      # a prefill (fixed slots out of order)
        new = slice(start, end)
        keys, values, positions = cache.update(k[:, :, new], v[:, :, new])
        out = cache.attention(q[:, :, new], keys, values, positions, key_padding_mask=padding[:, positions])
        expected = sa.sparse_attention(q[:, :, new], k[:, :, :end], v[:, :, :end], pattern,
                                       key_padding_mask=padding[:, :end], backend="reference")
        assert (out - expected).abs().max().item() <= 1e-12


def test_update_returns_the_held_keys_and_their_positions():
    cache = SparseKVCache(sa.Local(2, 0) | sa.Sink(first=1))
    k = torch.arange(10, dtype=torch.float64).view(1, 1, 10, 1).expand(1, 1, 10, 2)
    for p in range(10):
        keys, values, positions = cache.update(k[:, :, p:p + 1], k[:, :, p:p + 1])
        assert positions.dtype == torch.int64 and keys.shape == (1, 1, len(positions), 2)
        assert (keys[0, 0, :, 0] == positions.to(keys.dtype)).all() and torch.equal(keys, values)
        assert sorted(positions.tolist()) == sorted({0, *range(max(p - 2, 0), p + 1)})  # what query p needs
    assert cache.seq_len == 10 and torch.equal(cache.positions, positions)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(patterns, st.integers(1, 40), st.sampled_from([1, 4, 8, 64]), st.data())
def test_layout_at_positions_equals_the_mask_at_those_positions(pattern, n, block_size, data):
    n_q = data.draw(st.integers(1, n))
    rows = np.array(data.draw(st.lists(st.integers(n - n_q, n - 1), min_size=1, max_size=10, unique=True)))
    keys = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=25, unique=True)))
    heads = 2 if pattern.head_dependent else 1
    padding = torch.from_numpy(np.random.default_rng(n).random((2, len(keys))) < 0.2)          # (B, keys)
    layout = layout_at_positions(pattern, Context(n_q, n, 0), rows, keys, heads, block_size,
                                 key_padding_mask=padding)
    BlockLayout(pattern=None, n_q=len(rows), n_k=len(keys), heads=heads, block_size=block_size,   # the checked
                causal=False, **layout.index._asdict())                                          # constructor
    mask = pattern.mask(n_q, n, heads=heads)                              # (H, n_q, n), rows at n - n_q ..
    expected = mask[:, rows - (n - n_q)][:, :, keys][None] & ~padding[:, None, None, :]
    assert torch.equal(layout.to_dense(), expected)


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="pattern must be a sparse_attn Pattern"):
        SparseKVCache("Local(4)")
    with pytest.raises(ValueError, match="backend must be one of"):
        SparseKVCache(sa.Local(4), backend="cuda")
    cache = SparseKVCache(sa.Local(4))
    x = torch.randn(1, 2, 3, 8)
    cache.update(x, x)
    with pytest.raises(ValueError, match=r"does not continue this cache of \(batch, kv_heads, head_dim\) = \(1, 2, 8\)"):
        cache.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    with pytest.raises(ValueError, match="q has 1 queries but the last update appended 3 tokens"):
        cache.attention(torch.randn(1, 2, 1, 8), x, x, torch.arange(3))
    with pytest.raises(ValueError, match="q and k must hold the same new tokens"):
        cache.attend(torch.randn(1, 2, 2, 8), x, x)


def test_global_queries_to_come_keep_everything_until_they_have_run():
    cache = sa.SparseKVCache(sa.Local(2, 0) | sa.Global(tokens=(12,)), backend="reference")
    assert sa.SparseKVCache is SparseKVCache and cache.bounded
    held = []
    for _ in range(20):
        x = torch.randn(1, 1, 1, 4, dtype=torch.float64)
        cache.attend(x, x, x)
        held.append(len(cache.positions))
    assert held[:13] == list(range(1, 14))                  # up to the global query at 12: every key
    assert held[13:] == [3, 3] + [4] * 5                    # then token 12, the 2 before the newest, the newest
    assert sorted(cache.positions.tolist()) == [12, 17, 18, 19]


def test_non_contiguous_inputs():
    pattern, g = sa.Local(3, 0) | sa.Sink(tokens=(2,)), torch.Generator().manual_seed(2)
    q = torch.randn(1, 9, 2, 16, generator=g, dtype=torch.float64).transpose(1, 2)     # (1, 2, 9, 16), strided
    k, v = (torch.randn(1, 9, 1, 16, generator=g, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    cache = SparseKVCache(pattern, backend="numba")
    out = torch.cat([cache.attend(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]) for s, e in [(0, 3), (3, 4), (4, 9)]], 2)
    assert (out - sa.sparse_attention(q, k, v, pattern, backend="reference")).abs().max().item() <= 1e-12
    assert sorted(cache.positions.tolist()) == [1, 2, *range(3, 9)]     # 1 and 3: the window of the chunk at 4


# A call that raises leaves the cache exactly as it was (issue 23, item 1): checks run before any change.
def _state(cache):
    return cache.seq_len, cache.positions.tolist(), cache.nbytes, repr(cache)


def _bad_calls():
    """(what is wrong, a call on a cache that holds 7 tokens of (1, 2, D 8) float64, the expected error)."""
    x = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    return [
        ("q dtype", lambda c: c.attend(q.float(), x, x), TypeError, "q, k, v must share one dtype"),
        ("q heads", lambda c: c.attend(q[:, :3], x, x), ValueError, r"k/v heads \(2\) must divide .* q heads \(3\)"),
        ("q head_dim", lambda c: c.attend(q[..., :4], x, x), ValueError, r"got shape \(1, 2, 1, 8\)"),  # k as passed
        ("q tokens", lambda c: c.attend(q.repeat(1, 1, 2, 1), x, x), ValueError, "q and k must hold the same new"),
        ("scale", lambda c: c.attend(q, x, x, scale=-1.0), ValueError, "scale must be a finite positive float"),
        ("return_lse", lambda c: c.attend(q, x, x, return_lse="yes"), TypeError, "return_lse must be a bool"),
        ("k type", lambda c: c.update(x.numpy(), x), TypeError, "k must be a torch.Tensor, got ndarray"),
        ("k dtype", lambda c: c.update(x.long(), x.long()), TypeError, "k and v must be float16, bfloat16, float32"),
        ("k and v", lambda c: c.update(x, x[..., :4]), ValueError, "k and v must have the same shape"),
        ("k empty", lambda c: c.update(x[:, :, :0], x[:, :, :0]), ValueError, r"k must have shape .* \(1, 2, 0, 8\)"),
        ("k batch", lambda c: c.attend(q.repeat(2, 1, 1, 1), x.repeat(2, 1, 1, 1), x.repeat(2, 1, 1, 1)), ValueError,
         "does not continue this cache"),
    ]


@pytest.mark.parametrize("what, call, error, message", _bad_calls(), ids=[case[0] for case in _bad_calls()])
def test_a_call_that_raises_leaves_the_cache_as_it_was(what, call, error, message):
    """The retry with the right arguments returns the rows attention over the full past returns (the bad q
    used to be checked after k, v were appended: the retry then saw them twice, max error 0.54). Two steps
    before the bad call: a step like the last checked one skips the checks, a bad one must not."""
    pattern, g = sa.Local(3, 0) | sa.Sink(first=1), torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 8, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    cache = SparseKVCache(pattern, backend="reference")
    for new in (slice(0, 5), slice(5, 6), slice(6, 7)):
        cache.attend(q[:, :, new], k[:, :, new], v[:, :, new])
    before = _state(cache)
    with pytest.raises(error, match=message):
        call(cache)
    assert _state(cache) == before
    out = cache.attend(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:])
    assert (out - sa.sparse_attention(q[:, :, 7:], k, v, pattern, backend="reference")).abs().max().item() <= 1e-12


def test_errors_found_only_by_the_pattern_also_leave_the_cache_as_it_was():
    """A Blocks grid too short for the next length, a PerHead pattern for another number of heads."""
    grid = sa.Blocks(np.ones((2, 2), dtype=bool), block_size=4)                      # 8 tokens at most
    cases = [(grid, torch.randn(1, 1, 8, 4), torch.randn(1, 1, 1, 4), "does not fit n_q=1, n_k=9"),
             (sa.PerHead([sa.Local(1), sa.Local(2)]), torch.randn(1, 2, 3, 4), torch.randn(1, 4, 1, 4), "PerHead")]
    for pattern, prefill, step, message in cases:
        cache = SparseKVCache(pattern, backend="reference")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")                                           # Blocks: keeps every key
            cache.attend(prefill, prefill[:, :1], prefill[:, :1])
        before = _state(cache)
        with pytest.raises(ValueError, match=message):
            cache.attend(step, step[:, :1], step[:, :1])
        assert _state(cache) == before


def test_a_backend_that_refuses_the_inputs_leaves_the_cache_as_it_was():
    """Triton's interpreter refuses bfloat16 (tests/conftest.py runs Triton interpreted without a GPU)."""
    pytest.importorskip("triton", reason='needs triton (its interpreter without a GPU): pip install ".[triton]"')
    if torch.cuda.is_available():
        pytest.skip("on a GPU Triton runs bfloat16")
    cache = SparseKVCache(sa.Local(2), backend="triton")
    x = torch.randn(1, 1, 3, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="computes tl.dot on bfloat16 wrongly"):
        cache.attend(x, x, x)
    assert _state(cache) == (0, [], 0, repr(SparseKVCache(sa.Local(2))))


# Left padding (issue 23, item 3): each example's positions count from its first token.
STARTS = [0, 5, 11]


@pytest.mark.parametrize("set_after_prefill", [False, True])
@pytest.mark.parametrize("pattern", [BOUNDED[0], BOUNDED[2], sa.Local(W - 1, 0) | sa.Sink(tokens=(5, 9))], ids=repr)
def test_a_left_padded_batch_equals_each_sequence_alone(pattern, set_after_prefill):
    """Sinks and globals at each example's own first tokens, across eviction and chunks that straddle a start."""
    chunks, g = SCHEDULES["straddle"], torch.Generator().manual_seed(4)
    n = sum(chunks)
    q, k, v = (torch.randn(3, h, n, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    cache = SparseKVCache(pattern, backend="numba")
    if not set_after_prefill:
        cache.set_starts(STARTS)
    outs, start = [], 0
    for size in chunks:
        new = slice(start, start + size)
        keys, values, positions = cache.update(k[:, :, new], v[:, :, new])
        if set_after_prefill and start == 0:
            cache.set_starts(torch.tensor(STARTS))
        outs.append(cache.attention(q[:, :, new], keys, values, positions))
        start += size
    out = torch.cat(outs, 2)                                                            # (3, 4, n, 8)
    for b, s in enumerate(STARTS):
        alone = generation_of_one(pattern, chunks, q[b:b + 1], k[b:b + 1], v[b:b + 1], s)
        assert (out[b:b + 1, :, s:] - alone).abs().max().item() <= 1e-12
        assert not out[b, :, :s].any()                                                   # padding rows: 0
    fixed = {p + s for p in cache.retention.fixed for s in STARTS}
    assert fixed <= set(cache.positions.tolist()) and len(cache.positions) < n
    assert cache.starts.tolist() == STARTS


def generation_of_one(pattern, chunks, q, k, v, start):
    """The outputs of one example's own sequence (from ``start``) under the same chunk boundaries, each chunk
    over the full past, by the reference backend in float64."""
    outs, end = [], 0
    for size in chunks:
        first, end = max(end, start), end + size
        if end > start:
            outs.append(sa.sparse_attention(q[:, :, first:end], k[:, :, start:end], v[:, :, start:end], pattern,
                                            backend="reference"))
    return torch.cat(outs, 2)


def test_set_starts_errors_leave_the_cache_as_it_was():
    cache = SparseKVCache(sa.Local(2, 0) | sa.Sink(first=1), backend="reference")
    x = torch.randn(2, 1, 6, 4)
    cache.attend(x, x, x)
    for _ in range(4):                                     # position 3 (example 1's sink if it started at 3) goes
        cache.attend(x[:, :, :1], x[:, :, :1], x[:, :, :1])
    before = _state(cache)
    with pytest.raises(ValueError, match=r"set_starts\(\[0, 3\]\) needs the keys at positions \[3\], which this "
                                         r"cache has already dropped"):
        cache.set_starts([0, 3])
    with pytest.raises(ValueError, match=r"starts must be ints >= 0 of shape \(2,\), one per example"):
        cache.set_starts([0, 1, 2])
    with pytest.raises(ValueError, match="starts must be ints >= 0"):
        cache.set_starts([0, -1])
    with pytest.raises(ValueError, match="starts must be ints >= 0"):
        cache.set_starts([0.0, 1.0])
    assert _state(cache) == before and cache.starts is None
    fresh = SparseKVCache(sa.Local(2, 0) | sa.Sink(first=1), backend="reference")
    fresh.set_starts([0, 2, 4])
    with pytest.raises(ValueError, match="k has batch 2 but set_starts gave 3 starts"):
        fresh.update(x, x)
    assert fresh.seq_len == 0 and fresh.nbytes == 0


def test_left_padded_attention_forward_and_backward_equal_each_sequence_alone():
    """Training on a left-padded batch: gradients reach each row's real tokens only, as for the row alone."""
    pattern, g = sa.Local(2, 0) | sa.Sink(first=1), torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, h, 9, 4, generator=g, dtype=torch.float64, requires_grad=True) for h in (2, 1, 1))
    out = left_padded_attention(q, k, v, pattern, [0, 4], causal=True, backend="numba")
    out.sum().backward()
    alone = [t.detach()[1:, :, 4:].requires_grad_() for t in (q, k, v)]
    expected = sa.sparse_attention(*alone, pattern, causal=True, backend="reference")
    expected.sum().backward()
    assert (out[1:, :, 4:] - expected).abs().max().item() <= 1e-12 and not out[1, :, :4].any()
    for padded, one in zip((q, k, v), alone):
        assert (padded.grad[1:, :, 4:] - one.grad).abs().max().item() <= 1e-12 and not padded.grad[1, :, :4].any()


def test_a_left_padded_batch_with_modifiers_on_numba_equals_the_reference_cache():
    """The numba decode step (dense over the held keys) with softcap, ALiBi, sinks and return_lse, left-padded."""
    pattern, chunks, g = BOUNDED[0], SCHEDULES["straddle"], torch.Generator().manual_seed(5)
    n = sum(chunks)
    q, k, v = (torch.randn(3, h, n, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    mods = dict(softcap=2.0, alibi_slopes=torch.rand(3, 4, generator=g, dtype=torch.float64),
                sinks=torch.randn(4, generator=g, dtype=torch.float64), return_lse=True)
    caches = [SparseKVCache(pattern, backend=backend) for backend in ("numba", "reference")]
    start = 0
    for size in chunks:
        new = slice(start, start + size)
        results = []
        for cache in caches:
            if start == 0:
                cache.set_starts(STARTS)
            results.append(cache.attend(q[:, :, new], k[:, :, new], v[:, :, new], **mods))
        (out, lse), (want_out, want_lse) = results
        torch.testing.assert_close(out, want_out, atol=1e-10, rtol=1e-8)
        torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=1e-8)
        start += size
    assert len(caches[0].positions) < n


# A chunked prefill (issue 24): a chunk of more than 64 queries over held keys runs the pattern's own layout,
# its used key blocks gathered from the held keys, with no token mask.
CHUNKS = [70, 90, 130, 65]


def _no_token_mask(*args, **kwargs):
    raise AssertionError("a token mask was built for a chunk")


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("pattern", [sa.Local(40, 0) | sa.Sink(first=3), (sa.Local(30, 0) | sa.Sink(first=2)) & sa.Causal(),
                                     sa.Dilated(20, 2) | sa.Global(tokens=(100,)), sa.Local(5, 0, block_size=7),
                                     sa.PerHead([sa.Local(9, 0), sa.Local(50, 0) | sa.Sink(first=1), sa.Local(3, 2),
                                                 sa.Sink(first=4) | sa.Local(20, 0)])], ids=repr)
def test_a_chunked_prefill_runs_without_a_token_mask(pattern, backend, monkeypatch):
    monkeypatch.setattr("sparse_attn.kv_cache.allowed_at_positions", _no_token_mask)
    out, oracle, _, cache = generation(pattern, CHUNKS, backend=backend)
    assert (out - oracle).abs().max().item() <= 1e-12
    assert len(cache.positions) < cache.seq_len                             # the last chunks ran over held keys


def test_a_chunk_with_softcap_and_sinks_equals_the_full_past():
    pattern, g = sa.Local(40, 0) | sa.Sink(first=3), torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 300, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    cache = SparseKVCache(pattern, backend="reference")
    for new in (slice(0, 100), slice(100, 200), slice(200, 300)):
        out, lse = cache.attend(q[:, :, new], k[:, :, new], v[:, :, new], softcap=2.0, sinks=sinks, return_lse=True)
    expected = sa.sparse_attention(q[:, :, 200:], k, v, pattern, softcap=2.0, sinks=sinks, return_lse=True,
                                   backend="reference")
    assert len(cache.positions) < 300
    for actual, wanted in zip((out, lse), expected):
        assert (actual - wanted).abs().max().item() <= 1e-12


def test_a_layout_over_held_keys_refuses_a_dropped_key():
    layout = (sa.Local(3, 0) | sa.Sink(first=1)).layout(4, 40, block_size=8)
    with pytest.raises(RuntimeError, match="reads a key the cache no longer holds"):
        over_held_keys(layout, np.array([0, *range(34, 40)]))              # 33 is in query 36's window
