"""The two test layers are two folders: nothing under tests/unit starts Ray or processes, as far as the
markers say, and every integration test lives under tests/integration (so `pytest tests/unit` is the
fast layer, and a slow test cannot hide in it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def collected(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=TESTS.parent, capture_output=True, text=True, check=False,
    )  # fmt: skip
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_no_integration_test_sits_under_tests_unit():
    assert collected("-m", "integration", str(TESTS / "unit")) == []


def test_every_test_file_is_in_one_of_the_two_layers():
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert loose == [], f"test files outside tests/unit and tests/integration: {loose}"


def test_the_alone_marker_goes_to_the_integration_files_named_for_it_only():
    from types import SimpleNamespace

    from tests.conftest import ALONE_FILES, INTEGRATION_DIR, pytest_collection_modifyitems

    paths = [INTEGRATION_DIR / ALONE_FILES[0], INTEGRATION_DIR / "test_bsp.py", TESTS / "unit" / ALONE_FILES[0]]
    items = [SimpleNamespace(path=p, fixturenames=(), marks=[]) for p in paths]
    for item in items:
        item.add_marker = lambda mark, item=item: item.marks.append(mark.name)
    pytest_collection_modifyitems(None, items)
    assert {str(i.path): i.marks for i in items} == {
        str(paths[0]): ["integration", "alone"], str(paths[1]): ["integration"], str(paths[2]): []
    }


def test_the_slowest_files_are_scheduled_first_and_unit_files_last():
    """`make test` hands files to its two xdist workers in collection order (tests/conftest.py): the
    files named there as slowest must exist (a renamed one would silently lose its place) and come first,
    in their order; the other integration files next, in their own order; the unit files last."""
    from types import SimpleNamespace

    from tests.conftest import ALONE_FILES, INTEGRATION_DIR, SLOWEST_FILES, _schedule_rank

    assert len(set(SLOWEST_FILES)) == len(SLOWEST_FILES)
    # (and the files `make test` keeps out of the parallel part: a renamed one would run in it)
    assert [name for name in SLOWEST_FILES + ALONE_FILES if not (INTEGRATION_DIR / name).is_file()] == []
    paths = [
        TESTS / "unit" / "test_layers.py", INTEGRATION_DIR / "test_bsp.py", INTEGRATION_DIR / SLOWEST_FILES[1],
        INTEGRATION_DIR / "test_diloco.py", INTEGRATION_DIR / SLOWEST_FILES[0], INTEGRATION_DIR / SLOWEST_FILES[1],
    ]  # fmt: skip
    items = [SimpleNamespace(path=p, n=i) for i, p in enumerate(paths)]
    assert [i.n for i in sorted(items, key=_schedule_rank)] == [4, 2, 5, 1, 3, 0]
