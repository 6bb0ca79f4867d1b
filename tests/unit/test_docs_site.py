"""The documentation site (mkdocs.yml, docs/) builds with warnings as errors (a broken link or anchor, a
docstring mkdocstrings cannot read), offline, in seconds; every page under docs/ is on it and in its nav
(docs/hooks.py adds the pages mkdocs.yml does not name); the API page is the code's own docstrings.
No Ray."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the hook finds the package itself
    # Not --quiet: it hides the warnings from --strict too, and the build then passes whatever they say.
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir", str(site)]
    return subprocess.run(cmd, cwd=config.parent, env=env, capture_output=True, text=True, timeout=300)


def nav_links(index_html: str) -> set[str]:
    """The page addresses the site's navigation bar links to (the built-in theme's dropdown items)."""
    nav = index_html[index_html.index('class="navbar') : index_html.index('role="main"')]
    return {href.strip("./") for href in re.findall(r'href="([^"#]*)"', nav)}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_every_docs_page_is_built_and_in_the_nav(site):
    pages = sorted(p.relative_to(ROOT / "docs") for p in (ROOT / "docs").rglob("*.md"))
    assert len(pages) > 15
    linked = nav_links((site / "index.html").read_text())
    for page in pages:
        address = "" if page.name == "index.md" else page.with_suffix("").as_posix()
        assert (site / address / "index.html").is_file(), page
        assert address == "" or address in linked, page


def test_the_api_page_is_made_of_the_docstrings(site):
    html = (site / "reference" / "python-api" / "index.html").read_text()
    for name in ("fit", "FitResult", "Task", "Callback", "Strategy", "load_model"):
        assert f'id="distrain.{name}"' in html, name
    source = ast.parse((ROOT / "trainers" / "task.py").read_text())  # read, not imported: no torch here
    task = next(n for n in source.body if isinstance(n, ast.ClassDef) and n.name == "Task")
    first_line = " ".join(ast.get_docstring(task).split("\n\n")[0].replace("`", "").split())
    assert first_line in " ".join(re.sub(r"<[^>]+>", "", html).split())


def test_the_cli_page_has_every_command(site):
    from distrain.flag_table import commands

    html = (site / "reference" / "cli" / "index.html").read_text()
    for name in commands():
        assert f"distrain {name}</code>" in html, name


def test_a_page_the_nav_does_not_name_is_added_and_a_broken_link_fails_the_build(tmp_path):
    """docs/hooks.py on a small site of its own (no API pages: quick), as other pages will join this one."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the new page](new-feature.md).\n")
    (docs / "new-feature.md").write_text("# A new feature\n\nWritten on another branch.\n")
    config = tmp_path / "mkdocs.yml"
    hooks = (ROOT / "docs" / "hooks.py").as_posix()
    config.write_text(f"site_name: t\ntheme: mkdocs\nhooks: [{hooks}]\nnav:\n  - Home: index.md\n  - Guides: []\n")
    done = mkdocs_build(config, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    html = (tmp_path / "site" / "index.html").read_text()
    assert "new-feature" in nav_links(html) and "A new feature" in html
    (docs / "index.md").write_text("# Home\n\nSee [a page that is not there](missing.md).\n")
    done = mkdocs_build(config, tmp_path / "site")
    assert done.returncode != 0 and "missing.md" in done.stdout + done.stderr


def test_the_readmes_links_reach_pages_that_exist():
    """The README is read on the forge, not built: its links to docs/ pages are checked here instead."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len([link for link in links if link.startswith("docs/")]) > 15
    for link in links:
        assert "#" not in link and (ROOT / link).is_file(), link
