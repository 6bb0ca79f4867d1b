"""Pipeline stages sharded by FSDP2 end to end (`--pipeline-stages S --fsdp D`, strategies/sharded_pipeline.py)
on real Ray actors over real gloo groups: S = 2 x D = 2 equals one process at the same global batch
after 20 steps of momentum SGD, each of the four workers holds a quarter of the parameters, gradients and
optimizer state, its sharded checkpoint is the whole model's, and R = 2 such replicas (HSDP per stage,
1F1B) resume as one at the same global batch, ending where one process does. S = 2 x T = 2 (a
tensor-parallel plan whose column-wise layer ends stage 0 and whose row-wise layer starts stage 1) equals
one process too."""

from __future__ import annotations

from pathlib import Path

import pytest

from distrain.config import RunConfig
from distrain.orchestrator.resume import resume_config
from distrain.orchestrator.run import run_training
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")
HERE = Path(__file__).resolve().parents[1]  # tests/
WIDTH, BLOCKS = 32, 4
# Four equal Linear(32, 32) blocks: two stages of two blocks each, every tensor's rows cut evenly in two.
TASK = dict(task=f"{HERE / 'pipeline_task.py'}:WideMLP", task_args={"width": WIDTH, "blocks": BLOCKS, "samples": 704})
BASE = TASK | dict(
    optimizer="sgd", momentum=0.9, lr=0.5, lr_scaling="none", epochs=1, max_steps=20, seed=3, segment_steps=10,
    eval_every=0,
)  # fmt: skip
PARAMS = BLOCKS * (WIDTH * WIDTH + WIDTH)
TOL = 1e-5


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    return RunConfig(**(BASE | {"run_dir": str(tmp_path / name)} | kw))



@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process on the global batch of 32: its final parameters, step rows and test loss."""
    run = run_training(cfg(tmp_path_factory.mktemp("one"), "one", workers=1, batch_size=32))
    return final_params(run.run_dir), steps_of(run.run_dir), run.summary["final_test_loss"]


def test_two_stages_of_two_shards_equal_one_process_and_hold_a_quarter_each(tmp_path, one_process):
    run = run_training(cfg(tmp_path, "s2d2", workers=1, fsdp=2, batch_size=16, pipeline_stages=2, microbatches=2))
    assert run.summary["status"] == "completed"
    assert run.summary["global_batch_size"] == 32
    params, one_steps, one_test_loss = one_process
    assert (final_params(run.run_dir) - params).abs().max().item() <= TOL
    assert abs(run.summary["final_test_loss"] - one_test_loss) <= TOL  # shard 0's pipelines score, once each
    rows = steps_of(run.run_dir)
    # rank = (replica x S + stage) x D + shard: two shards of stage 0, then two of stage 1.
    firsts = rows.groupby("worker")[["stage", "shard", "replica"]].first()
    assert firsts["stage"].tolist() == [0, 0, 1, 1] and firsts["shard"].tolist() == [0, 1, 0, 1]
    assert (rows.groupby("step").size() == 4).all() and rows["samples"].sum() == 20 * 32
    # Each pipeline's two stages report its loss; the D pipelines' losses average to one process's loss
    # on all 32 samples.
    last = rows[rows["stage"] == 1].groupby("step")["loss"].mean().to_numpy()
    assert abs(last - one_steps["loss"].to_numpy()).max() <= TOL
    assert last[-4:].mean() < 0.85 * last[:4].mean()  # and it learns (at lr 0.5: from 0.41 to 0.3)
    # A quarter of the parameters each (FSDP2 cuts every 32-row tensor in two), with their gradients and
    # momentum buffers alike; together the whole model.
    held = rows.groupby("worker")[["mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes"]].max()
    assert (held["mem_param_bytes"] == PARAMS * 4 // (2 * 2)).all()  # float32 bytes over S x D
    assert (held["mem_grad_bytes"] == held["mem_param_bytes"]).all()
    assert (held["mem_optim_bytes"] == held["mem_param_bytes"]).all()


def test_sharded_stages_of_two_replicas_resume_as_one_replica_at_the_same_global_batch(tmp_path, one_process):
    """R = 2 replicas (HSDP per stage) under 1F1B at B = 8 for 10 steps, then --resume as R = 1 under GPipe
    at B = 16: every worker writes its stage's shards, the next run's workers read their own stage's
    pieces back at the other layout, and the end is one process's."""
    first = run_training(
        cfg(tmp_path, "r2", workers=2, fsdp=2, batch_size=8, pipeline_stages=2, microbatches=2,
            pipeline_schedule="1f1b", max_steps=10)
    )  # fmt: skip
    assert first.summary["status"] == "completed" and first.summary["global_batch_size"] == 32
    rows = steps_of(first.run_dir)
    firsts = rows.groupby("worker")[["stage", "shard", "replica"]].first()
    assert firsts["replica"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and firsts["stage"].tolist() == [0, 0, 1, 1] * 2
    assert (rows.groupby("step").size() == 8).all() and rows["samples"].sum() == 10 * 32
    resumed = run_training(
        resume_config(first.run_dir, {"workers": 1, "batch_size": 16, "pipeline_schedule": "gpipe", "max_steps": 20}),
        resume=True,
    )
    assert resumed.summary["status"] == "completed" and resumed.summary["steps_completed"] == 20
    assert (final_params(resumed.run_dir) - one_process[0]).abs().max().item() <= TOL


def test_two_stages_split_two_ways_across_the_stage_boundary_equal_one_process(tmp_path, one_process):
    """S = 2 x T = 2: the task's plan cuts Linear "2" (the end of stage 0) column-wise and Linear "4" (the
    start of stage 1) row-wise, so each TP rank of stage 0 sends its half of the features to its peer in
    stage 1. The run is one process's at B = 32, and each worker holds its stage's whole layers plus half
    of the split ones."""
    planned = {"task_args": TASK["task_args"] | {"tp_plan": True}}
    run = run_training(cfg(tmp_path, "s2t2", workers=1, tensor_parallel=2, batch_size=32, pipeline_stages=2,
                           microbatches=2, **planned))  # fmt: skip
    assert run.summary["status"] == "completed" and run.summary["global_batch_size"] == 32
    assert run.summary["layout"]["workers_per_replica"] == 4
    params, one_steps, one_test_loss = one_process
    assert (final_params(run.run_dir) - params).abs().max().item() <= TOL
    assert abs(run.summary["final_test_loss"] - one_test_loss) <= TOL  # TP rank 0's pipeline scores, once
    rows = steps_of(run.run_dir)
    # rank = ((replica x S + stage) x D + shard) x T + tp: two TP ranks of stage 0, then two of stage 1.
    firsts = rows.groupby("worker")[["stage", "shard", "replica"]].first()
    assert firsts["stage"].tolist() == [0, 0, 1, 1] and firsts["shard"].tolist() == [0, 0, 0, 0]
    last = rows[rows["stage"] == 1].groupby("step")["loss"].mean().to_numpy()
    assert abs(last - one_steps["loss"].to_numpy()).max() <= TOL
    # Stage 0: Linear 0 whole and Linear 2 cut by rows (weight and bias); stage 1: Linear 4's weight cut by
    # columns (its bias whole) and Linear 6 whole.
    whole, half = WIDTH * WIDTH + WIDTH, (WIDTH * WIDTH + WIDTH) // 2
    held = rows.groupby("stage")["mem_param_bytes"].max()
    assert held.tolist() == [4 * (whole + half), 4 * (WIDTH * WIDTH // 2 + WIDTH + whole)]
