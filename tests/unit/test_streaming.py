"""Ray Data input without Ray (orchestrator/streaming.py): which runs may stream a Dataset and which are
refused in one line (the CLI's exit 2, before Ray starts), the CPUs Ray Data needs, a worker's reading of
its shard epoch by epoch, and the driver's call of `datasets()` that keeps Ray Data from starting a Ray."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from distrain.cli import app
from distrain.config import RunConfig
from distrain.errors import ConfigError, ResourceError
from distrain.orchestrator import cluster, streaming
from tests.raydata_task import write_digits

TASK = f"{Path(__file__).parents[1] / 'raydata_task.py'}:DigitsStream"


@pytest.mark.parametrize(
    "options",
    [{}, {"strategy": "local-sgd", "tau": 4}, {"strategy": "diloco"}, {"strategy": "bsp", "compress": "int8"}],
)
def test_collective_strategies_stream(options):
    assert streaming.refusal(RunConfig(workers=2, **options)) is None


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"strategy": "async"}, "--strategy async over --transport ps assigns samples"),
        ({"strategy": "ssp", "staleness": 2}, "--strategy ssp over --transport ps"),
        ({"strategy": "bsp", "transport": "ps"}, "--strategy bsp over --transport ps"),
        ({"strategy": "bsp", "transport": "ps", "backup_tasks": True}, "--strategy bsp over --transport ps"),
        ({"strategy": "sandblaster"}, "--strategy sandblaster"),
        ({"workers": "2..4"}, "--workers 2..4 (elastic)"),
        ({"pipeline_stages": 2, "task": "tests/pipeline_task.py:WideMLP"}, "--pipeline-stages 2 cuts a replica"),
        ({"fsdp": 2}, "--fsdp 2 cuts a replica"),
        ({"worker_weights": "3,1"}, "--worker-weights / --worker-group / --balance speed give workers unequal shares"),
        ({"balance": "speed"}, "--worker-weights / --worker-group / --balance speed give workers unequal shares"),
        ({"worker_groups": ["a:1:48", "b:1:16"]}, "--worker-group / --balance speed give workers unequal shares"),
    ],
)
def test_strategies_that_assign_by_index_are_refused(options, named):
    config = RunConfig(**({"workers": 2} | options))
    why = streaming.refusal(config)
    assert why is not None and named in why, why
    with pytest.raises(ConfigError, match="Ray Dataset, which streams") as refused:
        streaming.check_streamable(config)
    assert "\n" not in str(refused.value)


def test_cli_refuses_a_streamed_task_under_ps_in_one_line_before_ray_starts(tmp_path, monkeypatch):
    import ray

    from distrain.orchestrator import cluster

    def no_ray(*args, **kwargs):
        raise AssertionError("the run connected to Ray before refusing")

    # (`make test` runs this file after the integration tests, with their Ray still up: the connection is
    # what must not happen, whether or not some Ray is running in this process)
    monkeypatch.setattr(cluster, "connect", no_ray)
    was_up = ray.is_initialized()
    write_digits(tmp_path, 64)
    result = CliRunner().invoke(
        app, ["run", "--task", TASK, "--task-arg", f"data_dir={tmp_path}", "--strategy", "async", "--workers", "2"]
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--strategy async over --transport ps assigns samples" in lines[0], result.output
    assert ray.is_initialized() == was_up  # refused from the Dataset's plan alone: nothing was read


def test_ray_data_needs_a_cpu_the_workers_do_not_hold(monkeypatch):
    config = RunConfig(workers=2, cpus_per_worker=2)
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 4.0})
    with pytest.raises(ResourceError, match=r"Ray Data needs 1 CPU .* has 4 and the run's 2 workers hold 4"):
        cluster.check_data_cpus(config)
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 7.0})
    assert cluster.check_data_cpus(config) == 3


class FakeIterator:
    """A shard's iterator: each `iter_batches` call is one epoch's pass over `rows` rows."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.passes: list[list[int]] = []  # the batches handed out, per pass
        self.closed = 0

    def iter_batches(self, batch_size, batch_format, drop_last, prefetch_batches):
        assert batch_format == "numpy" and drop_last
        handed: list[int] = []
        self.passes.append(handed)
        try:
            for start in range(0, self.rows - batch_size + 1, batch_size):
                handed.append(start)
                yield {"id": np.arange(start, start + batch_size)}
        finally:
            self.closed += 1


def test_a_worker_reads_its_shard_in_order_one_pass_an_epoch():
    it = FakeIterator(rows=10)
    reader = streaming.StreamReader(streaming.Shard(it, rows=20, batch=3), lambda c: c["id"].tolist(), 3)
    assert [reader.read(0, s) for s in range(3)] == [([0, 1, 2], 3), ([3, 4, 5], 3), ([6, 7, 8], 3)]
    assert it.closed == 1  # the epoch's pass is closed after its last step (the 10th row is never read)
    assert reader.read(1, 0) == ([0, 1, 2], 3)  # the next epoch: a new pass from its start
    assert len(it.passes) == 2
    # resumed in the middle of an epoch: the rest of its steps from a fresh pass
    resumed = streaming.StreamReader(streaming.Shard(FakeIterator(10), 20, 3), lambda c: c["id"].tolist(), 3)
    assert [resumed.read(4, 1)[0], resumed.read(4, 2)[0]] == [[0, 1, 2], [3, 4, 5]]


def test_a_shard_that_runs_dry_says_the_data_changed():
    reader = streaming.StreamReader(streaming.Shard(FakeIterator(4), rows=16, batch=3), lambda c: c, 4)
    reader.read(0, 0)
    with pytest.raises(ConfigError, match="ran out at step 1 of epoch 0 .* changed since the run counted it"):
        reader.read(0, 1)


def test_streamed_test_set_is_scored_by_share_zero_whole():
    class Test:
        def iter_batches(self, batch_size, batch_format):
            yield {"x": np.arange(batch_size)}
            yield {"x": np.arange(2)}

    assert [b.tolist() for b in streaming.test_batches(Test(), lambda c: c["x"], 0, 4)] == [[0, 1, 2, 3], [0, 1]]
    assert list(streaming.test_batches(Test(), lambda c: c["x"], 1, 4)) == []


def test_datasets_needing_ray_at_once_start_distrains_ray_first(monkeypatch):
    """Ray Data's in-memory Datasets (from_items) need Ray when built: the driver's call starts the run's
    Ray (`start_ray`) and calls `datasets()` again, rather than letting Ray Data start a Ray of its own."""
    import ray

    calls: list[str] = []

    class NeedsRay:
        def datasets(self):
            calls.append("datasets")
            if "start" not in calls:
                raise ray.exceptions.RaySystemError("Ray has not been started yet")
            return "train", "test"

    # The driver before distrain has started Ray (`make test` runs this file with the integration tests' Ray up)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert streaming.datasets_lazily(NeedsRay(), lambda: calls.append("start")) == ("train", "test")
    assert calls == ["datasets", "start", "datasets"]
    calls.clear()
    with pytest.raises(ray.exceptions.RaySystemError):  # nothing to start Ray with: Ray's own error
        streaming.datasets_lazily(NeedsRay(), None)


def test_default_collate_columns_makes_a_dict_of_writable_tensors():
    import torch

    from distrain.trainers.task import Task

    column = np.arange(6, dtype=np.float32).reshape(3, 2)
    column.flags.writeable = False  # as Ray Data's arrays may be: views of its blocks
    batch = Task().collate_columns({"x": column, "y": np.array([1, 0, 1])})
    assert set(batch) == {"x", "y"} and torch.equal(batch["x"], torch.from_numpy(column.copy()))
    assert batch["y"].tolist() == [1, 0, 1] and Task().batch_size(batch) == 3
