"""No import circles between modules, and the package rules between the trainer and the service.

The imports are read with ``ast``, every one of them: a function-level import is how a circle
hides, so it counts as much as one at the top of a file. An import of ``a.b.c`` also counts as
importing the packages ``a`` and ``a.b`` (Python runs their ``__init__`` first).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("recsys", "embedding_server")
# The commands that start the service or export to it: the only modules under recsys/ that
# may import embedding_server (the benchmarks are commands too: `recsys bench serve|live`).
SERVICE_ENTRY_POINTS = ("recsys.cli", "recsys.bench")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imported(node: ast.AST, here: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The project modules one import statement names (a ``from`` import's names that are modules)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = here.split(".") if is_package else here.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    else:
        return []
    found = []
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # the packages on the way run first
            prefix = ".".join(parts[:i])
            if prefix in modules and prefix != here:
                found.append(prefix)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first import of it}, for every project module."""
    modules = _modules()
    return {name: _edges(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", modules)
            for name, path in modules.items()}


def _edges(tree: ast.AST, name: str, is_package: bool, modules) -> dict[str, int]:
    edges: dict[str, int] = {}
    for node in ast.walk(tree):
        for target in _imported(node, name, is_package, modules):
            edges.setdefault(target, node.lineno)
    return edges


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components with more than one module (iterative: the graph is deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _circle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One shortest circle through the component's first module (breadth-first)."""
    members = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return list(reversed(path)) + [start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle in component {component}")


def _describe(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])]
    return " -> ".join(steps + [circle[-1]])


def test_no_import_circles():
    graph = import_graph()
    circles = [_circle(graph, component) for component in _strongly_connected(graph)]
    report = "\n".join(_describe(graph, circle) for circle in circles)
    print(report)
    assert not circles, f"{len(circles)} import circle(s):\n{report}"


def _violations(graph, importer_prefixes, imported_prefixes, allowed=()) -> list[str]:
    def under(name, prefixes):
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    return [f"{a} (line {line}) imports {b}"
            for a, edges in sorted(graph.items()) if under(a, importer_prefixes) and not under(a, allowed)
            for b, line in sorted(edges.items()) if under(b, imported_prefixes)]


def test_service_never_imports_the_trainer():
    bad = _violations(import_graph(), ("embedding_server",), ("recsys.train", "recsys.eval", "recsys.bench",
                                                               "recsys.cli"))
    assert not bad, "\n".join(bad)


def test_recsys_imports_the_service_only_from_its_commands():
    bad = _violations(import_graph(), ("recsys",), ("embedding_server",), allowed=SERVICE_ENTRY_POINTS)
    assert not bad, "\n".join(bad)


def test_no_product_module_imports_the_test_machinery_or_the_benchmarks():
    """``recsys.testing`` (harness, fault jobs, reference models) and ``recsys.bench`` are no
    part of the product: only the benchmarks import the first, and only the command that runs a
    benchmark (``recsys bench``, in ``recsys.cli``) and the test machinery the second."""
    graph = import_graph()
    bad = _violations(graph, PACKAGES, ("recsys.testing",), allowed=("recsys.testing", "recsys.bench"))
    bad += _violations(graph, PACKAGES, ("recsys.bench",), allowed=("recsys.bench", "recsys.cli", "recsys.testing"))
    assert not bad, "\n".join(bad)


def _test_imports() -> dict[str, dict[str, int]]:
    """tests/<file> -> {project module: line}, for every test module and test helper."""
    modules = _modules()
    return {p.name: _edges(ast.parse(p.read_text(), str(p)), p.stem, False, modules)
            for p in sorted((ROOT / "tests").rglob("*.py"))}


def test_tests_import_the_benchmarks_only_in_test_bench_files():
    """A test of a product promise never leans on a benchmark's code: ``recsys.bench`` is
    imported only by ``tests/test_bench_*.py`` (what tests and benches share is in
    ``recsys.testing``)."""
    bad = [f"tests/{name} (line {line}) imports {module}"
           for name, edges in _test_imports().items() if not name.startswith("test_bench_")
           for module, line in sorted(edges.items()) if module == "recsys.bench" or module.startswith("recsys.bench.")]
    assert not bad, "\n".join(bad)



def test_train_and_eval_point_one_way():
    """The trainer may use offline evaluation's code; evaluation never imports the trainer."""
    bad = _violations(import_graph(), ("recsys.eval",), ("recsys.train",))
    assert not bad, "\n".join(bad)


def test_the_graph_sees_every_import():
    source = """
import recsys.store.table
from . import wide
def f():
    from recsys import hashing, schema as s
    from ..train.checkpoint import save
"""
    modules = dict.fromkeys(["recsys", "recsys.hashing", "recsys.schema", "recsys.store", "recsys.store.table",
                             "recsys.store.wide", "recsys.store.spill", "recsys.train", "recsys.train.checkpoint"])
    edges = _edges(ast.parse(source), "recsys.store.spill", False, modules)
    assert edges == {"recsys": 2, "recsys.store": 2, "recsys.store.table": 2, "recsys.store.wide": 3,
                     "recsys.hashing": 5, "recsys.schema": 5, "recsys.train": 6, "recsys.train.checkpoint": 6}
