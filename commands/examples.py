"""`distrain examples`: the examples shipped inside the package (user tasks, a strategy plugin, the
notebook, the cluster launcher configs), listed with what each is and the command that runs it, or copied
into a folder to edit. They are package data (pyproject.toml), so a wheel install has them too, where no
checkout is at hand.

Each file describes itself: a Python example by its docstring's first line and its indented
`distrain ...` command lines, a notebook by its first markdown heading, a YAML file by its first comment
line. No Ray, no torch.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

from distrain.commands import console as consoles
from distrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]  # the package's root (a checkout's root, or site-packages/distrain)
# What is shipped, relative to ROOT: pyproject.toml's package-data names the same files.
FOLDERS = {"examples": "*.py", "notebooks": "*.ipynb"}
FILES = ("notebooks/README.md", "cluster.yaml", "cluster-local.yaml")


def bundled(root: Path = ROOT) -> list[Path]:
    """The shipped example files under `root`, relative to it, in a stable order."""
    found = [p.relative_to(root) for folder, pattern in FOLDERS.items() for p in (root / folder).rglob(pattern)]
    found += [Path(name) for name in FILES if (root / name).is_file()]
    return sorted(p for p in found if "__pycache__" not in p.parts and "-out" not in p.stem)


def describe(path: Path) -> tuple[str, list[str]]:
    """What the file is (one line) and the `distrain ...` commands it gives, as written in it."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(text)) or ""
        lines = doc.splitlines()
        commands = [line.strip() for line in lines if line.startswith("    distrain ")]
        return (lines[0] if lines else ""), commands
    if path.suffix == ".ipynb":
        for cell in json.loads(text)["cells"]:
            heading = next((s for s in cell["source"] if s.startswith("# ")), None)
            if cell["cell_type"] == "markdown" and heading:
                return heading[2:].strip(), []
        return "", []
    return _first_paragraph(text, comments=path.suffix in (".yaml", ".yml")), []


def _first_paragraph(text: str, comments: bool) -> str:
    """A YAML file's first comment paragraph, or a markdown file's first paragraph after its headings."""
    words: list[str] = []
    for line in text.splitlines():
        line = line.lstrip("#").strip() if comments else line.strip()
        if not comments and line.startswith("#"):
            continue
        if not line and words:
            break
        words += line.split()
    return " ".join(words)


def list_examples(root: Path = ROOT) -> None:
    consoles.say(f"examples shipped with distrain, in {root}:")
    here = f" {root / 'examples'}/"
    for rel in bundled(root):
        what, commands = describe(root / rel)
        consoles.say(f"  {rel}: {what}" if what else f"  {rel}")
        for command in commands:  # with the file's own path, so it runs from any folder
            consoles.say("      " + command.replace(" examples/", here))
    consoles.say("`distrain examples --copy DIR` copies them into DIR to edit; their commands then run from DIR.")


def copy_examples(dest: Path, root: Path = ROOT) -> list[Path]:
    """Copy the shipped files into `dest` (new or empty), keeping their relative paths."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"--copy {dest}: must be a new or empty directory")
    files = bundled(root)
    try:
        for rel in files:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, dest / rel)
    except OSError as e:
        raise ConfigError(f"--copy {dest}: cannot write there ({e.strerror or e})") from None
    consoles.say(f"copied {len(files)} files to {dest}/ ({', '.join(sorted({r.parts[0] for r in files}))})")
    return files
