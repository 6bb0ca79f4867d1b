"""MkDocs hooks (mkdocs.yml `hooks:`, built into MkDocs: no plugin to install).

- A page under docs/ that the nav does not name is added to the nav's "Guides" section, in file-name
  order, so a new page is on the site (and in its search) without an edit to mkdocs.yml; naming it in
  the nav places it elsewhere.
- The API pages read this checkout's docstrings. mkdocstrings finds `distrain` through griffe, which
  looks for a folder named `distrain` on its search path; the repository root *is* the package but has
  any name (a clone's), and griffe cannot follow setuptools' editable finder for a package mapped to
  ".", so the build puts a `distrain` link to the root in a temporary folder first on sys.path.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority
from mkdocs.structure.nav import Navigation, Section
from mkdocs.structure.pages import Page

SECTION = "Guides"


def listed_files(items: list[Any]) -> set[str]:
    """The source paths of the pages the nav already holds, sections included."""
    found: set[str] = set()
    for item in items:
        if isinstance(item, Section):
            found |= listed_files(item.children)
        elif isinstance(item, Page):
            found.add(item.file.src_uri)
    return found


def on_nav(nav: Navigation, config: Any, files: Any) -> Navigation:
    listed = listed_files(nav.items)
    unlisted = sorted((f for f in files.documentation_pages() if f.src_uri not in listed), key=lambda f: f.src_uri)
    if not unlisted:
        return nav
    section = next((i for i in nav.items if isinstance(i, Section) and i.title == SECTION), None)
    if section is None:
        section = Section(SECTION, [])
        nav.items.append(section)
    for file in unlisted:
        page = file.page or Page(None, file, config)
        page.parent = section
        section.children.append(page)
    nav.pages = [*nav.pages, *(f.page for f in unlisted)]
    return nav


PREFIX = "distrain-docs-"


@event_priority(100)  # before mkdocstrings' own, which reads sys.path
def on_config(config: Any) -> Any:
    root = Path(config.config_file_path).resolve().parent  # mkdocs.yml sits at the package's root
    if any(Path(entry, "distrain").resolve() == root for entry in sys.path if entry):
        return config  # already found (PYTHONPATH, or `mkdocs serve` loading the config again)
    folder = tempfile.mkdtemp(prefix=PREFIX)
    (Path(folder) / "distrain").symlink_to(root, target_is_directory=True)
    sys.path.insert(0, folder)
    return config


def on_shutdown() -> None:
    # Found on sys.path rather than remembered: `mkdocs serve` loads this module again on each rebuild.
    temp = Path(tempfile.gettempdir())
    for folder in [e for e in sys.path if Path(e).name.startswith(PREFIX) and Path(e).parent == temp]:
        sys.path.remove(folder)
        shutil.rmtree(folder, ignore_errors=True)  # the link only: rmtree does not follow it
