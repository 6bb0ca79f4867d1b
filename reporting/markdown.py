"""Markdown tables for report.md: the report's own sections and the prediction's (one module below both,
so neither imports the other to draw a table)."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(rows: Sequence[Sequence[str]], columns: Sequence[str], numeric_from: int = 2) -> str:
    """`columns` over `rows`, the columns from `numeric_from` on right-aligned (figures)."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    align = ["---"] * numeric_from + ["---:"] * (len(columns) - numeric_from)
    return "\n".join([line(columns), line(align), *(line(r) for r in rows)]) + "\n"
