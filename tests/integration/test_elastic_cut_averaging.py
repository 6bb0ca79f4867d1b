"""Elastic local SGD and DiLoCo across cut replicas (`--fsdp 2` or `--tensor-parallel 2`, `--workers 2..3`,
strategies/elastic_cut.py; issue 28), on the shared local Ray (8 CPUs). The kill runs once, under DiLoCo (CI
time: most of it is the replica's workers built twice); the block logic it exercises (`ElasticCutBlocks`:
local steps, undo and redo, the round's weighted sum, the re-form's copy) is the same code under local SGD,
whose own piece a joiner takes (its books) is tested without Ray in tests/unit/test_elastic_cut_blocks.py,
with DiLoCo's round and outer state.

- A range whose membership never changes (--cpus-per-worker 2: room for MIN = 2 replicas of 2 workers, the
  third replica's group stays pending) equals plain elastic replicas at the same replica batch under the same
  range (--cpus-per-worker 4): the same rounds of R' x D units out of MAX x D a step, the same rate, the same
  blocks and averages (epoch ends and a partial last round, where a whole replica sits out, included). D = 2
  (each worker at half the plain batch) for both; T = 2 (the mlp's plan, its 2 workers sharing each unit) for
  DiLoCo, whose round averages worker t's part with worker t of the other replica.
- DiLoCo at T = 2 under fp16, a loss that overflows the starting scale for 3 steps: the range equals the fixed
  run of its members, the same steps skipped by every member alike.
- DiLoCo with the cnn's hybrid plan at T = 2 (each tensor-parallel worker dealt its own unit): the range equals
  the fixed run of its members, every (epoch, step, slice) trained once by one worker.
- DiLoCo: --chaos kill-worker of one worker of the third replica: its replica leaves whole (a shrink, not a
  failure), the survivors undo the block and redo it, and its slot's group is placed again: a replica joins
  and takes worker d's pieces (parameters, inner and DiLoCo's outer optimizer state) from a live replica's
  worker d. Every (epoch, step, slice) has exactly one row."""

from __future__ import annotations

import time

import pandas as pd
import pytest

import distrain
from distrain.config import RunConfig
from distrain.orchestrator.callbacks import Callback
from distrain.orchestrator.run import run_training
from tests.helpers import LoudDigits, final_params

pytestmark = pytest.mark.usefixtures("ray_cluster")
TOL = 1e-5
OPTIONS = {"local-sgd": dict(tau=2), "diloco": dict(sync_every=2)}
BASE = dict(model="mlp", epochs=2, max_steps=8, seed=3, eval_every=0, optimizer="sgd", momentum=0.9, lr=0.05)


def cfg(tmp_path, name: str, strategy: str, **kw) -> RunConfig:
    return RunConfig(**(BASE | OPTIONS[strategy] | {"strategy": strategy, "run_dir": str(tmp_path / name)} | kw))


def step_rows(run_dir) -> pd.DataFrame:
    rows = pd.read_parquet(f"{run_dir}/metrics.parquet")
    return rows[rows["kind"] == "step"]


# A replica of 2 workers, 2 CPUs each: --fsdp 2 (D = 2 data-parallel ranks, each at half the plain batch) or
# --tensor-parallel 2 (the mlp's plan: one data-parallel rank whose T = 2 workers share the plain batch).
LAYOUTS = {"fsdp": dict(fsdp=2, batch_size=8), "tp": dict(tensor_parallel=2, batch_size=16)}


@pytest.mark.parametrize(("strategy", "layouts"), [("local-sgd", ["fsdp"]), ("diloco", ["fsdp", "tp"])])
def test_a_range_that_never_changes_equals_plain_replicas_at_the_same_batch(tmp_path, strategy, layouts):
    common = dict(workers="2..3", hang_timeout_s=300.0, collective_timeout_s=60.0)
    plain = run_training(cfg(tmp_path, "plain", strategy, batch_size=16, cpus_per_worker=4, **common))
    assert plain.summary["status"] == "completed" and plain.summary["membership"]["peak_members"] == 2
    for name in layouts:  # a few seconds each once Ray's workers are warm
        layout = LAYOUTS[name]
        cut = run_training(cfg(tmp_path, name, strategy, cpus_per_worker=2, **layout, **common))
        assert cut.summary["status"] == "completed" and cut.summary["membership"]["peak_members"] == 4
        gap = (final_params(cut.run_dir) - final_params(plain.run_dir)).abs().max().item()
        assert gap <= TOL, (name, gap)
        rows = step_rows(cut.run_dir)
        units = rows.groupby(["epoch", "step", "slice"]).size()
        # MAX x D slices a step, each once, by its data-parallel rank's T workers together (a row each)
        d, t = layout.get("fsdp", 1), layout.get("tensor_parallel", 1)
        assert len(units) == 8 * 3 * d and (units == t).all(), name


class _LoudForThreeSteps(LoudDigits):
    """LoudDigits' loss / 2**8: fp16's starting scale 2**16 overflows its backward for the first 3 steps (11
    under LoudDigits' own)."""

    def criterion(self, output, batch):
        return super().criterion(output, batch) / 2**8


def test_a_tensor_parallel_diloco_range_in_fp16_equals_the_fixed_run_of_its_members(tmp_path):
    """--tensor-parallel 2 --precision fp16 with a loss whose backward overflows fp16's starting scale for the
    first rounds: the range, MIN = 2 replicas placed and the third never, deals a step's MAX = 3 units 2 a
    round in order, so its 4 steps are the fixed run's 6 sample for sample (--lr-scaling none), the same
    overflows skipped by every member alike (the scale halved alike) and the same blocks of H = 2 rounds."""
    small = dict(
        strategy="diloco", sync_every=2, tensor_parallel=2, batch_size=16, lr_scaling="none", precision="fp16",
        seed=3, epochs=1, eval_every=0, optimizer="sgd", momentum=0.9, lr=1e-3, progress=False,
    )  # fmt: skip
    elastic = distrain.fit(
        _LoudForThreeSteps, workers="2..3", cpus_per_worker=2.0, max_steps=4, hang_timeout_s=300.0,
        collective_timeout_s=60.0, run_dir=str(tmp_path / "e"), **small,
    ).summary  # fmt: skip
    fixed = distrain.fit(_LoudForThreeSteps, workers=2, max_steps=6, run_dir=str(tmp_path / "f"), **small).summary
    assert elastic["status"] == fixed["status"] == "completed"
    assert elastic["membership"]["peak_members"] == 4
    gap = (final_params(tmp_path / "e") - final_params(tmp_path / "f")).abs().max().item()
    assert gap <= TOL, gap
    skipped = [step_rows(tmp_path / run)["overflow"].fillna(False).astype(bool).sum() for run in ("e", "f")]
    # 3 rounds of 2 members x T rows, as the fixed run's 3 steps of 2 replicas x T; then 12 rows trained
    assert skipped[0] == skipped[1] == 12, skipped


def test_a_hybrid_diloco_range_equals_the_fixed_run_of_its_members(tmp_path):
    """The cnn's hybrid plan at T = 2 (each tensor-parallel worker on its own unit): MIN = 2 replicas placed,
    the third never; a step is MAX x T = 6 slices, dealt 4 a round in order (one per worker), so the range's
    4 steps are the fixed run's 6 sample for sample (--lr-scaling none), each replica's inner step counting
    its 2 workers' units and the round averaging worker t's part with worker t of the other replica."""
    small = dict(
        strategy="diloco", sync_every=2, tensor_parallel=2, batch_size=16, lr_scaling="none", seed=3, epochs=1,
        eval_every=0, optimizer="sgd", momentum=0.9, lr=0.05, model="cnn",
    )  # fmt: skip
    elastic = run_training(
        RunConfig(workers="2..3", cpus_per_worker=2.0, max_steps=4, hang_timeout_s=300.0, collective_timeout_s=60.0,
                  run_dir=str(tmp_path / "e"), **small)
    ).summary  # fmt: skip
    fixed = run_training(RunConfig(workers=2, max_steps=6, run_dir=str(tmp_path / "f"), **small)).summary
    assert elastic["status"] == fixed["status"] == "completed"
    assert elastic["membership"]["peak_members"] == 4
    gap = (final_params(tmp_path / "e") - final_params(tmp_path / "f")).abs().max().item()
    assert gap <= TOL, gap
    units = step_rows(tmp_path / "e").groupby(["epoch", "step", "slice"]).size()
    assert len(units) == 4 * 6 and (units == 1).all()  # MAX x T slices a step, each once, by one worker


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
