"""Elastic local SGD and DiLoCo across cut replicas (`--fsdp 2 --workers 2..3`, strategies/elastic_cut.py;
issue 28), on the shared local Ray (8 CPUs). The kill runs once, under DiLoCo (CI time: most of it is the
replica's workers built twice); the block logic it exercises (`ElasticCutBlocks`: local steps, undo and redo,
the round's weighted sum, the re-form's copy) is the same code under local SGD, whose own piece a joiner takes
(its books) is tested without Ray in tests/unit/test_elastic_cut_blocks.py, with DiLoCo's round and outer state.

- A range whose membership never changes (--cpus-per-worker 2: room for MIN = 2 replicas of 2 workers, the
  third replica's group stays pending) equals plain elastic replicas at twice the batch under the same range
  (--cpus-per-worker 4): the same rounds of R' x D units out of MAX x D a step, the same rate, the same blocks
  and averages (epoch ends and a partial last round, where a whole replica sits out, included).
- DiLoCo: --chaos kill-worker of one worker of the third replica: its replica leaves whole (a shrink, not a
  failure), the survivors undo the block and redo it, and its slot's group is placed again: a replica joins
  and takes worker d's pieces (parameters, inner and DiLoCo's outer optimizer state) from a live replica's
  worker d. Every (epoch, step, slice) has exactly one row."""

from __future__ import annotations

import time

import pandas as pd
import pytest

from distrain.config import RunConfig
from distrain.orchestrator.callbacks import Callback
from distrain.orchestrator.run import run_training
from tests.helpers import final_params

pytestmark = pytest.mark.usefixtures("ray_cluster")
TOL = 1e-5
OPTIONS = {"local-sgd": dict(tau=2), "diloco": dict(sync_every=2)}
BASE = dict(model="mlp", epochs=2, max_steps=8, seed=3, eval_every=0, optimizer="sgd", momentum=0.9, lr=0.05)


def cfg(tmp_path, name: str, strategy: str, **kw) -> RunConfig:
    return RunConfig(**(BASE | OPTIONS[strategy] | {"strategy": strategy, "run_dir": str(tmp_path / name)} | kw))


def step_rows(run_dir) -> pd.DataFrame:
    rows = pd.read_parquet(f"{run_dir}/metrics.parquet")
    return rows[rows["kind"] == "step"]


@pytest.mark.parametrize("strategy", ["local-sgd", "diloco"])  # a few seconds each once Ray's workers are warm
def test_a_range_that_never_changes_equals_plain_replicas_at_twice_the_batch(tmp_path, strategy):
    common = dict(workers="2..3", hang_timeout_s=300.0, collective_timeout_s=60.0)
    cut = run_training(cfg(tmp_path, "cut", strategy, fsdp=2, batch_size=8, cpus_per_worker=2, **common))
    plain = run_training(cfg(tmp_path, "plain", strategy, batch_size=16, cpus_per_worker=4, **common))
    for run in (cut, plain):
        assert run.summary["status"] == "completed" and run.summary["membership"]["peak_members"] == 2 * (
            2 if run is cut else 1
        )
    assert (final_params(cut.run_dir) - final_params(plain.run_dir)).abs().max().item() <= TOL
    rows = step_rows(cut.run_dir)
    units = rows.groupby(["epoch", "step", "slice"]).size()
    assert len(units) == 8 * 6 and (units == 1).all()  # MAX x D = 6 slices a step, each once


class _PaceUntilReplicaTwoTrains(Callback):
    """Blocks run faster than a replica's workers are built: until replica 2 (ranks 4, 5) has trained
    before the kill (at step 4) and again after it (it rejoined), slow the driver between blocks."""

    def __init__(self) -> None:
        self.latest, self.before, self.after = 0, False, False

    def on_rows(self, rows):
        self.latest = max([self.latest, *rows["step"]])
        mine = [step for worker, step in zip(rows["worker"], rows["step"], strict=True) if worker in (4, 5)]
        self.before = self.before or any(step < 4 for step in mine)
        self.after = self.after or any(step >= 4 for step in mine)
        if not self.before or (self.latest >= 4 and not self.after):
            time.sleep(1.0)  # a loaded box builds a replica's workers slowly


def test_a_killed_diloco_replica_leaves_and_rejoins_from_live_pieces_with_every_unit_once(tmp_path):
    strategy = "diloco"
    run = run_training(
        cfg(tmp_path, "r", strategy, fsdp=2, workers="2..3", batch_size=8, chaos=["kill-worker@4:5"],
            hang_timeout_s=300.0, collective_timeout_s=60.0),
        callbacks=[_PaceUntilReplicaTwoTrains()],
    )  # fmt: skip
    s = run.summary
    assert s["status"] == "completed" and s["failures"] == 0, s["failure_events"]
    assert [c["fired_step"] for c in s["chaos"]] == [4], s["chaos"]
    m = s["membership"]
    changes = [(e["change"], e["rank"], e["cause"]) for e in m["events"]]
    # Rank 5 lost takes its replica mate 4 with it; the slot's group is placed again and both rejoin.
    first = changes.index(("leave", 5, "worker lost"))
    assert ("leave", 4, "replica of 5 left (worker lost)") in changes[first:], changes
    assert {("join", 4, "placed"), ("join", 5, "placed")} <= set(changes[first + 1 :]), changes
    assert not [c for c in changes if c[2] == "restart"]
    # The re-form after the loss: the survivors, from one of them. The re-form with the rejoined replica:
    # its worker d's pieces are a survivor's worker d's (a copy of live pieces, not its own seeded start).
    shrink = next(r for r in m["reforms"] if r["cause"] == "resize" and sorted(r["members"]) == [0, 1, 2, 3])
    assert shrink["source"] in (0, 1, 2, 3)
    grow = next(r for r in m["reforms"] if r["step"] >= shrink["step"] and {4, 5} <= set(r["members"]))
    for joiner in (4, 5):
        live = {grow["before"][str(r)] for r in (0, 1, 2, 3) if r % 2 == joiner % 2}
        assert live == {grow["after"][str(joiner)]}, grow
    for reform in m["reforms"]:  # worker d's pieces equal on every replica after each re-form
        for d in (0, 1):
            assert len({reform["after"][str(r)] for r in reform["members"] if r % 2 == d}) == 1, reform
    rows = step_rows(run.run_dir)
    units = rows.groupby(["epoch", "step", "slice"]).size()
    assert len(units) == 8 * 6 and (units == 1).all()
    assert {4, 6} <= set(rows["members"])
