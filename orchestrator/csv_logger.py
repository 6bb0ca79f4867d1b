"""The CSV logger (`--loggers csv`): a run's figures (orchestrator/loggers.py) in RUN_DIR/scalars.csv.

One row per figure, `step,name,value` (long form: names appear as the run goes, a task's own scalars and
each evaluation's metrics, which a fixed header could not hold). A resumed run appends to the file; the
steps it redoes after its checkpoint appear again, the later rows the ones that count. Read it back with
`pandas.read_csv(...).pivot_table(index="step", columns="name", values="value", aggfunc="last")`.
"""

from __future__ import annotations

import csv
from typing import Any

from distrain.orchestrator.callbacks import RunInfo
from distrain.orchestrator.loggers import Logger

FILE = "scalars.csv"
HEADER = ("step", "name", "value")


class CsvLogger(Logger):
    def open(self, info: RunInfo) -> None:
        self.path = info.run_dir / FILE
        new = not self.path.exists()
        self.file = self.path.open("a", newline="")
        self.writer = csv.writer(self.file)
        if new:
            self.writer.writerow(HEADER)

    def write(self, step: int, values: dict[str, float]) -> None:
        self.writer.writerows((step, name, repr(float(value))) for name, value in values.items())

    def flush(self) -> None:
        self.file.flush()

    def close(self, summary: dict[str, Any]) -> None:
        self.file.close()
