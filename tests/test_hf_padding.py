"""Left padding through attn_implementation="sparse_attn" (issue 23, item 3): the pattern's positions count from
each row's first token, as the model's own position_ids do, so a padded row computes what its prompt alone
computes, in the prefill and in every decode step, with a dynamic, a static and a SparseCache."""

import pytest
import torch

import sparse_attn as sa

transformers = pytest.importorskip("transformers", minversion="4.54",
                                   reason='needs transformers >= 4.54: pip install ".[hf]"')
from transformers import AutoModelForCausalLM  # noqa: E402

from sparse_attn.integrations.transformers import CACHE_KEYWORD, SparseCache, register  # noqa: E402
from tests.helpers import CPU_BACKEND, VOCAB, tiny_config  # noqa: E402

PATTERNS = {"sinks": sa.Local(3, 0) | sa.Sink(first=2),                 # evicts early in a SparseCache
            "globals": sa.Local(3) | sa.Global(first=2)}
LENGTHS = (12, 7, 4)                                                    # rows 1 and 2: 5 and 8 padding tokens


def _model(pattern_name):
    torch.manual_seed(0)
    name = register(PATTERNS[pattern_name], name=f"sparse_attn_test_padding_{pattern_name}", backend=CPU_BACKEND)
    return AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=name).eval()


def _prompts():
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in LENGTHS]
    n = max(LENGTHS)
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, n - len(prompt):], mask[row, n - len(prompt):] = prompt, 1
    return prompts, ids, mask                                            # left-padded (B, N)


@pytest.mark.parametrize("pattern_name", sorted(PATTERNS))
def test_a_left_padded_row_equals_its_prompt_alone(pattern_name):
    """Sinks and globals used to land on the padding: the logits differed by 0.15 (sdpa: 1.5e-7)."""
    model = _model(pattern_name)
    prompts, ids, mask = _prompts()
    logits = model(input_ids=ids, attention_mask=mask).logits                       # (B, N, V)
    for row, prompt in enumerate(prompts):
        alone = model(input_ids=prompt[None]).logits[0]                             # (n, V)
        torch.testing.assert_close(logits[row, -len(prompt):], alone, atol=1e-5, rtol=1e-5)


def _generate(model, ids, mask, cache, tokens=10):
    options = {CACHE_KEYWORD: SparseCache(model)} if cache == "sparse" else \
        {"cache_implementation": "static"} if cache == "static" else {}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True, **options)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1)            # (B, tokens), (B, tokens, V)


@pytest.mark.parametrize("cache", ["dynamic", "static", "sparse"])
def test_generate_from_a_left_padded_batch_equals_generate_per_prompt(cache):
    """Used to diverge from the 6th token."""
    model = _model("sinks")
    prompts, ids, mask = _prompts()
    tokens, scores = _generate(model, ids, mask, cache)
    for row, prompt in enumerate(prompts):
        alone_tokens, alone_scores = _generate(model, prompt[None], torch.ones(1, len(prompt), dtype=torch.long),
                                               cache)
        torch.testing.assert_close(tokens[row:row + 1], alone_tokens, rtol=0, atol=0)
        torch.testing.assert_close(scores[row:row + 1], alone_scores, atol=1e-5, rtol=1e-5)
    assert len(set(tokens[0].tolist())) > 2                                          # not one token repeated


def test_a_sparse_cache_keeps_each_rows_sinks():
    model = _model("sinks")
    _, ids, mask = _prompts()
    cache = SparseCache(model)
    model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                   **{CACHE_KEYWORD: cache})
    pads = [max(LENGTHS) - n for n in LENGTHS]
    for layer in cache.layers:
        assert layer.kv.starts.tolist() == pads
        held = set(layer.kv.positions.tolist())
        assert {p + s for p in (0, 1) for s in pads} <= held and len(held) < cache.get_seq_length()

