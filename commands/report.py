"""`distrain report`: the runs' comparison table (and report.md, the plots), the predicted-against-
measured table for runs that carry a prediction, and where the report went."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

from distrain.commands.console import print_wide, say, warn


def report(run_dirs: list[str] | list[Path], out_dir: Path | None) -> None:
    from distrain.orchestrator.storage import localize  # a --storage URI: reported from its local copy
    from distrain.reporting.report import (
        COLUMNS,
        choose_out_dir,
        distinct_dirs,
        load_runs,
        table_rows,
        write_report,
    )

    given = [str(d) for d in run_dirs]  # the report names each run so, a URI too (not its local copy)
    local = [Path(localize(d, "report")) for d in given]
    kept, repeats = distinct_dirs(local)
    runs = load_runs([local[i] for i in kept], [given[i] for i in kept])
    target = choose_out_dir(out_dir)
    written = write_report(runs, target)
    table = Table(title=Text(f"distrain report: {len(runs)} run(s)"))
    for i, name in enumerate(COLUMNS):
        table.add_column(name, justify="left" if i < 2 else "right", no_wrap=i == 0)
    for row in table_rows(runs):
        table.add_row(*row)
    print_wide(table)
    from distrain.reporting.gpu import COLUMNS as GPU_COLUMNS
    from distrain.reporting.gpu import gpu_rows

    gpus = gpu_rows(runs)
    if gpus:  # runs whose workers trained on GPUs
        table = Table(title=Text("GPUs"))
        for i, name in enumerate(GPU_COLUMNS):
            table.add_column(name, justify="left" if i < 1 else "right")
        for row in gpus:
            table.add_row(*row)
        print_wide(table)
    from distrain.reporting.prediction import COLUMNS as PREDICTED
    from distrain.reporting.prediction import prediction_rows

    predicted = prediction_rows(runs)
    if predicted:
        table = Table(title=Text("predicted against measured step time"))
        for i, name in enumerate(PREDICTED):
            table.add_column(name, justify="left" if i < 2 else "right")
        for row in predicted:
            table.add_row(*row)
        print_wide(table)
    files = ", ".join(p.name for p in written)
    say(f"report in {target}/ ({files})")
    for repeat, first in repeats:  # said, not silently dropped
        warn(f"note: {given[repeat]!r} is the same run directory as {given[first]!r}; it is reported once")
