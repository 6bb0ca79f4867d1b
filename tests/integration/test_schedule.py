"""--schedule: strategies switch at epoch marks on the same workers, and the state crosses bit for bit.

Each switch keeps the state it handed over as checkpoints/switch-EPOCH.pt. Two facts pin the switch:
the handed-over state is exactly what the first phase alone ends with, and the rest of the schedule
run is exactly a fresh run of the next strategy started from that state (`--init-from`), so nothing
was lost or changed on the way into the new transport.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from distrain.config import RunConfig
from distrain.orchestrator.checkpoint import load_checkpoint
from distrain.orchestrator.run import run_training
from tests.helpers import final_params

pytestmark = pytest.mark.usefixtures("ray_cluster")


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    base = dict(workers=2, seed=7, segment_steps=11, eval_every=0, run_dir=str(tmp_path / name))
    return RunConfig(**(base | kw))


def assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    va, vb = a["optimizer"]["vectors"], b["optimizer"]["vectors"]
    assert va.keys() == vb.keys() and va  # momentum buffers exist and cross too
    for key in va:
        assert torch.equal(va[key], vb[key]), key


def test_bsp_then_local_sgd_hands_over_the_exact_state(tmp_path):
    sched = run_training(cfg(tmp_path, "sched", schedule="bsp:1,local-sgd", tau=4, epochs=2))
    first = run_training(cfg(tmp_path, "bsp-only", epochs=1))
    handed = load_checkpoint(sched.run_dir / "checkpoints" / "switch-0001.pt")
    assert_same_state(handed, load_checkpoint(first.run_dir / "checkpoints" / "final.pt"))
    rest = run_training(
        cfg(
            tmp_path,
            "rest",
            strategy="local-sgd",
            tau=4,
            epochs=2,
            init_from=str(sched.run_dir / "checkpoints" / "switch-0001.pt"),
        )
    )
    assert torch.equal(final_params(sched.run_dir), final_params(rest.run_dir))
    assert [p["strategy"] for p in sched.summary["phases"]] == ["bsp", "local-sgd"]
    df = pd.read_parquet(sched.run_dir / "metrics.parquet")
    steps = df[df["kind"] == "step"]
    spe = sched.summary["phases"][1]["start_step"]
    assert steps[steps["step"] < spe]["tau"].isna().all() and (steps[steps["step"] >= spe]["tau"] == 4).all()


def test_ssp_then_bsp_moves_the_state_out_of_the_parameter_server_and_learns_digits(tmp_path):
    sched = run_training(cfg(tmp_path, "sched", schedule="ssp:1,bsp", epochs=6, eval_every=6))
    assert [(p["strategy"], p["transport"]) for p in sched.summary["phases"]] == [("ssp", "ps"), ("bsp", "collective")]
    switch = sched.run_dir / "checkpoints" / "switch-0001.pt"
    rest = run_training(cfg(tmp_path, "rest", epochs=6, eval_every=6, init_from=str(switch)))
    assert torch.equal(final_params(sched.run_dir), final_params(rest.run_dir))
    df = pd.read_parquet(sched.run_dir / "metrics.parquet")
    steps = df[df["kind"] == "step"]
    spe = sched.summary["phases"][1]["start_step"]
    assert steps[steps["step"] < spe]["staleness"].notna().all()  # the first epoch ran on the shards
    assert steps[steps["step"] >= spe]["staleness"].isna().all()
    assert sched.summary["final_test_accuracy"] >= 0.95
