"""The package's layering: cli -> api -> tuning -> reporting -> planning -> orchestrator (and config) ->
strategies -> compression -> trainers -> foundation.

A module may import its own layer and the layers below it, never one above, anywhere in the module
(function-level imports included; `if TYPE_CHECKING:` blocks, which never run, excepted). So a strategy
never reaches into the orchestrator, and trainers know nothing of strategies.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [
    ("cli", {"cli", "sweep_display", "run_progress"}),
    ("api", {"api"}),
    ("tuning", {"tuning"}),
    ("reporting", {"reporting"}),
    ("planning", {"planning"}),
    ("orchestrator", {"orchestrator", "config"}),
    ("strategies", {"strategies"}),
    ("compression", {"compression"}),
    ("trainers", {"trainers"}),
    ("foundation", {"errors", "name_registry", "plugins", "fields"}),
]
RANK = {top: rank for rank, (_, tops) in enumerate(LAYERS) for top in tops}


def product_modules() -> list[Path]:
    files = [ROOT / f"{top}.py" for top in RANK if (ROOT / f"{top}.py").is_file()]
    files += [p for top in RANK if (ROOT / top).is_dir() for p in (ROOT / top).rglob("*.py")]
    return files


def runtime_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, distrain submodule) of every import that can run (TYPE_CHECKING blocks skipped)."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distrain."):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.module == "distrain":
            found.extend((node.lineno, f"distrain.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name.startswith("distrain."))
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
