"""SIGINT (Ctrl-C) and SIGTERM (schedulers, `docker stop`) as one thing: an interruption of the run.

    installed()      the CLI's entry point only: Tune trial threads and notebooks run runs too, and
                     there `signal.signal` cannot (or must not) be used
    deferred()       a section a signal must not cut in half (starting or stopping Ray): a signal that
                     arrives inside takes effect when it ends
    check()          raise now if a signal came (library code may have swallowed the first raise)
    exit_code()      128 + the first signal's number: 130 for SIGINT, 143 for SIGTERM

The first signal raises KeyboardInterrupt in the main thread, so the run's own teardown (status
"interrupted", metrics and summary written, actors killed, Ray stopped) runs as for Ctrl-C. Further
signals do not cut that teardown short; the third ends the process at once (its Ray processes die
with it, or the next start stops them: orchestrator/leftovers.py).

One stop request often arrives as several signals at once: `timeout` sends SIGTERM to its child and
then to its whole process group (the child again), and a supervisor's group kill adds one more. So
signals that come within SAME_REQUEST_S of the first one of a burst count as one: only a user who
presses Ctrl-C again (later) moves towards the forced exit, never a single `timeout` or group kill.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
FORCE_AFTER = 3  # stop requests: the third one exits without teardown
SAME_REQUEST_S = 1.0  # signals this soon after the first of a burst are the same request delivered again

_installed = False
_received: list[int] = []  # signal numbers of the stop requests, in order of arrival
_burst_start = 0.0  # time.monotonic() of the signal that made the last request
_depth = 0  # nesting of deferred() sections (main thread)


def install() -> None:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt (main thread only; the CLI calls this)."""
    global _installed
    _received.clear()
    for sig in SIGNALS:
        signal.signal(sig, _handle)
    _installed = True


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """install() for the length of the block, then the previous handlers back (the CLI's main() is
    also called in-process, by tests)."""
    global _installed
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    install()
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        _installed = False


def _handle(signum: int, frame: Any) -> None:
    global _burst_start
    now = time.monotonic()
    if _received and now - _burst_start < SAME_REQUEST_S:
        return  # the same request again (timeout's child and group sends, a group kill): already on its way
    _burst_start = now
    _received.append(signum)
    if len(_received) >= FORCE_AFTER:
        os._exit(128 + _received[0])
    if _depth or len(_received) > 1:
        return  # deferred() raises once its section ends; a teardown already under way goes on
    raise KeyboardInterrupt


def received() -> int | None:
    """The first signal received, if any."""
    return _received[0] if _received else None


def exit_code() -> int:
    return 128 + (_received[0] if _received else signal.SIGINT)


def name() -> str:
    return signal.Signals(_received[0]).name if _received else "SIGINT"


def check() -> None:
    """Raise KeyboardInterrupt if a signal came: once interrupted, a run does not go on."""
    if _received:
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold signals for the length of the block (only where install() was called, in the main thread).

    Also puts the handlers back afterwards: ray.init installs its own SIGTERM handler (sys.exit),
    which would turn `docker stop` into a stack dump and status "failed"."""
    global _depth
    if not _installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for sig in SIGNALS:
            if signal.getsignal(sig) is not _handle:
                signal.signal(sig, _handle)
    if not _depth and sys.exc_info()[0] is None:  # in a teardown, the interruption is already on its way
        check()


def reassert() -> None:
    """Put the handlers back even where Python still records them as in place: a library's C++ code
    (Ray's core worker, connecting on another thread: orchestrator/ray_start.py) may have replaced them
    underneath, which `signal.getsignal` does not see. Main thread, and only where install() was called."""
    if _installed and threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _handle)


@dataclass
class Lent:
    caught: bool = False  # the borrower's handler caught a SIGINT


@contextlib.contextmanager
def sigint_lent() -> Iterator[Lent]:
    """Around library code that installs its own SIGINT handler and puts the previous one back once
    that has caught a signal (Ray Tune's fit, which then stops the sweep gracefully): afterwards
    `.caught` tells whether it did; if not, the previous handler is put back here (Tune leaves its own
    installed). Outside the main thread nothing can be installed, and nothing is caught."""
    lent = Lent()
    if threading.current_thread() is not threading.main_thread():
        yield lent
        return
    before = signal.getsignal(signal.SIGINT)
    try:
        yield lent
    finally:
        borrowed = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER", "0") in ("", "0")
        lent.caught = borrowed and signal.getsignal(signal.SIGINT) is before
        if signal.getsignal(signal.SIGINT) is not before and before is not None:
            signal.signal(signal.SIGINT, before)


def quiet_shutdown_exits() -> None:
    """In a Ray actor process: drop the stack dump Python prints when Ray's SIGTERM handler (which
    raises SystemExit) fires inside a weakref or finaliser callback while Ray stops the actor at the
    end of a sweep. Python cannot raise there, so it prints "Exception ignored in ..." and the process
    goes on to be stopped anyway; Ray forwards that print to the user's console. Every other
    unraisable exception is still printed."""
    shown = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, SystemExit):
            return
        shown(unraisable)

    sys.unraisablehook = hook
