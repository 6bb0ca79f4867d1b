"""A resumed run's metrics rows come from metrics.parquet, cut at its checkpoint's step (issue 13): the
checkpoint no longer carries them, so it does not grow with the step count."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from distrain.config import RunConfig
from distrain.errors import DistrainError
from distrain.orchestrator.metrics import MetricsSink
from distrain.orchestrator.resume import recorded_rows, steps_per_epoch


def _sink(run_id: str, steps: range, epochs_evaluated: list[int], per_epoch: int) -> MetricsSink:
    sink = MetricsSink(run_id)
    for step in steps:
        sink.add_steps({"worker": [0, 1], "step": [step, step], "epoch": [step // per_epoch] * 2, "loss": [1.0, 2.0]})
    for epoch in epochs_evaluated:
        sink.add_eval(epoch, (epoch + 1) * per_epoch, {"loss": 0.5, "accuracy": 0.9}, float(epoch), 0.1)
    return sink


def test_rows_before_the_checkpoint_step_come_from_metrics_parquet(tmp_path):
    config = RunConfig(run_dir=str(tmp_path), model="mlp")
    per_epoch = steps_per_epoch(config)  # digits at 2 x 32: 22
    # The driver was killed at step 30, after the checkpoint of step 25 (metrics.parquet is written
    # with every checkpoint, so it holds at least the rows before it, and maybe some after).
    _sink(tmp_path.name, range(30), [0], per_epoch).write(tmp_path / "metrics.parquet")
    rows = recorded_rows(config, {"global_step": 25})
    assert sorted(set(rows["step"])) == list(range(25)) and len(rows["step"]) == 2 * 25 + 1
    assert [e for e, k in zip(rows["epoch"], rows["kind"], strict=True) if k == "eval"] == [0]
    # A checkpoint inside epoch 0: its evaluation (at the end of epoch 0) is redone, so it is dropped.
    rows = recorded_rows(config, {"global_step": 10})
    assert sorted(set(rows["step"])) == list(range(10)) and "eval" not in rows["kind"]


def test_a_checkpoint_of_an_earlier_version_still_brings_its_own_rows(tmp_path):
    """Checkpoints written before issue 13 held the rows; a resume of one takes them as they are."""
    config = RunConfig(run_dir=str(tmp_path), model="mlp")
    old_rows = _sink(tmp_path.name, range(6), [], 22).rows()
    assert recorded_rows(config, {"global_step": 6, "metrics": old_rows}) == old_rows


def test_a_metrics_file_written_before_the_overflow_column_still_resumes(tmp_path):
    """Issue 26 added `overflow` to the schema: a run directory written before it resumes, its rows with
    the column null; a file missing any other column is still refused."""
    config = RunConfig(run_dir=str(tmp_path), model="mlp")
    table = _sink(tmp_path.name, range(8), [], 22).table()
    pq.write_table(table.drop_columns(["overflow"]), tmp_path / "metrics.parquet")
    rows = recorded_rows(config, {"global_step": 6})
    assert sorted(set(rows["step"])) == list(range(6)) and set(rows["overflow"]) == {None}
    pq.write_table(table.drop_columns(["overflow", "loss"]), tmp_path / "metrics.parquet")
    with pytest.raises(DistrainError, match="missing or unreadable"):
        recorded_rows(config, {"global_step": 6})
