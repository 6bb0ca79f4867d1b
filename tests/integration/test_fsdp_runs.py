"""Sharded replicas (--fsdp D, torch's FSDP2 over real gloo groups in real Ray actors) end to end: D = 4
and R = 2 x D = 2 (HSDP) equal one process at the same global batch under momentum SGD and AdamW, each
worker holds a quarter of the state, and a run resumes at another D with the same global batch."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from distrain.config import RunConfig
from distrain.errors import ConfigError, ResourceError
from distrain.orchestrator.resume import resume_config
from distrain.orchestrator.run import run_training
from tests.helpers import final_params

pytestmark = pytest.mark.usefixtures("ray_cluster")
HERE = Path(__file__).resolve().parents[1]  # tests/
BASE = dict(model="mlp", lr_scaling="none", epochs=1, max_steps=20, seed=3, segment_steps=10, eval_every=0)
# AdamW at a small rate: Adam divides by sqrt(v), so at lr 0.05 even plain BSP over 4 workers ends 1.6e-4
# from one process (float sums in another order, amplified where v is near 0); at 2e-3 both are ~1e-6.
OPTIMIZERS = {"sgd": dict(optimizer="sgd", momentum=0.9, lr=0.05), "adamw": dict(optimizer="adamw", lr=2e-3)}
TOL = 1e-5
MLP_PARAMS = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10


def cfg(tmp_path, name: str, optimizer: str = "sgd", **kw) -> RunConfig:
    return RunConfig(**(BASE | OPTIMIZERS[optimizer] | {"run_dir": str(tmp_path / name)} | kw))


def steps_of(run_dir) -> pd.DataFrame:
    df = pd.read_parquet(Path(run_dir) / "metrics.parquet")
    return df[df["kind"] == "step"].sort_values(["step", "worker"])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process at the global batch 64, under each optimizer: its final parameters and step rows."""
    base = tmp_path_factory.mktemp("one")
    runs = {name: run_training(cfg(base, name, name, workers=1, batch_size=64)) for name in OPTIMIZERS}
    return {name: (final_params(run.run_dir), steps_of(run.run_dir)) for name, run in runs.items()}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_four_shards_equal_one_process_and_hold_a_quarter_each(tmp_path, one_process, optimizer):
    run = run_training(cfg(tmp_path, "d4", optimizer, workers=1, fsdp=4, batch_size=16))
    assert run.summary["status"] == "completed"
    assert (final_params(run.run_dir) - one_process[optimizer][0]).abs().max().item() <= TOL
    assert run.summary["layout"] == {
        "replicas": 1, "fsdp": 4, "pipeline_stages": 1, "workers_per_replica": 4, "worker_actors": 4,
    }  # fmt: skip
    assert run.summary["global_batch_size"] == 64
    rows = steps_of(run.run_dir)
    assert (rows.groupby("step").size() == 4).all() and rows["samples"].sum() == 20 * 64
    assert rows.groupby("worker")["shard"].first().tolist() == [0, 1, 2, 3] and (rows["replica"] == 0).all()
    # The four workers' losses on their own 16 samples average to one process's loss on all 64.
    mean_loss = rows.groupby("step")["loss"].mean().to_numpy()
    assert abs(mean_loss - one_process[optimizer][1]["loss"].to_numpy()).max() <= TOL
    # Each worker holds its shards: a quarter of the parameters, gradients and optimizer state (FSDP2 cuts
    # each tensor's rows in 4; the last classifier's 10 rows go 3, 3, 3, 1), together the whole model.
    held = rows.groupby("worker")[["mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes"]].max()
    whole = MLP_PARAMS * 4
    assert held["mem_param_bytes"].sum() == whole and (held["mem_param_bytes"] <= 1.25 * whole / 4).all()
    assert (held["mem_grad_bytes"] == held["mem_param_bytes"]).all()
    moments = 1 if optimizer == "sgd" else 2  # momentum buffer; Adam's two moments
    assert (held["mem_optim_bytes"] == moments * held["mem_param_bytes"]).all()
    # FSDP's traffic per worker and step: 2 all-gathers and a reduce-scatter of 3/4 of the parameters each.
    assert (rows["bytes_sent"] == 3 * 3 * whole // 4).all()


def test_two_sharded_replicas_equal_one_process_on_the_global_batch(tmp_path, one_process):
    run = run_training(cfg(tmp_path, "r2d2", workers=2, fsdp=2, batch_size=16))
    assert (final_params(run.run_dir) - one_process["sgd"][0]).abs().max().item() <= TOL
    rows = steps_of(run.run_dir)
    # rank = replica x D + shard, and data-parallel rank (r, d) takes slice r x D + d.
    placed = rows.groupby("worker")[["replica", "shard", "slice"]].first().values.tolist()
    assert placed == [[0, 0, 0], [0, 1, 1], [1, 0, 2], [1, 1, 3]]
    assert run.summary["layout"]["worker_actors"] == 4 and run.summary["global_batch_size"] == 64
    half = MLP_PARAMS * 4 // 2
    assert (rows["mem_param_bytes"] <= 1.25 * half).all()


def test_a_sharded_run_resumes_at_another_fsdp_with_the_same_global_batch(tmp_path, one_process):
    """--fsdp 4 --batch-size 16 for 10 steps, then --resume at --fsdp 2 --batch-size 32: the first resumed
    step's loss is the uninterrupted run's, and the end is one process's (the checkpoint holds the whole
    model and momentum; the global batch, so the data order, is the same)."""
    first = run_training(cfg(tmp_path, "d4", workers=1, fsdp=4, batch_size=16, max_steps=10))
    assert first.summary["steps_completed"] == 10
    with pytest.raises(ConfigError, match=r"--resume cannot change --fsdp here: the global batch .* from 64 to 32"):
        resume_config(first.run_dir, {"fsdp": 2})
    resumed = run_training(resume_config(first.run_dir, {"fsdp": 2, "batch_size": 32, "max_steps": 20}), resume=True)
    assert resumed.summary["status"] == "completed" and resumed.summary["layout"]["fsdp"] == 2
    assert (final_params(resumed.run_dir) - one_process["sgd"][0]).abs().max().item() <= TOL
    rows = steps_of(resumed.run_dir)
    after = rows[rows["step"] >= 10]
    assert sorted(set(after["worker"])) == [0, 1] and (after["samples"] == 32).all()
    expected = one_process["sgd"][1].set_index("step")["loss"]
    assert abs(after[after["step"] == 10]["loss"].mean() - expected[10]) <= TOL


def test_a_model_three_times_one_workers_budget_trains_at_four_shards(tmp_path):
    """WideMLP(width 64): 4 blocks of 4160 parameters, under Adam 5 copies each (θ, gradient, a buffer, two
    moments): 325 KiB in one worker against --worker-memory 100KiB. Refused at D = 1 and D = 2 naming
    D = 4 (a quarter of the copies plus one block gathered whole: 97.5 KiB), which trains; each worker then
    measurably holds a quarter of the unsharded parameter, gradient and Adam bytes."""
    wide = dict(
        task=f"{HERE / 'pipeline_task.py'}:WideMLP", task_args={"width": 64, "samples": 160}, optimizer="adam",
        lr=1e-3, workers=1, batch_size=8, epochs=1, eval_every=0, segment_steps=3, worker_memory="100KiB",
    )  # fmt: skip
    for shards, what in ((1, "one worker"), (2, "each of a replica's 2 shards")):
        refused = rf"^{what} would hold .*; (--pipeline-stages 4 .* or )?--fsdp 4 shards it"
        with pytest.raises(ResourceError, match=refused):
            run_training(RunConfig(**wide, fsdp=shards, run_dir=str(tmp_path / f"d{shards}")))
        assert not (tmp_path / f"d{shards}").exists()
    run = run_training(RunConfig(**wide, fsdp=4, run_dir=str(tmp_path / "d4")))
    assert run.summary["status"] == "completed" and run.summary["steps_completed"] == 3
    rows = steps_of(run.run_dir)
    held = rows[["mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes"]].sum(axis=1)
    unsharded = 4 * 4160 * 4 * (1 + 1 + 2)
    assert held.max() <= 1.25 * unsharded / 4 and held.min() >= unsharded / 4 * 0.75, held.tolist()
