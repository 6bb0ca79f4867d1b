"""Optimizers other than SGD, and LR decay, end to end on each transport family (real Ray, tiny runs)."""

from __future__ import annotations

import pytest
import torch

from distrain.config import RunConfig
from distrain.orchestrator.checkpoint import load_checkpoint
from distrain.orchestrator.run import run_training
from distrain.trainers.datasets import load_dataset
from distrain.trainers.schedule import LRSchedule
from distrain.trainers.sharding import EpochSharder
from distrain.trainers.splits import train_part_size
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    base = dict(
        model="mlp", optimizer="adamw", lr=0.01, lr_scaling="none", epochs=1, max_steps=20, seed=4,
        workers=2, batch_size=16, segment_steps=6, eval_every=0, run_dir=str(tmp_path / name),
    )  # fmt: skip
    return RunConfig(**(base | kw))



def optimizer_state(run_dir) -> dict:
    return load_checkpoint(run_dir / "checkpoints" / "final.pt")["optimizer"]


def test_adamw_with_cosine_decay_on_the_parameter_server_equals_allreduce(tmp_path):
    kw = dict(lr_decay="cosine", lr_min=0.001, warmup_epochs=0.1, lr=0.0025, lr_scaling="linear", base_batch_size=16)
    allreduce = run_training(cfg(tmp_path, "allreduce", **kw))
    ps = run_training(cfg(tmp_path, "ps", transport="ps", ps_shards=3, **kw))
    a, b = final_params(allreduce.run_dir), final_params(ps.run_dir)
    assert (a - b).abs().max().item() <= 1e-5
    # the state the shards held, concatenated, is AdamW's on every value
    sa, sb = optimizer_state(allreduce.run_dir), optimizer_state(ps.run_dir)
    assert set(sb["vectors"]) == set(sa["vectors"]) == {"exp_avg", "exp_avg_sq"}
    assert sa["scalars"] == sb["scalars"] == {"step": 20.0}
    for key in sa["vectors"]:
        assert (sa["vectors"][key] - sb["vectors"][key]).abs().max().item() <= 1e-6
    # every step ran at the schedule's rate: warmup, then a cosine down towards --lr-min
    rows = steps_of(allreduce.run_dir, sort_by=None).groupby("step")["lr"].first()
    trained = train_part_size(load_dataset("digits").train_size, RunConfig().val_fraction)  # less validation
    spe = EpochSharder(trained, 32, 4).steps_per_epoch
    sched = LRSchedule.create(0.0025, 32, 16, "linear", 0.1, spe, decay="cosine", total_steps=20, min_lr=0.001)
    assert sched.warmup_steps > 0 and sched.peak_lr == pytest.approx(0.005)
    assert rows.tolist() == pytest.approx([sched.lr_at(k) for k in range(20)])
    assert rows.iloc[0] == pytest.approx(0.0025) and rows.max() == pytest.approx(0.005) and rows.iloc[-1] < 0.0015
    assert (steps_of(ps.run_dir, sort_by=None).groupby("step")["lr"].first().to_numpy() == rows.to_numpy()).all()


@pytest.mark.parametrize("optimizer", ["adamw", "asgd"])
def test_local_sgd_averages_every_state_vector_of_the_optimizer(tmp_path, optimizer):
    run = run_training(cfg(tmp_path, f"local-{optimizer}", strategy="local-sgd", tau=4, optimizer=optimizer))
    state = optimizer_state(run.run_dir)
    expected = {"adamw": {"exp_avg", "exp_avg_sq"}, "asgd": {"ax"}}[optimizer]
    assert set(state["vectors"]) == expected
    assert all(v.abs().sum() > 0 for v in state["vectors"].values())
    rows = steps_of(run.run_dir, sort_by=None)
    assert rows["averaging_round"].max() == 5 and rows["loss"].notna().all()
    assert not torch.isnan(final_params(run.run_dir)).any()


def test_checkpointed_state_continues_on_another_transport_and_another_optimizer_starts_afresh(tmp_path):
    first = run_training(cfg(tmp_path, "first", optimizer="rprop", max_steps=10))
    checkpoint = str(first.run_dir / "checkpoints" / "final.pt")
    assert set(optimizer_state(first.run_dir)["vectors"]) == {"prev", "step_size"}
    # Rprop's state crosses into async parameter-server shards and keeps stepping there
    on_ps = run_training(
        cfg(tmp_path, "on-ps", optimizer="rprop", strategy="async", ps_shards=2, max_steps=16, init_from=checkpoint)
    )
    state = optimizer_state(on_ps.run_dir)
    assert set(state["vectors"]) == {"prev", "step_size"} and state["scalars"]["step"] > 10
    # a different optimizer keeps the model and starts its own state instead of misreading Rprop's
    other = run_training(cfg(tmp_path, "other", optimizer="nadam", max_steps=16, init_from=checkpoint))
    state = optimizer_state(other.run_dir)
    assert set(state["vectors"]) == {"exp_avg", "exp_avg_sq"} and set(state["scalars"]) == {"step", "mu_product"}
    assert state["scalars"]["step"] == 6.0  # steps 10..15 of this run, from a fresh state
