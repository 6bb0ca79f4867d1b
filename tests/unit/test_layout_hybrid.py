"""The cnn's hybrid tensor parallelism (each of the T workers on its own samples, the classifier split):
the global batch it makes, the work plan's slices, its plan's checks and the parameters a worker holds,
and the refusal of a user task's hybrid plan. No Ray (tests/integration/test_layout_hybrid.py runs it)."""

from __future__ import annotations

import pytest

from distrain.config import RunConfig
from distrain.config.layout_section import global_batch_of
from distrain.errors import ConfigError
from distrain.orchestrator.checkpoint import LATEST
from distrain.orchestrator.resume import resume_config
from distrain.orchestrator.run_checks import check_runnable
from distrain.strategies.base import StrategyContext
from distrain.strategies.sharded_bsp import ShardedBSP
from distrain.trainers.builtin_names import HYBRID_TP_MODELS, tp_sample_ranks
from distrain.trainers.datasets import DATASETS
from distrain.trainers.models import build_model
from distrain.trainers.tensor_parallel import BUILTIN_PLANS, check_plan, local_params, takes_own_samples

DIGITS = DATASETS.get("digits").info


def test_the_names_of_the_hybrid_models_are_those_whose_plan_takes_its_own_samples():
    assert {name for name, plan in BUILTIN_PLANS.items() if takes_own_samples(plan)} == set(HYBRID_TP_MODELS)
    assert not takes_own_samples(BUILTIN_PLANS["mlp"]) and not takes_own_samples(None)


def test_the_hybrid_global_batch_is_r_x_d_x_t_x_b():
    hybrid = RunConfig(model="cnn", workers=2, fsdp=2, tensor_parallel=2, batch_size=8)
    hybrid.validate()
    assert (hybrid.num_worker_actors, hybrid.global_batch_size, hybrid.samples_per_step) == (8, 64, 64)
    shared = RunConfig(model="mlp", workers=2, fsdp=2, tensor_parallel=2, batch_size=8)
    assert (shared.num_worker_actors, shared.global_batch_size, shared.samples_per_step) == (8, 32, 32)
    assert RunConfig(model="cnn", workers=2, fsdp=2, batch_size=8).global_batch_size == 32  # T = 1: no hybrid
    # A user's task shares the slice whatever its model flag says; the summary and --resume agree.
    assert tp_sample_ranks("cnn", "my_task.py:Mine", 2) == 1 and tp_sample_ranks("cnn", "", 4) == 4
    assert global_batch_of(hybrid.to_dict(), 2) == 64 and global_batch_of(shared.to_dict(), 2) == 32
    assert global_batch_of({"model": "cnn", "batch_size": 8, "fsdp": 2}, 2) == 32  # recorded before T


def test_a_hybrid_run_resumes_at_another_layout_with_the_same_global_batch(tmp_path):
    """The hybrid's T workers hand out the same R x D x T x B samples per step as one process at T x B."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / LATEST).write_text('{"name": "step-00000004.pt", "global_step": 4}\n')
    (run / "config.yaml").write_text(RunConfig(run_dir=str(run), model="cnn", workers=1, tensor_parallel=2).to_yaml())
    assert resume_config(run, {"tensor_parallel": 1, "batch_size": 64}).global_batch_size == 64
    with pytest.raises(ConfigError, match=r"^--resume cannot change --tensor-parallel here: .* from 64 to 32"):
        resume_config(run, {"tensor_parallel": 1})


@pytest.mark.parametrize("rank, placed", [(0, (0, 0, 0)), (1, (0, 0, 1)), (5, (1, 0, 1)), (6, (1, 1, 0))])
def test_every_hybrid_worker_takes_and_counts_its_own_slice(rank, placed):
    """rank = (replica x D + shard) x T + tp; under the hybrid the work plan's slice r stays rank r."""
    config = RunConfig(model="cnn", workers=2, fsdp=2, tensor_parallel=2, batch_size=8)
    hybrid = ShardedBSP(config, StrategyContext(rank, 8, "cpu"))
    assert (hybrid.replica, hybrid.shard, hybrid.tp_rank) == placed
    assert hybrid.slices_per_step == 8 and list(hybrid.plan([(0, 3, rank)])) == [(0, 3, rank)]
    assert hybrid.counts_samples
    shared = ShardedBSP(config.replace(model="mlp"), StrategyContext(rank, 8, "cpu"))
    assert shared.slices_per_step == 4 and list(shared.plan([(0, 3, rank)])) == [(0, 3, rank // 2)]
    assert shared.counts_samples == (placed[2] == 0)


def test_the_cnn_plan_is_checked_and_counted_like_named_styles():
    cnn = build_model("cnn", DIGITS, 0)
    plan = BUILTIN_PLANS["cnn"]
    check_plan(cnn, plan, 4, "--model cnn")  # the hidden Linear's 128 outputs split 4 ways
    with pytest.raises(ConfigError, match=r"^--tensor-parallel 3 does not divide '6''s 128 outputs \(colwise\); pick"):
        check_plan(cnn, plan, 3, "--model cnn")
    # One of two workers: the convolutions whole, half the hidden Linear, half the classifier's weight, its bias whole.
    convs = 1 * 32 * 9 + 32 + 32 * 64 * 9 + 64
    assert local_params(cnn, plan, 2) == convs + (1024 * 128 + 128) // 2 + 128 * 10 // 2 + 10


def test_the_builtin_cnn_hybrid_runs_and_a_users_hybrid_plan_is_refused(tmp_path):
    assert check_runnable(RunConfig(model="cnn", tensor_parallel=2)) == sum(
        p.numel() for p in build_model("cnn", DIGITS, 0).parameters()
    )
    task = tmp_path / "hybrid_task.py"
    task.write_text(
        "from distrain.trainers.task import ClassificationTask\n\n\n"
        "class Hybrid(ClassificationTask):  # the built-in cnn and its hybrid plan, as a user's task\n"
        "    pass\n"
    )
    with pytest.raises(ConfigError, match=r"^--tensor-parallel 2: --task .*'s plan takes its input sharded on the"):
        check_runnable(RunConfig(task=f"{task}:Hybrid", tensor_parallel=2))
