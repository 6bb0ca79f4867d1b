"""The task contract (`distrain.Task`), import paths for users' code, and their one-line errors.

Unit tests: no Ray. The runs of a user task through the CLI and `distrain.fit` are in
tests/integration/test_user_task_acceptance.py.
"""

from __future__ import annotations

import math
import re
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset
from typer.testing import CliRunner

import distrain
from distrain.cli import app
from distrain.config import RunConfig, parse_target
from distrain.errors import ConfigError
from distrain.orchestrator import run_checks
from distrain.orchestrator.tasks import build_task, check_task, run_target
from distrain.plugins import absolute_import_path, load_object
from distrain.trainers.task import BatchReader, ClassificationTask, Task, reduce_metrics
from tests.unit.test_cli_errors import no_ray  # noqa: F401 - the fixture: fail if Ray would start

REGRESSION = textwrap.dedent(
    """
    import torch
    from torch.utils.data import TensorDataset

    import distrain


    class Regression(distrain.Task):
        default_target = "test_loss<=0.05"

        def __init__(self, n=256, noise=0.05):
            self.n, self.noise = n, noise

        def build_model(self):
            return torch.nn.Linear(4, 1)

        def datasets(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(self.n, 4, generator=g)
            y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + self.noise * torch.randn(self.n, generator=g)
            cut = self.n * 3 // 4
            return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])

        def loss(self, model, batch):
            x, y = batch
            return ((model(x).squeeze(-1) - y) ** 2).mean()

        def metrics(self, model, batch):
            x, y = batch
            return {"mae": (model(x).squeeze(-1) - y).abs().mean().item()}


    class NotATask:
        pass


    class EmptyData(Regression):
        def datasets(self):
            return TensorDataset(torch.zeros(0, 4), torch.zeros(0)), TensorDataset(torch.zeros(1, 4), torch.zeros(1))


    class VectorLoss(Regression):
        def loss(self, model, batch):
            return (model(batch[0]).squeeze(-1) - batch[1]) ** 2


    class ConstantLoss(Regression):
        def loss(self, model, batch):
            return torch.tensor(1.0)


    class BrokenModel(Regression):
        def build_model(self):
            raise RuntimeError("my model has a bug")


    class StringMetrics(Regression):
        def metrics(self, model, batch):
            return "mae: low"


    class TextMetricValue(Regression):
        def metrics(self, model, batch):
            return {"mae": "low"}


    class NanLoss(Regression):
        def loss(self, model, batch):
            return super().loss(model, batch) * float("nan")


    class OneDataset(Regression):
        def datasets(self):
            return super().datasets()[0]


    class Bounded(Regression):
        metric_ranges = {"mae": (0.0, float("inf"))}


    class Overreaching(Bounded):
        default_target = "mae<=-0.5"
    """
)


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_task.py"
    path.write_text(REGRESSION)
    return path


# ---------------------------------------------------------------- import paths
def test_load_object_from_a_file_and_from_a_module(task_file):
    cls = load_object(f"{task_file}:Regression", "--task")
    assert issubclass(cls, distrain.Task)
    assert load_object(f"{task_file}:Regression", "--task") is cls  # one module per file: same class again
    assert load_object("distrain.trainers.task:ClassificationTask", "--task") is ClassificationTask


def test_file_paths_are_recorded_absolute(task_file, monkeypatch):
    monkeypatch.chdir(task_file.parent)
    assert absolute_import_path("my_task.py:Regression", "--task") == f"{task_file}:Regression"
    assert absolute_import_path("pkg.mod:Name", "--task") == "pkg.mod:Name"
    cfg = RunConfig(task="my_task.py:Regression")
    assert cfg.task == f"{task_file}:Regression"


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("nowhere.py:Task", "no file"),
        ("no_such_module_xyz:Task", "no module named 'no_such_module_xyz'"),
        ("{file}:Missing", "has no attribute 'Missing'"),
        ("{raises}:Task", "raised ZeroDivisionError"),
        ("justaname", "must be module:Name"),
    ],
)
def test_bad_import_paths_are_one_config_error(tmp_path, task_file, path, fragment):
    raises = tmp_path / "raises.py"
    raises.write_text("1 / 0\n")
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        load_object(path.format(file=task_file, raises=raises), "--task")


def test_an_object_that_is_not_a_task_is_refused(task_file):
    with pytest.raises(ConfigError, match="not a subclass of distrain.Task"):
        build_task(RunConfig(task=f"{task_file}:NotATask"))


# ---------------------------------------------------------------- checks before the run starts
@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("EmptyData", "the training set is empty"),
        ("VectorLoss", r"must return a scalar tensor .* shape \(8,\)"),
        ("ConstantLoss", "does not depend on the model"),
    ],
)
def test_check_task_refuses_what_cannot_train(task_file, name, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_task(RunConfig(task=f"{task_file}:{name}"), batch_size=8)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        # distrain's own TypeError/AttributeError used to be shown as the user's, through its internals
        ("StringMetrics", "task StringMetrics: metrics() returned str 'mae: low'; it must return a dict {name: "),
        ("TextMetricValue", "metrics() returned str 'low' for 'mae'; it must return a number (the batch mean)"),
        ("OneDataset", "datasets() returned a TensorDataset; it must return (train, val, test) or (train, test)"),
    ],
)
def test_a_task_that_breaks_the_contract_is_one_config_error(task_file, name, fragment):
    with pytest.raises(ConfigError) as info:
        check_task(RunConfig(task=f"{task_file}:{name}"), batch_size=8)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_a_loss_that_is_not_finite_at_the_start_is_refused_before_the_run(task_file):
    """It used to pass the pre-flight: Ray started, the run diverged at step 0."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the one line only (no torch warning about reading the loss)
        with pytest.raises(ConfigError, match=r"loss\(\) is nan at the initial parameters, on the first batch"):
            check_task(RunConfig(task=f"{task_file}:NanLoss"), batch_size=8)


def test_an_exception_in_the_users_code_keeps_its_traceback(task_file):
    with pytest.raises(RuntimeError, match="my model has a bug") as info:
        check_task(RunConfig(task=f"{task_file}:BrokenModel"), batch_size=8)
    assert any("build_model" in note for note in info.value.__notes__)


def test_check_task_reports_size_and_parameters(task_file):
    task, n_train, sizes = check_task(RunConfig(task=f"{task_file}:Regression", task_args={"n": 100}), 8)
    assert (n_train, sizes) == (75, [4, 1])
    assert str(run_target(RunConfig(task=f"{task_file}:Regression"), task)) == "test_loss<=0.05"
    assert str(run_target(RunConfig(task=f"{task_file}:Regression", target="mae<=0.1"), task)) == "val_mae<=0.1"
    assert str(run_target(RunConfig())) == "val_accuracy>=0.95"


def test_a_target_on_a_metric_the_task_does_not_report_is_refused(task_file):
    """Else it is never reached, silently (and a sweep's scheduler has no metric to compare)."""
    for target in ("mae<=0.1", "test_loss<=0.5"):
        check_task(RunConfig(task=f"{task_file}:Regression", target=target), 8)
    reported = "test_loss, test_mae, val_loss, val_mae"
    with pytest.raises(ConfigError, match=rf"--target val_mea<=0.1 names .* it reports {reported}$"):
        check_task(RunConfig(task=f"{task_file}:Regression", target="mea<=0.1"), 8)


def test_a_target_outside_its_metrics_range_is_refused(task_file):
    """A target the metric can never reach ran to the end; a metric of unknown range is left alone."""
    unreachable = (("test_accuracy>=1.5", "test_accuracy lies in [0, 1]"), ("loss<=-1", "val_loss lies in [0, inf)"))
    for target, reach in unreachable:
        with pytest.raises(ConfigError, match=rf"--target .* can never be reached: {re.escape(reach)}"):
            run_checks.check_runnable(RunConfig(target=target))
    run_checks.check_runnable(RunConfig(target="accuracy>=1"))  # reachable at the edge
    check_task(RunConfig(task=f"{task_file}:Regression", target="mae<=-1"), 8)  # the user's: range not declared
    with pytest.raises(ConfigError, match=r"--target val_mae<=-1 can never be reached: val_mae lies in \[0, inf\)"):
        check_task(RunConfig(task=f"{task_file}:Bounded", target="mae<=-1"), 8)
    with pytest.raises(ConfigError, match=r"the task's default_target val_mae<=-0.5 can never be reached"):
        check_task(RunConfig(task=f"{task_file}:Overreaching"), 8)


def test_unknown_task_arguments_are_one_line(task_file):
    with pytest.raises(ConfigError, match=r"Regression\(width=3\) failed"):
        build_task(RunConfig(task=f"{task_file}:Regression", task_args={"width": 3}))


@pytest.mark.parametrize("text", ["accuracy", "acc>0.5", "test_loss<=x", "loss<=inf", ">=0.3"])
def test_malformed_targets_are_refused(text):
    with pytest.raises(ConfigError, match="--target"):
        parse_target(text)


def test_targets():
    t = parse_target("accuracy >= 0.9")
    assert (t.metric, t.op, t.value) == ("val_accuracy", ">=", 0.9)
    assert t.reached(0.9) and not t.reached(0.89) and not t.reached(None) and not t.reached(math.nan)
    assert parse_target("test_loss<=0.5").reached(0.4)


# ---------------------------------------------------------------- metrics reduce over batches and shards
class PerplexityTask(Task):
    def derived_metrics(self, means):
        return {"perplexity": math.exp(means["loss"])}


def test_metrics_reduce_by_sample_and_by_declared_pairs():
    # Two shards: a batch mean of 1.0 over 3 samples and 4.0 over 1 sample -> 1.75, not 2.5.
    parts = [
        {"loss": (3.0, 3.0), "tokens_right": (5.0, 10.0)},
        {"loss": (4.0, 1.0), "tokens_right": (5.0, 30.0)},
    ]
    figures = reduce_metrics(PerplexityTask(), parts)
    assert figures["loss"] == pytest.approx(1.75)
    assert figures["tokens_right"] == pytest.approx(10 / 40)
    assert figures["perplexity"] == pytest.approx(math.exp(1.75))


def test_evaluate_batch_weights_float_metrics_by_batch_size():
    class Mean(Task):
        def loss(self, model, batch):
            return batch[0].mean()

        def metrics(self, model, batch):
            return {"max": float(batch[0].max()), "pair": (2.0, 4.0)}

    sums = Mean().evaluate_batch(None, (torch.tensor([1.0, 2.0, 6.0]),))
    assert sums == {"loss": (9.0, 3.0), "max": (18.0, 3.0), "pair": (2.0, 4.0)}


def test_classification_task_matches_the_registered_model_and_data():
    task = ClassificationTask("mlp", "digits")
    train, test = task.datasets()
    assert (len(train), len(test)) == (1438, 359)
    x, y = BatchReader(train, task.collate).read(np.arange(5))
    assert x.shape == (5, 1, 8, 8) and y.dtype == torch.int64
    # the fast path and the per-sample path read the same batch
    x2, y2 = task.collate([train[i] for i in range(5)])
    torch.testing.assert_close(x, x2)
    assert torch.equal(y, y2)


# ---------------------------------------------------------------- reading batches by index
class Counting(Dataset):
    def __init__(self, batched: bool):
        self.calls = 0
        if batched:
            self.__getitems__ = lambda idx: [self[i] for i in idx]

    def __len__(self):
        return 10

    def __getitem__(self, i):
        self.calls += 1
        return torch.tensor([float(i)]), i


@pytest.mark.parametrize("batched", [False, True])
def test_batch_reader_reads_the_named_samples_and_prefetches(batched):
    data = Counting(batched)
    reader = BatchReader(data, Task().collate)
    x, y = reader.read([3, 1, 4])
    assert x.squeeze(-1).tolist() == [3.0, 1.0, 4.0] and y.tolist() == [3, 1, 4]
    reader.prefetch([5, 9])
    x, y = reader.read([5, 9])  # the prefetched batch is the one returned
    assert y.tolist() == [5, 9] and data.calls == 5
    reader.prefetch([0])
    assert reader.read([2])[1].tolist() == [2]  # a different batch than prefetched: read it, not the other
    reader.close()


def test_tensor_dataset_reads_through_the_default_collate():
    data = TensorDataset(torch.arange(6.0).view(6, 1), torch.arange(6))
    x, y = BatchReader(data, Task().collate, prefetch=False).read(np.array([4, 0]))
    assert x.view(-1).tolist() == [4.0, 0.0] and y.tolist() == [4, 0]


# ---------------------------------------------------------------- the CLI: one line, exit 2, before Ray
runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--task", "nowhere.py:Task"], "no file"),
        (["--task", "{file}:NotATask"], "not a subclass of distrain.Task"),
        (["--task", "{file}:EmptyData"], "the training set is empty"),
        (["--task", "{file}:VectorLoss"], "must return a scalar tensor"),
        (["--task", "{file}:Regression", "--model", "mlp"], "--model applies to the built-in"),
        (["--task", "{file}:Regression", "--model", "cnn"], "--model applies to the built-in"),  # the default, given
        (["--task", "{file}:Regression", "--dataset", "digits"], "--dataset applies to the built-in"),
        (["--task", "{file}:StringMetrics"], "metrics() returned str 'mae: low'"),
        (["--task", "{file}:NanLoss"], "loss() is nan at the initial parameters"),
        (["--target", "test_accuracy>=1.5"], "can never be reached: test_accuracy lies in [0, 1]"),
        (["--target", "test_loss<=-1"], "can never be reached: test_loss lies in [0, inf)"),
        (["--task", "{file}:Regression", "--task-arg", "width"], "must be key=value"),
        (["--task", "{file}:Regression", "--task-arg", "width=3"], "failed"),
        (["--task-arg", "n=3"], "--task-arg applies to a --task"),
        (["--target", "accuracy>"], "--target"),
        (["--task", "{file}:Regression", "--target", "rmse<=0.1"], "names val_rmse, which the task does not"),
        (["--target", "test_f1>=0.9"], "it reports test_accuracy, test_loss"),  # the built-in task too
    ],
)
@pytest.mark.usefixtures("no_ray")
def test_cli_refuses_bad_tasks_in_one_line(tmp_path, task_file, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["run", *[a.format(file=task_file) for a in args]])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.usefixtures("no_ray")
def test_the_built_in_tasks_options_given_at_their_default_are_refused_with_a_task(tmp_path, task_file):
    """`--model cnn` equals the default, so it was taken for "not given" and ignored in silence (and recorded
    in config.yaml); a user's YAML that names it is refused too, config.yaml that distrain recorded is not."""
    task = f"{task_file}:Regression"
    with pytest.raises(ConfigError, match="--model applies to the built-in classification task"):
        distrain.fit(task=task, model="cnn")
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"task: {task}\ndata:\n  model: cnn\n")
    with pytest.raises(ConfigError, match=r"model \(in .*mine.yaml\) applies to the built-in classification task"):
        RunConfig.resolve(str(mine), {})
    mine.write_text("model: cnn\n")  # the file's, for the built-in task; the flag brings another task
    with pytest.raises(ConfigError, match="applies to the built-in"):
        RunConfig.resolve(str(mine), {"task": task})
    recorded = tmp_path / "config.yaml"
    recorded.write_text(RunConfig(task=task).to_yaml())  # holds model: cnn, as every run's config.yaml does
    assert RunConfig.resolve(str(recorded), {}).task == task
    assert RunConfig.resolve(None, {"task": task, "model": None}).task == task  # a flag not given


def test_fit_refuses_unknown_options():
    with pytest.raises(ConfigError, match="unknown option"):
        distrain.fit(wokers=2)


class _ThreadNoting:
    """A dataset that notes which thread read each batch, and spends `cpu_s` of CPU on it."""

    def __init__(self, cpu_s):
        self.cpu_s, self.threads = cpu_s, []

    def __len__(self):
        return 10

    def get_batch(self, indices):
        import threading
        import time

        self.threads.append(threading.current_thread().name)
        end = time.thread_time() + self.cpu_s
        while time.thread_time() < end:
            pass
        return torch.as_tensor(indices)


@pytest.mark.parametrize(("cpu_s", "ahead"), [(0.0, False), (3 * BatchReader.CHEAP_READ_S, True)])
def test_cheap_batches_are_read_on_the_training_thread_dear_ones_ahead(cpu_s, ahead):
    data = _ThreadNoting(cpu_s)
    reader = BatchReader(data, Task().collate, prefetch=True)
    for i in range(4):
        assert reader.read([i]).tolist() == [i]
        reader.prefetch([i + 1])
    reader.close()
    # The first read is always the training thread's (nothing was read ahead); it prices the next ones.
    assert data.threads[0] == "MainThread"
    assert set(data.threads[1:]) == ({"distrain-prefetch"} if ahead else {"MainThread"}), data.threads
