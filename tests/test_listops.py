"""benchmarks/listops.py: the generator against an independent evaluator, its determinism and length limits, and
training end to end at a tiny size (a few steps, seconds)."""
import dataclasses
import doctest
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("listops_benchmark", ROOT / "benchmarks" / "listops.py")
listops = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = listops            # dataclasses and the worker processes look the module up by name
_spec.loader.exec_module(listops)

WORDS = {**{str(d): d + 1 for d in range(10)}, "[MIN": 11, "[MAX": 12, "[MED": 13, "[SM": 14, "]": 15}


def tokens_of(text: str) -> np.ndarray:
    """ListOps text as token ids, from the ids the script documents (PAD 0, digit d -> d + 1, operators 11..14,
    "]" 15), written out here rather than taken from the script."""
    return np.array([WORDS[word] for word in text.split()], dtype=np.uint8)


def evaluate(tokens) -> tuple[int, int, int]:
    """A second evaluator, over the token list with a stack (the script's recurses while it generates): the value,
    the deepest operator nesting and the most arguments of one operator. Raises on a malformed expression."""
    operations = {11: min, 12: max, 13: lambda args: int(statistics.median(args)), 14: lambda args: sum(args) % 10}
    stack, deepest, widest = [], 0, 0                        # stack: [operator, its arguments so far]
    value = None
    for token in (int(t) for t in tokens):
        assert value is None, "tokens after the end of the expression"
        if token in operations:
            stack.append([token, []])
            deepest = max(deepest, len(stack))
            continue
        if token == 15:
            operator, args = stack.pop()
            widest = max(widest, len(args))
            result = operations[operator](args)
        else:
            assert 1 <= token <= 10, f"unknown token {token}"
            result = token - 1
        if stack:
            stack[-1][1].append(result)
        else:
            value = result
    assert value is not None and not stack, "an unclosed expression"
    return value, deepest, widest


def test_docstring_examples():
    assert doctest.testmod(listops).failed == 0


@pytest.mark.parametrize("text, value", [
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9), ("[MED 1 2 3 4 ]", 2), ("[MED 7 1 3 ]", 3), ("[SM 5 7 [MAX 1 8 ] ]", 0),
    ("[MIN [SM 9 9 ] [MED 8 9 ] ]", 8), ("[MED 9 0 ]", 4),
])
def test_the_evaluator_and_the_operators_on_hand_worked_expressions(text, value):
    assert evaluate(tokens_of(text))[0] == value
    operator, *args = text.split()[:-1]
    if all(a.isdigit() for a in args):                      # one operator over digits: the script's apply too
        assert listops.apply(operator[1:], [int(a) for a in args]) == value
    assert listops.text(tokens_of(text)) == text


@pytest.fixture(scope="module")
def generated():
    return {split: listops.generate(split, size) for split, size in (("train", 300), ("validation", 60),
                                                                     ("test", 60))}


def test_labels_agree_with_an_independent_evaluator(generated):
    for split in generated.values():
        assert [evaluate(t)[0] for t in split.tokens] == split.labels.tolist()


def test_lengths_depth_and_arguments_are_lra_s(generated):
    for split in generated.values():
        lengths = split.lengths
        assert (lengths > 500).all() and (lengths < 2000).all()
        shapes = [evaluate(t)[1:] for t in split.tokens]
        assert max(deepest for deepest, _ in shapes) <= 9          # operators below depth 10, digits down to 10
        assert max(widest for _, widest in shapes) <= 10
        assert all(t[0] in (11, 12, 13, 14) for t in split.tokens)  # every kept expression is an operator's
    lengths = generated["train"].lengths
    assert lengths.min() < 600 and lengths.max() > 1700             # the whole range is drawn
    assert len(np.unique(generated["train"].labels)) == 10


def test_generation_is_deterministic_and_a_smaller_split_is_a_prefix(generated):
    again = listops.generate("test", 60)
    assert all((a == b).all() for a, b in zip(again.tokens, generated["test"].tokens))
    assert (again.labels == generated["test"].labels).all()
    two_workers = listops.generate("train", 1200, workers=2)        # streams of 1,000: two chunks, two processes
    assert all((a == b).all() for a, b in zip(two_workers.tokens, generated["train"].tokens))
    assert len(two_workers.tokens) == 1200
    other_seed = listops.generate("test", 60, seed=1)
    assert not any(np.array_equal(a, b) for a, b in zip(other_seed.tokens, generated["test"].tokens))


def test_splits_and_examples_are_distinct(generated):
    seen = [t.tobytes() for split in generated.values() for t in split.tokens]
    assert len(set(seen)) == len(seen)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="split must be one of train, validation, test, got 'valid'"):
        listops.generate("valid", 3)
    with pytest.raises(ValueError, match="size must be an int >= 1, got 0"):
        listops.generate("test", 0)


def test_every_pattern_runs_with_the_recipe_s_heads():
    recipe = listops.RECIPES["cpu"]
    for pattern, _, _ in listops.PATTERNS.values():
        pattern.check_heads(recipe.heads)


def short_split(texts: list[str]):
    tokens = [tokens_of(text) for text in texts]
    return listops.Split(tokens, np.array([evaluate(t)[0] for t in tokens]))


def test_training_fits_a_few_short_expressions():
    """The model, its batches (padding as documents -1) and the optimiser learn: 20 steps on four short expressions
    of different lengths bring the loss down by more than half and label them all right."""
    data = short_split(["[MAX 2 9 [MIN 4 7 ] 0 ]", "[MIN 3 8 ]", "[SM 5 7 [MAX 1 8 ] 1 1 ]", "[MED 4 4 5 ]"])
    recipe = dataclasses.replace(listops.RECIPES["quick"], train=4, steps=20, batch=4, lr=1e-2, warmup=0.0,
                                 dropout=0.0, layers=1, width=16, mlp=32)
    torch.manual_seed(0)
    model = listops.encoder("longformer", recipe, "cpu")
    losses = listops.train(model, data, recipe, seed=0, device="cpu", label="fit")
    assert losses[-1] < losses[0] / 2
    assert listops.accuracy(model, data, 3, "cpu") == 1.0


def test_padding_does_not_change_an_example_s_logits():
    """An example's logits are the same alone and padded in a batch with a longer one (key padding as documents)."""
    recipe = dataclasses.replace(listops.RECIPES["quick"], dropout=0.0)
    torch.manual_seed(0)
    model = listops.encoder("bigbird", recipe, "cpu").eval()
    short, long = tokens_of("[MAX 2 9 [MIN 4 7 ] 0 ]"), tokens_of("[SM " + "1 " * 150 + "]")
    alone = model(*listops.batch([short]))
    padded = model(*listops.batch([short, long]))[:1]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


def run_main(monkeypatch, out: Path, *args: str) -> dict:
    monkeypatch.setattr(sys, "argv", ["listops.py", "--quick", "--out", str(out), *args])
    listops.main()
    return json.loads((out / "listops.json").read_text())


def test_a_run_writes_its_files_and_resumes(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    tiny = dataclasses.replace(listops.RECIPES["quick"], train=2, validation=2, test=2, steps=1, batch=2)
    monkeypatch.setitem(listops.RECIPES, "quick", tiny)
    first = run_main(monkeypatch, tmp_path, "--patterns", "local")
    assert [(r["pattern"], r["seed"]) for r in first["rows"]] == [("local", 0)]
    assert {"listops.json", "listops.md", "listops.png"} <= {p.name for p in tmp_path.iterdir()}
    assert listops.markdown(first) == (tmp_path / "listops.md").read_text()     # the table is the JSON's
    assert "| 15.82 (Local Attention) |" in (tmp_path / "listops.md").read_text()
    with pytest.raises(SystemExit, match="exists: add --resume"):
        run_main(monkeypatch, tmp_path, "--patterns", "local")
    second = run_main(monkeypatch, tmp_path, "--resume", "--patterns", "local", "ours")
    assert [(r["pattern"], r["seed"]) for r in second["rows"]] == [("local", 0), ("ours", 0)]
    assert second["rows"][0] == first["rows"][0]                  # kept, not run again
    with pytest.raises(SystemExit, match="another set-up"):
        run_main(monkeypatch, tmp_path, "--resume", "--steps", "2")


def test_the_doc_page_lists_the_script_s_patterns():
    page = (ROOT / "docs" / "listops.md").read_text()
    source = page[page.index("patterns = {"):page.index("\n}\n", page.index("patterns = {")) + 2]
    namespace = {"sa": listops.sa}
    exec(source, namespace)
    assert namespace["patterns"] == {name: pattern for name, (pattern, _, _) in listops.PATTERNS.items()}


def test_committed_table_is_rendered_from_the_committed_json():
    path = ROOT / "benchmarks" / "results" / "listops.json"
    if not path.exists():
        pytest.skip("no committed run yet: benchmarks/results/listops.json")
    record = json.loads(path.read_text())
    assert listops.markdown(record) == path.with_suffix(".md").read_text()
