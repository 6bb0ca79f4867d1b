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


def integration_under_unit_in(session) -> list[str] | None:
    """The integration-marked tests under tests/unit, read from this pytest session's own collection when it
    holds every unit test file, unfiltered (the whole suite's run, as CI's: a second collection in a
    subprocess would import every unit module again, about 15 s); None when it does not."""
    option = session.config.option
    if option.markexpr or option.keyword or option.deselect:
        return None
    unit = TESTS / "unit"
    items = [item for item in session.items if unit in Path(item.path).parents]
    if {Path(item.path) for item in items} != set(unit.rglob("test_*.py")):
        return None
    return [item.nodeid for item in items if item.get_closest_marker("integration")]


def test_no_integration_test_sits_under_tests_unit(request):
    found = integration_under_unit_in(request.session)
    if found is None:
        found = collected("-m", "integration", str(TESTS / "unit"))
    assert found == []


def test_every_test_file_is_in_one_of_the_two_layers():
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert loose == [], f"test files outside tests/unit and tests/integration: {loose}"
