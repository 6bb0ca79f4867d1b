"""Heterogeneous workers end to end: static shares (--worker-weights) and speed-balanced shares
(--balance speed) give the update of one process at the global batch, over the same samples."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest

from distrain.config import RunConfig
from distrain.orchestrator.callbacks import Callback
from distrain.orchestrator.run import run_training
from distrain.orchestrator.tasks import build_task
from distrain.trainers.sharding import EpochSharder
from distrain.trainers.splits import task_splits
from tests.helpers import BlockStarts, final_params

pytestmark = pytest.mark.usefixtures("ray_cluster")
STEPS = 30  # across an epoch's end (22 steps of 64 digits: the whole training set, none held out to validate)


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    base = dict(
        optimizer="sgd", momentum=0.9, lr=0.05, lr_scaling="none", epochs=2, max_steps=STEPS, seed=7,
        workers=2, batch_size=32, segment_steps=4, eval_every=0, val_fraction=0.0, run_dir=str(tmp_path / name),
    )  # fmt: skip
    return RunConfig(**(base | kw))


def step_rows(run) -> pd.DataFrame:
    df = pd.read_parquet(run.run_dir / "metrics.parquet")
    return df[df["kind"] == "step"].sort_values(["step", "worker"])


def samples_seen(run, config: RunConfig) -> list[tuple[int, int]]:
    """Every (epoch, sample) the run's workers trained on, rebuilt from the shares each step row recorded:
    each step's shares sum to the global batch, some worker's share changed during the run, and the
    workers' blocks at a step tile exactly that step's samples of the epoch."""
    steps = step_rows(run)
    shares = steps.pivot(index="step", columns="worker", values="samples")
    assert (shares.sum(axis=1) == config.global_batch_size).all() and shares.nunique().max() > 1
    cuts = [
        (step, epoch, tuple(int(b) for b in shares.loc[step]))
        for step, epoch in steps[["step", "epoch"]].drop_duplicates().itertuples(index=False)
    ]
    return blocks_seen(config, cuts)


def blocks_seen(config: RunConfig, cuts: list[tuple[int, int, tuple[int, ...]]]) -> list[tuple[int, int]]:
    """Every (epoch, sample) of the steps in `cuts` [(step, epoch, each worker's or replica's share)]: at
    each step the blocks cut by those shares, in order, tile exactly that step's samples of the epoch."""
    train = task_splits(build_task(config), config.val_fraction).train  # what the workers train on
    sharder = EpochSharder(len(train), config.global_batch_size, config.seed)
    seen = []
    for step, epoch, cut in cuts:
        within = step - epoch * sharder.steps_per_epoch
        blocks = np.concatenate([sharder.worker_indices(epoch, within, r, len(cut), cut) for r in range(len(cut))])
        assert np.array_equal(blocks, sharder.global_batch_indices(epoch, within))
        seen += [(epoch, int(i)) for i in blocks]
    return seen


def replica_cuts(last: pd.DataFrame) -> list[tuple[int, int, tuple[int, ...]]]:
    """Each step's replica shares, in replica order, as a pipeline's last stages recorded them."""
    return [
        (step, epoch, tuple(int(b) for b in rows.sort_values("replica")["samples"]))
        for (step, epoch), rows in last.groupby(["step", "epoch"])
    ]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One worker at the global batch, 64: what every heterogeneous run here must equal."""
    return final_params(run_training(cfg(tmp_path_factory.mktemp("one"), "one", workers=1, batch_size=64)).run_dir)


def test_weighted_shares_equal_one_process_at_the_global_batch_on_both_transports(tmp_path, one_process):
    """--worker-weights 3,1 on 2 workers (b = 48 and 16 of B = 64) equals one worker at 64 over the same
    samples after 30 momentum-SGD steps, over the all-reduce and over the parameter server; each step row
    records the worker's share."""
    for transport in ("collective", "ps"):
        run = run_training(cfg(tmp_path, transport, worker_weights="3,1", transport=transport))
        assert run.summary["steps_completed"] == STEPS
        assert (final_params(run.run_dir) - one_process).abs().max().item() <= 1e-5, transport
        steps = step_rows(run)
        assert steps.groupby("worker")["samples"].unique().map(list).to_dict() == {0: [48], 1: [16]}, transport
        assert run.summary["worker_shares"] == [48, 16]  # what the report shows


def test_weighted_pipeline_replicas_equal_one_process_and_see_every_sample_once(tmp_path, one_process):
    """--worker-weights 3,1 over a pipeline's replicas (S = 2 stages, R = 2 replicas, M = 4 micro-batches):
    replica 0 takes 48 samples a step (micro-batches of 12), replica 1 16 (of 4), each stage weights its
    gradient by b_r x R / B before the all-reduce over its copies: after 30 momentum-SGD steps (across an
    epoch's end) the model equals one process at 64. The last stage's rows record each replica's share,
    and rebuilt from them every step's blocks tile its 64 samples, each sample of the epoch once."""
    config = cfg(tmp_path, "pipe", worker_weights="3,1", pipeline_stages=2, microbatches=4)
    run = run_training(config)
    assert run.summary["steps_completed"] == STEPS and run.summary["worker_shares"] == [48, 16]
    assert (final_params(run.run_dir) - one_process).abs().max().item() <= 1e-5
    steps = step_rows(run)
    assert sorted(set(zip(steps["worker"], steps["stage"], steps["replica"], strict=True))) == [
        (0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)
    ]  # fmt: skip
    last = steps[steps["stage"] == 1]  # the stage that counts its replica's samples (the others record 0)
    assert last.groupby("replica")["samples"].unique().map(list).to_dict() == {0: [48], 1: [16]}
    assert (steps[steps["stage"] == 0]["samples"] == 0).all()
    seen = blocks_seen(config, replica_cuts(last))
    first = [s for s in seen if s[0] == 0]
    assert len(first) == len(set(first)) == 22 * 64


def test_balanced_pipeline_replicas_rebuild_their_schedules_and_equal_one_process(tmp_path, one_process, monkeypatch):
    """--balance speed over a pipeline's replicas (S = 2, R = 2, M = 4; shares in sets of 4 samples): the
    driver's balancer (in this process) is made to move the shares at segment starts inside the first
    epoch, 32/32 -> 48/16 (step 4) -> 20/44 (step 12) -> 40/24 (step 16), as measured speeds would. Each
    move changes the replicas' micro-batch sizes, so their stages rebuild torch's stage and schedule; the
    gradients are weighted b_r x R / B. After 30 momentum-SGD steps the model equals one process at 64;
    every stage's row records its replica's share, the last stage's `samples` is b_r, and rebuilt from
    them every step's blocks tile its 64 samples, each sample of the epoch once."""
    from distrain.orchestrator.pipeline_balance import PipelineShareBalancer

    plan = {0: (8, 8), 1: (12, 4), 2: (12, 4), 3: (5, 11)}  # the k-th decision, units of 4 samples; then 10/6
    monkeypatch.setattr(PipelineShareBalancer, "proposal", lambda self: plan.get(len(self.decided), (10, 6)))
    config = cfg(tmp_path, "pipe-balanced", balance="speed", pipeline_stages=2, microbatches=4)
    run = run_training(config)
    assert run.summary["steps_completed"] == STEPS and run.summary["worker_shares"] == [40, 24]
    assert [m["step"] for m in run.summary["balance"]["moves"]] == [4, 12, 16]
    assert (final_params(run.run_dir) - one_process).abs().max().item() <= 1e-5
    steps = step_rows(run)
    last = steps[steps["stage"] == 1]
    assert (last["samples"] == last["replica_samples"]).all() and (steps[steps["stage"] == 0]["samples"] == 0).all()
    by_step = steps.pivot_table(index="step", columns="worker", values="replica_samples")
    assert (by_step[0] == by_step[1]).all() and (by_step[2] == by_step[3]).all()  # a replica's stages agree
    expected = {0: (32, 32), 4: (48, 16), 12: (20, 44), 16: (40, 24)}
    for step, row in by_step.iterrows():
        start = max(k for k in expected if k <= step)
        assert (row[1], row[3]) == expected[start], (step, row)
    seen = blocks_seen(config, replica_cuts(last))
    first = [s for s in seen if s[0] == 0]
    assert len(first) == len(set(first)) == 22 * 64


def test_speed_balanced_shares_move_mid_epoch_see_every_sample_once_and_equal_one_process(tmp_path, one_process):
    """Worker 1 computes 6x slower: --balance speed moves its share down at a segment start inside the
    first epoch; rebuilt from the recorded shares, every step is cut into blocks covering its 64 samples,
    each sample of the epoch once; and the update is still one process's at 64. (At x3 a load of 7-9 once
    hid the gain: worker 1 measured only 1.5x slower, within the balancer's noise margin, and no move came.)"""
    config = cfg(tmp_path, "balanced", balance="speed", straggler=["1:x6"])
    run = run_training(config)
    moves = run.summary["balance"]["moves"]
    assert run.summary["worker_shares"] == run.summary["balance"]["final_shares"] == moves[-1]["shares"]
    assert moves and moves[0]["step"] < 22 and moves[0]["shares"][1] < moves[0]["shares"][0], moves
    seen = samples_seen(run, config)
    first = [s for s in seen if s[0] == 0]
    assert len(first) == len(set(first)) == 22 * 64
    assert (final_params(run.run_dir) - one_process).abs().max().item() <= 1e-5


def test_local_sgd_and_diloco_weigh_their_averages_by_the_samples_each_replica_took(tmp_path, one_process):
    """Equal numbers of local steps at unequal batches (--worker-weights 3,1): local SGD at τ = 1, its
    momentum averaged with θ, is one process at 64; and DiLoCo with plain outer SGD (lr 1) is local SGD
    at τ = H, each average weighted by the samples the replicas took (unweighted, it would not be)."""
    shares = dict(worker_weights="3,1")
    tau1 = run_training(cfg(tmp_path, "tau1", strategy="local-sgd", tau=1, **shares))
    # Averaging θ_i − η m_i rounds differently from θ − η mean(m): test_local_sgd.py's tolerance for τ = 1
    # vs BSP.
    diff = (final_params(tau1.run_dir) - one_process).abs()
    assert diff.max().item() <= 2e-4 and diff.mean().item() <= 2e-6
    short = dict(momentum=0.0, max_steps=9, **shares)
    local = run_training(cfg(tmp_path, "tau3", strategy="local-sgd", tau=3, **short))
    diloco = run_training(
        cfg(tmp_path, "h3", strategy="diloco", sync_every=3, outer_lr=1.0, outer_momentum=0.0, **short)
    )
    assert (final_params(diloco.run_dir) - final_params(local.run_dir)).abs().max().item() <= 1e-5
    assert step_rows(diloco).groupby("worker")["samples"].unique().map(list).to_dict() == {0: [48], 1: [16]}


@pytest.mark.parametrize(
    ("strategy", "accuracy"),
    [
        # The least final test accuracy each must reach: BSP's update does not depend on the shares (one
        # process at 64: 0.96 in 3 epochs); local SGD's local steps do (0.94-0.96 measured). DiLoCo with plain
        # outer SGD at lr 1 averages as local SGD does; with its default outer Nesterov (0.7, 0.9) 3 epochs
        # ended anywhere from 0.69 to 0.83, depending on where the shares went.
        pytest.param(dict(transport="ps"), 0.9, id="bsp-ps"),
        pytest.param(dict(strategy="local-sgd", tau=4), 0.85, id="local-sgd"),
        pytest.param(dict(strategy="diloco", sync_every=4, outer_lr=1.0, outer_momentum=0.0), 0.85, id="diloco"),
    ],
)
def test_speed_balanced_shares_under_the_other_strategies(tmp_path, strategy, accuracy):
    """--balance speed end to end where else it is accepted (BSP over the parameter server, local SGD,
    DiLoCo), worker 1 computing 3x slower, 3 whole epochs on the mlp: the slow worker's share falls below
    half the batch, the shares change mid-run and every sample of every epoch is still trained on exactly
    once (rebuilt from the recorded shares), and the model learns (digits: chance is 0.1)."""
    config = cfg(
        tmp_path, "balanced", model="mlp", epochs=3, max_steps=0, balance="speed", straggler=["1:x3"], **strategy
    )
    run = run_training(config)
    assert run.summary["steps_completed"] == 3 * 22
    moves = run.summary["balance"]["moves"]
    assert moves and run.summary["worker_shares"] == moves[-1]["shares"], moves
    assert any(m["step"] % 22 for m in moves), moves  # some move inside an epoch (22 steps)
    assert min(step_rows(run).query("worker == 1")["samples"]) < 32, moves
    seen = samples_seen(run, config)
    assert len(seen) == len(set(seen)) == 3 * 22 * 64
    assert run.summary["final_test_accuracy"] >= accuracy, run.summary["final_test_accuracy"]


def test_equal_workers_under_speed_balance_keep_their_shares_within_ten_percent_of_equal(tmp_path):
    """Issue 31's noise acceptance on a real run: two equal workers, --balance speed, 4 epochs of the mlp
    deciding every 4 steps: every step row's share stays within 10 % of 32, with at most one move. (On
    the loaded 2-core machine two such runs predicted gains up to 10 %, the hysteresis, and a noise margin
    of 36-58 % held them; a 2-worker move that a gain of 10 % to 12.5 % allows is to 35/29, still inside.)"""
    config = cfg(tmp_path, "equal", model="mlp", epochs=4, max_steps=0, balance="speed")
    run = run_training(config)
    assert run.summary["steps_completed"] == 4 * 22
    assert len(run.summary["balance"]["moves"]) <= 1, run.summary["balance"]
    samples = step_rows(run)["samples"]
    assert ((samples - 32).abs() <= 3.2).all(), samples.value_counts()


def test_balanced_shares_under_a_range_equal_one_process_at_the_global_batch(tmp_path, one_process, monkeypatch):
    """--workers 1..2 --balance speed over the collective: every round is a whole step of B = 64 cut among
    the members, each unit weighted b_i x MAX / B, so the run equals one worker at 64 over the same
    samples. Equal workers would stay at 32/32 (weight 1, nothing to check): the driver's balancer (in
    this process) is made to cut 40/24 once both are members, as a measured speed difference would."""
    from distrain.orchestrator.elastic_balance import ElasticShareBalancer

    unequal = lambda self: (40, 24) if len(self.members) == 2 else self.current  # noqa: E731
    monkeypatch.setattr(ElasticShareBalancer, "proposal", unequal)
    run = run_training(cfg(tmp_path, "elastic", workers="1..2", balance="speed", cpus_per_worker=3))
    assert run.summary["steps_completed"] == STEPS
    steps = step_rows(run)
    assert (steps.groupby("step")["samples"].sum() == 64).all()
    # Rank 1 may join after rank 0 started alone (its placement and build take a while when the machine is
    # loaded): rank 0 then takes whole steps of 64 until the join.
    shares = steps.groupby("worker")["samples"].unique().map(set).to_dict()
    assert shares[0] in ({40}, {64, 40}) and shares[1] == {24}, shares
    assert run.summary["worker_shares"] == [40, 24]
    assert (final_params(run.run_dir) - one_process).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    ("strategy", "reference"),
    [
        # τ = 1: every round averages θ and momentum weighted by samples, i.e. BSP at 64 (test_local_sgd's
        # float tolerance for τ = 1 vs BSP, as at a fixed size above).
        pytest.param(dict(strategy="local-sgd", tau=1), dict(), id="local-sgd"),
        # H = 1, plain inner SGD, outer SGD at lr 1: θ_g is the members' sample-weighted mean, i.e. BSP.
        pytest.param(
            dict(strategy="diloco", sync_every=1, outer_lr=1.0, outer_momentum=0.0, momentum=0.0),
            dict(momentum=0.0),
            id="diloco",
        ),
    ],
)
def test_local_sgd_and_diloco_take_balanced_shares_under_a_range(
    tmp_path, one_process, monkeypatch, strategy, reference
):
    """--workers 2..4 --balance speed under local SGD and DiLoCo (room for 2 of the 4; B = 4 x 16): a block
    is whole steps of 64 cut among the members, each member's average weighted by the samples it took in
    the block, at the unscaled rate. The driver's balancer is made to cut 40/24 once both are members; at
    τ = H = 1 the run is then one process at 64 (unweighted or at the members' scaled rate, 2 of MAX 4,
    it would not be)."""
    from distrain.orchestrator.elastic_balance import ElasticShareBalancer

    unequal = lambda self: (40, 24) if len(self.members) == 2 else self.current  # noqa: E731
    monkeypatch.setattr(ElasticShareBalancer, "proposal", unequal)
    # MIN = 2 (as in the restart test below): both members from the start, two slots pending throughout.
    # With --workers 1..2 rank 1 was built while rank 0 trained alone and could miss the run, so rank 0 was
    # held 1 s a step (--straggler 0:1): 30 s a run.
    config = cfg(tmp_path, "elastic", workers="2..4", batch_size=16, balance="speed", cpus_per_worker=3, **strategy)
    run = run_training(config)
    assert run.summary["steps_completed"] == STEPS
    steps = step_rows(run)
    assert (steps.groupby("step")["samples"].sum() == 64).all()
    shares = steps.groupby("worker")["samples"].unique().map(set).to_dict()
    assert len(shares) == 2 and sorted(map(tuple, shares.values())) == [(24,), (40,)], shares
    assert [b for b in run.summary["worker_shares"] if b] == [40, 24]
    one = cfg(tmp_path, "one", workers=1, batch_size=64, **reference)
    alone = final_params(run_training(one).run_dir) if reference else one_process
    diff = (final_params(run.run_dir) - alone).abs()
    assert diff.max().item() <= 2e-4 and diff.mean().item() <= 2e-6, (diff.max().item(), diff.mean().item())


def test_a_straggler_under_a_range_is_slowed_once_a_member_and_balanced(tmp_path, one_process):
    """--straggler composes with --workers MIN..MAX (a slowdown belongs to a rank): --workers 1..2 --balance
    speed --straggler 1:x6 over 2 epochs. Once rank 1 is a member its steps are 6x slower and the balancer
    moves its share below half; every step is still a whole 64 cut among the members in slot order, each
    sample of each epoch once, and the run equals one process at 64 (30 steps: the `one_process` run)."""
    config = cfg(
        tmp_path, "elastic-straggler", workers="1..2", balance="speed", straggler=["1:x6"], cpus_per_worker=3
    )
    run = run_training(config)
    assert run.summary["steps_completed"] == STEPS
    steps = step_rows(run)
    assert (steps.groupby("step")["samples"].sum() == 64).all()
    assert min(steps.query("worker == 1")["samples"]) < 32, run.summary["balance"]
    assert run.summary["worker_shares"][1] < 32
    cuts = []
    for (step, epoch), rows in steps.groupby(["step", "epoch"]):
        cut = [0, 0]  # per slot: 0 where a slot had no member at that step
        for worker, samples in zip(rows["worker"], rows["samples"], strict=True):
            cut[int(worker)] = int(samples)
        cuts.append((step, epoch, tuple(cut)))
    seen = blocks_seen(config, cuts)
    first = [s for s in seen if s[0] == 0]
    assert len(first) == len(set(first)) == 22 * 64
    assert (final_params(run.run_dir) - one_process).abs().max().item() <= 1e-5


def test_balanced_shares_under_a_range_restart_from_a_checkpoint_and_still_equal_one_process(
    tmp_path, one_process, monkeypatch
):
    """--workers 2..4 (room for 2; B = 4 x 16) --balance speed: a member killed at step 15 would take the run below MIN,
    so the attempt restarts from the last checkpoint (every 5 steps). The shares are not in the checkpoint: the new
    attempt's balancer starts its members equal and decides again (here made to cut 40/24 once it does);
    the steps after the restore are the same samples and updates, so the run still equals one process."""
    from distrain.orchestrator.elastic_balance import ElasticShareBalancer

    decided: list[tuple[int, ...]] = []

    def unequal(self):
        decided.append(self.current)  # the shares each decision starts from
        return (40, 24) if len(self.members) == 2 else self.current

    monkeypatch.setattr(ElasticShareBalancer, "proposal", unequal)
    config = cfg(
        tmp_path, "restart", workers="2..4", batch_size=16, balance="speed", cpus_per_worker=3, checkpoint_steps=5,
        chaos=["kill-worker@15:1"], collective_timeout_s=20.0, hang_timeout_s=20.0,
    )  # fmt: skip
    run = run_training(config)
    s = run.summary
    assert s["status"] == "completed" and s["failures"] == 1, s["failure_events"]
    (event,) = s["failure_events"]
    assert event["action"] == "restarted" and event["restored_step"] in (10, 15)
    assert decided[0] == (32, 32) and decided.count((32, 32)) == 2  # equal at each attempt's start: recomputed
    # (the new attempt's members may be placed in other slots of the four: the shares are per slot)
    assert s["steps_completed"] == STEPS and [b for b in s["worker_shares"] if b] == [40, 24]
    assert (final_params(run.run_dir) - one_process).abs().max().item() <= 1e-5


def cut_samples_seen(steps: pd.DataFrame, config: RunConfig) -> list[tuple[int, int]]:
    """Every (epoch, sample) cut replicas (R = 2 of D = 2) trained on, rebuilt from their rows: each
    worker's row records its replica's share (`replica_samples`, the same on the replica's D rows) and
    its own part (`samples`, b_r / D); the replicas' shares sum to the global batch, and the workers'
    parts, in rank order, tile exactly the step's samples of the epoch."""
    train = task_splits(build_task(config), config.val_fraction).train
    sharder = EpochSharder(len(train), config.global_batch_size, config.seed)
    seen = []
    for (step, epoch), rows in steps.groupby(["step", "epoch"]):
        rows = rows.sort_values("worker")
        assert rows["worker"].tolist() == [0, 1, 2, 3] and rows["replica"].tolist() == [0, 0, 1, 1]
        shares = tuple(int(b) for b in rows.groupby("replica")["replica_samples"].agg(lambda b: b.unique().item()))
        assert sum(shares) == config.global_batch_size and (rows["samples"] * 2 == rows["replica_samples"]).all()
        within = step - epoch * sharder.steps_per_epoch
        parts = [sharder.worker_indices(epoch, within, s, 4, shares, cut=2) for s in range(4)]
        assert [len(p) for p in parts] == rows["samples"].tolist()
        assert np.array_equal(np.concatenate(parts), sharder.global_batch_indices(epoch, within))
        seen += [(epoch, int(i)) for p in parts for i in p]
    return seen


CUT = dict(workers=2, fsdp=2, batch_size=16)  # R = 2 replicas of D = 2 FSDP workers: B = 64


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(CUT, id="fsdp"),
        # the cnn's hybrid plan: each of a replica's T = 2 workers takes its own half of the replica's share
        pytest.param(dict(workers=2, tensor_parallel=2, batch_size=16), id="tp-hybrid"),
    ],
)
def test_weighted_cut_replicas_equal_one_process_and_see_every_sample_once(tmp_path, one_process, layout):
    """--worker-weights 3,1 across R = 2 replicas of D = 2 FSDP workers (BSP over the collective): replica
    0 takes 48 samples a step (24 per rank), replica 1 16 (8 per rank); FSDP averages inside each replica
    and every worker weights its part of the gradient by b_r x R / B before the all-reduce across the
    replicas, so after 30 momentum-SGD steps (across an epoch's end) the model equals one process at 64;
    rebuilt from the rows, every step's parts tile its 64 samples, each sample of the epoch once. The
    same for R = 2 replicas of the cnn's T = 2 hybrid (each worker on its own samples)."""
    config = cfg(tmp_path, "cut", worker_weights="3,1", **layout)
    run = run_training(config)
    assert run.summary["steps_completed"] == STEPS and run.summary["worker_shares"] == [48, 16]
    assert (final_params(run.run_dir) - one_process).abs().max().item() <= 1e-5
    steps = step_rows(run)
    assert steps.groupby("worker")["samples"].unique().map(list).to_dict() == {0: [24], 1: [24], 2: [8], 3: [8]}
    first = [s for s in cut_samples_seen(steps, config) if s[0] == 0]
    assert len(first) == len(set(first)) == 22 * 64


def test_balanced_cut_replicas_move_their_shares_mid_epoch_and_equal_one_process(tmp_path, one_process, monkeypatch):
    """--balance speed across R = 2 replicas of D = 2 FSDP workers: the driver's per-replica balancer (in
    this process; shares in units of D = 2 samples) is made to move the shares at segment starts inside
    the first epoch, 32/32 -> 48/16 (step 4) -> 20/44 (step 12) -> 40/24 (step 16), as measured speeds
    would. After 30 momentum-SGD steps the model equals one process at 64; every worker's row records
    its replica's share, and rebuilt from them every step's parts tile its 64 samples, each sample once."""
    from distrain.orchestrator.pipeline_balance import PipelineShareBalancer

    plan = {0: (16, 16), 1: (24, 8), 2: (24, 8), 3: (10, 22)}  # the k-th decision, units of 2 samples; then 20/12
    monkeypatch.setattr(PipelineShareBalancer, "proposal", lambda self: plan.get(len(self.decided), (20, 12)))
    config = cfg(tmp_path, "cut-balanced", balance="speed", **CUT)
    run = run_training(config)
    assert run.summary["steps_completed"] == STEPS and run.summary["worker_shares"] == [40, 24]
    assert [m["step"] for m in run.summary["balance"]["moves"]] == [4, 12, 16]
    assert (final_params(run.run_dir) - one_process).abs().max().item() <= 1e-5
    steps = step_rows(run)
    by_step = steps.pivot_table(index="step", columns="replica", values="replica_samples")
    expected = {0: (32, 32), 4: (48, 16), 12: (20, 44), 16: (40, 24)}
    for step, row in by_step.iterrows():
        assert (row[0], row[1]) == expected[max(k for k in expected if k <= step)], (step, row)
    first = [s for s in cut_samples_seen(steps, config) if s[0] == 0]
    assert len(first) == len(set(first)) == 22 * 64


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(dict(strategy="local-sgd", tau=3), id="local-sgd"),
        pytest.param(dict(strategy="diloco", sync_every=3), id="diloco"),  # outer Nesterov, its defaults
        # Streaming DiLoCo: each fragment weighted by the samples since its own last sync
        pytest.param(
            dict(strategy="diloco", sync_every=4, fragments=2, overlap_steps=1, mix_alpha=0.5), id="streaming-diloco"
        ),
    ],
)
def test_local_sgd_and_diloco_across_cut_replicas_weigh_by_samples_as_plain_replicas_do(tmp_path, strategy):
    """--worker-weights 3,1 across R = 2 replicas of D = 2 FSDP workers equals the same weights over two
    plain replicas at twice the batch (b = 48 and 16 either way: the same samples per replica): each
    round's parts of θ's change and momentum (local SGD), each outer step's parts of the pseudo-gradient
    (DiLoCo), are weighted by the samples the replica took, as the plain replicas' whole ones are."""
    short = dict(max_steps=9, worker_weights="3,1", **strategy)
    plain = run_training(cfg(tmp_path, "plain", workers=2, batch_size=32, **short))
    cut = run_training(cfg(tmp_path, "cut", **CUT, **short))
    assert cut.summary["worker_shares"] == plain.summary["worker_shares"] == [48, 16]
    assert (final_params(cut.run_dir) - final_params(plain.run_dir)).abs().max().item() <= 1e-5
    assert step_rows(cut).groupby("replica")["replica_samples"].unique().map(list).to_dict() == {0: [48], 1: [16]}


def test_a_slow_cut_replica_is_measured_and_given_less(tmp_path, one_process):
    """--balance speed across R = 2 replicas of D = 2 FSDP workers, actor 2 (replica 1's first worker)
    computing 6x slower: a replica's workers leave each step together, so the compute times the balancer
    reads are each replica's own (without that, replica 0's second worker waited for the slow replica
    inside its next forward and both replicas measured alike: no move). The balancer moves replica 1's
    share below half inside the first epoch, in units of D = 2, and the run still equals one process at
    64 and sees each sample of the epoch once."""
    config = cfg(tmp_path, "cut-slow", balance="speed", straggler=["2:x6"], **CUT)
    run = run_training(config)
    moves = run.summary["balance"]["moves"]
    assert moves and moves[0]["step"] < 22 and moves[0]["shares"][1] < 32, moves
    assert all(b % 2 == 0 for m in moves for b in m["shares"]) and run.summary["worker_shares"] == moves[-1]["shares"]
    steps = step_rows(run)
    first = [s for s in cut_samples_seen(steps, config) if s[0] == 0]
    assert len(first) == len(set(first)) == 22 * 64
    assert (final_params(run.run_dir) - one_process).abs().max().item() <= 1e-5


RANGE_CUT = dict(workers="1..2", fsdp=2, batch_size=16)  # up to 2 replicas of D = 2 FSDP workers: B = 64


def range_cut_samples_seen(steps: pd.DataFrame, config: RunConfig) -> list[tuple[int, int]]:
    """Every (epoch, sample) cut replicas under a range (MAX = 2 of D = 2) trained on, rebuilt from their
    rows: at each step the member replicas' shares (`replica_samples`, 0 for a slot with no member) sum to
    the global batch, and each worker's part (its row's slice: slot x D + d, b_r / D samples) of those
    shares, in slice order, tiles exactly the step's samples of the epoch."""
    train = task_splits(build_task(config), config.val_fraction).train
    sharder = EpochSharder(len(train), config.global_batch_size, config.seed)
    seen = []
    for (step, epoch), rows in steps.groupby(["step", "epoch"]):
        rows = rows.sort_values("slice")
        assert rows["slice"].tolist() == [int(w) for w in rows["worker"]]  # (T = 1: worker a reads slice a)
        shares = [0, 0]
        for replica, b in rows.groupby("replica")["replica_samples"]:
            shares[int(replica)] = int(b.unique().item())
        assert sum(shares) == config.global_batch_size and all(b % 2 == 0 for b in shares), (step, shares)
        within = step - epoch * sharder.steps_per_epoch
        parts = [sharder.worker_indices(epoch, within, int(s), 4, tuple(shares), cut=2) for s in rows["slice"]]
        assert [len(p) for p in parts] == rows["samples"].tolist()
        assert np.array_equal(np.concatenate(parts), sharder.global_batch_indices(epoch, within))
        seen += [(epoch, int(i)) for p in parts for i in p]
    return seen


class PaceUntilJoinedAfter(Callback):
    """Blocks run faster than a replica's workers are built: between blocks (the first `on_rows` call of each,
    `BlockStarts`) the driver is held `pause_s` until a worker of `ranks` has trained at step `at` or later."""

    def __init__(self, ranks, at: int, pause_s: float) -> None:
        self.ranks, self.at, self.pause_s = set(ranks), at, pause_s
        self.joined, self.starts = False, BlockStarts()

    def on_rows(self, rows):
        if self.starts.first(rows) and self.starts.blocks and not self.joined:
            time.sleep(self.pause_s)
        self.joined = self.joined or any(
            w in self.ranks and step >= self.at for w, step in zip(rows["worker"], rows["step"], strict=True)
        )


def test_a_slow_cut_replica_under_a_range_leaves_rejoins_at_the_mean_is_given_less_and_equals_one_process(
    tmp_path, one_process
):
    """--workers 1..2 --fsdp 2 --balance speed --straggler 2:x6 (replica 1's first worker 6x slower), --chaos
    kill-worker@2:3: the balancer's slots are the replicas, their shares whole units of D = 2 samples, every
    step a whole B = 64 cut among the member replicas. Replica 1 leaves at step 2 (its share goes to replica
    0: 64/0), is placed again and joins at the mean share (32/32; had it not been a member yet, its first
    join is that one), and the balancer then moves its share below half. Each replica's mean gradient is
    weighted by its share across the replicas, so after 30 steps the run equals one process at 64, and
    rebuilt from the rows' parts each sample of the epoch is seen once."""
    config = cfg(
        tmp_path, "cut-range-slow", balance="speed", straggler=["2:x6"], segment_steps=2, chaos=["kill-worker@2:3"],
        hang_timeout_s=300.0, collective_timeout_s=60.0, **RANGE_CUT,
    )  # fmt: skip
    # Blocks run faster than a replica's workers are built: held 3 s a block until replica 1 trained again.
    run = run_training(config, callbacks=[PaceUntilJoinedAfter({2, 3}, at=2, pause_s=3.0)])
    assert run.summary["steps_completed"] == STEPS
    moves = run.summary["balance"]["moves"]
    assert all(b % 2 == 0 for m in moves for b in m["shares"]) and run.summary["worker_shares"][1] < 32, moves
    events = run.summary["membership"]["events"]
    if any(e["change"] == "leave" for e in events):  # (a member at step 2: it left, its share to replica 0)
        assert {"step": 2, "shares": [64, 0], "joined": []} in moves, moves
    joins = [m for m in moves if m.get("joined")]
    assert joins and all(m["joined"] == [1] and m["shares"] == [32, 32] for m in joins), moves  # at the mean
    steps = step_rows(run)
    # each replica's share: its D = 2 workers' parts summed (from `samples`, not the balancer's books)
    per_replica = steps.groupby(["step", "replica"])["samples"].sum().unstack(fill_value=0)
    assert (per_replica.sum(axis=1) == 64).all() and per_replica.iloc[:, 1].min() < 32, per_replica
    first = [s for s in range_cut_samples_seen(steps, config) if s[0] == 0]
    assert len(first) == len(set(first)) == 22 * 64
    assert (final_params(run.run_dir) - one_process).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    ("strategy", "reference"),
    [
        pytest.param(dict(strategy="local-sgd", tau=1), dict(), id="local-sgd"),
        pytest.param(
            dict(strategy="diloco", sync_every=1, outer_lr=1.0, outer_momentum=0.0, momentum=0.0),
            dict(momentum=0.0),
            id="diloco",
        ),
    ],
)
def test_local_sgd_and_diloco_across_cut_replicas_take_balanced_shares_under_a_range(
    tmp_path, one_process, monkeypatch, strategy, reference
):
    """--workers 2..4 --fsdp 2 --balance speed under local SGD (τ = 1) and DiLoCo (H = 1, plain inner SGD, outer
    SGD at lr 1), room for 2 replicas of the 4 (2 CPUs a worker; B = 4 x 2 x 8 = 64): every round is a whole
    step of 64 cut among the member replicas in units of D = 2 samples; each replica's part of the block's
    average (θ's change and momentum; the pseudo-gradient) is weighted by the samples it took in the block, at
    the unscaled rate. The driver's balancer is made to cut 20/12 units (40/24 samples) once both replicas
    are members, so the run is one process at 64 (unweighted, or at the members' scaled rate, it would not
    be)."""
    from distrain.orchestrator.elastic_balance import ElasticShareBalancer

    unequal = lambda self: (20, 12) if len(self.members) == 2 else self.current  # noqa: E731
    monkeypatch.setattr(ElasticShareBalancer, "proposal", unequal)
    config = cfg(
        tmp_path, "cut-range", workers="2..4", fsdp=2, batch_size=8, cpus_per_worker=2, balance="speed", **strategy
    )
    run = run_training(config)
    assert run.summary["steps_completed"] == STEPS
    steps = step_rows(run)
    shares = steps.groupby("replica")["replica_samples"].unique().map(set).to_dict()
    assert sorted(map(sorted, shares.values())) == [[24], [40]], shares
    assert [b for b in run.summary["worker_shares"] if b] == [40, 24]
    assert (steps.groupby("step")["samples"].sum() == 64).all()
    one = cfg(tmp_path, "one", workers=1, batch_size=64, **reference)
    alone = final_params(run_training(one).run_dir) if reference else one_process
    diff = (final_params(run.run_dir) - alone).abs()
    assert diff.max().item() <= 2e-4 and diff.mean().item() <= 2e-6, (diff.max().item(), diff.mean().item())
