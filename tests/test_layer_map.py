"""docs/architecture.md's layer map is the package's imports, read from the code with ``ast``.

The map's table names, for every module, what it imports when loaded and what only inside a function
(lazily), in an order where every module imports only modules above it (so no cycle, lazy imports
included). The test checks the table both ways (every import is declared, every declared import is
made) and every arrow of the map's diagram. Modules group as the docs describe them: a subpackage's
modules (``bench``, ``integrations``) are one entry, the Numba backend's modules are ``backends.numba``.
"""
import ast
import pathlib
import re

import sparse_attn

PACKAGE = pathlib.Path(sparse_attn.__file__).parent
DOC = PACKAGE.parent / "docs" / "architecture.md"
SECTION = "## The layer map"
HEADER = "| Module | Imports when loaded | Imports inside functions only |"
ARROW, LAZY_ARROW = "──>", "╌╌>"


def entry(module: str) -> str:
    """The map's entry for a dotted module inside the package (``backends.numba.forward`` -> ``backends.numba``)."""
    parts = module.split(".") if module else ["__init__"]
    if parts[0] in ("bench", "integrations"):
        return parts[0]
    if parts[0] == "backends" and len(parts) > 1:
        return "backends.numba" if parts[1].startswith("numba") else ".".join(parts[:2])
    return parts[0]


def dotted(path: pathlib.Path) -> str:
    """``sparse_attn/backends/__init__.py`` -> ``backends``; the package's own ``__init__`` -> ``""``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path) -> dict[str, bool]:
    """The package modules that the file at ``path`` imports, dotted from the package root, each mapped to
    whether some import of it runs when the file is loaded (False: only inside functions). Imports under
    ``if TYPE_CHECKING:`` never run and are left out."""
    package = dotted(path).split(".") if path.name == "__init__.py" else dotted(path).split(".")[:-1]
    package = [part for part in package if part]
    found: dict[str, bool] = {}

    def add(node: ast.ImportFrom, at_load: bool) -> None:
        if node.level:
            base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
        elif node.module.split(".")[0] == "sparse_attn":
            base = node.module.split(".")[1:]
        else:
            return
        for alias in node.names:
            candidate = PACKAGE.joinpath(*base, alias.name)
            is_module = candidate.with_suffix(".py").exists() or candidate.is_dir()
            name = ".".join(base + [alias.name] if is_module else base)
            found[name] = found.get(name, False) or at_load

    def visit(node: ast.AST, at_load: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", "") == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.ImportFrom):
                add(child, at_load)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("sparse_attn."):
                        name = alias.name.removeprefix("sparse_attn.")
                        found[name] = found.get(name, False) or at_load
            visit(child, at_load and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), True)
    return found


def code_map() -> dict[str, dict[str, bool]]:
    """Every entry -> the entries it imports, each mapped to whether some import of it runs when loaded."""
    graph: dict[str, dict[str, bool]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = entry(dotted(path))
        targets = graph.setdefault(source, {})
        for module, at_load in imported_modules(path).items():
            target = entry(module)
            if target != source:
                targets[target] = targets.get(target, False) or at_load
    return graph


def section() -> list[str]:
    lines = DOC.read_text().splitlines()
    start = lines.index(SECTION)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def declared_map() -> dict[str, dict[str, bool]]:
    """The table, in its order: entry -> the entries it imports, True when loaded, False inside functions."""
    lines = section()
    rows = lines[lines.index(HEADER) + 2:]
    declared: dict[str, dict[str, bool]] = {}
    for row in rows[:next((i for i, line in enumerate(rows) if not line.startswith("|")), len(rows))]:
        name_cell, at_load_cell, lazy_cell = [cell.strip() for cell in row.strip("|").split("|")]
        names = re.findall(r"`([\w.]+)`", at_load_cell), re.findall(r"`([\w.]+)`", lazy_cell)
        declared[name_cell.strip("`")] = {**dict.fromkeys(names[1], False), **dict.fromkeys(names[0], True)}
    return declared


def diagram_arrows() -> list[tuple[str, str, bool]]:
    """(importer, imported, when loaded) of every arrow in the section's diagram: ``a, b ──> c ──> d`` says
    that a and b import c and c imports d when loaded; ``╌╌>`` says the import is inside functions only.
    Three spaces or more separate two chains on one line."""
    lines = section()
    start = lines.index("```text")
    chains = [chain for line in lines[start + 1:lines.index("```", start + 1)]
              for chain in re.split(" {3,}", line.strip())]
    arrows = []
    for chain in chains:
        parts = re.split(f"({ARROW}|{LAZY_ARROW})", chain)
        groups = [[name.strip() for name in part.split(",")] for part in parts[::2]]
        for importers, arrow, imported in zip(groups, parts[1::2], groups[1:]):
            arrows += [(a, b, arrow == ARROW) for a in importers for b in imported]
    return arrows


def row(name: str, targets: dict[str, bool]) -> str:
    """The table row that declares ``targets``, to paste into the map."""
    cell = lambda at_load: ", ".join(f"`{t}`" for t in sorted(targets) if targets[t] is at_load)  # noqa: E731
    return f"| `{name}` | {cell(True)} | {cell(False)} |"


def test_entries_group_subpackages_and_the_numba_backend():
    assert [entry(m) for m in ("", "pattern", "bench.runner", "integrations.transformers.cache", "backends",
                               "backends.numba", "backends.numba.forward", "backends.reference")] == \
        ["__init__", "pattern", "bench", "integrations", "backends", "backends.numba", "backends.numba",
         "backends.reference"]


def test_every_module_has_a_row_and_every_row_a_module():
    code, declared = code_map(), declared_map()
    missing = [row(name, code[name]) for name in code if name not in declared]
    assert not missing, "modules missing from docs/architecture.md's layer map; add their rows:\n" + "\n".join(missing)
    assert not set(declared) - set(code), f"rows of modules that do not exist: {sorted(set(declared) - set(code))}"


def test_the_table_declares_exactly_the_imports_of_the_code():
    code, declared = code_map(), declared_map()
    wrong = [row(name, code[name]) for name in declared if name in code and declared[name] != code[name]]
    assert not wrong, "docs/architecture.md's layer map differs from the imports; the rows as the code has them " \
                      "(change the code if the import is not meant):\n" + "\n".join(wrong)


def test_every_module_imports_only_modules_above_it():
    assert not upward_imports(declared_map()), "imports of a module listed below the importer (a layer broken, " \
                                               "perhaps a cycle)"


def upward_imports(declared: dict[str, dict[str, bool]]) -> list[str]:
    """``importer -> imported`` for every import of a module that is not above the importer in the table."""
    above, upward = set(), []
    for name, targets in declared.items():
        upward += [f"{name} -> {target}" for target in targets if target not in above]
        above.add(name)
    return upward


def test_upward_imports_are_found():
    assert upward_imports({"checks": {}, "blocks": {"checks": True}}) == []
    assert upward_imports({"blocks": {"checks": True}, "checks": {}}) == ["blocks -> checks"]
    assert upward_imports({"rules": {"rules": False}}) == ["rules -> rules"]


def test_every_arrow_of_the_diagram_is_an_import():
    declared, arrows = declared_map(), diagram_arrows()
    assert len(arrows) > 20
    wrong = [f"{a} {ARROW if at_load else LAZY_ARROW} {b}" for a, b, at_load in arrows
             if declared.get(a, {}).get(b) is not at_load]
    assert not wrong, f"arrows of the layer map's diagram that the table does not declare: {wrong}"
