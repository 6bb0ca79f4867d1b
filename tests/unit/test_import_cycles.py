"""No import cycle through the planning, tuning and reporting packages or the run (function-local imports
count: they run too). Cycles elsewhere (config, strategies, compression) are other parts of issue 27; the
walk below finds them as well, so widening SCOPE is all it takes to hold them."""

from __future__ import annotations

import ast

from tests.unit.test_layering import ROOT, product_modules

SCOPE = ("distrain.planning", "distrain.tuning", "distrain.reporting", "distrain.orchestrator.run")


def module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(("distrain", *parts))
    return name.removesuffix(".__init__")


def imported(tree: ast.AST, known: set[str]) -> set[str]:
    """The product modules a module imports anywhere (TYPE_CHECKING blocks skipped); `from pkg import mod`
    counts as importing `pkg.mod`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "distrain":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("distrain."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            connect(v)
    return found


def test_no_cycle_runs_through_planning_tuning_reporting_or_the_run():
    paths = {module_name(p): p for p in product_modules()}
    known = set(paths)
    imports = {m: imported(ast.parse(p.read_text()), known) for m, p in paths.items()}
    edges = {m: {t for t in ts if t in known and t != m} for m, ts in imports.items()}
    # a package's __init__ is not an edge back to its own modules' importers
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}
    ours = [c for c in cycles(edges) if any(m.startswith(SCOPE) for m in c)]
    assert not ours, f"import cycles: {ours}"


def test_the_walk_finds_a_cycle_through_a_function_local_import():
    tree_a = ast.parse("def f():\n    from distrain.b import x\n")
    tree_b = ast.parse("from distrain import a\n")
    known = {"distrain.a", "distrain.b"}
    edges = {"distrain.a": imported(tree_a, known), "distrain.b": imported(tree_b, known)}
    assert cycles(edges) == [["distrain.a", "distrain.b"]]
