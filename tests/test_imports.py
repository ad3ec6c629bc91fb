"""The project's modules import one another without a circle.

A circle of imports (a imports b, b imports a, however indirectly) ties its modules into one: none of them can be
read, tested or replaced alone, and Python only resolves it by the order in which things happen to run. An import
inside a function does not remove such a circle, it postpones it to the first call; so imports inside functions
count here as much as those at the top of a file. The graph is read from the source (``ast``), nothing is imported:
every ``import`` and ``from ... import`` anywhere in a module of the packages below, relative ones resolved.

An edge from a module to a package that contains it is left out: Python imports a package before its modules, and a
package's ``__init__`` importing its own modules is how packages are made, not a circle between ideas.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("client", "server", "shared", "netsim", "bench")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of ``PACKAGES`` by its dotted name (a package by its own name), with its file."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The dotted names an import statement may load: ``a.b`` for ``import a.b``; for ``from a import b``, ``a.b``
    (``b`` may be a module) and ``a`` itself (which runs either way). ``package`` resolves relative imports."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def graph(found: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the first line that does}, for the modules in ``found`` only."""

    def resolve(name: str) -> str | None:  # the module a dotted name lands in: itself, or its closest parent
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, dict[str, int]] = {}
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges[name] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in filter(None, map(resolve, imported_names(node, package))):
                if target != name and not name.startswith(target + "."):
                    edges[name].setdefault(target, node.lineno)
    return edges


def reached(edges: dict[str, dict[str, int]], start: str) -> set[str]:
    """Every module ``start`` imports, however indirectly."""
    seen, todo = set(), [start]
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module: each a set of modules that all reach each other."""
    reach = {start: reached(edges, start) for start in edges}
    out, placed = [], set()
    for m in sorted(edges):
        if m in placed:
            continue
        component = sorted({m} | {o for o in reach[m] if m in reach[o]})
        placed.update(component)
        if len(component) > 1:
            out.append(component)
    return out


def describe(component: list[str], edges: dict[str, dict[str, int]], found: dict[str, Path]) -> str:
    inside = set(component)
    lines = [f"  circle of {len(component)} modules: {', '.join(component)}"]
    for m in component:
        for target, line in sorted(edges[m].items()):
            if target in inside:
                lines.append(f"    {m} imports {target} ({found[m].relative_to(ROOT)}:{line})")
    return "\n".join(lines)


def test_the_graph_is_read():
    """Guards the test below against passing on a graph read wrongly: imports at the top of a file and inside a
    function, a submodule imported from its package, relative imports."""
    edges = graph(modules())
    assert "shared.engine.target" in edges["shared.engine.models"]  # at the top of the file
    assert "shared.engine.models" in edges["client.drafters"]  # inside a function
    assert "shared.engine.kernels" in edges["shared.engine.linear"]  # `from shared.engine import kernels`
    assert "shared.engine" not in edges["shared.engine.linear"]  # its own package
    relative = ast.parse("from .models import load_target\nfrom .. import errors").body
    assert imported_names(relative[0], "shared.engine") == ["shared.engine.models", "shared.engine.models.load_target"]
    assert imported_names(relative[1], "shared.engine") == ["shared", "shared.errors"]


def test_no_module_imports_itself_through_others():
    found = modules()
    edges = graph(found)
    found_circles = circles(edges)
    assert not found_circles, "import circles (imports inside functions count too):\n" + "\n".join(
        describe(c, edges, found) for c in found_circles
    )


def test_the_engine_package_itself_imports_nothing():
    """``shared.engine``'s ``__init__`` is a docstring: importing one of its modules never drags in the others."""
    tree = ast.parse((ROOT / "shared" / "engine" / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def test_serving_never_reaches_into_training():
    """No module of the client (but the training pipeline's own), the server or shared imports the training pipeline,
    however indirectly: loading a drafter once counted its draft vocabulary over a training dataset. A drafter carries
    its vocabulary or reads a ranking (``client.drafters.vocabulary``)."""
    edges = graph(modules())
    sides = ("client", "server", "shared")
    serving = [m for m in edges if m.split(".")[0] in sides and not m.startswith("client.training")]
    assert "client.drafters.model" in serving and "client.build" in serving
    assert "client.training.datasets" in reached(edges, "client.training.vocab")  # the graph is read through
    reaching = {m: sorted(t for t in reached(edges, m) if t.startswith("client.training")) for m in serving}
    assert not {m: t for m, t in reaching.items() if t}, "serving modules that import the training pipeline"
