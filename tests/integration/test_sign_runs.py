"""`--compress sign` (added as compression/sign.py alone) on real runs: bsp, local-sgd, diloco and the
parameter server each put one bit a value (plus a scale) on the wire, say so in their rows, and train."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from distrain.config import RunConfig
from distrain.orchestrator.checkpoint import load_checkpoint
from distrain.orchestrator.run import run_training

pytestmark = pytest.mark.usefixtures("ray_cluster")

RUNS = [
    ("bsp", {}),
    ("local-sgd", dict(strategy="local-sgd", tau=4)),
    ("diloco", dict(strategy="diloco", sync_every=4)),
    ("async", dict(strategy="async", ps_shards=2)),
]


def sign_bytes(n: int) -> int:
    return math.ceil(n / 8) + 4  # the packed signs and one float32 scale


@pytest.mark.parametrize("name,kw", RUNS, ids=[n for n, _ in RUNS])
def test_sign_compression_runs_under_every_strategy_family(tmp_path, name, kw):
    base = dict(
        model="mlp", optimizer="sgd", momentum=0.0, lr=0.05, lr_scaling="none", epochs=2, max_steps=24, seed=5,
        workers=2, batch_size=16, segment_steps=8, eval_every=1, run_dir=str(tmp_path / name), compress="sign",
    )  # fmt: skip
    run = run_training(RunConfig(**(base | kw)))
    assert run.summary["compress"] == "sign" and math.isfinite(run.summary["final_test_loss"])
    shapes = [t.shape for t in load_checkpoint(run.run_dir / "checkpoints" / "final.pt")["model"].values()]
    n = sum(s.numel() for s in shapes)
    df = pd.read_parquet(run.run_dir / "metrics.parquet")
    rows = df[(df["kind"] == "step") & (df["bytes_sent"] > 0)]
    assert len(rows) > 0 and rows["bytes_uncompressed"].notna().all()
    if name == "async":  # each shard's slice encoded on its own: two scales, each slice's bits padded
        config = RunConfig.resolve(str(run.run_dir / "config.yaml"), {})
        assert config.ps_shards == 2
        assert (rows["bytes_sent"] <= sign_bytes(n) + 4 + 1).all() and (rows["bytes_sent"] >= sign_bytes(n)).all()
        assert (rows["bytes_uncompressed"] == 4 * n).all()
    else:
        # local-sgd: θ's change in sign, then its three statistics in float32 (plain SGD has no state vectors)
        extra = 4 * 3 if name == "local-sgd" else 0
        assert (rows["bytes_sent"] == sign_bytes(n) + extra).all(), rows["bytes_sent"].unique()
    assert run.summary["codec_ratio"] > 10
    assert torch.isfinite(torch.tensor(df[df["kind"] == "step"]["loss"].to_numpy())).all()
