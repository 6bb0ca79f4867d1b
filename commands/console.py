"""Where the commands print: `out` (results, progress) and `err` (errors, notes). Read them as
`console.out` at the time of printing, so that a test can swap them."""

from __future__ import annotations

from typing import Any

from rich.console import Console

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def say(line: str) -> None:
    """One plain line on stdout (no markup, no highlighting)."""
    out.print(line, markup=False, highlight=False)


def warn(line: str) -> None:
    """One plain line on stderr."""
    err.print(line, markup=False, highlight=False)


def print_wide(table: Any) -> None:
    """Logs, pipes: nothing wraps the lines, so print the table at its natural width."""
    console = out
    if not out.is_terminal:
        natural = out.measure(table, options=out.options.update_width(1_000)).maximum
        console = Console(file=out.file, width=max(out.width, natural), soft_wrap=True)
    console.print(table)
