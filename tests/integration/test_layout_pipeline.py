"""Pipeline stages sharded by FSDP2 end to end (`--pipeline-stages S --fsdp D`, strategies/sharded_pipeline.py)
on real Ray actors over real gloo groups: S = 2 x D = 2 equals one process at the same global batch
after 20 steps of momentum SGD, each of the four workers holds a quarter of the parameters, gradients and
optimizer state, and its sharded checkpoint is the whole model's."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from tests.helpers import final_params

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


def steps_of(run_dir) -> pd.DataFrame:
    df = pd.read_parquet(Path(run_dir) / "metrics.parquet")
    return df[df["kind"] == "step"].sort_values(["step", "worker"])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process on the global batch of 32: its final parameters, step rows and test loss."""
    run = run_training(cfg(tmp_path_factory.mktemp("one"), "one", workers=1, batch_size=32))
    return final_params(run.run_dir), steps_of(run.run_dir), run.summary["final_test_loss"]


@pytest.mark.parametrize(
    "schedule, replicas, batch",
    [("gpipe", 1, 16), ("1f1b", 2, 8)],  # R x D x B = 32 both
)
def test_two_stages_of_two_shards_equal_one_process_and_hold_a_quarter_each(
    tmp_path, one_process, schedule, replicas, batch
):
    run = run_training(
        cfg(tmp_path, schedule, workers=replicas, fsdp=2, batch_size=batch, pipeline_stages=2, microbatches=2,
            pipeline_schedule=schedule)
    )  # fmt: skip
    assert run.summary["status"] == "completed"
    assert run.summary["global_batch_size"] == 32
    params, one_steps, one_test_loss = one_process
    assert (final_params(run.run_dir) - params).abs().max().item() <= TOL
    assert abs(run.summary["final_test_loss"] - one_test_loss) <= TOL  # shard 0's pipelines score, once each
    rows = steps_of(run.run_dir)
    # rank = (replica x S + stage) x D + shard: in each replica, two shards of stage 0, then of stage 1.
    firsts = rows.groupby("worker")[["stage", "shard", "replica"]].first()
    assert firsts["stage"].tolist() == [0, 0, 1, 1] * replicas
    assert firsts["shard"].tolist() == [0, 1, 0, 1] * replicas
    assert firsts["replica"].tolist() == [r for r in range(replicas) for _ in range(4)]
    assert (rows.groupby("step").size() == 4 * replicas).all() and rows["samples"].sum() == 20 * 32
    # Each pipeline's two stages report its loss; the R x D pipelines' losses average to one process's
    # loss on all 32 samples.
    last = rows[rows["stage"] == 1].groupby("step")["loss"].mean().to_numpy()
    assert abs(last - one_steps["loss"].to_numpy()).max() <= TOL
    assert last[-4:].mean() < 0.85 * last[:4].mean()  # and it learns (at lr 0.5: from 0.41 to 0.3)
    # A quarter of the parameters each (FSDP2 cuts every 32-row tensor in two), with their gradients and
    # momentum buffers alike; together the whole model.
    held = rows.groupby("worker")[["mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes"]].max()
    assert (held["mem_param_bytes"] == PARAMS * 4 // (2 * 2)).all()  # float32 bytes over S x D
    assert (held["mem_grad_bytes"] == held["mem_param_bytes"]).all()
    assert (held["mem_optim_bytes"] == held["mem_param_bytes"]).all()
