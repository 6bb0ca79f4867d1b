"""A strategy written outside distrain (examples/strategies/easgd.py, copied to a temporary directory):
`--strategy path.py:EASGD` trains with its own flags, its own metric columns and summary figures, and
its own checkpointed state, which `--resume` restores; no distrain file knows about it."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import torch

from distrain.config import RunConfig
from tests.unit.test_strategy_plugin import EXAMPLE, invoke


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("mine") / "easgd.py"
    shutil.copy(EXAMPLE, path)
    return f"{path}:EASGD"








@pytest.mark.usefixtures("ray_cluster")
def test_a_plugin_strategy_trains_records_its_columns_and_resumes_its_state(plugin, tmp_path):
    run_dir = tmp_path / "run"
    common = ["--model", "mlp", "--segment-steps", "8"]
    first = invoke(["run", "--strategy", plugin, "--elasticity", "0.2", "--easgd-period", "4", "--epochs", "1",
                    "--run-dir", str(run_dir), *common])  # fmt: skip
    assert first.exit_code == 0, first.output
    steps = pd.read_parquet(run_dir / "metrics.parquet").query("kind == 'step'")
    rounds_after_one_epoch = int(steps["elastic_round"].max())
    assert rounds_after_one_epoch == -(-20 // 4)  # 20 steps an epoch: a round every 4, and one at its end
    assert steps["center_distance"].notna().sum() == 2 * rounds_after_one_epoch  # one per worker per round
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["elastic_rounds"] == rounds_after_one_epoch
    assert summary["final_test_accuracy"] > 0.8
    checkpoint = torch.load(run_dir / "checkpoints" / "final.pt", weights_only=False)
    assert checkpoint["strategy_state"]["state"]["rounds"] == rounds_after_one_epoch

    again = invoke(["run", "--resume", str(run_dir), "--epochs", "2"])  # the state goes on from the checkpoint
    assert again.exit_code == 0, again.output
    steps = pd.read_parquet(run_dir / "metrics.parquet").query("kind == 'step'")
    second = steps[steps["epoch"] == 1]
    assert int(second["elastic_round"].min()) == rounds_after_one_epoch  # not restarted at 0
    assert int(steps["elastic_round"].max()) == 2 * rounds_after_one_epoch
    assert steps[steps["epoch"] == 0]["elastic_round"].notna().all()  # the first epoch's rows kept their columns


@pytest.mark.usefixtures("ray_cluster")
def test_the_plugin_s_averaging_is_compressed_counted_and_delayed_by_the_channel(plugin, tmp_path):
    """easgd.py has no code for --compress, --comm-delay-ms or byte counts: its channel applies them."""
    import math

    from distrain.orchestrator.run import run_training

    delay_ms = 60.0
    config = RunConfig(
        strategy=plugin, elasticity=0.2, easgd_period=4, model="mlp", epochs=1, max_steps=8, segment_steps=8,
        eval_every=0, compress="int8", comm_delay_ms=delay_ms, run_dir=str(tmp_path / "easgd-int8"),
    )  # fmt: skip
    run = run_training(config)
    model = torch.load(run.run_dir / "checkpoints" / "final.pt", weights_only=False)["model"]
    n = sum(t.numel() for t in model.values())
    steps = pd.read_parquet(run.run_dir / "metrics.parquet").query("kind == 'step'")
    rounds = steps[steps["center_distance"].notna()]
    assert len(rounds) == 2 * 2  # steps 4 and 8, on both workers
    int8 = n + 4 * math.ceil(n / 1024)  # int8 values and one scale a chunk, all-gathered by 2 workers
    assert (rounds["bytes_sent"] == int8).all() and (rounds["bytes_uncompressed"] == 4 * n).all()
    assert (rounds["comm_s"] >= delay_ms / 1000).all()  # each round is one transfer on the emulated link
    others = steps[steps["center_distance"].isna()]
    assert (others["bytes_sent"] == 0).all() and (others["comm_s"] == 0).all()  # local steps: nothing sent
    assert run.summary["compress"] == "int8" and run.summary["codec_ratio"] == pytest.approx(4 * n / int8)
