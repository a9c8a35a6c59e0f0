"""Every pattern kind, listed once in ``pattern.KINDS``, reaches every place that means something per kind:
the public names, pattern text, serialisation, the rules, FlexAttention's predicate and decoding's retention.

A new kind fails here until it has all of them; docs/architecture.md lists the steps.
"""
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import sparse_attn as sa
from sparse_attn import flex
from sparse_attn.expression import CONSTRUCTORS, parse_pattern
from sparse_attn.pattern import KINDS
from sparse_attn.retention import ANALYSES, retention
from sparse_attn.rules import RESOLVERS

N, HEADS = 16, 2
EXAMPLES = {  # one pattern of every kind, at N tokens and HEADS heads; a new kind adds one
    "local": sa.Local(3, 1),
    "stride": sa.Stride(3, offset=1),
    "dilated": sa.Dilated(2, 2),
    "global": sa.Global(tokens=(5,), first=1),
    "sink": sa.Sink(first=2),
    "causal": sa.Causal(),
    "dense": sa.Dense(),
    "random": sa.Random(1, seed=3, block_size=4),
    "blocks": sa.Blocks([[1, 0], [1, 1]], 8),
    "union": sa.Local(1) | sa.Global(first=1),
    "intersection": sa.Local(4) & sa.Causal(),
    "complement": ~sa.Local(1),
    "per_head": sa.PerHead([sa.Local(1), sa.Sink(first=1)]),
}


def test_every_kind_has_an_example_of_its_class():
    assert list(EXAMPLES) == list(KINDS), "add an example of the new kind to EXAMPLES, in KINDS' order"
    assert all(type(EXAMPLES[kind]) is cls for kind, cls in KINDS.items())


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_exported_by_its_class_name(kind):
    cls = KINDS[kind]
    assert cls.__name__ in sa.__all__ and getattr(sa, cls.__name__) is cls


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_nameable_in_pattern_text_and_its_repr_parses_back(kind):
    pattern = EXAMPLES[kind]
    assert CONSTRUCTORS[type(pattern).__name__] is type(pattern)
    assert parse_pattern(repr(pattern)) == (pattern, None)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_round_trips_through_a_dict(kind):
    pattern = EXAMPLES[kind]
    assert sa.Pattern.from_dict(pattern.to_dict()) == pattern


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_has_a_rule_a_layout_and_a_mask_mod_that_agree(kind):
    pattern = EXAMPLES[kind]
    assert kind in RESOLVERS and kind in flex.BUILDERS
    mask = pattern.mask(N, heads=HEADS)                                        # (HEADS, N, N)
    assert mask.any() and not mask.all() or kind == "dense", "the example shows nothing of its kind"
    assert torch.equal(pattern.layout(N, heads=HEADS, block_size=4).to_dense()[0], mask)
    assert torch.equal(create_mask(pattern.mask_mod(N, heads=HEADS), 1, HEADS, N, N, device="cpu")[0], mask)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_has_retention_that_keeps_every_key_a_later_query_reaches(kind):
    assert kind in ANALYSES
    kept = retention(EXAMPLES[kind], heads=HEADS)
    if not kept.bounded:             # keeps everything, and says why
        assert kept.reason and all(kept.kept(t, N).tolist() == list(range(N)) for t in range(N))
        return
    for t in range(N):
        reached = torch.zeros(t, dtype=torch.bool)
        for i in range(t, N):        # the query at position i decodes over keys 0 .. i
            reached |= EXAMPLES[kind].mask(1, i + 1, heads=HEADS)[:, 0, :t].any(dim=0)
        assert set(reached.nonzero().flatten().tolist()) <= set(kept.kept(t, N).tolist()), f"t={t}"


def test_a_kind_without_retention_is_a_clear_error():
    class Unknown(sa.Pattern):
        pass

    Unknown.kind = "unknown"  # set after the class is made, so it stays out of KINDS
    with pytest.raises(TypeError, match="no retention for Unknown [(]kind 'unknown'[)]: a pattern kind needs an "
                                        "entry in sparse_attn.retention.ANALYSES"):
        retention(Unknown())


def test_kinds_cannot_be_changed_from_outside():
    with pytest.raises(TypeError):
        KINDS["local"] = sa.Dense
