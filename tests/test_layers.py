"""Arrows point down: no module imports a higher layer, and no two modules import each other.

The import graph is read from the source with ``ast`` (nothing is imported). Every import
counts, module-level or inside a function; one under ``if TYPE_CHECKING:`` counts for the
layers but not for cycles, since it never runs. Layers, top to bottom:

    gateway, _cli, __main__                    the thin layers over the library
    __init__, _cache, _wiring, _decorator,     the front doors and what only they use
    _sync (_loopthread, _syncread, _syncpool,
    _syncgroup), integrations, telemetry
    _protocol, _leases, _protections           the rooms (_protocol and _leases never
                                               import each other)
    _backends                                  connections, servers, the ring
    _errors, _types, _keys, _codec, _config,   shared leaves
    _waits

A module in a room of its own that is not listed fails the test, so a new room is placed
on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "flightcache"

LAYERS: list[set[str]] = [
    {"gateway", "_cli", "__main__"},
    {
        "__init__",
        "_cache",
        "_engine",
        "_wiring",
        "_decorator",
        "_sync",
        "_loopthread",
        "_syncread",
        "_syncpool",
        "_syncgroup",
        "integrations",
        "telemetry",
    },
    {"_protocol", "_leases", "_protections"},
    {"_backends"},
    {"_errors", "_types", "_keys", "_codec", "_config", "_waits"},
]
APART = [("_protocol", "_leases")]  # same layer, and neither imports the other

# Known exceptions, each with its reason: (importer, imported) -> why.
ALLOWED: dict[tuple[str, str], str] = {}

Edge = tuple[str, str, bool]  # importer, imported, runs (False: under TYPE_CHECKING only)


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its __init__)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, runs: bool = True) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, runs))
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                found.extend(_imports(ast.Module(body=[child], type_ignores=[]), False))
            for child in node.orelse:
                found.extend(_imports(ast.Module(body=[child], type_ignores=[]), runs))
        else:
            found.extend(_imports(node, runs))
    return found


def import_edges(names: dict[str, Path]) -> list[Edge]:
    """Every import of one package module by another."""
    edges: list[Edge] = []
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node, runs in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                # ``from pkg import sub`` imports the submodule ``pkg.sub``.
                subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in names]
                targets = subs if len(subs) == len(node.names) else [module, *subs]
            for target in targets:
                while target and target not in names:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.append((name, target, runs))
    return edges


def room(name: str) -> str:
    """``flightcache._protocol.local`` -> ``_protocol``; the package itself is ``__init__``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer(name: str) -> int:
    for index, rooms in enumerate(LAYERS):
        if room(name) in rooms:
            return index
    raise LookupError(f"{name} is in no layer: add its room to LAYERS in {__file__}")


def layer_violations(edges: list[Edge]) -> list[str]:
    wrong = []
    for importer, imported, _runs in edges:
        if (importer, imported) in ALLOWED:
            continue
        if layer(imported) < layer(importer):
            wrong.append(f"{importer} imports {imported}, a higher layer")
        pair = (room(importer), room(imported))
        if pair in APART or pair[::-1] in APART:
            wrong.append(f"{importer} imports {imported}: {pair[0]} and {pair[1]} stay apart")
    return wrong


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The import cycles among imports that run (Tarjan's strongly connected components)."""
    graph: dict[str, set[str]] = {}
    for importer, imported, runs in edges:
        if runs:
            graph.setdefault(importer, set()).add(imported)
            graph.setdefault(imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges(module_names())


def test_every_module_is_in_a_layer() -> None:
    unplaced = []
    for name in module_names():
        try:
            layer(name)
        except LookupError as exc:
            unplaced.append(str(exc))
    assert not unplaced


def test_no_module_imports_a_higher_layer(edges: list[Edge]) -> None:
    assert layer_violations(edges) == []


def test_no_import_cycle(edges: list[Edge]) -> None:
    assert cycles(edges) == []


def test_the_allowed_exceptions_still_exist(edges: list[Edge]) -> None:
    """An exception that is no longer needed is removed from ALLOWED."""
    assert set(ALLOWED) <= {(a, b) for a, b, _ in edges}


def test_the_checks_see_what_they_must() -> None:
    """The checks themselves, on a made-up graph: an upward import, the two rooms that stay
    apart, a cycle, and a TYPE_CHECKING import that is no cycle."""
    made_up: list[Edge] = [
        ("flightcache._backends.redis", "flightcache._protocol.flight", True),
        ("flightcache._protocol.memory", "flightcache._leases.nodes", True),
        ("flightcache._protocol.a", "flightcache._protocol.b", True),
        ("flightcache._protocol.b", "flightcache._protocol.a", True),
        ("flightcache._cache", "flightcache._protections.bloom", True),
        ("flightcache._protections.bloom", "flightcache._cache", False),
    ]
    assert len(layer_violations(made_up)) == 3
    assert cycles(made_up) == [["flightcache._protocol.a", "flightcache._protocol.b"]]


def test_the_graph_is_read_from_the_source(edges: list[Edge]) -> None:
    """A few imports that are known to exist are found, relative and absolute alike."""
    pairs = {(a, b) for a, b, _ in edges}
    assert ("flightcache", "flightcache._cache") in pairs
    assert ("flightcache._protocol.local", "flightcache._protocol.base") in pairs
    assert ("flightcache._engine", "flightcache._protocol.local") in pairs
    assert ("flightcache.gateway._app", "flightcache.gateway._wire") in pairs
    assert not any(b == "flightcache.gateway._mock" for a, b in pairs if a.endswith("_app"))
