"""The one exception root for problems a user can fix.

The CLI turns a `DistrainError` into a single line on stderr and its `exit_code` (2: bad input);
anything else is a bug and keeps its traceback.
"""


class DistrainError(Exception):
    """A user-facing error: the message names the problem and the fix."""

    exit_code = 2  # the CLI's exit code for it: bad input, refused before anything is written


class ConfigError(DistrainError):
    """An invalid configuration value, file or combination of flags."""


class ResourceError(DistrainError):
    """The cluster cannot provide what the run asks for."""


class RunFailed(DistrainError):
    """A run that started and then failed for good: its restarts (--max-failures) were used up, or the
    disk filled up under it. Not bad input, so not exit code 2: what was recorded is in the run
    directory (summary.json says `failed`), and the message says whether a checkpoint can be resumed."""

    exit_code = 4
