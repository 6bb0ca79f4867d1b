"""The metrics sink: worker step rows and evaluation rows, one Arrow table, one Parquet file.

Rows arrive in batches (a segment's worth per worker per remote call). Step rows and evaluation rows
share one schema, told apart by `kind`; columns that do not apply to a row are null. The schema is
`SCHEMA` (the strategies' column families included: strategies/step_columns.py) plus one float column per
evaluation metric and split beyond the test loss and accuracy (`val_<name>` on the validation split,
`test_<name>` on the test set, e.g. `val_loss`, `test_perplexity`), and one per scalar the task logs from its
`loss` (`train_<name>`, on step rows: `Task.loss` returning `(loss, {name: value})`), each added when it first
appears. The file is
written atomically (temporary file, fsync, rename), so a crash never leaves a half-written one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from distrain.orchestrator.files import atomic_write
from distrain.orchestrator.gpu_stats import GPU_COLUMNS
from distrain.orchestrator.peak_memory import PEAK_COLUMNS
from distrain.strategies.step_columns import family_columns

# The columns of the scalars a task logs each step (`Task.loss` returning `(loss, {"name": value})`).
LOGGED_PREFIX = "train_"

SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("kind", pa.string()),  # "step" or "eval"
        ("worker", pa.int32()),  # rank; null on eval rows
        ("step", pa.int64()),  # global step (0-based); on eval rows: the steps the evaluated model had taken
        ("slice", pa.int32()),  # which of the N slices of the global batch this row trained on
        ("epoch", pa.int32()),
        ("loss", pa.float64()),
        ("lr", pa.float64()),
        ("samples", pa.int64()),
        ("compute_s", pa.float64()),
        ("comm_s", pa.float64()),
        # moving the step's batch to the worker's device (`trainers/task.py` DeviceCopy; part of compute_s);
        # null on a row whose unit the strategy read and moved itself (Sandblaster's portions)
        ("h2d_s", pa.float64()),
        ("bytes_sent", pa.int64()),
        ("bytes_received", pa.int64()),
        ("wall_time", pa.float64()),  # seconds since the run started (end of the step / evaluation)
        ("test_loss", pa.float64()),
        ("test_accuracy", pa.float64()),
        ("eval_s", pa.float64()),
    ]
    # the strategies' column families (the parameter server's, backup tasks', local SGD's: null elsewhere)
    + [(name, pa.type_for_alias(kind)) for name, kind in family_columns().items()]
    + [
        # --on-nonfinite: this step's loss, gradient or average was not finite (skipped, or the run stopped)
        ("nonfinite", pa.bool_()),
        # --precision fp16: that non-finite step was the loss scale's overflow (skipped, the scale halved:
        # normal, never counted as divergence); null otherwise
        ("overflow", pa.bool_()),
        # --compress: what this step's bytes_sent would have been uncompressed (float32); null without a codec
        ("bytes_uncompressed", pa.int64()),
    ]
    # every worker's peak memory so far: host (resident set) and CUDA (orchestrator/peak_memory.py)
    + [(name, pa.type_for_alias(kind)) for name, kind in PEAK_COLUMNS.items()]
    # a CUDA worker's GPU utilisation and memory in use, from NVML, about once a second
    # (orchestrator/gpu_stats.py); null in between, on the CPU and without nvidia-ml-py
    + [(name, pa.type_for_alias(kind)) for name, kind in GPU_COLUMNS.items()]
)


EVAL_PREFIXES = ("val_", "test_")  # the evaluation columns: a task's metrics on each split


class MetricsSink:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._batches: list[pa.RecordBatch] = []
        self.schema = SCHEMA

    def _widen(self, names: list[str]) -> None:
        """Add a float column for each evaluation metric not in the schema yet."""
        new = [n for n in names if self.schema.get_field_index(n) < 0]
        if new:
            for name in new:
                self.schema = self.schema.append(pa.field(name, pa.float64()))
            self._batches = [_conform(b, self.schema) for b in self._batches]

    def declare(self, columns: dict[str, str]) -> None:
        """Add a strategy's own step columns (`Strategy.metric_columns`: name -> Arrow type name)."""
        new = [(n, t) for n, t in columns.items() if self.schema.get_field_index(n) < 0]
        if new:
            for name, kind in new:
                self.schema = self.schema.append(pa.field(name, pa.type_for_alias(kind)))
            self._batches = [_conform(b, self.schema) for b in self._batches]

    def _append(self, columns: dict[str, list[Any]], kind: str) -> None:
        n = len(next(iter(columns.values()))) if columns else 0
        if n == 0:
            return
        arrays = []
        for field in self.schema:
            if field.name == "run_id":
                values: list[Any] = [self.run_id] * n
            elif field.name == "kind":
                values = [kind] * n
            else:
                values = columns.get(field.name, [None] * n)
            arrays.append(pa.array(values, type=field.type))
        self._batches.append(pa.RecordBatch.from_arrays(arrays, schema=self.schema))

    def add_steps(self, columns: dict[str, list[Any]]) -> None:
        self._widen([name for name in columns if name.startswith(LOGGED_PREFIX)])
        self._append(columns, "step")

    def add_eval(self, epoch: int, step: int, metrics: dict[str, float], wall_time: float, eval_s: float) -> None:
        """One evaluation: `metrics` maps its columns ("val_loss", "val_accuracy", "test_loss", ...) to values."""
        columns = {name: [value] for name, value in metrics.items()}
        self._widen(list(columns))
        self._append({"epoch": [epoch], "step": [step], "wall_time": [wall_time], "eval_s": [eval_s]} | columns, "eval")

    def last_eval(self) -> dict[str, Any] | None:
        """The last evaluation row, by column; None before the first."""
        table = self.table()
        kinds = table.column("kind").to_pylist()
        where = [i for i, k in enumerate(kinds) if k == "eval"]
        return None if not where else {name: table.column(name)[where[-1]].as_py() for name in table.schema.names}

    def fill_last_eval(self, figures: dict[str, float]) -> None:
        """Set `figures` (columns) on the last evaluation row (the test set scored after it, at the run's end)."""
        self._widen(list(figures))
        columns = self.table().to_pydict()
        last = max(i for i, k in enumerate(columns["kind"]) if k == "eval")
        for name, value in figures.items():
            columns[name][last] = value
        self._batches = pa.Table.from_pydict(columns, schema=self.schema).to_batches()

    def keep_before(self, step: int, steps_per_epoch: int) -> None:
        """Forget what was recorded after global step `step` (a recovery redoes it): step rows of later
        steps and evaluations of epochs that end after it."""
        table = self.table()
        if table.num_rows == 0:
            return
        steps = table.column("step").to_pylist()
        epochs = table.column("epoch").to_pylist()
        kinds = table.column("kind").to_pylist()
        keep = [
            (s < step) if k == "step" else ((e + 1) * steps_per_epoch <= step)
            for s, e, k in zip(steps, epochs, kinds, strict=True)
        ]
        self._batches = table.filter(pa.array(keep)).to_batches()

    def rows(self) -> dict[str, list[Any]]:
        """Everything recorded, as plain columns (checkpoints carry them to a resumed run)."""
        return self.table().to_pydict()

    def add_rows(self, columns: dict[str, list[Any]]) -> None:
        """Rows from `rows()` (a checkpoint's), as they were."""
        self._widen([name for name in columns if name.startswith((*EVAL_PREFIXES, LOGGED_PREFIX))])
        n = len(next(iter(columns.values()))) if columns else 0
        # Columns added since the rows were written (a checkpoint of an earlier version) are null in them.
        present = {name: columns.get(name, [None] * n) for name in self.schema.names}
        table = pa.Table.from_pydict(present, schema=self.schema)
        self._batches.extend(table.to_batches())

    def table(self) -> pa.Table:
        return pa.Table.from_batches(self._batches, schema=self.schema)

    def write(self, path: Path) -> None:
        table = self.table()
        atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def _conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """`batch` with nulls in the columns of `schema` it lacks."""
    arrays = [
        batch.column(f.name) if batch.schema.get_field_index(f.name) >= 0 else pa.nulls(batch.num_rows, f.type)
        for f in schema
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
