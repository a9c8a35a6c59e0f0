"""sparse_attn.integrations.transformers with score modifiers (issue 27, item 3): Gemma 2 (softcap=) and gpt-oss
(s_aux=, learned sinks) under attn_implementation="sparse_attn", their sliding and full layers each running the
model's own attention, against the models' eager attention: logits, gradients and generate with SparseCache
against the model's own cache. What sparse_attn still does not compute is refused."""
import copy

import pytest
import torch

import sparse_attn as sa
from sparse_attn import backends

transformers = pytest.importorskip("transformers", minversion="5.0",
                                   reason='needs transformers >= 5: pip install ".[hf]"')
from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from sparse_attn.integrations.transformers import CACHE_KEYWORD, SparseCache, own_patterns, register  # noqa: E402

NUMBA = "numba" if backends.availability("numba")[0] else "reference"
VOCAB = 100
WINDOW = 5
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=64, vocab_size=VOCAB, pad_token_id=0, sliding_window=WINDOW,
            initializer_range=0.15)                         # scores of a few units: the modifiers matter


def _gemma2():
    """Soft-capping at 2 with scores of a few units: the cap changes many scores."""
    return Gemma2Config(**TINY, attn_logit_softcapping=2.0, query_pre_attn_scalar=8)


def _gpt_oss():
    return GptOssConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)


# (config, the backend its modifiers run on here): the numba kernels where numba is installed
MODELS = {"gemma2": (_gemma2, NUMBA), "gpt-oss": (_gpt_oss, NUMBA)}


def _twins(model: str, without_modifier: bool = False):
    """eager and sparse_attn (no pattern: the model's own per layer) with the same random weights; gpt-oss's sinks
    drawn far from 0. ``without_modifier``: the eager model without soft-capping or sinks."""
    build, backend = MODELS[model]
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(build(), attn_implementation="eager").eval()
    for layer in theirs.model.layers:
        if hasattr(layer.self_attn, "sinks"):
            torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)              # learned sinks are far from 0
    name = register(name=f"sparse_attn_test_mods_{backend}", backend=backend)
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(theirs.config), attn_implementation=name).eval()
    ours.load_state_dict(theirs.state_dict())
    if not without_modifier:
        return theirs, ours
    plain = copy.deepcopy(theirs)
    plain.config.attn_logit_softcapping = None                   # Gemma 2 reads it from the config at each call
    for layer in plain.model.layers:
        layer.self_attn.attn_logit_softcapping = None
        if hasattr(layer.self_attn, "sinks"):
            torch.nn.init.constant_(layer.self_attn.sinks, -torch.inf)   # exp(-inf) = 0: no sink
    return theirs, ours, plain


def _batch(n=16):
    ids = torch.randint(3, VOCAB, (2, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0                                                           # left padding
    return ids, mask


@pytest.mark.slow  # numba compiles its softcap kernels
@pytest.mark.parametrize("model", MODELS)
def test_logits_and_gradients_equal_eager(model):
    """Soft-capped (Gemma 2) and sink (gpt-oss) attention, sliding and full layers, a left-padded batch: the
    logits and every parameter's gradient (the sinks' included) equal eager's; without the modifier they differ.
    Each layer runs the model's own attention: HF's window W (kv_idx > q_idx - W) is Local(W - 1, 0)."""
    theirs, ours, plain = _twins(model, without_modifier=True)
    assert own_patterns(ours.config) == [sa.Local(WINDOW - 1, 0), sa.Dense()]      # sliding, then full (causal)
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [WINDOW, None]
    ids, mask = _batch()
    keep = mask.bool()
    results = []
    for each in (theirs, ours):
        logits = each(input_ids=ids, attention_mask=mask).logits                     # (B, N, V)
        logits[keep].square().mean().backward()
        results.append((logits[keep], {name: p.grad for name, p in each.named_parameters()}))
    (expected, expected_grads), (actual, grads) = results
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)
    if model == "gpt-oss":
        assert grads["model.layers.0.self_attn.sinks"].abs().max() > 1e-4            # the sinks learn
    without = plain(input_ids=ids, attention_mask=mask).logits[keep]
    assert (without - expected).abs().max() > 0.1                                    # the modifier matters here


def _generate(model, ids, mask, cache, tokens=16):
    out = model.generate(ids, attention_mask=mask, **{CACHE_KEYWORD: cache}, max_new_tokens=tokens,
                         min_new_tokens=tokens, do_sample=False, output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores, 1)                                  # (B, N + tokens), (B, tokens, V)


@pytest.mark.filterwarnings("ignore:SparseKVCache keeps every key of Dense")           # the full layers
@pytest.mark.parametrize("model", MODELS)
def test_generate_with_sparse_cache_equals_the_model_own_cache(model):
    """Greedy generation far past the window: sparse_attn with SparseCache (sliding layers hold the window, full
    layers every key) generates what the eager model generates with its own cache (its sliding-window layers)."""
    theirs, ours = _twins(model)
    ids, mask = _batch(n=8)
    with torch.no_grad():
        cache = SparseCache(ours)
        tokens, scores = _generate(ours, ids, mask, cache)
        their_tokens, their_scores = _generate(theirs, ids, mask, None)
    torch.testing.assert_close(tokens, their_tokens, rtol=0, atol=0)
    torch.testing.assert_close(scores, their_scores, atol=1e-5, rtol=1e-5)
    assert len(set(tokens[0, 8:].tolist())) > 2                                      # not one token repeated
    seen = cache.get_seq_length()
    sliding, full = cache.layers
    assert sorted(sliding.kv.positions.tolist()) == list(range(seen - WINDOW, seen))
    assert full.kv.positions.tolist() == list(range(seen))


def _attention_call(**kwargs):
    """The registered attention function called as a layer calls it, with ``kwargs`` added."""
    name = register(sa.Dense(), name="sparse_attn_test_mods_refused", backend="reference")
    module = torch.nn.Module()
    q = k = v = torch.randn(1, 4, 6, 8)                                               # (B, H, N, D)
    return ALL_ATTENTION_FUNCTIONS[name](module, q, k, v, None, scaling=0.5, **kwargs)


@pytest.mark.parametrize("argument, what", [
    ("position_bias", "adds a position bias tensor to the attention scores"),
    ("sinks", "adds attention sinks computed per token to the softmax"),
    ("indices", "attends only the keys its indexer selects"),
    ("block_indices", "attends only the key blocks its indexer selects")])
def test_what_sparse_attn_does_not_compute_is_refused(argument, what):
    """Arguments that change the attention beyond softcap and per-head sinks (T5/Inkling position bias, Inkling 2's
    per-token sinks, DeepSeek V3.2's indexer selection) raise instead of being ignored."""
    with pytest.raises(ValueError, match=f"Module {what} \\(it passes {argument}= to the attention function\\), "
                                         f"which sparse_attn does not compute"):
        _attention_call(**{argument: torch.zeros(1, 4, 6, 1)})


def test_sinks_per_token_through_s_aux_are_refused():
    with pytest.raises(ValueError, match=r"passes s_aux= of shape \(1, 4, 6, 1\) .* one learned sink per query head "
                                         r"\(s_aux of shape \(4,\), as gpt-oss passes it\)"):
        _attention_call(s_aux=torch.zeros(1, 4, 6, 1))
    out, _ = _attention_call(s_aux=torch.zeros(4), softcap=2.0, sliding_window=None)  # (B, N, H, D)
    assert out.shape == (1, 6, 4, 8)
