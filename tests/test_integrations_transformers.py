"""sparse_attn.integrations.transformers: attn_implementation="sparse_attn" for BERT, RoBERTa and Llama
(GQA), against the models' own eager attention; training, generation with a dynamic and a static KV cache,
to_long_model; models it cannot run (own attention layers, cross-attention, score changes) are refused."""
import doctest
import importlib
import json
import re
import subprocess
import sys
import warnings

import pytest
import torch

import sparse_attn as sa

transformers = pytest.importorskip("transformers", minversion="4.54",
                                   reason='needs transformers >= 4.54: pip install ".[hf]"')
from transformers import (  # noqa: E402
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BartConfig,
    BigBirdConfig,
    DataCollatorWithFlattening,
    LongformerConfig,
    MistralConfig,
    T5Config,
    T5EncoderModel,
)

from sparse_attn.integrations.transformers import CACHE_KEYWORD, SparseCache, register, to_long_model  # noqa: E402
from tests.helpers import CPU_BACKEND, ROOT, VOCAB, python_blocks, tiny_config, twins  # noqa: E402

DENSE = register(sa.Dense(), name="sparse_attn_test_dense", backend=CPU_BACKEND)
LOCAL = register(sa.Local(3) | sa.Global(first=1), name="sparse_attn_test_local", backend=CPU_BACKEND)


def _batch(n=40, left=False):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, n), generator=gen)
    lengths = torch.tensor([n, n - 9, 12])
    keep = torch.arange(n) < lengths[:, None]                                   # (B, N), True = token
    if left:
        keep = keep.flip(1)
    return ids, keep.long()


@pytest.mark.parametrize("kind", ["bert", "roberta", "llama"])
def test_dense_pattern_equals_eager_attention(kind):
    eager, ours = twins(tiny_config(kind), DENSE)
    ids, mask = _batch()
    expected = eager(input_ids=ids, attention_mask=mask).last_hidden_state
    out = ours(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(input_ids=ids).last_hidden_state, eager(input_ids=ids).last_hidden_state,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_output_attentions_warns_and_returns_what_sdpa_returns(kind):
    _, ours = twins(tiny_config(kind), LOCAL)
    _, sdpa = twins(tiny_config(kind), "sdpa")
    ids, mask = _batch()
    with pytest.warns(UserWarning, match="does not support output_attentions=True: sparse_attn never materialises"):
        outputs = ours(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert outputs.attentions == sdpa(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(input_ids=ids, attention_mask=mask)


def test_dense_pattern_equals_eager_with_left_padding():
    eager, ours = twins(tiny_config("llama"), DENSE)
    ids, mask = _batch(left=True)
    keep = mask.bool()
    expected = eager(input_ids=ids, attention_mask=mask).last_hidden_state
    out = ours(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out[keep], expected[keep], atol=1e-5, rtol=1e-5)


def _pattern_mask(pattern, keep, causal):
    """Eager's additive 4D mask (B, 1, N, N) for ``pattern`` with padding."""
    n = keep.shape[1]
    allowed = pattern.mask(n)[None] & keep.bool()[:, None, None, :]
    if causal:
        allowed = allowed & sa.Causal().mask(n)[None]
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_sparse_pattern_equals_eager_with_the_pattern_as_mask(kind):
    eager, ours = twins(tiny_config(kind), LOCAL)
    ids, mask = _batch()
    keep = mask.bool()
    expected = eager(input_ids=ids, attention_mask=_pattern_mask(sa.Local(3) | sa.Global(first=1), mask,
                                                                 causal=kind == "llama")).last_hidden_state
    out = ours(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out[keep], expected[keep], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[keep], eager(input_ids=ids, attention_mask=mask).last_hidden_state[keep], atol=1e-3)


def test_config_pattern_overrides_the_registered_one():
    eager, ours = twins(tiny_config("bert"), DENSE)
    ours.config.sparse_attn_pattern = sa.Local(2).to_dict()
    ids, mask = _batch()
    expected = eager(input_ids=ids, attention_mask=_pattern_mask(sa.Local(2), mask, causal=False)).last_hidden_state
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()],
                               expected[mask.bool()], atol=1e-5, rtol=1e-5)
    saved = json.loads(ours.config.to_json_string())
    assert sa.Pattern.from_dict(saved["sparse_attn_pattern"]) == sa.Local(2)


@pytest.mark.slow
def test_training_step_encoder():
    torch.manual_seed(0)
    config = tiny_config("bert", num_labels=2, attention_probs_dropout_prob=0.1)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation=LOCAL).train()
    ids, mask = _batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 1])).loss
    loss.backward()
    grad = model.bert.encoder.layer[0].attention.self.query.weight.grad
    assert torch.isfinite(loss) and grad is not None and grad.abs().sum() > 0


def test_training_step_decoder():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=LOCAL).train()
    ids, mask = _batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    grad = model.model.layers[0].self_attn.k_proj.weight.grad
    assert torch.isfinite(loss) and grad is not None and grad.abs().sum() > 0


@pytest.mark.parametrize("left_padding", [False, True])
def test_decoding_with_kv_cache_matches_full_forward(left_padding):
    """Each decoded token's logits equal the full-sequence forward: the pattern is aligned to the end."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=LOCAL).eval()
    ids, mask = _batch(n=16, left=left_padding)
    full = model(input_ids=ids, attention_mask=mask).logits                     # (B, N, V)
    prefill = 10
    out = model(input_ids=ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
    cache, steps = getattr(out, CACHE_KEYWORD), [out.logits]
    for t in range(prefill, ids.shape[1]):
        out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], use_cache=True, **{CACHE_KEYWORD: cache})
        cache = getattr(out, CACHE_KEYWORD)
        steps.append(out.logits)
    keep = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[keep], full[keep], atol=1e-5, rtol=1e-5)


def test_generate_with_causal_sparse_pattern():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=LOCAL).eval()
    ids, mask = _batch(n=12, left=True)
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=mask)
    cached = model.generate(ids, use_cache=True, **options)
    assert cached.shape == (3, 20)
    torch.testing.assert_close(cached, model.generate(ids, use_cache=False, **options))


@pytest.mark.parametrize("left_padding", [False, True])
def test_static_cache_generates_what_the_dynamic_cache_generates(left_padding):
    """A static cache hands the attention all its slots; only the written ones are keys, the queries the last."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=LOCAL).eval()
    ids, mask = _batch(n=12, left=left_padding)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=mask)
    static = model.generate(ids, cache_implementation="static", **options)
    torch.testing.assert_close(static, model.generate(ids, **options))
    no_padding = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    torch.testing.assert_close(no_padding, model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))


def test_sliding_window_cache_is_refused():
    """A sliding-window layer's cache drops old keys: positions shift and a pattern's global keys are gone."""
    torch.manual_seed(0)
    llama = tiny_config("llama")
    config = MistralConfig(**{k: v for k, v in llama.to_dict().items() if k in llama.__dict__}, sliding_window=6)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=LOCAL).eval()
    ids, _ = _batch(n=12)
    with pytest.raises(ValueError, match=f"the model's cache dropped the first .* build the model with "
                                         f"config.sliding_window=None .* generate with {CACHE_KEYWORD}="
                                         f"SparseCache\\(model\\)"):
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_cached_call_needs_a_mask_over_cached_and_new_tokens():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=LOCAL).eval()
    ids, mask = _batch(n=12)
    cache = getattr(model(input_ids=ids[:, :10], attention_mask=mask[:, :10], use_cache=True), CACHE_KEYWORD)
    with pytest.raises(ValueError, match=r"attention_mask covers 2 tokens but the model sees 12 \(10 cached and 2 "
                                         r"new\); pass an attention_mask over all of them"):
        model(input_ids=ids[:, 10:], attention_mask=mask[:, 10:], **{CACHE_KEYWORD: cache})


def test_4d_padding_mask_is_accepted_and_a_structured_one_refused():
    eager, ours = twins(tiny_config("bert"), LOCAL)
    ids, mask = _batch()
    padding_4d = torch.zeros(3, 1, 40, 40).masked_fill(~mask.bool()[:, None, None, :], torch.finfo(torch.float32).min)
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=padding_4d).last_hidden_state,
                               ours(input_ids=ids, attention_mask=mask).last_hidden_state)
    with pytest.raises(ValueError, match=r"a 4D attention_mask of shape \(3, 1, 40, 40\) that is more than padding "
                                         r"cannot be honoured"):
        ours(input_ids=ids, attention_mask=_pattern_mask(sa.Local(2), mask, causal=False))


_TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB)


@pytest.mark.parametrize("config, layer", [
    (LongformerConfig(**_TINY, attention_window=8), "LongformerSelfAttention"),
    (BigBirdConfig(**_TINY), "BigBirdSelfAttention"),
])
def test_models_with_their_own_attention_layers_are_refused_when_built(config, layer):
    """Longformer crashed at the first forward; BigBird silently ran its own attention."""
    message = (f"{type(AutoModel.from_config(config)).__name__} computes attention in its own layers \\({layer}\\) "
               f"instead of calling transformers' AttentionInterface, .* sparse_attn.nn.SparseSelfAttention")
    with pytest.raises(ValueError, match=message):
        AutoModel.from_config(config, attn_implementation=LOCAL)
    with pytest.raises(ValueError, match=message):
        to_long_model(AutoModel.from_config(config), 4096)


def test_encoder_decoder_models_are_refused_when_built():
    config = BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="BartModel has cross-attention .* query i and key j are positions in two "
                                         "different sequences"):
        AutoModel.from_config(config, attn_implementation=DENSE)


@pytest.mark.parametrize("build, argument", [  # Gemma 2's softcap runs since issue 27: tests/test_hf_score_mods.py
    (lambda: T5EncoderModel._from_config(T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                                  vocab_size=VOCAB, is_encoder_decoder=False),
                                         attn_implementation=DENSE), "position_bias"),
])
def test_models_that_change_the_scores_are_refused(build, argument):
    """T5's position bias was silently dropped."""
    model = build().eval()
    with pytest.raises(ValueError, match=f"passes {argument}= to the attention function.* use "
                                         f"attn_implementation='sdpa' or 'eager' for this model"):
        model(input_ids=torch.randint(3, VOCAB, (2, 10)))


def test_to_long_model_tiles_positions_and_runs():
    torch.manual_seed(0)
    for kind, offset in (("bert", 0), ("roberta", 2)):
        config = tiny_config(kind, max_position_embeddings=32 + offset, num_labels=2)
        model = AutoModelForSequenceClassification.from_config(config)
        old = model.base_model.embeddings.position_embeddings.weight.detach().clone()
        model = to_long_model(model, 200, sa.Local(8) | sa.Global(first=1))
        new = model.base_model.embeddings.position_embeddings.weight
        assert new.shape == (200 + offset, 32) and model.config.max_position_embeddings == 200 + offset
        torch.testing.assert_close(new[:offset + 32], old)
        torch.testing.assert_close(new[offset + 32:offset + 64], old[offset:])
        torch.testing.assert_close(new[offset + 192:], old[offset:offset + 8])
        assert model.base_model.embeddings.position_ids.shape == (1, 200 + offset)
        assert model.config._attn_implementation == "sparse_attn"
        assert sa.Pattern.from_dict(model.config.sparse_attn_pattern) == sa.Local(8) | sa.Global(first=1)
        ids = torch.randint(3, VOCAB, (2, 200))
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([0, 1])).loss
        loss.backward()
        assert torch.isfinite(loss)


def test_save_and_reload_keep_the_pattern_and_positions(tmp_path):
    """from_pretrained(path) restores attn_implementation="sparse_attn" from the saved pattern (it loaded sdpa)."""
    torch.manual_seed(0)
    model = to_long_model(AutoModel.from_config(tiny_config("bert", max_position_embeddings=64)), 256,
                          sa.Local(8) | sa.Global(first=1)).eval()
    model.save_pretrained(tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path).eval()
    assert reloaded.config._attn_implementation == "sparse_attn"
    assert sa.Pattern.from_dict(reloaded.config.sparse_attn_pattern) == sa.Local(8) | sa.Global(first=1)
    ids = torch.randint(3, VOCAB, (2, 256))
    torch.testing.assert_close(reloaded(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)
    assert AutoModel.from_pretrained(tmp_path, attn_implementation="sdpa").config._attn_implementation == "sdpa"


def test_register_without_a_pattern_warns_naming_the_default_it_runs():
    name = register(name="sparse_attn_test_no_pattern", backend=CPU_BACKEND)
    with pytest.warns(UserWarning, match=r"attn_implementation='sparse_attn_test_no_pattern' runs this llama model "
                                         r"with sparse_attn's default pattern Local\(256\) \| Global\(first=1\) .* "
                                         r"register\(pattern, name='sparse_attn_test_no_pattern'\) or "
                                         r"model.config.sparse_attn_pattern = pattern.to_dict\(\)"):
        AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=name)
    with_pattern = tiny_config("llama")
    with_pattern.sparse_attn_pattern = sa.Local(4).to_dict()
    llama = tiny_config("llama")
    sliding = MistralConfig(**{k: v for k, v in llama.to_dict().items() if k in llama.__dict__},
                            sliding_window=6)                                 # its own windows: Local(5, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for config, implementation in [(with_pattern, name), (sliding, name), (tiny_config("llama"), LOCAL)]:
            AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    assert not [w for w in caught if "default pattern" in str(w.message)]


def test_an_unregistered_sparse_attn_name_points_at_register():
    """Forgetting register() or mistyping the name gave transformers' generic 'is not supported'."""
    with pytest.raises(ValueError, match=r"attn_implementation='sparse_atn' is not registered \(registered in this "
                                         r"process: .*\)\. .*transformers.register\(\), called once per process "
                                         r"before the model is built or loaded: .*, or did you mean 'sparse_attn'\?"):
        AutoModel.from_config(tiny_config("bert"), attn_implementation="sparse_atn")
    with pytest.raises(ValueError, match="did you mean 'sparse_attn_test_local'"):
        AutoModel.from_config(tiny_config("bert"), attn_implementation="sparse_attn_test_locl")
    with pytest.raises(ValueError, match='Specified `attn_implementation="eagre"` is not supported'):
        AutoModel.from_config(tiny_config("bert"), attn_implementation="eagre")            # transformers' own error


def test_the_default_name_before_register_says_to_call_register_first(monkeypatch):
    """attn_implementation="sparse_attn" before register() was answered "did you mean 'sparse_attn'?", the very
    name typed. Run here as in a fresh process: no name registered, none in transformers' table either."""
    from sparse_attn.integrations.transformers import attention
    monkeypatch.setattr(attention, "registration", lambda name: None)
    monkeypatch.setattr(attention, "registered_names", lambda: [])
    monkeypatch.setattr(attention, "ALL_ATTENTION_FUNCTIONS", {})
    with pytest.raises(ValueError) as caught:
        AutoModel.from_config(tiny_config("bert"), attn_implementation="sparse_attn")
    assert str(caught.value) == (
        "attn_implementation='sparse_attn' is not registered. sparse_attn's attention runs under a name given to "
        "sparse_attn.integrations.transformers.register(), called once per process before the model is built or "
        "loaded: call register(pattern) first, which registers the name 'sparse_attn'")
    with pytest.raises(ValueError, match=r"is not registered\. .*: register\(pattern, name='sparse_atn'\), or did you "
                                         r"mean 'sparse_attn'\?$"):
        AutoModel.from_config(tiny_config("bert"), attn_implementation="sparse_atn")


def test_the_default_pattern_warning_comes_once_per_model():
    """A LlamaForCausalLM and the LlamaModel inside it share one config and each runs the build check: the warning
    came twice for one model."""
    name = register(name="sparse_attn_test_warn_once", backend=CPU_BACKEND)
    for _ in range(2):                                                           # a second model warns again
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            llm = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=name)
            llm.set_attn_implementation("sdpa")
            llm.set_attn_implementation(name)                                    # switched back: the same model
        assert len([w for w in caught if "default pattern" in str(w.message)]) == 1


@pytest.mark.slow  # a fresh Python process imports transformers
def test_a_fresh_process_that_imports_the_integration_but_never_registers(tmp_path):
    """register() forgotten: the error points at it; a saved sparse model still loads as one."""
    model = to_long_model(AutoModel.from_config(tiny_config("bert", max_position_embeddings=64)), 128, sa.Local(4))
    model.save_pretrained(tmp_path)
    code = f"""
import sparse_attn.integrations.transformers
from transformers import AutoModel, BertConfig
try:
    AutoModel.from_config(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64), attn_implementation="sparse_attn")
except ValueError as error:
    print(error)
print(AutoModel.from_pretrained({str(tmp_path)!r}).config._attn_implementation)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=sa.__path__[0] + "/..")
    message, implementation = result.stdout.strip().splitlines()
    assert message.startswith("attn_implementation='sparse_attn' is not registered. sparse_attn's attention runs "
                              "under a name given to sparse_attn.integrations.transformers.register()")
    assert message.endswith(": call register(pattern) first, which registers the name 'sparse_attn'")
    assert implementation == "sparse_attn"


def test_docs_and_errors_teach_the_current_cache_keyword():
    """transformers 5.x renamed generate(past_key_values=...) to cache= and warns that the old name goes away:
    CACHE_KEYWORD is the installed transformers' name (no warning), and the docs teach the current one."""
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=LOCAL).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)                  # transformers' deprecation warning
        model.generate(torch.randint(3, VOCAB, (1, 4)), max_new_tokens=2, pad_token_id=0,
                       **{CACHE_KEYWORD: SparseCache(model)})
    for path in (ROOT / "docs" / "integrations.md", ROOT / "docs" / "decoding.md"):
        assert not [str(block) for block in python_blocks(path) if "past_key_values=" in block.source]


def test_errors():
    with pytest.raises(TypeError, match="pattern must be a sparse_attn Pattern"):
        register("local")
    with pytest.raises(ValueError, match="name must be a new attn_implementation name"):
        register(sa.Local(4), name="sdpa")
    with pytest.raises(ValueError, match="backend must be one of .* got 'trition'"):
        register(sa.Local(4), backend="trition")
    llama = AutoModel.from_config(tiny_config("llama"))
    with pytest.raises(ValueError, match="to_long_model needs a BERT/RoBERTa-style model"):
        to_long_model(llama, 4096)
    bert = AutoModel.from_config(tiny_config("bert"))
    with pytest.raises(ValueError, match="max_positions=64 must exceed the model's 128 positions"):
        to_long_model(bert, 64)
    with pytest.raises(ValueError, match="max_positions must be >= 1, got 0"):
        to_long_model(bert, 0)
    with pytest.raises(TypeError, match=r"max_positions must be an int, got 4096.0 \(float\)"):
        to_long_model(bert, 4096.0)
    with pytest.raises(TypeError, match="pattern must be a sparse_attn Pattern such as .*, got str: 'local'"):
        to_long_model(bert, 4096, "local")
    _, ours = twins(tiny_config("bert"), DENSE)
    with pytest.raises(ValueError, match=r"sparse_attn needs a padding mask of shape \(batch, kv_length\)"):
        ours(input_ids=torch.ones(2, 10, dtype=torch.long), attention_mask=torch.ones(2, 1, 10, 7))


def test_without_transformers_private_hook_the_integration_warns_naming_the_version(monkeypatch):
    """The integration wraps PreTrainedModel._check_and_adjust_attn_implementation, a transformers private: a
    transformers without it gets a warning that names its version and what is lost, not an AttributeError."""
    from sparse_attn.integrations.transformers import build_hook
    assert getattr(transformers.PreTrainedModel, build_hook.HOOK).checks_sparse_attn   # wrapped at import
    monkeypatch.delattr(transformers.PreTrainedModel, build_hook.HOOK)
    with pytest.warns(RuntimeWarning, match=f"transformers {re.escape(transformers.__version__)} has no "
                                            f"PreTrainedModel._check_and_adjust_attn_implementation, .* models it "
                                            f"cannot run are not refused, .* call check_model\\(model\\)"):
        assert build_hook.wrap_attn_implementation_check(lambda model, asked: asked, lambda model, chosen: None) \
            is False
    assert not hasattr(transformers.PreTrainedModel, build_hook.HOOK)


@pytest.mark.parametrize("module", ["registry", "masks", "cache", "attention", "model_checks", "build_hook"])
def test_docstring_examples_of_each_module(module):
    """The package's own docstring runs in tests/test_packaging.py; each module's here."""
    imported = importlib.import_module(f"sparse_attn.integrations.transformers.{module}")
    result = doctest.testmod(imported, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_the_public_names_users_import():
    """The names the single module had, now re-exported by the package."""
    import sparse_attn.integrations.transformers as integration
    assert sorted(integration.__all__) == ["CACHE_KEYWORD", "DEFAULT_PATTERN", "SparseCache", "SparseCacheLayer",
                                           "check_model", "first_tokens", "model_pattern", "own_patterns",
                                           "packed_documents", "padding_mask", "register", "to_long_model"]
    assert all(hasattr(integration, name) for name in integration.__all__)


def test_sparse_attn_nn_does_not_import_transformers():
    code = "import sys, sparse_attn.nn; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=sa.__path__[0] + "/..")


# Packed batches: several documents in one row, as DataCollatorWithFlattening makes them.
DOCUMENT_LENGTHS = (9, 1, 14, 5)  # a one-token document, documents longer than Local(3)'s window


def _documents(lengths=DOCUMENT_LENGTHS):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]


def _packed(documents, **collator_options):
    """DataCollatorWithFlattening's batch of ``documents``, without labels: (1, total) tensors."""
    batch = DataCollatorWithFlattening(**collator_options)([{"input_ids": d.tolist()} for d in documents])
    batch.pop("labels")
    return batch


def _per_document(packed_output, documents):
    return torch.split(packed_output[0], [len(d) for d in documents])


def _assert_packed_equals_separate(model, output, documents, **collator_options):
    """Every document's slice of the packed forward equals the document run by itself."""
    packed = _per_document(getattr(model(**_packed(documents, **collator_options)), output), documents)
    for document, out in zip(documents, packed):
        torch.testing.assert_close(out, getattr(model(input_ids=document[None]), output)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("collator_options", [
    {},                                                          # position_ids restarting at 0
    {"return_flash_attn_kwargs": True},                          # cu_seq_lens_q/k and position_ids
    {"return_flash_attn_kwargs": True, "return_position_ids": False},  # cu_seq_lens_q/k only
])
def test_packed_batch_equals_documents_one_by_one_decoder(collator_options):
    """Llama (causal, rotary positions): the pattern runs per document, Global(first=1) at each one's start."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=LOCAL).eval()
    documents = _documents()
    _assert_packed_equals_separate(model, "logits", documents, **collator_options)
    # Without the packing information the row is one sequence: later documents see earlier ones.
    ids = torch.cat(documents)[None]
    as_one = _per_document(model(input_ids=ids).logits, documents)
    assert not torch.allclose(as_one[2], model(input_ids=documents[2][None]).logits[0], atol=1e-3)


@pytest.mark.parametrize("kind, start", [("bert", 0), ("roberta", 2)])
def test_packed_batch_equals_documents_one_by_one_encoder(kind, start):
    """BERT and RoBERTa (absolute positions: RoBERTa's start after padding_idx, position_ids_start=2)."""
    torch.manual_seed(0)
    model = AutoModel.from_config(tiny_config(kind), attn_implementation=LOCAL).eval()
    documents = _documents()
    _assert_packed_equals_separate(model, "last_hidden_state", documents, position_ids_start=start)
    _assert_packed_equals_separate(model, "last_hidden_state", documents, position_ids_start=start,
                                   return_flash_attn_kwargs=True)


def test_padded_rows_of_packed_documents():
    """Two packed rows with right padding (attention_mask): documents from the position_ids of real tokens."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=LOCAL).eval()
    rows = [_documents((5, 7)), _documents((10, 6))]
    n = 16
    ids = torch.zeros(2, n, dtype=torch.long)
    positions = torch.zeros(2, n, dtype=torch.long)
    mask = torch.zeros(2, n, dtype=torch.long)
    for b, documents in enumerate(rows):
        total = sum(len(d) for d in documents)
        ids[b, :total] = torch.cat(documents)
        positions[b, :total] = torch.cat([torch.arange(len(d)) for d in documents])
        mask[b, :total] = 1
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    for b, documents in enumerate(rows):
        for document, out in zip(documents, torch.split(logits[b, :sum(len(d) for d in documents)],
                                                        [len(d) for d in documents])):
            torch.testing.assert_close(out, model(input_ids=document[None]).logits[0], atol=1e-5, rtol=1e-5)


def test_packed_batches_with_a_kv_cache_are_refused_at_the_cached_step():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=LOCAL).eval()
    documents = _documents((6, 4))
    cache = getattr(model(**_packed(documents), use_cache=True), CACHE_KEYWORD)  # the packed forward runs
    with pytest.raises(ValueError, match=r"LlamaAttention's KV cache was filled by a packed batch, .* \(10 cached "
                                         r"keys, 1 new queries\); .* pass use_cache=False"):
        model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[4]]), **{CACHE_KEYWORD: cache})
    prompt = torch.cat(documents)[None, :7]
    cache = getattr(model(input_ids=prompt, use_cache=True), CACHE_KEYWORD)  # a new prefill: one sequence
    with pytest.raises(ValueError, match=r"position_ids restart within a cached step \(7 cached keys, 3 new"):
        model(input_ids=torch.tensor([[5, 6, 7]]), position_ids=torch.tensor([[7, 0, 1]]), **{CACHE_KEYWORD: cache})
    flash = _packed(documents, return_flash_attn_kwargs=True)
    cache = getattr(model(input_ids=flash["input_ids"][:, :4], use_cache=True), CACHE_KEYWORD)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q/k \(packed sequences\) with 4 cached keys"):
        model(**flash, **{CACHE_KEYWORD: cache})
    cache = getattr(model(input_ids=prompt, use_cache=True), CACHE_KEYWORD)
    step = model(input_ids=torch.tensor([[5]]), **{CACHE_KEYWORD: cache}).logits   # not packed: decodes
    torch.testing.assert_close(step[0, -1], model(input_ids=torch.cat([prompt, torch.tensor([[5]])], 1)).logits[0, -1],
                               atol=1e-5, rtol=1e-5)


def test_packing_information_that_cannot_be_honoured_is_refused():
    torch.manual_seed(0)
    model = AutoModel.from_config(tiny_config("bert"), attn_implementation=LOCAL).eval()
    ids = torch.randint(3, VOCAB, (2, 8))
    offsets = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q/k must describe one packed row of 8 tokens \(batch 1, "
                                         r"offsets up to 8\), as DataCollatorWithFlattening produces, got batch 2"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), cu_seq_lens_q=offsets, cu_seq_lens_k=offsets)
    with pytest.raises(ValueError, match="packed sequences need cu_seq_lens_q == cu_seq_lens_k"):
        model(input_ids=ids[:1], cu_seq_lens_q=offsets, cu_seq_lens_k=torch.tensor([0, 8], dtype=torch.int32))
