"""`distrain plan` and `distrain run --strategy auto`: bad input, the plan's files from a saved calibration,
the record of an automatic choice; and one real plan on digits with a tiny calibration (integration)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from distrain.cli import app
from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.planning import auto_strategy, planner
from distrain.units import parse_duration, parse_flops, parse_worker_counts
from tests.unit.test_cli_errors import no_ray  # noqa: F401 - the fixture: fail if Ray would start

runner = CliRunner()


def _calibration(**changes) -> planner.Calibration:
    base = dict(
        task="mlp on digits", batch_size=32, num_params=85_002, compute_s=0.002, effective_cores=1.5,
        spread=[0.9, 1.0, 1.0, 1.1, 1.6], allreduce_latency_s=2e-4, allreduce_bandwidth=1e9, sync_scale=0.5,
        ps_call_s=3e-3, ps_bandwidth=5e8, ps_apply_s=1e-3, memory_per_worker=500 * 2**20,
        memory_per_shard=480 * 2**20, flops_per_sample=3e5,
    )  # fmt: skip
    return planner.Calibration(**(base | changes))


def test_worker_counts_and_units():
    assert parse_worker_counts("1,2,4,64,2") == [1, 2, 4, 64]
    for bad in ("", "0", "2,x", "1..4", "-1", "2,,4"):
        with pytest.raises(ConfigError, match="--workers"):
            parse_worker_counts(bad)
    assert parse_duration("50us") == pytest.approx(50e-6) and parse_duration("0.2ms") == pytest.approx(2e-4)
    assert parse_flops("300tflops") == 3e14
    with pytest.raises(ConfigError, match="--latency"):
        parse_duration("5 parsecs")


@pytest.mark.parametrize(
    "args, says",
    [
        (["--workers", "1,two"], "--workers"),
        (["--bandwidth", "fast"], "--bandwidth"),
        (["--bandwidth", "10gbit", "--latency", "soon"], "--latency"),
        (["--preset", "carrier-pigeon"], "--preset"),
        (["--latency", "5us"], "--bandwidth"),
        (["--gpu-flops", "lots", "--preset", "25gbe"], "--gpu-flops"),
        (["--calibration-steps", "2"], "--calibration-steps"),
        (["--calibration-repeats", "0"], "--calibration-repeats"),
        (["--calibration", "nowhere.json"], "--calibration"),
        (["--model", "no-such-model"], "model"),
        (["--worker-speeds", "1,0"], "--worker-speeds"),
    ],
)
@pytest.mark.usefixtures("no_ray")
def test_bad_plan_input_is_one_line_and_exit_2(args, says, tmp_path):
    result = runner.invoke(app, ["plan", "--out", str(tmp_path / "p"), *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "p").exists()


@pytest.mark.usefixtures("no_ray")
def test_plan_from_a_saved_calibration_writes_table_png_and_recommendation(tmp_path):
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"calibration": _calibration().to_dict()}))
    out = tmp_path / "plan"
    args = ["plan", "--workers", "1,2,8", "--calibration", str(saved), "--preset", "10gbe", "--out", str(out)]
    result = runner.invoke(app, [*args, "--worker-speeds", "1,1,0.5"])
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(out / "predictions.parquet")
    assert len(frame) == 2 * 3 * len(planner.CANDIDATES)  # here and 10gbe, 3 counts, every candidate
    assert set(frame["machine"]) == {"here", "10gbe"}
    # the table's figures are the model's
    cal = _calibration()
    row = frame[(frame.machine == "here") & (frame.strategy == "bsp") & (frame.transport == "collective")
                & (frame.workers == 8)].iloc[0]  # fmt: skip
    assert row["step_s"] == pytest.approx(planner.predict(cal, "bsp", "collective", 8).step_s)
    record = json.loads((out / "plan.json").read_text())
    assert record["calibration"] == cal.to_dict() and record["hardware"]["name"] == "10gbe"
    assert set(record["recommendations"]) == {"1", "2", "8"}
    assert (out / "plan.png").read_bytes()[:4] == b"\x89PNG"
    assert "recommended at N=8: --strategy" in result.output and "stragglers at N=8" in result.output
    # --worker-speeds: equal shares wait 2 x 2 ms for the half-speed worker; 39/38/19 take 39/32 x 2 ms
    assert "worker speeds 1,1,0.5: equal shares 32/32/32 take 4.0 ms" in result.output
    assert "b = 39/38/19: 2.4 ms, x1.64" in result.output


@pytest.mark.usefixtures("no_ray")
def test_a_run_configs_shares_do_not_stop_its_plan(tmp_path):
    """A YAML made for a run of unequal workers (--worker-weights 3,1 over 2 workers) plans as any other:
    plan calibrates one worker, and its --worker-speeds says what unequal workers would gain (before: "2
    weights for 1 workers")."""
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"calibration": _calibration().to_dict()}))
    yaml = tmp_path / "run.yaml"
    yaml.write_text('model: mlp\nworkers: 2\nworker_weights: "3,1"\nbalance: speed\n')
    args = ["plan", "--config", str(yaml), "--calibration", str(saved), "--worker-speeds", "3,1"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    assert "--worker-weights 3,1" in result.output and (tmp_path / "p" / "plan.json").exists()
    refused = runner.invoke(app, ["plan", "--worker-weights", "3,1", "--out", str(tmp_path / "q")])
    assert refused.exit_code == 2 and "No such option: --worker-weights" in refused.output  # --worker-speeds


@pytest.mark.usefixtures("no_ray")
def test_plan_takes_the_runs_compress_and_emulated_link(tmp_path):
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"calibration": _calibration().to_dict()}))  # mlp on digits, 85,002 parameters
    flags = ["--model", "mlp", "--compress", "int8", "--comm-delay-ms", "5", "--comm-bandwidth", "100mbit"]
    out = tmp_path / "plan"
    result = runner.invoke(app, ["plan", "--workers", "2,4", "--calibration", str(saved), *flags, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "--compress int8" in result.output and "emulated link: 5 ms per transfer + 12.5 MB/s" in result.output
    cal = planner.Calibration.from_dict(json.loads((out / "plan.json").read_text())["calibration"])
    assert cal.codec == "int8" and cal.link_latency_s == 0.005 and cal.link_bandwidth == 12.5e6
    frame = pd.read_parquet(out / "predictions.parquet").set_index(["strategy", "transport", "workers"])
    plain = _calibration()
    for key in (("bsp", "collective", 4), ("async", "ps", 2)):
        row = frame.loc[key]
        assert row["bytes_per_worker"] < planner.predict(plain, key[0], key[1], key[2]).bytes_per_worker
        assert row["step_s"] == pytest.approx(planner.predict(cal, key[0], key[1], key[2]).step_s)
        assert row["comm_s"] >= 0.005  # at least one emulated delay per synchronisation
    result = runner.invoke(app, ["plan", "--calibration", str(saved), "--compress", "zstd", "--out", str(out) + "2"])
    assert result.exit_code == 2 and "unknown codec 'zstd'" in result.output  # the run's own check, one line


def test_an_automatic_choice_is_recorded_so_config_repeats_it(tmp_path):
    from distrain.orchestrator.run import preflight

    choice = {
        "requested": "auto", "strategy": "local-sgd", "transport": "collective", "settings": {"tau": 6},
        "reason": "communication is 40% of a BSP step", "workers": 2,
        "predicted": {"step_s": 0.01}, "calibration": {},
    }  # fmt: skip
    run_dir = tmp_path / "run"
    cfg = RunConfig(strategy="local-sgd", tau=6, workers=2, model="mlp", run_dir=str(run_dir))
    plan = preflight(cfg, auto=choice)
    text = (plan.run_dir / "config.yaml").read_text()
    assert text.startswith("# --strategy auto chose local-sgd (collective) --tau 6\n# because communication")
    repeated = RunConfig.resolve(str(plan.run_dir / "config.yaml"), {"run_dir": ""})
    # --config repeats the concrete choice
    assert repeated.strategy == "local-sgd" and repeated.options_of("local-sgd").tau == 6
    assert auto_strategy.recorded_strategy(plan.run_dir) == "local-sgd"  # what --resume --strategy auto compares
    assert auto_strategy.recorded_choice(plan.run_dir) == choice
    assert auto_strategy.summary_entry(choice)["predicted_step_s"] == 0.01
    plan.claim.release()


def test_a_resume_with_strategy_auto_means_the_runs_own_choice(tmp_path):
    header = "# --strategy auto chose local-sgd (collective) --tau 6\n"
    (tmp_path / "config.yaml").write_text(header + "strategy: local-sgd\n")
    assert auto_strategy.resumed_values(tmp_path, {"strategy": "auto", "epochs": 3}) == {
        "strategy": "local-sgd", "epochs": 3,
    }  # fmt: skip
    assert auto_strategy.resumed_values(tmp_path, {"epochs": 3}) == {"epochs": 3}  # no strategy asked: as given
    assert auto_strategy.requested({"strategy": "auto"}, None)
    assert not auto_strategy.requested({"strategy": "bsp"}, None)


def test_run_strategy_auto_runs_the_concrete_choice(tmp_path, monkeypatch):
    from distrain.orchestrator import run as run_module

    seen = {}

    def fake_choose(values, config_file, task_object=None):
        seen["asked"] = values["strategy"]
        record = {"strategy": "ssp", "transport": "ps", "reason": "stragglers", "settings": {}}
        return {"strategy": "ssp", "transport": "ps", "staleness": 2}, record

    class Stop(Exception):
        pass

    def fake_run(cfg, on_event=None, auto=None, **kwargs):
        seen["cfg"], seen["auto"] = cfg, auto
        raise Stop

    monkeypatch.setattr(auto_strategy, "choose", fake_choose)
    monkeypatch.setattr(run_module, "run_training", fake_run)
    result = runner.invoke(app, ["run", "--strategy", "auto", "--workers", "2", "--run-dir", str(tmp_path / "r")])
    assert isinstance(result.exception, Stop)
    assert seen["asked"] == "auto" and seen["cfg"].strategy == "ssp" and seen["cfg"].options_of("ssp").staleness == 2
    assert seen["auto"]["reason"] == "stragglers"






def test_report_sets_the_prediction_against_the_measured_steady_step(tmp_path):
    from distrain.reporting.prediction import prediction_rows, prediction_section
    from distrain.reporting.report import Run

    # two workers, 20 steps each, 10 ms apart after a slow first step: the steady step is 10 ms
    rows = [
        {"kind": "step", "worker": w, "step": i, "wall_time": (0.5 if i > 0 else 0.0) + 1.0 + i * 0.01,
         "compute_s": 0.004}
        for w in (0, 1) for i in range(20)
    ]  # fmt: skip
    metrics = pd.DataFrame(rows)
    with_prediction = tmp_path / "auto"
    with_prediction.mkdir()
    choice = {
        "strategy": "bsp",
        "transport": "collective",
        "settings": {},
        "reason": "r",
        "predicted": {"step_s": 0.012},
    }
    auto_strategy.write_choice(with_prediction, choice)
    without = tmp_path / "plain"
    without.mkdir()
    runs = [Run(with_prediction, "auto", {}, {}, metrics), Run(without, "plain", {}, {}, metrics)]
    assert prediction_rows(runs) == [["auto", "bsp", "12.00", "10.00", "+20%"]]
    assert "Predicted against measured" in prediction_section(runs)
    assert prediction_section(runs[1:]) == ""
