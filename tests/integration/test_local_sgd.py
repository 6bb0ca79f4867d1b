"""Local SGD and AdaComm end to end on real Ray actors over a real gloo group; --comm-delay-ms."""

from __future__ import annotations

import math

import pytest

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from distrain.strategies.adacomm import AdaComm, TauInterval
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    base = dict(
        optimizer="sgd", momentum=0.0, lr=0.1, lr_scaling="none", epochs=2, max_steps=30, seed=3,
        workers=2, batch_size=16, segment_steps=7, eval_every=0, val_fraction=0.0, run_dir=str(tmp_path / name),
    )  # fmt: skip  (val_fraction 0: the whole training set, as the figures below were measured on)
    return RunConfig(**(base | kw))



def test_tau_one_with_plain_sgd_equals_bsp_and_larger_tau_averages_every_tau_steps(tmp_path):
    bsp = final_params(run_training(cfg(tmp_path, "bsp")).run_dir)
    one = run_training(cfg(tmp_path, "tau1", strategy="local-sgd", tau=1))
    # Float tolerance: averaging θ_i - η g_i rounds differently from θ - η mean(g), and 30 steps of
    # training grow that ulp-level noise a little (mean |Δ| ~2e-7 measured; parameters average ~2e-2).
    diff = (final_params(one.run_dir) - bsp).abs()
    assert diff.max().item() <= 2e-4 and diff.mean().item() <= 2e-6
    assert one.summary["averaging_rounds"] == 30 and one.summary["tau_changes"] == [[0, 1]]

    four = run_training(cfg(tmp_path, "tau4", strategy="local-sgd", tau=4))
    assert (final_params(four.run_dir) - bsp).abs().mean().item() > 1e-4  # local steps do change the result
    rows = steps_of(four.run_dir, sort_by=("worker", "step"))
    # Rounds every 4 local steps, and one more to close each epoch (and the run): ceil(steps / 4) per epoch.
    per_epoch = rows[rows["worker"] == 0].groupby("epoch").size()
    assert four.summary["averaging_rounds"] == sum(math.ceil(k / 4) for k in per_epoch)
    averaged = rows[rows["bytes_sent"] > 0]
    assert (averaged.groupby("worker").size() == four.summary["averaging_rounds"]).all()
    assert (rows[rows["bytes_sent"] == 0]["comm_s"] == 0).all()  # local steps communicate nothing
    assert four.summary["bytes_communicated"] == int(rows["bytes_sent"].sum())
    assert set(rows["tau"]) == {4}


def test_adaptive_tau_is_agreed_by_all_workers_and_follows_the_rule(tmp_path):
    run = run_training(
        cfg(tmp_path, "ada", strategy="local-sgd", adaptive_tau=True, tau=8, tau_interval="12", max_steps=0, lr=0.2)
    )
    rows = steps_of(run.run_dir, sort_by=("worker", "step"))
    per_step = rows.groupby("step").agg(taus=("tau", "nunique"), rounds=("averaging_round", "nunique"))
    assert (per_step["taus"] == 1).all() and (per_step["rounds"] == 1).all()  # every worker, every step
    changes = run.summary["tau_changes"]
    assert len(changes) >= 2 and changes[-1][1] < changes[0][1] == 8  # τ shrank as the loss fell
    assert run.summary["tau_max"] == 8  # the loss only fell, so τ never rose above τ_0

    # Replay the rule on the recorded losses: each period's worker-averaged loss decides the next τ.
    rows["period"] = rows.groupby("worker")["averaging_round"].shift(1, fill_value=0)
    rule = AdaComm(8, 16, TauInterval(steps=12))  # --tau-max defaults to 2 x --tau
    rule.start(float(rows["lr"].iloc[0]))
    tau, since = 8, 0
    for _, period in rows.groupby("period", sort=True):
        assert set(period["tau"]) == {tau}
        since += len(period) // 2
        if rule.after_round(float(period["loss"].mean()), float(period["lr"].iloc[0]), 0.0, since):
            tau, since = rule.tau, 0
    assert tau == run.summary["tau_final"]


def test_default_adacomm_run_changes_tau_on_the_bundled_data(tmp_path):
    """`distrain run --strategy local-sgd --adaptive-tau` at its defaults (12 epochs of digits, τ_0 = 8,
    interval 10% of the run, τ_max = 16) re-chooses τ; only the model is the small MLP, to keep it quick
    (the interval is a share of the steps, so the model's speed does not change when τ is re-chosen)."""
    config = RunConfig(strategy="local-sgd", adaptive_tau=True, model="mlp", eval_every=0, run_dir=str(tmp_path / "a"))
    options = config.options_of("local-sgd")
    assert (options.tau, options.tau_interval, options.tau_max) == (8, "10%", 16)
    run = run_training(config)
    changes = run.summary["tau_changes"]
    assert changes[0] == [0, 8] and len(changes) >= 2, changes
    # The first change comes at the first round after 10% of the 264 steps (27 local steps).
    assert changes[1][0] >= math.ceil(0.1 * run.summary["steps_completed"]), changes


def test_every_communication_round_lasts_at_least_the_comm_delay(tmp_path):
    delay = 0.04
    for name, kw in [
        ("bsp", {}),
        ("local", dict(strategy="local-sgd", tau=3)),
        ("ssp", dict(strategy="ssp", staleness=1)),
    ]:
        run = run_training(cfg(tmp_path, name, max_steps=6, comm_delay_ms=delay * 1000, **kw))
        rows = steps_of(run.run_dir, sort_by=("worker", "step"))
        rounds = rows[rows["bytes_sent"] > 0]
        assert len(rounds) == (4 if name == "local" else 12), name
        # BSP launches its buckets during backward, so the delay runs partly inside compute_s (a loaded
        # machine's slow backward can hide all of it); a local SGD round and a PS push-pull wait it out.
        spent = rounds["comm_s"] + (rounds["compute_s"] if name == "bsp" else 0)
        assert (spent >= delay).all(), (name, spent.min())


def test_comm_bandwidth_makes_every_transfer_last_latency_plus_bytes_over_rate(tmp_path):
    """--comm-bandwidth 80mbit (10 MB/s) with --comm-delay-ms 5: a transfer of b bytes lasts at least
    5 ms + b / 10 MB/s, counted from its launch. BSP launches its bucket during backward (inside
    compute_s), so only compute + comm bounds it; a local-SGD round and a PS push-pull wait it out."""
    rate, latency = 10e6, 0.005
    for name, kw in [
        ("bsp", {}),
        ("local", dict(strategy="local-sgd", tau=3)),
        ("ssp", dict(strategy="ssp", staleness=1)),
    ]:
        run = run_training(
            cfg(tmp_path, f"bw-{name}", max_steps=6, comm_delay_ms=latency * 1000, comm_bandwidth="80mbit", **kw)
        )
        rows = steps_of(run.run_dir, sort_by=("worker", "step"))
        rounds = rows[rows["bytes_sent"] > 0]
        assert len(rounds) == (4 if name == "local" else 12), name
        if name == "ssp":  # the push and the pull of θ: one request and its reply
            wire = rounds["bytes_sent"] + rounds["bytes_received"]
        else:  # a ring all-reduce: bytes_sent is what each worker puts on the wire (and receives)
            wire = rounds["bytes_sent"]
        bound = latency + wire / rate
        spent = rounds["comm_s"] + (rounds["compute_s"] if name == "bsp" else 0)
        assert (spent >= bound * 0.999).all(), (name, (spent - bound).min())
        assert bound.min() > 0.05, name  # the rate, not the latency, dominates: the bound means something


def test_a_resumed_adacomm_run_goes_on_with_its_tau_and_rounds(tmp_path):
    """Local SGD checkpoints its own state (τ in force, rounds, AdaComm's F_0 and η_0: `extra_state`), so
    --resume neither restarts τ at τ_0 nor the round count at 0."""
    import torch

    from distrain.orchestrator.resume import resume_config

    first = cfg(tmp_path, "ada", strategy="local-sgd", tau=2, adaptive_tau=True, tau_interval="5", max_steps=0)
    run_training(first)
    saved = torch.load(tmp_path / "ada" / "checkpoints" / "final.pt", weights_only=False)["strategy_state"]
    assert saved["strategy"] == "local-sgd" and saved["state"]["adacomm"]["loss0"] is not None
    assert saved["state"]["tau"] != 2  # AdaComm moved off tau_0, so a restart at tau_0 would show
    before = steps_of(tmp_path / "ada", sort_by=("worker", "step"))
    run_training(resume_config(tmp_path / "ada", {"epochs": 3}), resume=True)
    rows = steps_of(tmp_path / "ada", sort_by=("worker", "step"))
    resumed = rows[rows["step"] >= before["step"].max() + 1].sort_values("step")
    assert int(resumed["tau"].iloc[0]) == saved["state"]["tau"]  # the τ in force, not --tau
    assert resumed["averaging_round"].min() > before["averaging_round"].max()  # rounds go on counting
