"""Crash-safe file writes and the run directory rules (never overwrite what a user has)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from distrain.errors import ConfigError


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Write through `write(tmp)`, fsync, then rename over `path`: readers see old or new, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
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


def choose_run_dir(requested: str, strategy: str, root: str = "runs") -> Path:
    """`--run-dir`, or runs/<timestamp>-<strategy>; refuses an existing non-empty directory."""
    return fresh_dir(requested, timestamped(Path(root), strategy), "--run-dir")
