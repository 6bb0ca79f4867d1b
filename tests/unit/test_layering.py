"""The package's layering: cli -> api -> tuning -> reporting -> planning -> orchestrator -> config (the run's
spec) -> strategies -> compression -> trainers -> foundation.

A module may import its own layer and the layers below it, never one above, anywhere in the module
(function-level imports included; `if TYPE_CHECKING:` blocks, which never run, excepted). So a strategy
never reaches into the orchestrator, and trainers know nothing of strategies.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [
    ("cli", {"cli", "commands", "sweep_display", "run_progress"}),
    ("api", {"api"}),
    ("tuning", {"tuning"}),
    ("reporting", {"reporting"}),
    ("planning", {"planning"}),
    ("orchestrator", {"orchestrator"}),
    ("config", {"config"}),
    ("strategies", {"strategies"}),
    ("compression", {"compression"}),
    ("trainers", {"trainers"}),
    ("foundation", {"errors", "name_registry", "plugins", "fields", "actor_process"}),
]
RANK = {top: rank for rank, (_, tops) in enumerate(LAYERS) for top in tops}


def product_modules() -> list[Path]:
    files = [ROOT / f"{top}.py" for top in RANK if (ROOT / f"{top}.py").is_file()]
    files += [p for top in RANK if (ROOT / top).is_dir() for p in (ROOT / top).rglob("*.py")]
    return files


def runtime_imports(tree: ast.AST, with_names: bool = False) -> list[Any]:
    """(line, distrain submodule) of every import that can run (TYPE_CHECKING blocks skipped); with
    `with_names`, the imported names instead, each as `module.name` (a submodule, or a name in one)."""
    found: list[Any] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distrain."):
            if with_names:
                found.extend(f"{node.module}.{alias.name}" for alias in node.names)
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.module == "distrain":
            found.extend(
                f"distrain.{alias.name}" if with_names else (node.lineno, f"distrain.{alias.name}")
                for alias in node.names
            )
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("distrain.")]
            found.extend(names if with_names else [(node.lineno, name) for name in names])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_no_import_runs_upward():
    upward = []
    files = product_modules()
    assert len(files) > 40  # the walk found the package
    for path in files:
        top = path.relative_to(ROOT).parts[0].removesuffix(".py")
        for line, module in runtime_imports(ast.parse(path.read_text(), str(path))):
            target = module.split(".")[1]
            if target in RANK and RANK[target] < RANK[top]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({LAYERS[RANK[top]][0]}) imports {module}")
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def module_name(path: Path) -> str:
    return ".".join(("distrain", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """Product module -> the product modules it imports where it runs (function-level imports included,
    `if TYPE_CHECKING:` blocks not); `from pkg import mod` counts as an import of `mod`."""
    files = {module_name(p): p for p in product_modules()}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for target in runtime_imports(ast.parse(path.read_text(), str(path)), with_names=True):
            while target not in files and "." in target:
                target = target.rpartition(".")[0]
            if target in files and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    """No module imports, at any depth, something that imports it back (function-level imports count:
    they run too), in any layer."""
    graph = import_graph()
    assert len(graph) > 100 and any(name.startswith("distrain.config.") for name in graph)  # the walk saw it all
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_sees_a_function_level_import():
    tree = ast.parse("def f():\n    from distrain.strategies import bsp\n")
    assert runtime_imports(tree, with_names=True) == ["distrain.strategies.bsp"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_sees_an_upward_import(tmp_path):
    tree = ast.parse("import os\nfrom distrain.orchestrator import run\nif TYPE_CHECKING:\n    import distrain.cli\n")
    assert runtime_imports(tree) == [(2, "distrain.orchestrator")]


def test_the_cli_starts_without_torch_or_ray():
    """`distrain --help`, `distrain strategies` and flag errors answer in well under a second here."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from distrain.cli import app\n"
        "r = CliRunner()\n"
        "for args in (['--help'], ['run', '--help'], ['strategies'], ['tune', '--help'], ['report', '--help'],\n"
        "             ['run', '--workers', '0'], ['run', '--strategy', 'nope'], ['run', '--model', 'x'],\n"
        "             ['run', '--dataset', 'digits', '--data-dir', '.'], ['run', '--optimizer', 'lion']):\n"
        "    code = r.invoke(app, args).exit_code\n"
        "    assert code == (2 if len(args) > 2 else 0), (args, code)\n"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
