"""DiLoCo end to end on real Ray actors over a real gloo group: its identities, its rounds, its resume."""

from __future__ import annotations

import math

import pytest
import torch

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")
PLAIN_OUTER = dict(outer_lr=1.0, outer_momentum=0.0)  # θ_g becomes the plain mean of the replicas


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    base = dict(
        optimizer="sgd", momentum=0.0, lr=0.1, lr_scaling="none", epochs=2, max_steps=30, seed=3,
        workers=2, batch_size=16, segment_steps=7, eval_every=0, run_dir=str(tmp_path / name),
    )  # fmt: skip
    return RunConfig(**(base | kw))



def test_h1_with_plain_inner_and_outer_sgd_equals_bsp(tmp_path):
    bsp = final_params(run_training(cfg(tmp_path, "bsp")).run_dir)
    one = run_training(cfg(tmp_path, "h1", strategy="diloco", sync_every=1, **PLAIN_OUTER))
    # θ_g − mean(θ_g − (θ_g − η g_i)) rounds differently from θ − η mean(g): float tolerance, as for
    # local SGD's τ = 1 (30 steps grow the ulp-level noise a little; parameters average ~2e-2).
    diff = (final_params(one.run_dir) - bsp).abs()
    assert diff.max().item() <= 2e-4 and diff.mean().item() <= 2e-6
    assert one.summary["outer_steps"] == 30


@pytest.fixture(scope="module")
def paper(tmp_path_factory):
    """H = 4 with DiLoCo's outer Nesterov (momentum 0.9, lr 0.7), 30 steps straight through: two tests read it."""
    return run_training(cfg(tmp_path_factory.mktemp("paper"), "paper", strategy="diloco", sync_every=4))


def test_plain_outer_sgd_is_parameter_averaging_and_nesterov_changes_it(tmp_path, paper):
    local = run_training(cfg(tmp_path, "local", strategy="local-sgd", tau=4))  # plain SGD: θ only
    plain = run_training(cfg(tmp_path, "plain", strategy="diloco", sync_every=4, **PLAIN_OUTER))
    diff = (final_params(plain.run_dir) - final_params(local.run_dir)).abs()
    assert diff.max().item() <= 2e-5 and diff.mean().item() <= 5e-7

    assert (final_params(paper.run_dir) - final_params(plain.run_dir)).abs().mean().item() > 1e-3
    rows = steps_of(paper.run_dir, sort_by=("worker", "step"))
    # An outer step every 4 inner steps, and one more to close each epoch (and the run).
    per_epoch = rows[rows["worker"] == 0].groupby("epoch").size()
    outer = sum(math.ceil(k / 4) for k in per_epoch)
    assert paper.summary["outer_steps"] == paper.summary["averaging_rounds"] == outer
    synced = rows[rows["bytes_sent"] > 0]
    assert (synced.groupby("worker").size() == outer).all()
    assert (rows[rows["bytes_sent"] == 0]["comm_s"] == 0).all()  # inner steps communicate nothing
    n = final_params(paper.run_dir).numel()
    assert (synced["bytes_sent"] == 4 * n).all()  # a ring all-reduce of n float32: 2(P-1)/P x 4n bytes, P = 2
    assert set(rows["tau"]) == {4}
    saved = torch.load(paper.run_dir / "checkpoints" / "final.pt", weights_only=False)["strategy_state"]
    assert saved["strategy"] == "diloco" and saved["state"]["outer_steps"] == outer
    assert saved["state"]["outer_optimizer"]["vectors"]["momentum_buffer"].abs().sum() > 0


CKPT6 = dict(strategy="diloco", sync_every=4, checkpoint_steps=6, max_steps=12)


@pytest.fixture(scope="module")
def ckpt6(tmp_path_factory):
    """H = 4 with a step checkpoint every 6 steps, 12 steps, uninterrupted: two tests read it."""
    return run_training(cfg(tmp_path_factory.mktemp("ckpt6"), "ckpt", **CKPT6))


def test_outer_steps_close_periods_at_step_checkpoints(ckpt6):
    run = ckpt6
    rows = steps_of(run.run_dir, sort_by=("worker", "step"))
    synced = sorted(set(rows.loc[rows["bytes_sent"] > 0, "step"]))
    assert synced == [3, 5, 9, 11]  # every 4 inner steps, and before the checkpoints after steps 5 and 11


def test_resume_continues_exactly_with_the_outer_optimizer_state(tmp_path, paper):
    """Inner plain SGD (stateless), outer Nesterov momentum: a run stopped at step 16 (a period's end:
    4 outer steps have built the momentum) and resumed to step 30 ends where the same run taken straight
    through ends, because the checkpoint carries θ_g, the outer momentum and the outer step count."""
    from distrain.orchestrator.resume import resume_config

    straight = paper
    run_training(cfg(tmp_path, "parts", strategy="diloco", sync_every=4, max_steps=16))
    resumed = run_training(resume_config(tmp_path / "parts", {"max_steps": 30}), resume=True)
    assert (final_params(resumed.run_dir) - final_params(straight.run_dir)).abs().max().item() <= 1e-6
    assert resumed.summary["outer_steps"] == straight.summary["outer_steps"]


def test_the_default_diloco_run_reaches_the_usual_accuracy_on_the_bundled_data(tmp_path):
    """`distrain run --strategy diloco` as shipped: cnn on digits, 12 epochs, H = 8, outer Nesterov SGD
    (lr 0.7, momentum 0.9), inner SGD at DiLoCo's own default rate 0.01."""
    config = RunConfig(strategy="diloco", run_dir=str(tmp_path / "default"))
    options = config.options_of("diloco")
    assert (config.lr, options.sync_every, options.outer_lr, options.outer_momentum) == (0.01, 8, 0.7, 0.9)
    run = run_training(config)
    assert run.summary["final_test_accuracy"] >= 0.95, run.summary
    assert run.summary["time_to_target_s"] is not None


def test_schedules_hand_over_to_and_from_diloco(tmp_path):
    """What a switch carries: θ and the optimizer state (which becomes every replica's inner state under
    DiLoCo); the outer optimizer starts afresh in a DiLoCo phase and its rounds close at the switch."""
    into = run_training(cfg(tmp_path, "into", schedule="bsp:1,diloco", sync_every=4, max_steps=0))
    rows = steps_of(into.run_dir, sort_by=("worker", "step"))
    spe = into.summary["phases"][0]["end_step"]
    assert rows.loc[rows["step"] < spe, "averaging_round"].isna().all()  # BSP rows: no outer steps
    diloco = rows[rows["step"] >= spe]
    assert diloco["averaging_round"].notna().all() and into.summary["outer_steps"] == math.ceil(spe / 4)
    switch = torch.load(into.run_dir / "checkpoints" / "switch-0001.pt", weights_only=False)
    assert "strategy_state" not in switch  # BSP has none of its own to hand over

    out = run_training(cfg(tmp_path, "out", schedule="diloco:1,bsp", sync_every=4, max_steps=0))
    switch = torch.load(out.run_dir / "checkpoints" / "switch-0001.pt", weights_only=False)
    assert switch["strategy_state"]["strategy"] == "diloco"  # kept in the file, not applied to BSP
    rows = steps_of(out.run_dir, sort_by=("worker", "step"))
    last = rows[rows["step"] == out.summary["phases"][0]["end_step"] - 1]
    assert (last["bytes_sent"] > 0).all()  # the period closed at the switch: BSP starts from θ_g
    assert out.summary["status"] == "completed"


def test_a_worker_lost_mid_round_discards_the_round_and_ends_equal_to_the_uninterrupted_run(tmp_path, ckpt6):
    """torchft's choice: a round a worker dies in is discarded and every replica goes back to the last
    synchronised θ_g. Here that is the latest step checkpoint, which closes a period (an outer step), so
    with a stateless inner optimizer the recovered run ends exactly where the uninterrupted one does
    (the kill after step 8 lands in the round of steps 6-9; periods count from the step-6 checkpoint in
    both runs: outer steps after steps 9 and 11)."""
    clean = ckpt6
    hit = run_training(cfg(tmp_path, "hit", chaos=("kill-worker@8:1",), **CKPT6))
    (event,) = hit.summary["failure_events"]
    assert hit.summary["status"] == "completed" and (event["action"], event["restored_step"]) == ("restarted", 6), event
    assert (final_params(hit.run_dir) - final_params(clean.run_dir)).abs().max().item() <= 1e-6
    assert hit.summary["outer_steps"] == clean.summary["outer_steps"]


# ---------------------------------------------------------------- Streaming DiLoCo
def test_fragment_spans_cut_whole_tensors_into_balanced_groups():
    from distrain.strategies.fragments import fragment_spans

    assert fragment_spans([10, 10, 10, 10], 2) == [(0, 20), (20, 40)]
    assert fragment_spans([100, 1, 1, 1], 3) == [(0, 100), (100, 101), (101, 103)]  # each group gets a tensor
    assert fragment_spans([5, 5, 90], 1) == [(0, 100)]
    assert fragment_spans([1, 1, 98], 3) == [(0, 1), (1, 2), (2, 100)]


def test_fragments_sync_in_turn_and_overlap_with_inner_steps(tmp_path):
    """P = 2, H = 4: fragment 0 goes on the wire at inner steps 4, 8, ... and fragment 1 at 2, 6, ...; each
    carries its own part of θ, so a period moves what DiLoCo's one round moves. With τ = 1 each arrives
    one inner step after it left and is mixed in at α = 0.5; the run still trains."""
    kw = dict(strategy="diloco", sync_every=4, max_steps=0, epochs=2)
    stream = run_training(cfg(tmp_path, "stream", fragments=2, overlap_steps=1, mix_alpha=0.5, **kw))
    rows = steps_of(stream.run_dir, sort_by=("worker", "step"))
    first = rows[(rows["worker"] == 0) & (rows["epoch"] == 0)].sort_values("step")
    spe = len(first)
    sent = first["bytes_sent"].tolist()
    # inner step t = row index + 1: fragment 1 at t = 2, 6, ..., fragment 0 at t = 4, 8, ...; the epoch's
    # last step closes the period (both fragments, whatever is pending)
    on_wire = [t for t in range(1, spe) if sent[t - 1] > 0]
    assert on_wire == [t for t in range(1, spe) if t % 2 == 0], on_wire
    frag1 = {sent[t - 1] for t in range(2, spe, 4)}
    frag0 = {sent[t - 1] for t in range(4, spe, 4)}
    assert len(frag0) == len(frag1) == 1 and frag0 != frag1  # each fragment has its own size
    n = final_params(stream.run_dir).numel()  # the model's parameter count (the same for every run of it)
    assert frag0.pop() + frag1.pop() == 4 * n  # together one DiLoCo round's bytes (ring, P = 2, float32)
    assert stream.summary["status"] == "completed" and stream.summary["final_test_loss"] < 1.0, stream.summary
