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


def choose_run_dir(requested: str, strategy: str, root: str = "runs") -> Path:
    """The run directory to use; refuses an existing non-empty one. Creates nothing."""
    if requested:
        path = Path(requested)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(root) / f"{stamp}-{strategy}"
        suffix = 1
        while path.exists():  # two runs started in the same second
            suffix += 1
            path = Path(root) / f"{stamp}-{strategy}-{suffix}"
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"--run-dir {str(path)!r} exists and is not a directory; choose another path")
        if any(path.iterdir()):
            raise ConfigError(
                f"run directory {str(path)!r} is not empty; choose a new --run-dir (nothing is overwritten)"
            )
    return path
