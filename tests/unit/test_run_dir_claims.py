"""Run directories are claimed atomically before anything else happens (issue 13): two runs never share
one, a directory that cannot be written is refused before Ray starts, and a refused run leaves nothing."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from distrain.config import RunConfig
from distrain.errors import ConfigError, DistrainError
from distrain.orchestrator import cluster, files
from distrain.orchestrator.files import claim_run_dir
from distrain.orchestrator.run import preflight, run_training

FIXED_STAMP = "20260101-000000"


@pytest.fixture
def same_second(monkeypatch):
    """Every run 'starts' in the same second."""
    monkeypatch.setattr(files.time, "strftime", lambda fmt: FIXED_STAMP)


def race(n: int, claim) -> list[object]:
    """Call `claim()` from n threads released together; each one's result or exception."""
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def go(i: int) -> None:
        barrier.wait()
        try:
            results[i] = claim()
        except Exception as e:  # noqa: BLE001 - recorded for the assertions
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_two_runs_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch, same_second):
    """Before the fix both got runs/<stamp>-bsp (picked, then created later with exist_ok=True)."""
    monkeypatch.chdir(tmp_path)
    first = preflight(RunConfig(model="mlp", lr=0.1))
    second = preflight(RunConfig(model="mlp", lr=0.2))
    assert first.run_dir != second.run_dir
    assert first.run_dir == Path("runs") / f"{FIXED_STAMP}-bsp"
    assert second.run_dir == Path("runs") / f"{FIXED_STAMP}-bsp-2"
    # each holds its own configuration from the moment it is claimed
    assert RunConfig.resolve(str(first.run_dir / "config.yaml"), {}).lr == 0.1
    assert RunConfig.resolve(str(second.run_dir / "config.yaml"), {}).lr == 0.2


def test_many_simultaneous_default_claims_are_all_distinct(tmp_path, same_second):
    root = tmp_path / "runs"
    claims = race(8, lambda: claim_run_dir("", "bsp", lambda p: f"run_dir: {p}\n", root=str(root)))
    paths = [c.path for c in claims]
    assert len(set(paths)) == 8
    for path in paths:
        assert (path / "config.yaml").read_text() == f"run_dir: {path}\n"


@pytest.mark.parametrize("exists", [False, True], ids=["new", "existing-empty"])
def test_one_explicit_run_dir_claimed_at_once_by_many_runs_goes_to_exactly_one(tmp_path, exists):
    target = tmp_path / "shared" / "run"
    if exists:
        target.mkdir(parents=True)
    results = race(8, lambda: claim_run_dir(str(target), "bsp", lambda p: f"owner {threading.get_ident()}\n"))
    winners = [r for r in results if isinstance(r, files.Claim)]
    losers = [r for r in results if not isinstance(r, files.Claim)]
    assert len(winners) == 1 and len(losers) == 7
    assert all(isinstance(e, ConfigError) for e in losers), losers
    assert all("taken by another run" in str(e) or "not empty" in str(e) for e in losers)
    assert sorted(p.name for p in target.iterdir()) == ["config.yaml"]  # no temporary file left behind


def test_a_claimed_explicit_run_dir_is_refused_to_a_second_run(tmp_path):
    target = tmp_path / "run"
    preflight(RunConfig(model="mlp", run_dir=str(target)))
    with pytest.raises(ConfigError, match="not empty"):
        preflight(RunConfig(model="mlp", run_dir=str(target)))


def test_release_removes_what_the_claim_created_and_nothing_else(tmp_path):
    (tmp_path / "keep").mkdir()
    claim = claim_run_dir(str(tmp_path / "keep" / "a" / "b"), "bsp", lambda p: "x: 1\n")
    assert (tmp_path / "keep" / "a" / "b" / "config.yaml").is_file()
    claim.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"] and not any((tmp_path / "keep").iterdir())
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_run_dir(str(empty), "bsp", lambda p: "x: 1\n").release()
    assert empty.is_dir() and not any(empty.iterdir())  # the user's own (empty) directory stays


def test_a_run_refused_after_the_claim_leaves_no_directory(tmp_path, monkeypatch):
    """A refusal once the directory is claimed (here: Ray cannot be reached) gives the claim back."""

    def unreachable(config, keep=False):
        raise DistrainError("cannot reach the Ray cluster")

    monkeypatch.setattr(cluster, "connect", unreachable)
    with pytest.raises(DistrainError, match="cannot reach"):
        run_training(RunConfig(model="mlp", run_dir=str(tmp_path / "new" / "run")))
    assert list(tmp_path.iterdir()) == []


def _make_read_only(path: Path) -> bool:
    """Make `path` unwritable for real, even for root (tests here run as root): the immutable attribute."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return True
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def test_a_read_only_run_dir_is_one_line_before_ray_and_writes_nothing(tmp_path, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    genuine = _make_read_only(parent)
    if not genuine:  # no way to make a directory read-only for root here: the error path, simulated
        real_mkdir = Path.mkdir

        def read_only_mkdir(self, *args, **kwargs):
            if parent in (self, *self.parents):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", read_only_mkdir)

    def no_ray(config):
        raise AssertionError("Ray must not start for a run directory that cannot be written")

    monkeypatch.setattr(cluster, "connect", no_ray)
    try:
        with pytest.raises(ConfigError, match=r"--run-dir .*ro/run' cannot be written \(") as refused:
            run_training(RunConfig(model="mlp", run_dir=str(parent / "run")))
        reasons = ("Operation not permitted", "Permission denied", "Read-only file system")
        assert any(reason in str(refused.value) for reason in reasons)
        assert list(parent.iterdir()) == []
    finally:
        if genuine and os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(parent)], check=True)
        parent.chmod(0o755)


@pytest.mark.parametrize("where", ["ro", "ro/tb/deeper"])
def test_a_read_only_tensorboard_dir_is_one_line_before_ray_and_writes_nothing(tmp_path, monkeypatch, where):
    """Issue 26: found only when the run started (74 lines, a failed run directory left behind)."""
    from typer.testing import CliRunner

    from distrain.cli import app

    parent = tmp_path / "ro"
    parent.mkdir()
    genuine = _make_read_only(parent)
    if not genuine:  # no way to make a directory read-only for root here: the kernel's answer, simulated
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != parent and real_access(p, mode, **kw))

    def no_ray(config):
        raise AssertionError("Ray must not start for a --tensorboard directory that cannot be written")

    monkeypatch.setattr(cluster, "connect", no_ray)
    run_dir = tmp_path / "run"
    try:
        args = ["run", "--model", "linear", "--tensorboard", str(tmp_path / where), "--run-dir", str(run_dir)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result.output
        line = f"--tensorboard '{tmp_path / where}' cannot be written (permission denied at '{parent}')"
        assert line in result.stderr
        assert list(parent.iterdir()) == [] and not run_dir.exists()  # no run directory claimed, nothing made
    finally:
        if genuine and os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(parent)], check=True)
        parent.chmod(0o755)
