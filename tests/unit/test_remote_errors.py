"""An exception in the user's code, raised in a worker, reaches the caller as itself (issue 26): its own
type (not Ray's `RayTaskError(ValueError)`), the worker's traceback attached once as `__cause__`, and no
terminal colour codes in its text or in anything written to a file or a pipe."""

from __future__ import annotations

import os

import pytest
import ray

from distrain.orchestrator.remote_errors import RemoteTraceback, plain_ray_logs_when_piped, strip_ansi, user_exception

ESC = "\x1b["

# What Ray's RayTaskError.__str__ makes of a worker's traceback (Ray 2.60): a coloured header, then the
# caret lines of the Ray-internal frames it hid, then the user's frames.
RAY_RENDERED = (
    "\x1b[36mray::TrainWorker.run_segment()\x1b[39m (pid=7015, ip=192.0.2.2, actor_id=728491b8485196777c9a72190100"
    "0000, repr=<distrain.orchestrator.worker.TrainWorker object at 0x7efc1c1a3d90>)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/work/distrain/orchestrator/worker.py", line 234, in run_segment\n'
    "    loss = self.strategy.compute_gradients(self.trainer, batch)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/home/me/my_task.py", line 38, in loss\n'
    '    raise ValueError("my loss broke at step 3")\n'
    "ValueError: my loss broke at step 3"
)


class RenderedTaskError(ray.exceptions.RayTaskError):
    """A RayTaskError whose text is RAY_RENDERED (its own __str__ needs a real worker's traceback)."""

    def __str__(self) -> str:
        return RAY_RENDERED


def test_the_users_exception_comes_back_as_itself_with_its_traceback_in_plain_text():
    error = RenderedTaskError("TrainWorker.run_segment", "Traceback ...", ValueError("my loss broke at step 3"))
    exc = user_exception(error)
    assert type(exc) is ValueError and str(exc) == "my loss broke at step 3"
    remote = exc.__cause__
    assert isinstance(remote, RemoteTraceback)
    assert str(remote).splitlines()[1:4] == [
        "raised in ray::TrainWorker.run_segment() (pid=7015, ip=192.0.2.2)",
        "Traceback (most recent call last):",
        '  File "/work/distrain/orchestrator/worker.py", line 234, in run_segment',
    ]
    assert ESC not in str(remote) and "^^^" not in str(remote)
    assert str(remote).rstrip().endswith("ValueError: my loss broke at step 3")


def test_an_error_with_no_exception_inside_is_left_as_it_is():
    error = ray.exceptions.RayError("no cause")
    assert user_exception(error) is error


def test_strip_ansi():
    assert strip_ansi("\x1b[36mray::f()\x1b[39m (pid=1) \x1b[1;31mred\x1b[0m") == "ray::f() (pid=1) red"


class Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(("out", "err", "plain"), [(True, True, False), (False, True, True), (True, False, True)])
def test_ray_log_prefixes_are_plain_when_output_is_not_a_terminal(monkeypatch, out, err, plain):
    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    plain_ray_logs_when_piped((Stream(out), Stream(err)))
    assert os.environ.get("RAY_COLOR_PREFIX") == ("0" if plain else None)


def test_the_users_own_ray_colour_setting_stands(monkeypatch):
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    plain_ray_logs_when_piped((Stream(False), Stream(False)))
    assert os.environ["RAY_COLOR_PREFIX"] == "1"


def test_the_cli_asks_ray_for_plain_log_prefixes_when_piped(monkeypatch):
    """`distrain run ... > log` (or under `ray job submit`): the entry point sets it before Ray starts."""
    import sys

    from distrain import cli

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    monkeypatch.setattr(sys, "argv", ["distrain", "--version"])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # whatever pytest's capture is: a pipe
    assert cli.main() == 0
    assert os.environ.get("RAY_COLOR_PREFIX") == "0"


def test_rays_repeated_lines_note_is_plain_where_plain_text_was_asked_for(monkeypatch):
    """`(raylet) A worker died ... [repeated 2x across cluster]` in a piped log had ESC[32m around the note."""
    from ray._private.ray_logging import DedupState

    import distrain.orchestrator.cluster  # noqa: F401  (it teaches Ray's deduplicator the setting)

    state = DedupState(timestamp=0, count=2, line="(raylet) A worker died", metadata={}, sources=set())
    monkeypatch.setenv("RAY_COLOR_PREFIX", "0")
    assert state.formatted().startswith("(raylet) A worker died [repeated 2x across cluster]")
    assert "\x1b" not in state.formatted()
    monkeypatch.delenv("RAY_COLOR_PREFIX")
    assert "\x1b[32m" in state.formatted()  # a terminal keeps Ray's colours




