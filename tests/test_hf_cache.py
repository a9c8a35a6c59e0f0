"""sparse_attn.integrations.transformers: one pattern per layer (a model's own sliding-window and full layers by
default, or one given per layer), against the model's own eager/sdpa attention."""

import ast
import gc
import weakref
from pathlib import Path

import pytest
import torch

import sparse_attn as sa

transformers = pytest.importorskip("transformers", minversion="5.0",
                                   reason='needs transformers >= 5: pip install ".[hf]"')
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config  # noqa: E402

from sparse_attn.integrations.transformers import model_pattern, own_patterns, register  # noqa: E402
from tests.helpers import CPU_BACKEND, VOCAB, twins  # noqa: E402

OWN = register(name="sparse_attn_test_own", backend=CPU_BACKEND)               # no pattern: the model's own per layer
WINDOW = 5
TINY = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0)


def _sliding_configs():
    return [Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
            MistralConfig(**TINY, sliding_window=WINDOW)]


def _batch(n=24, left=True):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, n), generator=gen)
    keep = torch.arange(n) < torch.tensor([n, n - 7, 9])[:, None]             # (B, N), True = token
    return ids, (keep.flip(1) if left else keep).long()


def test_own_patterns_follow_transformers_window_convention():
    """transformers' sliding window w: kv_idx > q_idx - w, the current token and the w - 1 before it."""
    qwen, mistral = _sliding_configs()
    assert own_patterns(qwen) == [sa.Local(WINDOW - 1, 0), sa.Dense(), sa.Local(WINDOW - 1, 0)]
    assert own_patterns(mistral) == [sa.Local(WINDOW - 1, 0)] * 3
    assert own_patterns(LlamaConfig(**TINY)) is None
    assert own_patterns(Qwen2Config(**TINY)) is None                           # use_sliding_window=False
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay
    theirs = and_masks(causal_mask_function, sliding_window_overlay(WINDOW))
    n = 12
    mask = torch.tensor([[theirs(0, 0, torch.tensor(i), torch.tensor(j)) for j in range(n)] for i in range(n)])
    assert torch.equal(mask, (sa.Local(WINDOW - 1, 0) & sa.Causal()).mask(n)[0])


@pytest.mark.parametrize("reference", ["eager", "sdpa"])
@pytest.mark.parametrize("config", _sliding_configs(), ids=["qwen2-layer-types", "mistral"])
def test_sliding_and_full_layers_equal_the_model_by_default(config, reference):
    theirs, ours = twins(config, OWN, AutoModelForCausalLM, reference)
    ids, mask = _batch()
    keep = mask.bool()
    expected = theirs(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits[keep], expected[keep],
                               atol=1e-5, rtol=1e-5)
    everything = register(sa.Dense(), name="sparse_attn_test_dense_all", backend=CPU_BACKEND)
    _, dense = twins(config, everything, AutoModelForCausalLM, reference)      # the windows matter
    assert not torch.allclose(dense(input_ids=ids, attention_mask=mask).logits[keep], expected[keep], atol=1e-3)


def test_one_pattern_per_layer():
    qwen, _ = _sliding_configs()
    name = register([sa.Local(WINDOW - 1, 0), sa.Dense(), sa.Local(WINDOW - 1, 0)], name="sparse_attn_test_layers",
                    backend=CPU_BACKEND)
    theirs, ours = twins(qwen, name, AutoModelForCausalLM)
    ids, mask = _batch()
    keep = mask.bool()
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits[keep],
                               theirs(input_ids=ids, attention_mask=mask).logits[keep], atol=1e-5, rtol=1e-5)
    ours.config.sparse_attn_pattern = [sa.Dense().to_dict()] * 3             # the config's list wins
    _, dense = twins(qwen, register(sa.Dense(), name="sparse_attn_test_dense_all", backend=CPU_BACKEND),
                     AutoModelForCausalLM)
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits[keep],
                               dense(input_ids=ids, attention_mask=mask).logits[keep], atol=1e-5, rtol=1e-5)


def test_per_layer_errors():
    qwen, _ = _sliding_configs()
    assert model_pattern(qwen, [sa.Local(1), sa.Local(2)], layer_idx=1) == sa.Local(2)
    with pytest.raises(ValueError, match=r"2 patterns \(one per layer\) but the attention layer's layer_idx is 2; "
                                         r"give one pattern per decoder layer"):
        model_pattern(qwen, [sa.Local(1), sa.Local(2)], layer_idx=2)
    with pytest.raises(TypeError, match=r"pattern\[1\] must be a sparse_attn Pattern"):
        register([sa.Local(1), "local"], name="sparse_attn_test_bad")
    qwen.sparse_attn_pattern = ["local"]
    with pytest.raises(TypeError, match="config.sparse_attn_pattern must be a sparse_attn Pattern, its to_dict"):
        model_pattern(qwen, layer_idx=0)


# SparseCache: generation that keeps only what each layer's pattern can still reach.

from transformers import DynamicCache  # noqa: E402

from sparse_attn.integrations.transformers import CACHE_KEYWORD, SparseCache  # noqa: E402
from sparse_attn.kv_cache import SparseKVCache  # noqa: E402

STREAMING = sa.Local(5, 0) | sa.Sink(first=2)                       # 2 sinks and a window of 6: eviction early


def _llama(implementation):
    torch.manual_seed(0)
    config = LlamaConfig(**TINY)
    return AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()


def _generate(model, ids, mask, cache, tokens=40):
    out = model.generate(ids, attention_mask=mask, **{CACHE_KEYWORD: cache}, max_new_tokens=tokens,
                         min_new_tokens=tokens, do_sample=False, output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores, 1)                  # (B, N + tokens), (B, tokens, V)


@pytest.mark.slow  # generation
def test_generation_with_sparse_cache_equals_a_full_dynamic_cache():
    """Llama-style GQA, a batch with left padding, sinks + a window far shorter than the generation."""
    model = _llama(register(STREAMING, name="sparse_attn_test_streaming", backend=CPU_BACKEND))
    ids, mask = _batch(n=12)
    cache = SparseCache(model)
    tokens, scores = _generate(model, ids, mask, cache)
    full_tokens, full_scores = _generate(model, ids, mask, DynamicCache())
    torch.testing.assert_close(tokens, full_tokens, rtol=0, atol=0)
    torch.testing.assert_close(scores, full_scores, atol=1e-5, rtol=1e-5)
    assert len(set(tokens[0, 12:].tolist())) > 3                            # not one token repeated
    held = 3 * 2 + 6                   # each row's 2 sinks (rows start at 0, 7 and 3) + window (the next query's)
    assert all(layer.nbytes == 3 * 2 * held * 8 * 2 * 4 for layer in cache.layers)  # B, Hkv, held, D, k and v, fp32
    assert cache.get_seq_length() == 12 + 40 - 1


@pytest.mark.slow  # generation
def test_memory_stays_bounded():
    model = _llama(register(STREAMING, name="sparse_attn_test_streaming", backend=CPU_BACKEND))
    ids, mask = _batch(n=12)
    sizes = []
    for tokens in (20, 80):
        cache = SparseCache(model)
        _generate(model, ids, mask, cache, tokens)
        sizes.append(cache.nbytes)
    assert sizes[0] == sizes[1] > 0


@pytest.mark.slow  # generation
@pytest.mark.filterwarnings("ignore:SparseKVCache keeps every key of Dense")              # Qwen2's full layers
@pytest.mark.parametrize("config", _sliding_configs(), ids=["qwen2-layer-types", "mistral"])
def test_each_layer_evicts_by_its_own_pattern(config):
    """A model with sliding and full layers generates what transformers' own model generates with its own
    sliding-window cache, and what a full DynamicCache generates; sliding layers hold a window, full ones all."""
    theirs, ours = twins(config, OWN, AutoModelForCausalLM, "eager")
    ids, mask = _batch(n=12)
    cache = SparseCache(ours)
    tokens, scores = _generate(ours, ids, mask, cache, tokens=20)
    their_tokens, their_scores = _generate(theirs, ids, mask, None, tokens=20)
    torch.testing.assert_close(tokens, their_tokens, rtol=0, atol=0)
    torch.testing.assert_close(scores, their_scores, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_generate(ours, ids, mask, DynamicCache(), tokens=20)[0], tokens, rtol=0, atol=0)
    per_token = 3 * 2 * 8 * 2 * 4                                          # B, Hkv, D, k and v, fp32
    for layer, pattern in zip(cache.layers, own_patterns(config)):
        assert layer.pattern == pattern
        if pattern == sa.Dense():                                          # a full layer keeps every key
            assert layer.kv.positions.tolist() == list(range(cache.get_seq_length()))
        else:                          # the last step's w keys (the oldest goes at the next update), w slots
            seen = cache.get_seq_length()
            assert sorted(layer.kv.positions.tolist()) == list(range(seen - WINDOW, seen))
            assert layer.nbytes == WINDOW * per_token


def test_sparse_cache_errors():
    with pytest.raises(ValueError, match="SparseCache needs a model built with a sparse_attn attn_implementation .* "
                                         "got attn_implementation='sdpa'"):
        SparseCache(_llama("sdpa"))
    model = _llama(register(STREAMING, name="sparse_attn_test_streaming", backend=CPU_BACKEND))
    ids, mask = _batch(n=12)
    cache = SparseCache(model)
    model.config.sparse_attn_pattern = sa.Local(7, 0)
    with pytest.raises(ValueError, match=r"runs Local\(7, 0\) but its SparseCache layer evicts by"):
        _generate(model, ids, mask, cache)


def test_a_cache_call_that_raises_changes_nothing():
    """Keys that cannot continue the cache, and the methods SparseCache refuses (issue 23, item 1): the first
    update used to initialise the layer before its keys were checked, and crop() died with an AttributeError."""
    cache = SparseCache(_llama(register(STREAMING, name="sparse_attn_test_streaming", backend=CPU_BACKEND)))
    layer = cache.layers[0]
    with pytest.raises(ValueError, match=r"k must have shape \(batch, kv_heads, n_new, head_dim\) .* got \(1, 2, 8\)"):
        cache.update(torch.randn(1, 2, 8), torch.randn(1, 2, 8), 0)
    assert not layer.is_initialized and layer.kv is None and cache.get_seq_length() == 0
    x = torch.randn(1, 2, 9, 8)
    cache.update(x, x, 0)

    def state():
        return cache.get_seq_length(), layer.kv.positions.tolist(), layer.nbytes

    before = state()
    refused = [(lambda: cache.update(x[..., :4], x[..., :4], 0), "does not continue this cache"),
               (lambda: cache.crop(2), "SparseCache cannot crop"),
               (lambda: cache.activate_past_recording(), "SparseCache cannot crop"),
               (lambda: cache.batch_select_indices(torch.tensor([1])), r"index must be ints in 0 \.\. 0"),
               (lambda: cache.batch_repeat_interleave(0), r"repeats must be an int >= 1 .* got 0"),
               (lambda: cache.reorder_cache(torch.tensor([0.0])), r"index must be ints .* got tensor\(\[0\.\]\)")]
    for call, message in refused:
        with pytest.raises(ValueError, match=message):
            call()
        assert state() == before


def test_beam_search_equals_a_full_dynamic_cache(monkeypatch):
    """Beam search expands the left-padded batch into beams before the prefill and reorders the beams after every
    step: each beam's held keys follow it (SparseCache used to refuse the first reorder, after the prefill had
    filled it with the expanded batch, so a greedy retry with the same cache failed)."""
    model = _llama(register(STREAMING, name="sparse_attn_test_streaming", backend=CPU_BACKEND))
    ids, mask = _batch(n=12)
    reorders = []
    select = SparseKVCache.select_examples
    monkeypatch.setattr(SparseKVCache, "select_examples", lambda kv, index: reorders.append(index) or select(kv, index))

    def beams(cache):
        return model.generate(ids, attention_mask=mask, **{CACHE_KEYWORD: cache}, max_new_tokens=10, min_new_tokens=10,
                              num_beams=2, num_return_sequences=2, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)

    cache = SparseCache(model)
    ours, theirs = beams(cache), beams(DynamicCache())
    torch.testing.assert_close(ours.sequences, theirs.sequences, rtol=0, atol=0)
    torch.testing.assert_close(ours.sequences_scores, theirs.sequences_scores, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(theirs.scores), atol=1e-5, rtol=1e-5)
    assert any(not torch.equal(index, torch.arange(6)) for index in reorders)         # beams did change places
    assert all(len(layer.kv.positions) == 3 * 2 + 6 for layer in cache.layers)       # sinks of 3 starts + window
    assert cache.layers[0].kv.starts.tolist() == [0, 0, 7, 7, 3, 3]
    cache.reset()                                                     # the same cache, greedy, from the start
    torch.testing.assert_close(_generate(model, ids, mask, cache, tokens=8)[0],
                               _generate(model, ids, mask, DynamicCache(), tokens=8)[0], rtol=0, atol=0)


def test_a_refused_generate_leaves_the_cache_for_a_greedy_retry():
    """Prompt lookup (assisted generation) crops, which SparseCache cannot: refused before the prefill, so the same
    cache then generates greedily what a full DynamicCache generates."""
    model = _llama(register(STREAMING, name="sparse_attn_test_streaming", backend=CPU_BACKEND))
    ids, mask = _batch(n=12)
    ids, mask = ids[1:2], mask[1:2]                                  # assisted generation takes one sequence
    cache = SparseCache(model)
    with pytest.raises(ValueError, match="SparseCache cannot crop"):
        model.generate(ids, attention_mask=mask, **{CACHE_KEYWORD: cache}, prompt_lookup_num_tokens=3,
                       max_new_tokens=8, do_sample=False)
    assert cache.get_seq_length() == 0 and all(layer.kv is None for layer in cache.layers)
    tokens, scores = _generate(model, ids, mask, cache, tokens=12)
    full_tokens, full_scores = _generate(model, ids, mask, DynamicCache(), tokens=12)
    torch.testing.assert_close(tokens, full_tokens, rtol=0, atol=0)
    torch.testing.assert_close(scores, full_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # generation
def test_held_keys_are_forgotten_with_their_model_and_cache():
    """The positions of the keys a SparseCache layer returns live on those keys, not in a table of the integration:
    once a model and its cache are gone nothing of them stays, and the next model's caches start from nothing."""
    model = _llama(register(STREAMING, name="sparse_attn_test_streaming", backend=CPU_BACKEND))
    ids, mask = _batch(n=12)
    cache = SparseCache(model)
    _generate(model, ids, mask, cache, tokens=8)
    gone = [weakref.ref(model), weakref.ref(cache)] + [weakref.ref(layer.kv) for layer in cache.layers]
    del model, cache
    gc.collect()
    assert [ref() for ref in gone] == [None] * len(gone)
    other = _llama(register(sa.Local(3, 0), name="sparse_attn_test_other", backend=CPU_BACKEND))  # another pattern
    tokens, scores = _generate(other, ids, mask, SparseCache(other), tokens=8)
    full_tokens, full_scores = _generate(other, ids, mask, DynamicCache(), tokens=8)
    torch.testing.assert_close(tokens, full_tokens, rtol=0, atol=0)
    torch.testing.assert_close(scores, full_scores, atol=1e-5, rtol=1e-5)


def test_no_integration_state_is_keyed_by_object_ids():
    """An id() outlives its object and is reused by the next one: the integration keys nothing by it."""
    package = Path(sa.__file__).parent / "integrations"
    calls = [f"{path.name}:{node.lineno}" for path in package.rglob("*.py") for node in ast.walk(ast.parse(
        path.read_text())) if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "id"]
    assert not calls, f"id() called in the integration: {calls}"
