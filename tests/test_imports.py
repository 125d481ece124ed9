"""The real import graph of the installed layout: no cycle, nothing from the core up, no source
file over 600 lines.

pyproject's ``[tool.setuptools] package-dir`` maps each package to its folder (``partita.search``
is ``search/``); every .py file under those folders is a module (``search/costs/links.py`` is
``partita.search.costs.links``). Every import counts, those inside functions too, absolute and
relative; ``from partita.search import costs`` imports ``partita.search.costs`` when that is a
module. The layers (docs: ARCHITECTURE.md):

    core      partita and its modules, but the app     imports core only
    search    partita.search                           core, search (never torch)
    runtime   partita.runtime                          core, runtime
    profiler  partita.profiler                         core, runtime, profiler
    app       partita.cli                              everything
    configs   partita.configs                          data: imports nothing of Partita's
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600

# What each layer may import, besides third-party packages (which the layer rules do not name,
# but for torch: never under search).
MAY_IMPORT = {
    "core": {"core"},
    "search": {"core", "search"},
    "runtime": {"core", "runtime"},
    "profiler": {"core", "runtime", "profiler"},
    "app": {"core", "search", "runtime", "profiler", "app", "configs"},
    "configs": set(),
}
# The layer of a module: the longest prefix here that names it (everything else in partita is core).
LAYERS = {"partita.cli": "app", "partita.search": "search", "partita.runtime": "runtime",
          "partita.profiler": "profiler", "partita.configs": "configs"}


def package_dirs() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {package: ROOT / folder for package, folder in config["tool"]["setuptools"]["package-dir"].items()}


def modules() -> dict[str, Path]:
    """Every module name of the installed layout and its file."""
    found: dict[str, Path] = {}
    # longest package first: partita.search owns search/ even if a folder of partita/ were named so
    for package, folder in sorted(package_dirs().items(), key=lambda kv: -len(kv[0])):
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found.setdefault(".".join([package, *parts]), path)
    return found


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name ``module`` imports, anywhere in its file; for ``from X import a``
    both X and X.a (which is a module or a name inside X)."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of Partita's modules (``partita.search.costs``
    for ``partita.search.costs.CostModel``), or None for a third-party name."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in known:
            return ".".join(parts[:k])
    return None


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Partita's modules -> the Partita modules each imports, and -> the third-party top-level
    names each imports. A package's own submodules imported by its ``__init__`` are not an edge
    back up (importing ``partita.search.costs`` runs ``partita.search`` first anyway)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for module, path in known.items():
        graph[module], external[module] = set(), set()
        for name in imported_names(path, module):
            target = resolve(name, known)
            if target is None:
                if not name.startswith("partita"):
                    external[module].add(name.split(".")[0])
            elif target != module and not (path.name == "__init__.py" and target.startswith(module + ".")):
                graph[module].add(target)
    return graph, external


def layer_of(module: str) -> str:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    return "core"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return groups


def cycle_path(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """One closed walk through the group's first module, for the message: a -> b -> a."""
    members, start = set(group), group[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first inside the group, back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return group


def test_the_layout_maps_to_modules():
    """The walk sees the packages pyproject installs (else the other tests prove nothing)."""
    known = modules()
    for package in package_dirs():
        assert package in known, f"{package}: no __init__.py under its package-dir folder"
    assert "partita.search.planner" in known and "partita.validate" in known


def test_no_import_cycle():
    graph, _ = import_graph()
    found = [" -> ".join(cycle_path(graph, group)) + f"  (all of: {', '.join(group)})" for group in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_each_layer_imports_only_below_it():
    graph, _ = import_graph()
    upward = [f"{m} ({layer_of(m)}) imports {t} ({layer_of(t)})" for m in sorted(graph) for t in sorted(graph[m])
              if layer_of(t) not in MAY_IMPORT[layer_of(m)]]
    assert not upward, f"{len(upward)} imports against the layers:\n" + "\n".join(upward)


def test_the_search_and_the_core_never_import_torch():
    _, external = import_graph()
    torch_users = [m for m in sorted(external) if layer_of(m) in ("core", "search") and "torch" in external[m]]
    assert not torch_users, "torch imported by: " + ", ".join(torch_users)


def test_no_source_file_over_600_lines():
    root = ROOT
    sizes = {path: len(path.read_text().splitlines()) for path in modules().values()}
    big = sorted(((n, p) for p, n in sizes.items() if n > MAX_LINES), reverse=True)
    assert not big, f"files over {MAX_LINES} lines:\n" + "\n".join(f"{p.relative_to(root)}: {n}" for n, p in big)


def test_no_test_module_imports_another():
    """Shared helpers live in conftest.py (fixtures) and plain support modules, never in a test
    module another imports (inside functions too)."""
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.glob("test_*.py")):
        names = imported_names(path, path.stem)
        found += [f"{path.name} imports {n}" for n in sorted(names) if n.split(".")[0].startswith("test_")]
    assert not found, "test modules importing test modules:\n  " + "\n  ".join(found)
