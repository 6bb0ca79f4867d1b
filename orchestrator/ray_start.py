"""A local Ray begun in the background while the driver is still loading torch and checking the run.

`distrain run`'s cold start was serial: imports and the config's checks (the last of which loads
torch), then `ray.init` (seconds, mostly waiting for the GCS and the raylet to come up), then the
workers. Here the CLI has the config's checks call `begin` once every torch-free check has passed
(config/checks.py `before_torch`): the local Ray the run will want, sized by `cluster.connect`'s own
rule, starts on a thread, and `cluster.connect` takes it (`take`) when the run gets there. Bad input
is refused before any of this, as before; a run that ends before taking it (a later refusal, an
interruption) stops it (`discard`), so nothing is left running and the outcome is the one it was.

Only for the plain case: a fresh process (the console entry, not a notebook's `fit`, not a test's
in-process runner), no --address, no --resume, no --task (a Ray Dataset sizes Ray for its readers:
streaming.py), no `--strategy auto` (its calibration connects first).

Signals: Ray's core worker puts its own SIGTERM handler in place as it connects; on the main thread the
driver puts its own back at once (interrupts.deferred), here when the run takes the Ray (interrupts.reassert). A SIGTERM
in between (after Ray is up, before the checks end) gets Ray's handler: a stack dump and exit -6 instead
of the one line and 143.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

_enabled = False  # within the console entry (cli.main): only a fresh CLI process begins Ray early


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Early starts allowed for the block's length (cli.main's; tests also call main in-process)."""
    global _enabled
    before, _enabled = _enabled, True
    try:
        yield
    finally:
        _enabled = before


@dataclass
class EarlyRay:
    config: Any  # the run's RunConfig, its torch-free checks passed
    start: Callable[[Any], int]  # starts the local Ray for a config; returns its num_cpus
    stop: Callable[[], None]  # stops it
    num_cpus: int = 0
    thread: threading.Thread | None = None
    error: BaseException | None = None
    seconds: float | None = None  # ray.init's own duration
    done: threading.Event = field(default_factory=threading.Event)

    def _start(self) -> None:
        started = time.perf_counter()
        try:
            self.num_cpus = self.start(self.config)
        except BaseException as e:  # noqa: BLE001 - handed to the thread that takes it
            self.error = e
        finally:
            self.seconds = time.perf_counter() - started
            self.done.set()
        # The thread stays: Ray's GCS and raylet die with the *thread* that started them (Ray asks the
        # kernel for PR_SET_PDEATHSIG, which follows the parent thread), so it lives as long as the process,
        # with SIGINT and SIGTERM blocked: the kernel then hands them to a thread that is doing something
        # (blocked from here on, not before: what this thread spawned would inherit the mask).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        threading.Event().wait()

    def wait(self) -> None:
        """Until the start is over; its error (if any) is raised here, in the taking thread."""
        self.done.wait()
        if self.error is not None:
            raise self.error


_pending: EarlyRay | None = None


class _DropThreadNotice(logging.Filter):
    """ray.init off the main thread says it set no SIGTERM handler: the driver's own (interrupts.py) is it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def begin(config: Any, start: Callable[[Any], int], stop: Callable[[], None]) -> None:
    """Begin the local Ray for `config` on a thread (`start(config)`, which returns its num_cpus) when the
    run will surely start one (the module's note); `stop` stops it again, if the run does not take it."""
    global _pending
    if not _enabled or _pending is not None:
        return
    if config.address or config.task or config.strategy == "auto":
        return
    logging.getLogger("ray._private.worker").addFilter(_DropThreadNotice())
    _pending = EarlyRay(config, start, stop)
    _pending.thread = threading.Thread(target=_pending._start, name="distrain-ray-start", daemon=True)
    _pending.thread.start()


def pending() -> bool:
    """A local Ray is being (or was) begun for this run and not yet taken."""
    return _pending is not None


def take(num_cpus: int) -> bool:
    """The run's connect: True when the early Ray is up and of the run's size (it is then this run's
    local Ray, as if started here); False when there is none, or it was the wrong size (stopped)."""
    global _pending
    early, _pending = _pending, None
    if early is None:
        return False
    early.wait()  # its error is the run's, as the run's own ray.init would have raised it
    from distrain.orchestrator import startup

    if early.num_cpus != num_cpus:
        early.stop()
        return False
    startup.ray_started(early.seconds or 0.0, in_background=True)
    return True


def discard() -> None:
    """Stop an early Ray the run never took (it ended before connecting: bad input, an interruption)."""
    global _pending
    early, _pending = _pending, None
    if early is None:
        return
    early.done.wait()
    if early.error is None:
        early.stop()
