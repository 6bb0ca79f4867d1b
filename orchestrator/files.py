"""Crash-safe file writes and the run directory rules (never overwrite what a user has)."""

from __future__ import annotations

import errno
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distrain.errors import ConfigError

# errno values that mean the file system has no room for what is written (space, or the user's quota).
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class NoSpace(OSError):
    """A write found no space left on its device. `filename` is the file that was being written; its
    temporary file is gone and whatever `filename` held before is unchanged (atomic_write)."""

    def __init__(self, path: Path) -> None:
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def is_no_space(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from or while handling, is a full device. Writers wrap
    the OSError: torch.save raises a RuntimeError whose context holds it, pyarrow an OSError of its own."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS:
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Write through `write(tmp)`, fsync, then rename over `path`: readers see old or new, never half.
    A full device is raised as `NoSpace(path)`, without the writer's chain of errors; the partly
    written temporary file is removed whatever went wrong."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        if is_no_space(e):
            raise NoSpace(path) from None
        raise
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def fresh_dir(requested: str | Path | None, default: Callable[[int], Path], flag: str) -> Path:
    """A directory to write into that holds nothing yet. Creates nothing.

    `requested` (a flag's value) may be new or an existing empty directory; anything else is refused,
    so nothing a user has is overwritten. Without one, the first of default(1), default(2), ... that
    does not exist (two runs started in the same second get different names)."""
    if not requested:
        n = 1
        while default(n).exists():
            n += 1
        return default(n)
    path = Path(requested)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{flag} {str(path)!r} exists and is not a directory; choose another path")
        if any(path.iterdir()):
            raise ConfigError(f"{flag} {str(path)!r} is not empty; choose a new directory (nothing is overwritten)")
    return path


def timestamped(parent: Path, name: str) -> Callable[[int], Path]:
    """parent/<YYYYmmdd-HHMMSS>-name, then ...-name-2, -3, ..."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return lambda n: parent / (f"{stamp}-{name}" if n == 1 else f"{stamp}-{name}-{n}")


def exclusive_write_text(path: Path, text: str) -> None:
    """Create `path` holding `text` only if it does not exist yet (FileExistsError otherwise).

    The text goes to a temporary file that is hard-linked into place: of two writers exactly one wins,
    and no reader ever sees the file half-written. Where hard links are not supported, an exclusive
    create (O_EXCL) still decides the winner."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)  # unique even between threads
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes it private; a run's files are as readable as others
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # no hard links on this file system
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class Claim:
    """A run directory this process owns: created (or found empty) and holding its config.yaml."""

    path: Path
    made: list[Path]  # directories the claim created, outermost first

    def release(self) -> None:
        """Undo the claim of a run refused before it wrote anything else: nothing is left behind."""
        (self.path / CLAIM_FILE).unlink(missing_ok=True)
        _remove_empty(self.made)


CLAIM_FILE = "config.yaml"  # its exclusive creation is the claim


def claim_run_dir(requested: str, strategy: str, config_text: Callable[[Path], str], root: str = "runs") -> Claim:
    """Create the run directory and its config.yaml (`config_text(path)`) atomically, before anything else.

    `--run-dir` may be new or an existing empty directory; one that another run has just claimed is
    refused, as is one that cannot be created (under a file, read-only, no permission). Without it:
    runs/<timestamp>-<strategy>, then -2, -3, ...: each name is taken by an exclusive mkdir, so two runs
    started in the same second get different directories. Every refusal is a ConfigError (one line,
    exit 2) and leaves nothing behind."""
    flag = "--run-dir"
    try:
        if requested:
            path = fresh_dir(requested, timestamped(Path(root), strategy), flag)  # refuses a file, a non-empty dir
            made = _missing_parents(path) + ([] if path.is_dir() else [path])
            path.mkdir(parents=True, exist_ok=True)
        else:
            default = timestamped(Path(root), strategy)
            made = _missing_parents(default(1))
            default(1).parent.mkdir(parents=True, exist_ok=True)
            n = 1
            while True:
                path = default(n)
                try:
                    path.mkdir()  # exclusive: exactly one run gets each name
                    break
                except FileExistsError:
                    n += 1
            made.append(path)
    except OSError as e:
        if not requested:
            reason = e.strerror or type(e).__name__
            raise ConfigError(f"cannot create a run directory in {root!r} ({reason}); pass --run-dir") from None
        raise _unwritable(flag, Path(requested), e) from None
    try:
        exclusive_write_text(path / CLAIM_FILE, config_text(path))
    except FileExistsError:  # made or emptied at the same moment by another run, which got there first
        raise ConfigError(f"{flag} {str(path)!r} was just taken by another run; choose another directory") from None
    except OSError as e:
        _remove_empty(made)
        raise _unwritable(flag, path, e) from None
    return Claim(path, made)


def _missing_parents(path: Path) -> list[Path]:
    """The ancestors of `path` that do not exist yet, outermost first."""
    missing = []
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            break
        missing.append(parent)
    return list(reversed(missing))


def _remove_empty(directories: list[Path]) -> None:
    for directory in reversed(directories):
        try:
            directory.rmdir()
        except OSError:  # not empty (another run wrote there) or already gone: leave it
            return


def check_creatable_dir(requested: str | Path, flag: str) -> None:
    """Refuse, writing nothing, an output directory that could not be made or written into later: a path
    that is a file or lies under one, or whose nearest existing directory this process may not write to
    (no permission, a read-only file system). Asked of the kernel with access(2), which answers for the
    user this process runs as (root included: it may write into a 0555 directory, not on a read-only
    mount). Used for directories a run fills only once it has started (--tensorboard)."""
    path = Path(requested).absolute()
    existing = path  # the directory that will hold what is made: the path itself, or its nearest existing parent
    while not existing.exists() and not existing.is_symlink():
        existing = existing.parent
    if not existing.is_dir():
        what = "exists and is not a directory" if existing == path else f"lies under {str(existing)!r}, a file"
        raise ConfigError(f"{flag} {str(requested)!r} {what}; choose a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only(existing) else "permission denied"
        raise ConfigError(
            f"{flag} {str(requested)!r} cannot be written ({reason} at {str(existing)!r}); choose a writable directory"
        )


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _unwritable(flag: str, path: Path, error: OSError) -> ConfigError:
    reason = error.strerror or type(error).__name__
    return ConfigError(f"{flag} {str(path)!r} cannot be written ({reason}); choose a writable directory")
