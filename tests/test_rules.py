"""The layers under the Pattern API: specs resolve to rules, rules compile to layouts, imports run one way."""
import ast
import pathlib
import re

import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn.rules import (
    RESOLVERS,
    Context,
    IntersectionRule,
    StrideRule,
    TokenRule,
    UnionRule,
    WindowRule,
    resolve,
)

PACKAGE = pathlib.Path(sa.__file__).parent
SPEC_CLASSES = [getattr(sa, name) for name in sa.__all__
                if isinstance(getattr(sa, name), type) and issubclass(getattr(sa, name), sa.Pattern)
                and getattr(sa, name) is not sa.Pattern]


def test_every_spec_kind_has_a_resolver():
    assert {cls.kind for cls in SPEC_CLASSES} == set(RESOLVERS)


def test_a_spec_kind_without_a_resolver_is_a_clear_error():
    class Unknown(sa.Pattern):
        pass

    Unknown.kind = "unknown"  # set after the class is made, so it stays out of from_dict's registry
    with pytest.raises(TypeError, match=re.escape("no rule for Unknown (kind 'unknown'): a pattern kind needs a "
                                                  "resolver in sparse_attn.rules, registered with @resolver(kind)")):
        Unknown().mask(4)
    with pytest.raises(TypeError, match="no rule for str"):
        resolve("Local(3)", Context(4, 4, 0))


def test_rules_are_not_patterns():
    rule = resolve(sa.Local(2) | sa.Global(first=1), Context(8, 8, 0))
    assert isinstance(rule, UnionRule) and not isinstance(rule, sa.Pattern)
    with pytest.raises(TypeError, match="right operand of [|] must be a sparse_attn Pattern such as .*, got UnionRule"):
        sa.Local(1) | rule
    with pytest.raises(TypeError):
        rule | rule


def test_resolving_expands_sugar_and_clamps_to_the_context():
    ctx = Context(n_q=10, n_k=13, head=0)
    dilated = resolve(sa.Dilated(2, 3), ctx)
    assert isinstance(dilated, IntersectionRule)
    assert [type(m) for m in dilated.members] == [WindowRule, StrideRule]
    huge = resolve(sa.Local(10**30, 0, block_size=2**70), ctx)    # one unit of span=13 positions, reach 2 units
    assert (huge.before, huge.after, huge.unit) == (2, 0, 13)
    stride = resolve(sa.Stride(10**30, offset=-1), ctx)
    assert stride.stride == 2 * ctx.span and stride.offset == 2 * ctx.span - 1
    sink = resolve(sa.Sink(tokens=(3, 99), first=2), ctx)
    assert isinstance(sink, TokenRule) and sink.rows.tolist() == [] and sink.cols.tolist() == [0, 1, 3]


def test_per_head_resolves_the_heads_pattern_and_union_members_are_flattened():
    spec = sa.PerHead([sa.Local(1), sa.Local(2) | (sa.Stride(3) | sa.Dense())])
    assert isinstance(resolve(spec, Context(4, 4, 0)), WindowRule)
    union = resolve(spec, Context(4, 4, 1))
    assert [type(m).__name__ for m in union.members] == ["WindowRule", "StrideRule", "DenseRule"]


def test_random_tiles_lie_before_their_row_and_avoid_the_tiles_of_their_union_siblings():
    ctx = Context(32, 32, 0)
    rule = resolve(sa.Local(1, 0, block_size=4) | sa.Random(2, seed=1, block_size=4), ctx)
    chosen = rule.members[1].chosen                                     # keys R * 8 + C of 4 x 4 tiles
    rows, cols = chosen // 8, chosen % 8
    # the window takes tiles R - 1 and R: row R draws among tiles 0 .. R - 2
    assert (cols < rows - 1).all() and np.bincount(rows, minlength=8).tolist() == [0, 0, 1, 2, 2, 2, 2, 2]


# --- the import graph ---------------------------------------------------------------------------
def imports(path: pathlib.Path) -> dict[str, bool]:
    """What the module at ``path`` imports: package modules by dotted name (``sparse_attn.rules``), others by
    top-level name (``torch``), each mapped to whether some import of it runs at module level. Imports inside
    functions count too (as lazy); ``if TYPE_CHECKING:`` imports never run and are left out."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = parts if parts[-1] == "__init__" else parts[:-1]
    package = [p for p in package if p != "__init__"]
    found: dict[str, bool] = {}

    def add(name, top_level):
        found[name] = found.get(name, False) or top_level

    def visit(node, top_level):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", "") == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.ImportFrom) and child.level:
                base = ".".join(package[:len(package) - child.level + 1] + ([child.module] if child.module else []))
                for alias in child.names:
                    submodule = f"{base}.{alias.name}"
                    is_module = (PACKAGE.parent / submodule.replace(".", "/")).with_suffix(".py").exists() or \
                        (PACKAGE.parent / submodule.replace(".", "/")).is_dir()
                    add(submodule if is_module else base, top_level)
            elif isinstance(child, ast.ImportFrom):
                add(child.module.split(".")[0], top_level)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name.split(".")[0], top_level)
            visit(child, top_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), True)
    return found


def module_imports(name: str) -> dict[str, bool]:
    return imports(PACKAGE / f"{name}.py")


def test_imports_run_one_way_pattern_rules_compiler_layout():
    blocks, rules = module_imports("blocks"), module_imports("rules")
    assert {m for m in blocks if m.startswith("sparse_attn")} == {"sparse_attn.checks"} and "torch" not in blocks
    assert {m for m in rules if m.startswith("sparse_attn")} == {"sparse_attn.blocks"} and "torch" not in rules, \
        "rules import no pattern, compiler, layout or torch"
    assert not {"sparse_attn.pattern", "sparse_attn.rules", "sparse_attn.compiler"} & set(module_imports("layout"))
    compiler = module_imports("compiler")
    assert "sparse_attn.pattern" not in compiler and compiler["sparse_attn.rules"] and compiler["sparse_attn.layout"]
    pattern = module_imports("pattern")
    assert pattern["sparse_attn.rules"] and pattern["sparse_attn.compiler"] is False and pattern["torch"] is False, \
        "pattern imports the compiler and torch only lazily (import sparse_attn loads numpy only)"


def test_no_import_cycle_in_the_package_lazy_imports_included():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = {m for m in imports(path) if m.startswith("sparse_attn.") and m != name}
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(module):] + [module])}")
        if module in done or module not in graph:
            return
        path.append(module)
        for target in sorted(graph[module]):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_no_module_imports_another_modules_private_names():
    private = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            is_package_import = isinstance(node, ast.ImportFrom) and (node.level or node.module.startswith("sparse_attn"))
            if is_package_import:
                private += [f"{path.name}: {alias.name}" for alias in node.names if alias.name.startswith("_")]
    assert not private, f"private names imported across modules: {private}"
