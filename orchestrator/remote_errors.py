"""An exception raised by the user's code in a worker, handed to the caller as itself.

Ray hands the driver a `RayTaskError(ValueError)`: a class made on the fly that is both, whose message
is the worker's whole traceback with terminal colour codes in it. A `distrain.fit` caller who wrote
`except ValueError` catches it, but sees escape codes in its text (and in any log or file it is written
to), and `type(e)` is not their class. `user_exception` gives back the worker's own exception object
(Ray pickles it as its `cause`) with the worker's traceback chained to it as `__cause__`, the way
`multiprocessing` and `concurrent.futures` attach a remote traceback: printed once, above the
driver's, in plain text. No Ray import: it works on the attributes Ray's exception carries.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

# CSI sequences: colours (ESC [ 36 m), resets, cursor moves
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
CARETS = re.compile(r"^\s*[\^~]+\s*$")  # Python 3.11's markers under a line of code: nothing to read
ACTOR_DETAILS = re.compile(r", actor_id=\w+, repr=<.*>\)$")  # the actor's id and Python repr: noise here


def strip_ansi(text: str) -> str:
    """`text` without terminal escape codes (for files, pipes and exception messages)."""
    return ANSI.sub("", text)


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (the `__cause__` of that exception)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def user_exception(error: BaseException) -> BaseException:
    """The exception a worker's code raised, for `error` (a RayTaskError): the worker's own exception
    object, its remote traceback as `__cause__`; `error` itself if it carries no exception."""
    cause = getattr(error, "cause", None)
    if not isinstance(cause, BaseException):
        return error
    cause.__cause__ = RemoteTraceback(remote_traceback(str(error)))
    return cause


def remote_traceback(text: str) -> str:
    """Ray's rendering of a worker's traceback, as plain text: escape codes and caret lines dropped, and
    the header line (`ray::TrainWorker.run_segment() (pid=..., ip=..., actor_id=..., repr=...)`) said
    in words."""
    lines = [line for line in strip_ansi(text).strip().splitlines() if not CARETS.match(line)]
    if lines and lines[0].startswith("ray::"):
        where = ACTOR_DETAILS.sub(")", lines[0])
        lines[0:1] = [f"raised in {where}", "Traceback (most recent call last):"]
    return "\n" + "\n".join(lines)


def plain_ray_logs_when_piped(streams: Any = None) -> None:
    """Ray colours the `(TrainWorker pid=...)` prefix of every line a worker prints, whatever the output
    is; where it is a file or a pipe, ask for plain text (Ray's RAY_COLOR_PREFIX=0) unless the user set
    the variable."""
    streams = streams if streams is not None else (sys.stdout, sys.stderr)
    if not all(_is_terminal(s) for s in streams):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
