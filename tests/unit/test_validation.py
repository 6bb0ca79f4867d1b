"""The validation split (trainers/splits.py), what selects on it (targets, --checkpoint-best:
orchestrator/best_checkpoint.py) and where its figures go (val_* columns, final_val_* keys), the test set
scored at the end and reported apart: without Ray (the controller through tests/unit/dummy_group.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import TensorDataset

from distrain.api import FitResult
from distrain.config import RunConfig, parse_monitor, parse_target
from distrain.errors import ConfigError
from distrain.orchestrator import run_checks
from distrain.orchestrator.best_checkpoint import BEST, BestKeeper, checkpoint_period
from distrain.orchestrator.summary import summarize
from distrain.trainers.splits import (
    SPLIT_SEED,
    carve_validation,
    evaluation_figures,
    task_splits,
    train_part_size,
)
from distrain.trainers.task import ClassificationTask, Task

RunConfig()  # the first config built imports torch.optim for its checks: here, once


# ---------------------------------------------------------------------- the splits
def test_carving_holds_out_a_seeded_share_and_keeps_the_training_order():
    data = TensorDataset(torch.arange(100).float().unsqueeze(1), torch.arange(100))
    train, val = carve_validation(data, 0.1)
    assert (len(train), len(val)) == (90, 10)
    train_ids = [int(train[i][1]) for i in range(len(train))]
    val_ids = [int(val[i][1]) for i in range(len(val))]
    assert sorted(train_ids + val_ids) == list(range(100))  # disjoint, and nothing lost
    assert train_ids == sorted(train_ids)  # the samples left keep their order
    expected = sorted(np.random.default_rng(SPLIT_SEED).permutation(100)[:10].tolist())
    assert val_ids == expected  # the same samples every run, whatever --seed
    again_train, again_val = carve_validation(data, 0.1)
    assert [int(again_val[i][1]) for i in range(10)] == val_ids


def test_a_carved_image_set_keeps_its_one_indexing_batch_read():
    task = ClassificationTask()
    splits = task_splits(task, 0.1)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (1294, 144, 359)
    assert train_part_size(1438, 0.1) == 1294 and not splits.val_is_test
    idx = np.array([0, 5, 143])
    xb, yb = splits.val.get_batch(idx)
    one = [splits.val[int(i)] for i in idx]
    assert torch.equal(xb, torch.stack([x for x, _ in one])) and torch.equal(yb, torch.stack([y for _, y in one]))


def test_val_fraction_0_trains_on_the_same_samples_and_validates_on_the_test_set():
    task = ClassificationTask()
    whole_train, test = task.datasets()
    splits = task_splits(task, 0.0)
    assert splits.val_is_test and splits.val is splits.test
    assert len(splits.train) == len(whole_train) == 1438
    assert torch.equal(splits.train.x, whole_train.x) and torch.equal(splits.train.y, whole_train.y)


class Three(Task):
    def datasets(self):
        ds = TensorDataset(torch.zeros(6, 1), torch.zeros(6))
        return ds, TensorDataset(torch.ones(3, 1), torch.ones(3)), ds


class Two(Task):
    def datasets(self):
        ds = TensorDataset(torch.zeros(6, 1), torch.zeros(6))
        return ds, ds


def test_a_task_s_own_validation_split_is_used_as_is_and_two_items_validate_on_test():
    returned = Three().datasets()
    splits = task_splits(Three(), 0.5, returned)
    assert splits.val is returned[1] and splits.train is returned[0] and not splits.val_is_test
    two = task_splits(Two(), 0.5)  # no carve_validation: --val-fraction does not touch it
    assert two.val_is_test and len(two.train) == 6
    carving = type("Carving", (Two,), {"carve_validation": True})
    assert (len(task_splits(carving(), 0.5).train), len(task_splits(carving(), 0.5).val)) == (3, 3)
    with pytest.raises(ConfigError, match=r"datasets\(\) returned a tuple of 1; it must return \(train, val, test\)"):
        task_splits(Two(), 0.1, (returned[0],))


# ---------------------------------------------------------------------- what selects on it
def test_targets_and_checkpoint_best_name_validation_metrics_unless_told_otherwise():
    assert str(parse_target("accuracy>=0.9")) == "val_accuracy>=0.9"
    assert str(parse_target("test_loss<=0.5")) == "test_loss<=0.5"
    assert str(RunConfig().target_spec) == "val_accuracy>=0.95"
    assert (parse_monitor("val_loss").mode, parse_monitor("accuracy").metric) == ("min", "val_accuracy")
    assert parse_monitor("val_accuracy").mode == "max" and parse_monitor("max:val_r2").mode == "max"
    assert str(parse_monitor("min:test_f1")) == "min:test_f1"
    for bad in ("", "best:val_loss", "val loss"):
        with pytest.raises(ConfigError, match="--checkpoint-best"):
            parse_monitor(bad)
    with pytest.raises(ConfigError, match=r"--val-fraction must be in \[0, 1\)"):
        RunConfig(val_fraction=1.0)


def test_a_target_on_the_test_set_needs_it_scored_at_every_evaluation():
    with pytest.raises(ConfigError, match="selects on the test set, which is scored only at the end"):
        run_checks.check_runnable(RunConfig(target="test_accuracy>=0.9"))
    run_checks.check_runnable(RunConfig(target="test_accuracy>=0.9", test_every_epoch=True))
    run_checks.check_runnable(RunConfig(target="test_accuracy>=0.9", val_fraction=0))  # validation is test
    with pytest.raises(ConfigError, match="--checkpoint-best val_f1 names val_f1, which the task does not report"):
        run_checks.check_runnable(RunConfig(checkpoint_best="val_f1"))
    with pytest.raises(ConfigError, match="global batch .* exceeds the 1294 training samples"):
        run_checks.check_runnable(RunConfig(batch_size=700))  # 1438 without the validation split


def test_configs_recorded_before_the_validation_split_load_with_none(tmp_path):
    recorded = tmp_path / "config.yaml"
    from distrain.config import RECORDED_HEADER

    recorded.write_text(f"{RECORDED_HEADER}\ndata:\n  epochs: 1\n")
    assert RunConfig.load_yaml(recorded)["val_fraction"] == 0.0
    plain = tmp_path / "mine.yaml"
    plain.write_text("data:\n  epochs: 1\n")
    assert "val_fraction" not in RunConfig.load_yaml(plain)  # a user's file: the default, 0.1


def test_an_evaluation_reduces_each_split_apart_and_drops_one_not_every_share_scored():
    task = ClassificationTask()
    a = {"val": {"loss": (2.0, 2.0), "accuracy": (1.0, 2.0)}, "test": {"loss": (9.0, 3.0), "accuracy": (3.0, 3.0)}}
    b = {"val": {"loss": (4.0, 2.0), "accuracy": (2.0, 2.0)}, "test": {"loss": (3.0, 3.0), "accuracy": (0.0, 3.0)}}
    assert evaluation_figures(task, [a, b]) == {
        "val_loss": 1.5, "val_accuracy": 0.75, "test_loss": 2.0, "test_accuracy": 0.5,
    }  # fmt: skip
    assert set(evaluation_figures(task, [a, {"val": b["val"]}])) == {"val_loss", "val_accuracy"}


def test_the_summary_reports_validation_and_test_apart():
    rows = pd.DataFrame(
        {
            "run_id": "r", "kind": ["step", "eval", "step", "eval"], "worker": [0, None, 0, None],
            "step": [0, 1, 1, 2], "epoch": [0, 0, 1, 1], "loss": [1.0, None, 0.5, None],
            "samples": [8, None, 8, None], "wall_time": [1.0, 2.0, 3.0, 4.0], "compute_s": 0.1, "comm_s": 0.0,
            "bytes_sent": 0, "eval_s": [None, 0.1, None, 0.1],
            "val_loss": [None, 0.9, None, 0.4], "val_accuracy": [None, 0.7, None, 0.96],
            "test_loss": [None, None, None, 0.5], "test_accuracy": [None, None, None, 0.93],
        }
    )  # fmt: skip
    config = RunConfig(target_accuracy=0.95).to_dict()
    s = summarize(rows, config, 0.0, 5.0, "completed", 2, RunConfig(target_accuracy=0.95).target_spec)
    assert (s["final_val_loss"], s["final_val_accuracy"]) == (0.4, 0.96)
    assert (s["final_test_loss"], s["final_test_accuracy"]) == (0.5, 0.93)
    assert s["target"] == "val_accuracy>=0.95" and s["time_to_target_s"] == 4.0
    assert s["best_val_accuracy"] == 0.96 and s["best_test_accuracy"] == 0.93
    result = FitResult(Path("r"), s)
    assert result.metrics["val_accuracy"] == 0.96 and result.metrics["test_accuracy"] == 0.93


# ---------------------------------------------------------------------- keep-best checkpoints
def test_the_best_keeper_copies_the_checkpoint_of_the_best_evaluation(tmp_path):
    cfg = RunConfig(checkpoint_best="val_loss")
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    keeper = BestKeeper(cfg, tmp_path)
    for epoch, (step, loss) in enumerate([(4, 0.9), (8, 0.5), (12, 0.7)]):
        keeper.seen(epoch, step, {"val_loss": loss, "val_accuracy": 0.1})
        path = checkpoints / f"epoch-{epoch:04d}.pt"
        path.write_bytes(f"state after {step}".encode())
        keeper.saved(path, step, steps_per_epoch=4)
    assert (checkpoints / BEST).read_bytes() == b"state after 8"  # epoch 1's: the lowest loss
    assert keeper.summary() == {
        "path": "checkpoints/best.pt", "metric": "val_loss", "mode": "min", "value": 0.5, "epoch": 1, "step": 8,
    }  # fmt: skip
    rows = {"kind": ["eval", "eval"], "epoch": [0, 1], "step": [4, 8], "val_loss": [0.9, 0.5]}
    resumed = BestKeeper(cfg, tmp_path, rows)  # a resumed run: the best recorded before stays the one to beat
    assert (resumed.value, resumed.step, resumed.saved_step) == (0.5, 8, 8)
    assert checkpoint_period(cfg) == 1 and checkpoint_period(RunConfig(checkpoint_best="val_loss", eval_every=3)) == 3
    assert checkpoint_period(RunConfig()) == 0 and checkpoint_period(RunConfig(checkpoint_every=2)) == 2


def test_a_run_scores_validation_each_epoch_the_test_set_at_the_end_and_keeps_the_best(tmp_path):
    """The controller driven by the dummy group (4 steps an epoch, 3 epochs): each evaluation asks for
    validation, the last one for the test set too; val_* columns each epoch, test_* on the last row; the
    lowest val_loss (the dummy's: the steps applied, so the first epoch's) is kept as best.pt."""
    from tests.unit.test_controller import controller

    cfg = RunConfig(
        run_dir=str(tmp_path / "run"), strategy="bsp", workers=2, batch_size=160, epochs=3,
        checkpoint_best="val_loss", lr_scaling="none",
    )  # fmt: skip
    from tests.unit.dummy_group import DummyGroup

    group = DummyGroup(cfg)
    assert group.spe == 4
    ctl, _ = controller(cfg, group)
    s = ctl.run().summary
    assert sorted(set(group.evaluations)) == [(0, ("val",)), (1, ("val",)), (2, ("val", "test"))]
    table = pq.read_table(Path(cfg.run_dir) / "metrics.parquet").to_pandas()
    evals = table[table["kind"] == "eval"].sort_values("epoch")
    assert evals["val_loss"].tolist() == [4.0, 8.0, 12.0]
    assert evals["test_loss"].isna().tolist() == [True, True, False] and s["final_test_loss"] == 120.0
    assert s["final_val_loss"] == 12.0
    best = s["best_checkpoint"]
    assert (best["epoch"], best["step"], best["value"]) == (0, 4, 4.0)
    run_dir = Path(cfg.run_dir)
    epoch_checkpoint = run_dir / "checkpoints" / "epoch-0001.pt"  # named 1-based: after epoch 0
    assert (run_dir / best["path"]).read_bytes() == epoch_checkpoint.read_bytes()
    result = FitResult(run_dir, json.loads((run_dir / "summary.json").read_text()))
    assert result.best_checkpoint == run_dir / best["path"]


def test_test_every_epoch_scores_both_at_every_evaluation_and_a_run_validating_on_test_says_so(tmp_path):
    from distrain.orchestrator.run import Notice
    from tests.unit.dummy_group import DummyGroup
    from tests.unit.test_controller import controller

    notes = {}
    for fraction in (0.0, 0.1):
        cfg = RunConfig(
            run_dir=str(tmp_path / f"run-{fraction}"), strategy="bsp", workers=2, batch_size=144, epochs=2,
            lr_scaling="none", test_every_epoch=True, val_fraction=fraction,
        )  # fmt: skip
        group = DummyGroup(cfg)
        ctl, events = controller(cfg, group)
        ctl.run()
        assert sorted(set(group.evaluations)) == [(0, ("val", "test")), (1, ("val", "test"))]
        table = pq.read_table(Path(cfg.run_dir) / "metrics.parquet").to_pandas()
        assert table[table["kind"] == "eval"]["test_loss"].notna().all()
        notes[fraction] = [e.text for e in events if isinstance(e, Notice) and "validation split" in e.text]
    assert notes[0.1] == [] and len(notes[0.0]) == 1
    assert "targets and sweeps select on the test set (--val-fraction > 0 holds" in notes[0.0][0]


def test_a_last_evaluation_without_the_test_set_gets_it_after_training(tmp_path):
    """A callback's stop can make an epoch the last after its validation-only evaluation was queued: once
    training is over, the run scores the test set (the model is the one validated last) and puts its
    figures on that last row. Here every evaluation the loop queues comes back validation-only."""
    from tests.unit.dummy_group import DummyGroup
    from tests.unit.test_controller import controller

    class ValidationOnly(DummyGroup):
        def submit(self, kind, rank, payload, whole_test_set=False, splits=("val",), **rest):
            asked = ("test",) if splits == ("test",) else ("val",)
            return super().submit(kind, rank, payload, whole_test_set=whole_test_set, splits=asked, **rest)

    cfg = RunConfig(
        run_dir=str(tmp_path / "run"), strategy="bsp", workers=2, batch_size=160, epochs=2, lr_scaling="none",
    )  # fmt: skip
    group = ValidationOnly(cfg)
    ctl, _ = controller(cfg, group)
    s = ctl.run().summary
    assert group.evaluations[-2:] == [(1, ("test",)), (1, ("test",))]  # each worker its share, after the rest
    assert (s["final_val_loss"], s["final_test_loss"]) == (8.0, 80.0)  # the model after the last step
    table = pq.read_table(Path(cfg.run_dir) / "metrics.parquet").to_pandas()
    assert table[table["kind"] == "eval"]["test_loss"].isna().tolist() == [True, False]  # on the last row


def test_the_final_evaluation_is_the_last_steps_even_when_an_earlier_one_is_recorded_after_it():
    """Two evaluations can finish out of order (a CI run recorded step 24's after step 32's): the summary's
    final figures are step 32's, and the target counts as reached when the first evaluation meeting it
    was recorded."""
    rows = pd.DataFrame(
        {
            "run_id": "r", "kind": ["step", "eval", "eval"], "worker": [0, None, None], "step": [31, 32, 24],
            "epoch": [3, 3, 2], "loss": [0.1, None, None], "samples": [8, None, None],
            "wall_time": [1.0, 2.0, 2.5], "compute_s": 0.1, "comm_s": 0.0, "bytes_sent": 0,
            "eval_s": [None, 0.1, 0.1], "val_loss": [None, 0.03, 0.05], "val_accuracy": [None, 0.97, 0.96],
            "test_loss": [None, 0.028, 0.054], "test_accuracy": [None, 0.97, 0.96],
        }
    )  # fmt: skip
    config = RunConfig(target_accuracy=0.95).to_dict()
    s = summarize(rows, config, 0.0, 5.0, "completed", 4, RunConfig(target_accuracy=0.95).target_spec)
    assert (s["final_test_loss"], s["final_val_loss"]) == (0.028, 0.03)
    assert s["time_to_target_s"] == 2.0
