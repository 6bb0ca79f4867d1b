"""Ctrl-C and SIGTERM sent to a real `distrain` process, at start-up and mid-run, and the check that
none of its processes is left.

Each command runs in its own session (start_new_session) with a Ray temp dir of its own
(RAY_TMPDIR). Its processes are found three ways, never by name (other Ray instances may run on this
machine): by session id (the driver and whatever stays in its session), as descendants of the
command (collected while it runs: the GCS and raylet run in sessions of their own, and the raylet
starts the workers in process groups of their own) and by their Ray temp dir (named on the command
line or holding a log file open there: every Ray process does, also once re-parented to init).
SIGINT goes to the process group, as a terminal's Ctrl-C does; SIGTERM to the process group, as
`timeout`, a supervisor or a batch scheduler sends it.
"""

from __future__ import annotations

import json
import os
import shutil
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


def processes_using(directory: Path) -> list[psutil.Process]:
    """This user's processes that name `directory` on their command line or hold a file open in it."""
    root, found = os.path.realpath(directory), []
    for proc in psutil.process_iter(["uids", "cmdline"]):
        try:
            if proc.pid == os.getpid() or proc.info["uids"] is None or proc.info["uids"].real != os.getuid():
                continue
            if root in " ".join(proc.info["cmdline"] or ()) or any(
                f.path.startswith(root + os.sep) for f in proc.open_files()
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _alive(proc: psutil.Process) -> bool:
    try:  # is_running() also tells a reused PID from the process seen before
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_commands: list[Command] = []


@pytest.fixture(autouse=True)
def _stop_what_a_failed_test_left():
    """A test that fails before its own check must not leave Ray processes on a shared machine."""
    yield
    while _commands:
        cmd = _commands.pop()
        for proc in cmd.processes():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(cmd.ray_tmp, ignore_errors=True)


class Command:
    """`distrain ARGS` (or `PREFIX distrain ARGS`) in its own session, with a Ray temp dir of its own;
    stdout lines collected as they come."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = (), script: str = ""
    ) -> None:
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="ds", dir="/tmp"))  # short: Ray's socket paths live in it
        env = (
            os.environ
            | {"PYTHONPATH": os.pathsep.join(sys.path), "PYTHONUNBUFFERED": "1", "RAY_TMPDIR": str(self.ray_tmp)}
            | (env or {})
        )
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, *(["-c", script] if script else ["-m", "distrain.cli"]), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        )  # fmt: skip
        self.seen: dict[int, psutil.Process] = {}
        _commands.append(self)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, ready, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.proc.poll() is None, f"ended before the signal: {self.finish()}"
        self.look()

    def look(self) -> None:
        """Remember the command's processes now (its descendants and its Ray's), to look for later."""
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        for proc in descendants + processes_using(self.ray_tmp):
            self.seen.setdefault(proc.pid, proc)

    def processes(self) -> list[psutil.Process]:
        """Every process of this command still running: in its session, seen before, or its Ray's."""
        found = {p.pid: p for p in session_processes(self.proc.pid)}
        found |= {p.pid: p for p in self.seen.values() if _alive(p)}
        found |= {p.pid: p for p in processes_using(self.ray_tmp) if _alive(p)}
        return list(found.values())

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


def assert_nothing_left(cmd: Command, within_s: float = 15.0) -> None:
    """No process of `cmd` left (after `within_s` for exits under way); kills any found."""
    deadline = time.monotonic() + within_s
    while (left := cmd.processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    names = [" ".join(p.cmdline())[:80] or p.name() for p in left if _alive(p)]
    for proc in left:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, names
    shutil.rmtree(cmd.ray_tmp, ignore_errors=True)


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
    assert_nothing_left(cmd)


MID_RUN = {  # id: (signal, command prefix, exit code)
    "ctrl-c": (signal.SIGINT, (), 130),
    "sigterm-to-group": (signal.SIGTERM, (), 143),
    "sigterm-under-timeout": (signal.SIGTERM, ("timeout", "600"), 143),
}


def test_signal_mid_run_records_an_interrupted_run_and_leaves_nothing(tmp_path):
    """Every signal goes to the whole process group. Under `timeout` the driver gets SIGTERM three times
    at once (from the group kill, then from timeout to its child and to its group again): one request,
    not three Ctrl-Cs, so the teardown runs to its end.

    The three cases are three commands (each its own session, Ray and run directory), started together:
    one's imports and Ray start overlap the others' (each alone left a core idle for most of its ~18 s);
    each gets its signal as soon as its own workers train."""
    cmds = {}
    for case, (_, prefix, _) in MID_RUN.items():
        run_dir = tmp_path / case
        args = ("run", *SMALL, f"--run-dir={run_dir}", "--segment-steps=2", "--batch-size=8")
        cmds[case] = Command(*args, prefix=prefix)
    waiting = dict(cmds)
    deadline = time.monotonic() + 240
    while waiting and time.monotonic() < deadline:
        for case, cmd in list(waiting.items()):
            if any(line.startswith("run dir") for line in cmd.lines):  # the workers are training
                cmd.wait_for(lambda: True)  # (remembers its processes; fails if it ended already)
                os.killpg(cmd.proc.pid, MID_RUN[case][0])
                del waiting[case]
            elif cmd.proc.poll() is not None:
                pytest.fail(f"{case}: ended before the signal: {cmd.finish()}")
        time.sleep(0.05)
    assert not waiting, f"not training within 240 s: {sorted(waiting)}"
    for case, cmd in cmds.items():
        signum, _, code = MID_RUN[case]
        run_dir = tmp_path / case
        rc, stderr = cmd.finish()
        assert rc == code, (case, stderr)
        assert stderr.strip().splitlines() == [
            f"interrupted ({signal.Signals(signum).name}): workers stopped; what was recorded so far is in {run_dir}/"
        ], case
        total = int(next(line for line in cmd.lines if line.startswith("run dir")).split("|")[-1].split()[0])
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "interrupted" and summary["steps_completed"] < total, (case, summary)
        assert (run_dir / "metrics.parquet").is_file(), case
    for cmd in cmds.values():
        assert_nothing_left(cmd)


def test_ctrl_c_during_a_sweep_exits_130_quietly_and_says_how_to_resume(tmp_path):
    """The second trial waits for CPUs (two trials of 2.01 CPUs on 3): Tune holds it as pending, never
    started, which on Ctrl-C it reports in a warning of its own (no metrics for it) besides its stop
    and resume notices. The one line the CLI prints says all of it."""
    sweep = tmp_path / "sweep"
    cmd = Command(
        "tune", "--model", "mlp", "--batch-sizes", "16,32", "--epochs", "1", "--cluster-cpus", "3",
        "--sweep-dir", str(sweep),
    )  # fmt: skip
    cmd.wait_for(lambda: bool(list(sweep.glob("trials/*/config.yaml"))))  # the first trial runs
    os.killpg(cmd.proc.pid, signal.SIGINT)
    rc, stderr = cmd.finish()
    assert rc == 130, stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.strip().endswith(f"go on with: distrain tune --resume {sweep}"), stderr
    said = "".join(cmd.lines) + stderr
    assert not any(tune_says in said for tune_says in ("WARNING", "Failed to fetch", "Stop signal", "Tuner.restore"))
    assert_nothing_left(cmd)


DRIVER = """
import sys, time
from distrain.orchestrator import cluster
cluster.start_local_ray(1)
print("started", flush=True)
time.sleep(600)
"""


def test_the_next_start_stops_what_a_sigkilled_driver_left():
    """kill -9 of the driver alone: no handler runs. What its Ray leaves behind (the raylet's agents,
    re-parented to init) is stopped by the next local start's check, here called directly."""
    from distrain.orchestrator import leftovers

    driver = Command(script=DRIVER)
    temp = driver.ray_tmp / "ray"
    driver.wait_for(lambda: "started\n" in driver.lines, timeout_s=60)
    assert len(leftovers.orphaned_sessions(temp)) == 0  # its driver is alive
    assert len(list(temp.glob(f"session_2*/{leftovers.MARKER}"))) == 1
    os.kill(driver.proc.pid, signal.SIGKILL)
    driver.proc.wait()
    leftovers.stop_orphaned(temp)
    assert_nothing_left(driver, within_s=5)
    assert not list(temp.glob(f"session_*/{leftovers.MARKER}"))
