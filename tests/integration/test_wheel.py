"""A wheel built from this checkout carries every package and the shipped examples, and distrain runs from
it: the wheel is installed with `pip install --no-deps --target DIR` and run with `PYTHONPATH=DIR` (a fresh
virtual environment would download its ~6 GB of dependencies on every CI run; this one lends them).
One short run (the mlp, one epoch, one worker) on a local Ray of its own, whose worker imports the wheel's
copy too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from distrain.commands.examples import bundled

ROOT = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "site", "runs", "sweep", "*.egg-info", "__pycache__")


def source_copy(dest: Path) -> Path:
    """The checkout's files (as git sees them, untracked ones it does not ignore included), so that the
    build neither writes into the checkout nor packs a stale build/ folder of it."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if listed.returncode != 0:  # not a git checkout (an unpacked source tree): everything but outputs
        shutil.copytree(ROOT, dest, ignore=SKIP)
        return dest
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def python(*args: str, env_path: Path, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "PYTHONPATH": str(env_path),  # the wheel's copy only: not this checkout
        "RAY_TMPDIR": tempfile.mkdtemp(prefix="dw", dir="/tmp"),  # short: Ray's socket paths live in it
        "DISTRAIN_PROGRESS_EVERY_S": "0",
    }
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_the_wheel_installs_with_its_examples_and_trains(tmp_path):
    src = source_copy(tmp_path / "src")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "dist", str(src)]
    subprocess.run(build, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("distrain-*.whl")
    inside = wheel_files(wheel)

    # Every package pyproject.toml lists (each __init__.py and module of the checkout) and every example.
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    for package in packages:
        folder = src.joinpath(*package.split(".")[1:])
        for module in folder.glob("*.py"):
            assert f"{package.replace('.', '/')}/{module.name}" in inside, (package, module.name)
    shipped = bundled(src)
    assert {"examples/char_lm.py", "examples/strategies/easgd.py", "notebooks/explore_strategies.ipynb",
            "cluster.yaml"} <= {p.as_posix() for p in shipped}  # fmt: skip
    for rel in shipped:
        assert f"distrain/{rel.as_posix()}" in inside, rel

    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)]
    subprocess.run(install, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    # The example tasks are importable from the install too (--task distrain.examples.char_lm:CharLM).
    code = "import distrain, distrain.examples.char_lm; print(distrain.__file__)"
    where = python("-c", code, env_path=site, cwd=tmp_path)
    assert where.stdout.strip() == str(site / "distrain" / "__init__.py"), where.stderr

    # `distrain examples`: lists the wheel's own copies, and copies exactly the shipped files.
    listed = python("-m", "distrain.cli", "examples", env_path=site, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert f"--task {site / 'distrain' / 'examples' / 'char_lm.py'}:CharLM" in listed.stdout, listed.stdout
    copied = python("-m", "distrain.cli", "examples", "--copy", "mine", env_path=site, cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr
    assert sorted(bundled(tmp_path / "mine")) == sorted(shipped)
    for rel in shipped:
        assert (tmp_path / "mine" / rel).read_bytes() == (src / rel).read_bytes(), rel

    run = python("-m", "distrain.cli", "run", "--model", "mlp", "--epochs", "1", "--workers", "1", "--run-dir", "run",
                 env_path=site, cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"status": "completed"' in summary and '"epochs_completed": 1' in summary, summary
