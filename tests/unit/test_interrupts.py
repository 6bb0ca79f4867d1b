"""Signals as interruptions (orchestrator/interrupts.py) and the stopping of a dead driver's Ray
leftovers (orchestrator/leftovers.py), without Ray: real signals to this process, real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from distrain.orchestrator import interrupts, leftovers


@pytest.fixture
def installed():
    """The CLI's handlers in this process for one test; the previous ones (pytest's) back after."""
    before = {sig: signal.getsignal(sig) for sig in interrupts.SIGNALS}
    with interrupts.installed():
        yield
    assert {sig: signal.getsignal(sig) for sig in interrupts.SIGNALS} == before
    interrupts._received.clear()


def test_sigterm_interrupts_like_ctrl_c_with_its_own_exit_code(installed):
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs in the main thread at the next bytecode
    assert interrupts.exit_code() == 143 and interrupts.name() == "SIGTERM"


def test_a_signal_inside_a_deferred_section_takes_effect_when_it_ends(installed):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            done.append("the section ran to its end")
    assert done and interrupts.exit_code() == 130


def test_deferred_puts_back_a_handler_replaced_inside_it(installed):
    """ray.init replaces the SIGTERM handler with its own (sys.exit)."""
    with interrupts.deferred():
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(15))
    assert signal.getsignal(signal.SIGTERM) is interrupts._handle


def test_a_second_signal_does_not_cut_the_teardown_short_and_check_stays_true(installed):
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    os.kill(os.getpid(), signal.SIGINT)  # during the teardown: held, not raised
    time.sleep(0.2)
    with pytest.raises(KeyboardInterrupt):  # a swallowed raise does not let the run go on
        interrupts.check()


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs in the main thread at the next bytecode (or cuts the sleep short)


def test_one_stop_request_delivered_three_times_is_one_interruption(installed, monkeypatch):
    """`timeout` sends SIGTERM to its child and then to its group (the child again), and a supervisor's
    group kill may add one more: the same request, so the teardown goes on (no forced exit)."""
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    with pytest.raises(KeyboardInterrupt):
        _signal_self(signal.SIGTERM)
    _signal_self(signal.SIGTERM)  # during the teardown, within SAME_REQUEST_S of the first
    _signal_self(signal.SIGTERM)
    assert exits == [] and interrupts.exit_code() == 143
    with pytest.raises(KeyboardInterrupt):
        interrupts.check()


def test_a_third_request_later_still_ends_the_process_at_once(installed, monkeypatch):
    """Ctrl-C pressed three times, apart: the user gave up on the teardown."""
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(interrupts, "SAME_REQUEST_S", 0.01)
    with pytest.raises(KeyboardInterrupt):
        _signal_self(signal.SIGINT)
    time.sleep(0.05)
    _signal_self(signal.SIGINT)
    assert exits == []
    time.sleep(0.05)
    _signal_self(signal.SIGINT)
    assert exits == [130]


def test_without_install_deferred_and_check_change_nothing():
    """Tune trial threads and notebooks: no handlers installed, nothing held, nothing raised."""
    assert signal.getsignal(signal.SIGINT) is not interrupts._handle
    with interrupts.deferred():
        pass
    interrupts.check()


def test_interrupted_line_names_a_run_directory_only_if_it_exists(tmp_path):
    from distrain.cli import _interrupted_line

    assert "before the run started" in _interrupted_line(tmp_path / "never-made")
    assert str(tmp_path / "never-made") not in _interrupted_line(tmp_path / "never-made")
    assert str(tmp_path) in _interrupted_line(tmp_path) and "--resume" not in _interrupted_line(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest.json").write_text("{}")
    assert f"distrain run --resume {tmp_path}" in _interrupted_line(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed"}))  # the signal came at the end
    assert "it completed" in _interrupted_line(tmp_path) and "--resume" not in _interrupted_line(tmp_path)


# ---------------------------------------------------------------------- leftovers of a dead driver
HOLD = "import sys, time; f = open(sys.argv[1], 'a'); print('ready', flush=True); time.sleep(600)"


def _holder(path: Path) -> subprocess.Popen:
    """A process with a file open in a session directory, as every Ray process has its logs."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _session(temp_dir: Path, name: str, driver_pid: int | None) -> Path:
    session = temp_dir / f"session_{name}"
    (session / "logs").mkdir(parents=True)
    if driver_pid is not None:
        leftovers.record(session, driver_pid)
    return session


def test_only_sessions_whose_distrain_driver_is_gone_are_stopped(tmp_path):
    dead_driver = subprocess.Popen([sys.executable, "-c", "pass"])
    marker = {"pid": dead_driver.pid, "create_time": psutil.Process(dead_driver.pid).create_time()}
    dead_driver.wait()
    orphan = _session(tmp_path, "orphan", None)
    (orphan / leftovers.MARKER).write_text(json.dumps(marker))
    alive = _session(tmp_path, "alive", os.getpid())  # its driver (this test) still runs
    foreign = _session(tmp_path, "foreign", None)  # a Ray that distrain did not start
    sessions = {"orphan": orphan, "alive": alive, "foreign": foreign}
    procs = {name: _holder(session / "logs" / "x.log") for name, session in sessions.items()}
    try:
        assert leftovers.orphaned_sessions(tmp_path) == [orphan]
        assert leftovers.stop_orphaned(tmp_path) == 1
        assert procs["orphan"].wait(timeout=10) is not None
        assert procs["alive"].poll() is None and procs["foreign"].poll() is None
        assert not (orphan / leftovers.MARKER).exists() and (alive / leftovers.MARKER).exists()
        assert leftovers.stop_orphaned(tmp_path) == 0  # once stopped, not looked at again
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_a_reused_pid_is_not_taken_for_the_driver(tmp_path):
    session = _session(tmp_path, "reused", None)
    me = psutil.Process()
    (session / leftovers.MARKER).write_text(json.dumps({"pid": me.pid, "create_time": me.create_time() - 3600}))
    assert leftovers.orphaned_sessions(tmp_path) == [session]


UNRAISABLE = """
import weakref
from distrain.orchestrator import interrupts
if {quiet}:
    interrupts.quiet_shutdown_exits()
class Thing: pass
def exits(_): raise SystemExit(1)        # what Ray's SIGTERM handler raises, landing in a callback
def fails(_): raise ValueError("a real bug")
a, b = Thing(), Thing()
ra, rb = weakref.ref(a, exits), weakref.ref(b, fails)
del a, b
print("went on")
"""


@pytest.mark.parametrize("quiet", [False, True])
def test_quiet_shutdown_exits_drops_only_the_system_exit_dump(quiet):
    """A sweep's trial actor stopped by Ray's SIGTERM printed "Exception ignored in ... SystemExit" to
    the user's console (CI saw it after Ctrl-C); other unraisable errors are still shown."""
    done = subprocess.run([sys.executable, "-c", UNRAISABLE.format(quiet=quiet)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "went on\n", done.stderr
    assert "ValueError: a real bug" in done.stderr
    assert ("SystemExit" in done.stderr) is not quiet, done.stderr
