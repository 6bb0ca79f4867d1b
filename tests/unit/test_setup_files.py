"""What a new user meets before the first run: the Makefile installs what each target needs, the
README's commands without make do the same, .gitignore covers every directory distrain writes by
default, and docs/cluster.md describes the fault tolerance that exists. No Ray."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from distrain.flag_table import run_options
from distrain.orchestrator.files import timestamped
from distrain.planning import command as plan_run
from distrain.reporting import report

ROOT = Path(__file__).resolve().parents[2]


def ignored(path: Path) -> bool:
    """Whether .gitignore's patterns ignore the directory `path` (relative, as distrain writes it)."""
    patterns = [p.strip() for p in (ROOT / ".gitignore").read_text().splitlines() if p.strip() and p[0] != "#"]
    top = path.parts[0]
    return any(fnmatch.fnmatch(top, p.strip("/")) for p in patterns if p.endswith("/"))


def test_gitignore_covers_every_default_output_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the defaults are relative to where the command runs
    defaults = {
        "run": timestamped(Path("runs"), "bsp")(1),
        "tune": timestamped(Path("sweep"), "tune")(1),
        "report": report.choose_out_dir(None),
        "plan": plan_run.choose_out_dir(None),
    }
    for command, path in defaults.items():
        assert not path.is_absolute() and ignored(path), (command, path)
    assert not ignored(Path("orchestrator")) and not ignored(Path("docs"))  # the patterns are not catch-alls


def dry_run(target: str, tmp_path: Path) -> str:
    """What `make TARGET` would run on a fresh checkout (no .venv yet)."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    # Under `make test` (CI) this make is a sub-make, which would print "Entering directory" lines.
    cmd = ["make", "--no-print-directory", "-n", target]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def without_make(readme: str) -> list[str]:
    """The README's two "Without make" command lines: run, then test."""
    block = readme[readme.index("Without make") :]
    block = block[block.index("```bash\n") + 8 : block.index("```", block.index("```bash\n") + 8)]
    return block.strip().splitlines()


def pip_target(text: str) -> str:
    """What `pip install -e` installs in `text`: `.` or `".[dev]"`."""
    (target,) = re.findall(r"pip install (?:--quiet )?-e (\S+)", text)
    return target


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_run_installs_distrain_and_make_test_its_dev_extras(tmp_path):
    run, test = dry_run("run", tmp_path), dry_run("test", tmp_path)
    assert "-m venv .venv" in run and "-m venv .venv" in test  # a fresh machine: both create it
    assert pip_target(run) == "." and run.rstrip().endswith(".venv/bin/distrain run")
    assert pip_target(test) == '".[dev]"' and "pytest" in test
    readme_run, readme_test = without_make((ROOT / "README.md").read_text())
    assert pip_target(readme_run) == pip_target(run) and readme_run.endswith("distrain run")
    assert pip_target(readme_test) == pip_target(test) and readme_test.endswith("-m pytest")


def test_cluster_doc_describes_the_fault_tolerance_that_exists():
    text = " ".join((ROOT / "docs" / "cluster.md").read_text().split())
    assert "no fault tolerance" not in text
    flags = {opt for option in run_options() for opt in option.opts}
    for flag in ("--max-failures", "--checkpoint-steps", "--hang-timeout-s", "--chaos", "--workers", "--resume"):
        assert flag in text and flag in flags, flag
    assert "MIN..MAX" in text and "replaced in place" in text and "restarts" in text


def test_every_product_package_is_in_the_wheel():
    """pyproject.toml lists the packages by hand (the repository root is the package): a new folder of
    product code left off the list would import in this checkout and be missing from an installed wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    skip = {"tests", "benchmarks", "examples", "notebooks", "docs", "build"}
    found = {
        ".".join(("distrain", *p.parent.relative_to(ROOT).parts))
        for p in ROOT.rglob("__init__.py")
        if not ({".venv", *skip} & set(p.relative_to(ROOT).parts)) and "egg-info" not in str(p)
    }
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert len(found) > 8
