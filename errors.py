"""The one exception root for problems a user can fix.

The CLI turns a `DistrainError` into a single line on stderr and exit code 2; anything else is a bug
and keeps its traceback.
"""


class DistrainError(Exception):
    """A user-facing error: the message names the problem and the fix."""


class ConfigError(DistrainError):
    """An invalid configuration value, file or combination of flags."""


class ResourceError(DistrainError):
    """The cluster cannot provide what the run asks for."""
