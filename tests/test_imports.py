"""The package's import graph: no cycle between folders or files, no package import hidden inside a function, and
``config/`` depending on nothing but the standard library and itself (issue 38, items 2 and 3).

Read from the source with ``ast`` (no module is imported), so a new cycle fails here before it fails at run time in
whichever order a user happens to import things."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "lightning_flagscale"
NAME = PKG.name

# Imports made inside functions on purpose: the CLI loads a subcommand's (heavy) code only when it runs, after its
# options are parsed. (The model families register their presets and HF converters when ``lightning_flagscale.models``
# imports them, at the top.)
LAZY_ALLOWED = {
    ("cli", "lightning_flagscale.cli_train"),
    ("cli", "lightning_flagscale.convert.cli"),
    ("cli", "lightning_flagscale.tune"),
    ("cli", "lightning_flagscale.bench_cli"),
}
# Registration edges, left out of the file graph (none: the families import the registries, never the reverse).
REGISTRATION: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG.parent).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return out


MODULES = _modules()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            is_pkg = MODULES[module].name == "__init__.py"
            parts = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    return [n for n in names if n.startswith(NAME)]


def _named_imports(module: str, tree: ast.AST) -> set[str]:
    """Modules a package ``__init__`` names as strings: its PEP 562 ``__getattr__`` imports them on first access
    (``lightning_flagscale/__init__.py``), so they are edges of the graph like any import."""
    if MODULES[module].name != "__init__.py":
        return set()
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES
    } - {module}


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, int, str]], dict[str, set[str]]]:
    """File edges among package modules (lazy ``__init__`` imports named as strings included), function-level
    imports, and every absolute import root per module."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    lazy: list[tuple[str, int, str]] = []
    roots: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        edges[module].update(_named_imports(module, tree))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots[module].add(node.module)
            elif isinstance(node, ast.Import):
                roots[module].update(a.name for a in node.names)
            targets = [t for t in _targets(module, node) if t in MODULES and t != module]
            if not targets:
                continue
            if node.col_offset > 0:
                lazy.append((module, node.lineno, targets[0]))
            edges[module].update(t for t in targets if (module, t) not in REGISTRATION)
    return edges, lazy, roots


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in list(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def _folder(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _folder_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for a, targets in edges.items():
        for b in targets:
            fa, fb = _folder(a), _folder(b)
            # A package and its own sub-packages are one room: the parent's __init__ re-exports its children.
            if fa != fb and not fb.startswith(fa + ".") and not fa.startswith(fb + "."):
                folders.setdefault(fa, set()).add(fb)
    return folders


def test_no_file_level_import_cycle():
    edges, _, _ = _graph()
    assert _cycles(edges) == []


def test_no_folder_level_import_cycle():
    edges, _, _ = _graph()
    assert _cycles(_folder_graph(edges)) == []


def test_lazy_package_imports_are_edges():
    """The root's lazy names are edges (a cycle through them is a cycle), the ``TYPE_CHECKING`` imports are not."""
    edges, _, _ = _graph()
    assert {f"{NAME}.strategies", f"{NAME}.precision", f"{NAME}.models"} <= edges[NAME]
    assert f"{NAME}.tune.search" not in edges[NAME]


def test_no_package_import_hidden_in_a_function():
    _, lazy, _ = _graph()
    hidden = [
        f"{m}:{line} imports {t}"
        for m, line, t in lazy
        if (m.removeprefix(NAME + "."), t) not in LAZY_ALLOWED
        and (m.removeprefix(NAME + "."), t.rsplit(".", 1)[0]) not in LAZY_ALLOWED
    ]
    assert hidden == []


def test_config_depends_on_the_standard_library_and_itself_only():
    _, _, roots = _graph()
    stdlib = set(sys.stdlib_module_names) | {"__future__", "typing_extensions"}
    outside = {
        (m, r)
        for m, rs in roots.items()
        if m == f"{NAME}.config" or m.startswith(f"{NAME}.config.")
        for r in rs
        if not (r.split(".")[0] in stdlib or r == f"{NAME}.config" or r.startswith(f"{NAME}.config."))
    }
    assert outside == set()


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_the_cycle_finder_finds_cycles(edges, expected):
    assert _cycles(edges) == expected
