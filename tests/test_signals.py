"""Ctrl-C and SIGTERM sent to a real `distrain` process, at start-up and mid-run, and the check that
none of its processes is left.

Each command runs in its own session (start_new_session), so it and everything it starts (Ray's GCS,
raylet, agents, workers: the workers have process groups of their own, but stay in the session) are
found by session id, never by name: other Ray instances may run on this machine. SIGINT goes to the
process group, as a terminal's Ctrl-C does; SIGTERM to the driver alone, as `docker stop` does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

SMALL = ["--model", "mlp", "--epochs", "1", "--workers", "1"]


def session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return found


def assert_nothing_left(sid: int, within_s: float = 15.0) -> None:
    """No process of session `sid` left (after `within_s` for exits under way); kills any found."""
    deadline = time.monotonic() + within_s
    while (left := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = [" ".join(p.cmdline())[:80] or p.name() for p in left]
    for proc in left:
        proc.kill()
    assert not left, names


class Command:
    """`distrain ARGS` in its own session; stdout lines collected as they come."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "PYTHONUNBUFFERED": "1"} | (env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "distrain.cli", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, ready, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.proc.poll() is None, f"ended before the signal: {self.finish()}"

    def finish(self, timeout_s: float = 120) -> tuple[int, str]:
        try:
            stderr = self.proc.communicate(timeout=timeout_s)[1]
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        self.reader.join(5)
        return self.proc.returncode, stderr

    def children(self) -> bool:
        try:
            return bool(psutil.Process(self.proc.pid).children())
        except psutil.NoSuchProcess:
            return False


def test_ctrl_c_while_ray_starts_exits_130_naming_no_directory_that_is_not_there(tmp_path):
    run_dir = tmp_path / "run"
    cmd = Command("run", *SMALL, f"--run-dir={run_dir}")
    cmd.wait_for(cmd.children)  # ray.init has started the GCS: the driver is inside Ray's start-up
    os.killpg(cmd.proc.pid, signal.SIGINT)
    rc, stderr = cmd.finish()
    assert rc == 130, stderr
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("interrupted (SIGINT)"), stderr
    if run_dir.exists():  # the signal may land just after the run directory is made
        assert str(run_dir) in stderr
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    else:
        assert "before the run started" in stderr and str(run_dir) not in stderr
    assert_nothing_left(cmd.proc.pid)


@pytest.mark.parametrize(
    ("signum", "send", "code"),
    [(signal.SIGINT, os.killpg, 130), (signal.SIGTERM, os.kill, 143)],
    ids=["ctrl-c", "sigterm"],
)
def test_signal_mid_run_records_an_interrupted_run_and_leaves_nothing(tmp_path, signum, send, code):
    run_dir = tmp_path / "run"
    cmd = Command("run", *SMALL, f"--run-dir={run_dir}", "--segment-steps=2", "--batch-size=8")  # 180 steps
    cmd.wait_for(lambda: any(line.startswith("run dir") for line in cmd.lines))  # the workers are training
    send(cmd.proc.pid, signum)
    rc, stderr = cmd.finish()
    assert rc == code, stderr
    assert stderr.strip().splitlines() == [
        f"interrupted ({signal.Signals(signum).name}): workers stopped; what was recorded so far is in {run_dir}/"
    ]
    total = int(next(line for line in cmd.lines if line.startswith("run dir")).split("|")[-1].split()[0])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps_completed"] < total
    assert (run_dir / "metrics.parquet").is_file()
    assert_nothing_left(cmd.proc.pid)


def test_ctrl_c_during_a_sweep_exits_130_quietly_and_says_how_to_resume(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = Command(
        "tune", "--model", "mlp", "--batch-sizes", "16,32", "--epochs", "1", "--max-concurrent-trials", "1",
        "--sweep-dir", str(sweep),
    )  # fmt: skip
    cmd.wait_for(lambda: bool(list(sweep.glob("trials/*/config.yaml"))))  # the first trial runs
    os.killpg(cmd.proc.pid, signal.SIGINT)
    rc, stderr = cmd.finish()
    assert rc == 130, stderr
    assert stderr.strip().splitlines()[-1].endswith(f"go on with: distrain tune --resume {sweep}"), stderr
    assert "WARNING" not in stderr and len(stderr.strip().splitlines()) <= 2, stderr
    assert_nothing_left(cmd.proc.pid)


DRIVER = """
import sys, time
from distrain.orchestrator import cluster
cluster.start_local_ray(1)
print("started", flush=True)
time.sleep(600)
"""


def test_the_next_start_stops_what_a_sigkilled_driver_left(tmp_path):
    """kill -9 of the driver alone: no handler runs. What its Ray leaves behind (the raylet's agents,
    re-parented to init) is stopped by the next local start's check, here called directly."""
    from distrain.orchestrator import leftovers

    temp = Path(tempfile.mkdtemp(prefix="dr", dir="/tmp"))  # short: Ray's socket paths live in it
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "RAY_TMPDIR": str(temp)}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        assert driver.stdout.readline().strip() == "started"
        assert len(leftovers.orphaned_sessions(temp / "ray")) == 0  # its driver is alive
        assert len(list((temp / "ray").glob(f"session_2*/{leftovers.MARKER}"))) == 1
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        leftovers.stop_orphaned(temp / "ray")
        assert_nothing_left(driver.pid, within_s=5)
        assert not list((temp / "ray").glob(f"session_*/{leftovers.MARKER}"))
    finally:
        for proc in session_processes(driver.pid):
            proc.kill()
