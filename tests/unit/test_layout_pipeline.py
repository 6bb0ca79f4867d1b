"""Pipeline stages x FSDP shards (`--pipeline-stages S --fsdp D`): the rank layout, the run's shape and
strategy, what stays refused, and the memory estimate's 1/D. No Ray."""

from __future__ import annotations

import pytest

from distrain.config import RunConfig
from distrain.config.layout_section import position_of
from distrain.errors import ConfigError
from distrain.orchestrator.memory import estimate
from distrain.strategies.bsp import BSP
from distrain.strategies.pipeline import PipelineBSP
from distrain.strategies.sharded_bsp import ShardedBSP
from distrain.strategies.sharded_pipeline import ShardedPipelineBSP
from distrain.trainers.grid_position import GridPosition, grid_position


def test_rank_is_replica_then_stage_then_shard_then_tp():
    # R = 2, S = 2, D = 2, T = 1: a stage's two shards are neighbours, then the replica's two stages.
    grid = [grid_position(rank, shards=2, tp=1, stages=2) for rank in range(8)]
    assert [(p.replica, p.stage, p.shard) for p in grid] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]  # fmt: skip
    # Data-parallel rank replica x D + shard: the two stages of shard d read the same slice.
    assert [p.data_rank(2) for p in grid] == [0, 1, 0, 1, 2, 3, 2, 3]


@pytest.mark.parametrize("shards, tp, stages", [(2, 1, 2), (3, 2, 2), (1, 1, 4), (4, 1, 1), (2, 2, 1), (2, 1, 3)])
def test_grid_positions_are_one_to_one_and_invert_the_rank_formula(shards, tp, stages):
    replicas = 2
    seen = set()
    for rank in range(replicas * stages * shards * tp):
        p = grid_position(rank, shards, tp, stages)
        assert ((p.replica * stages + p.stage) * shards + p.shard) * tp + p.tp == rank
        assert 0 <= p.stage < stages and 0 <= p.shard < shards and 0 <= p.tp < tp and 0 <= p.replica < replicas
        seen.add((p.replica, p.stage, p.shard, p.tp))
    assert len(seen) == replicas * stages * shards * tp


def test_without_stages_or_shards_the_layout_is_the_older_strategies():
    # ShardedBSP's (replica x D + shard) x T + tp and PipelineBSP's replica x S + stage, unchanged.
    for rank in range(12):
        assert grid_position(rank, 3, 2, 1) == GridPosition(rank // 6, 0, rank // 2 % 3, rank % 2)
        assert grid_position(rank, 1, 1, 3) == GridPosition(rank // 3, rank % 3, 0, 0)


def test_stages_of_shards_make_a_run_of_r_s_d_workers_under_sharded_pipeline_bsp():
    config = RunConfig(workers=2, fsdp=2, pipeline_stages=2, microbatches=2, batch_size=16)
    config.validate()
    assert (config.num_worker_actors, config.replica_size, config.global_batch_size) == (8, 4, 64)
    assert config.samples_per_step == 64
    assert BSP.implementation(config) is ShardedPipelineBSP
    assert issubclass(ShardedPipelineBSP, PipelineBSP)
    assert position_of(config, 6) == GridPosition(replica=1, stage=1, shard=0, tp=0)
    # Either alone keeps its own strategy.
    assert BSP.implementation(RunConfig(pipeline_stages=2)) is PipelineBSP
    assert BSP.implementation(RunConfig(fsdp=2)) is ShardedBSP


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(model="cnn", tensor_parallel=2), r"^--tensor-parallel 2 with the cnn model's hybrid plan .* --pipeline"),
        (dict(fsdp=2, strategy="diloco"), r"^--pipeline-stages runs with --strategy bsp"),
        (dict(fsdp=2, workers="1..2"), r"^--fsdp 2 with --workers MIN..MAX does not compose with --pipeline-stages"),
    ],
)
def test_what_stays_refused_with_stages_in_one_line(given, message):
    with pytest.raises(ConfigError, match=message) as caught:
        RunConfig(**(dict(pipeline_stages=2) | given)).validate()
    assert "\n" not in str(caught.value)


def test_the_memory_estimate_holds_one_dth_of_the_largest_stage():
    plain = RunConfig(model="mlp", pipeline_stages=2, batch_size=16)
    whole = estimate(plain, 0).model
    for shards in (2, 4):  # the stage's parameter copies cut D ways (rounded up to whole values)
        assert estimate(plain.replace(fsdp=shards), 0).model == pytest.approx(whole / shards, abs=64)


def test_the_timeline_plot_draws_one_pipeline_of_sharded_stages():
    """D = 2: each stage's two shards record spans; the plot draws shard 0's pipeline only (one lane each)."""
    import json

    import pandas as pd

    from distrain.reporting.plots import PlotRun, plot_pipeline_timeline

    spans = [json.dumps([["F", 0, 0.0, 1.0], ["B", 0, 2.0, 3.0]]), json.dumps([["F", 0, 1.0, 2.0], ["B", 0, 2.0, 2.5]])]
    rows = pd.DataFrame(
        {
            "kind": ["step"] * 4,
            "step": [1] * 4,
            "stage": [0, 0, 1, 1],
            "shard": [0, 1, 0, 1],
            "replica": [0] * 4,
            "wall_time": [1.0] * 4,
            "pipe_spans": [spans[0], spans[0], spans[1], spans[1]],
        }
    )
    fig = plot_pipeline_timeline([PlotRun("r", "r", "C0", rows, {})])
    assert fig is not None and len(fig.axes[0].collections) == 4  # two stages x (F, B), not eight
