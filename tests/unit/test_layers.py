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
