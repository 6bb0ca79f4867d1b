"""The planner across cut replicas (planning/layout_model.py, layout_figures.py): FSDP's and tensor
parallelism's traffic per worker, compute that FSDP does not split and TP splits, memory, the layouts
proposed when one worker cannot hold the model, the choice among them, `distrain plan`'s layout column and
`--strategy auto` choosing a layout."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from distrain.cli import app
from distrain.config import RunConfig
from distrain.orchestrator import memory
from distrain.planning import auto_strategy, calibrate, planner
from distrain.planning.layout_figures import layout_of, model_figures, planned_layouts
from distrain.planning.layout_model import Layout, layout_scale_of, predict_layout, recommend_among, recommend_layout
from distrain.planning.planner import Calibration, Hardware
from tests.unit.test_cli_errors import no_ray  # noqa: F401 - the fixture: fail if Ray would start
from tests.unit.test_plan_traffic import loopback  # noqa: F401 - the fixture: collectives without a group

WIDE = str(Path(__file__).parents[1] / "pipeline_task.py") + ":WideMLP"
P = 120_000  # parameter values: divisible by every D below
LINK = Hardware("link", bandwidth=1e9, latency_s=0.0)  # no contention, no latency: bytes alone


def _cal(**changes) -> Calibration:
    base = dict(
        task="mlp on digits", batch_size=32, num_params=P, compute_s=0.01, effective_cores=2.0,
        spread=[1.0] * 10, allreduce_latency_s=1e-4, allreduce_bandwidth=1e9, sync_scale=1.0,
        ps_call_s=2e-3, ps_bandwidth=1e9, ps_apply_s=5e-4, memory_per_worker=500 * 2**20,
        memory_per_shard=480 * 2**20,
    )  # fmt: skip
    return Calibration(**(base | changes))


def _sent(replicas: int, **layout) -> float:
    return predict_layout(_cal(), "bsp", replicas, Layout(held_params=P, **layout), LINK).bytes_per_worker


def test_fsdp_traffic_is_three_gathers_worth_and_two_without_reshard_against_ddps_two():
    n = P * 4
    assert _sent(1, fsdp=4) == pytest.approx(3 * 3 / 4 * n)  # all-gather forward and backward, reduce-scatter
    assert _sent(1, fsdp=4, reshard_after_forward=False) == pytest.approx(2 * 3 / 4 * n)
    plain = planner.predict(_cal(), "bsp", "collective", 4, LINK).bytes_per_worker
    assert plain == pytest.approx(2 * 3 / 4 * n)  # DDP's ring: what FSDP without reshard moves too
    # HSDP: the shard's all-reduce across R replicas adds 2(R-1)/R x P/D
    assert _sent(2, fsdp=4) - _sent(1, fsdp=4) == pytest.approx(2 * 1 / 2 * n / 4)
    assert _sent(4, fsdp=2) - _sent(1, fsdp=2) == pytest.approx(2 * 3 / 4 * n / 2)


def test_tensor_parallelism_all_reduces_its_activations_and_splits_only_the_planned_compute():
    cut = Layout(tensor_parallel=4, held_params=P, tp_activation_values=300, tp_all_reduces=2, split_share=0.6)
    p = predict_layout(_cal(), "bsp", 1, cut, LINK)
    assert p.bytes_per_worker == pytest.approx(2 * 3 / 4 * 300 * 32 * 4)  # D = 1: no FSDP traffic at all
    assert p.compute_s == pytest.approx(0.01 * (0.4 + 0.6 / 4))
    assert p.comm_s == pytest.approx(p.bytes_per_worker / 1e9)  # on the critical path, never hidden
    # FSDP splits no compute: each rank computes its own B samples, and the global batch grows D-fold
    d4 = predict_layout(_cal(), "bsp", 2, Layout(fsdp=4, held_params=P), LINK)
    assert d4.compute_s == pytest.approx(0.01)
    assert d4.samples_per_s == pytest.approx(2 * 4 * 32 / d4.step_s)
    assert d4.layout == "2 replicas x 4 shards" and d4.row()["layout"] == d4.layout


def test_latency_counts_each_units_collectives_and_this_machine_stretches_them():
    no_bytes = Hardware("lat", bandwidth=1e30, latency_s=1e-3)
    cal = _cal(compute_s=0.0)
    p = predict_layout(cal, "bsp", 2, Layout(fsdp=3, units=2, held_params=P), no_bytes)
    # per unit: 2 gathers + 1 reduce-scatter of D-1 = 2 rounds each, and 2(R-1) = 2 across: 8; nothing hides
    assert p.comm_s == pytest.approx(2 * 8 * 1e-3)
    # this machine: the R x D = 4 busy processes stretch compute and communication alike (1 + 3 x 0.5)
    here = predict_layout(_cal(contention_slope=0.5, effective_cores=64), "bsp", 2, Layout(fsdp=2, held_params=P))
    alone = predict_layout(_cal(effective_cores=64), "bsp", 2, Layout(fsdp=2, held_params=P))
    assert here.compute_s == pytest.approx(0.01 * 2.5) and here.comm_s == pytest.approx(alone.comm_s * 2.5)


def test_memory_is_the_estimates_and_diloco_adds_its_parts_outer_state():
    cut = Layout(fsdp=4, held_params=P, memory_per_worker=123_456)
    assert predict_layout(_cal(), "bsp", 2, cut).memory_per_worker == 123_456
    dl = predict_layout(_cal(), "diloco", 2, cut, LINK, {"sync_every": 10})
    assert dl.memory_per_worker == 123_456 + 2 * P * 4 // 4  # θ_g and outer momentum of its 1/D part
    # DiLoCo's replicas run FSDP alone (no HSDP), and all-reduce the part's pseudo-gradient every H steps
    inside = predict_layout(_cal(), "bsp", 1, cut, LINK).bytes_per_worker
    rounds = _cal().rounds_per_step(10, 2 * 4)
    assert dl.bytes_per_worker == pytest.approx(inside + 2 * 1 / 2 * (P * 4 // 4) * rounds)
    with pytest.raises(ValueError, match="not built across cut replicas"):
        predict_layout(_cal(), "async", 2, cut)


def test_the_emulated_link_carries_only_what_crosses_the_replicas():
    """--comm-delay-ms/--comm-bandwidth emulate the link between replicas (strategies/network.py): DiLoCo's
    pseudo-gradient rounds pay it, FSDP's collectives inside each replica never do."""
    cut, slow = Layout(fsdp=4, held_params=P), 1e5  # bytes/s: the link's time dwarfs every real transfer
    linked = _cal(link_bandwidth=slow, link_latency_s=0.05)
    plain, dl = (predict_layout(c, "diloco", 2, cut, None, {"sync_every": 10}) for c in (_cal(), linked))
    rounds = _cal().rounds_per_step(10, 2 * 4)
    across = 2 * 1 / 2 * (P * 4 // 4)  # the part's pseudo-gradient, ring over the 2 replicas
    assert dl.comm_s - plain.comm_s == pytest.approx((0.05 + across / slow) * rounds, rel=0.02)
    # one replica: nothing crosses, so the link costs nothing (FSDP's bytes alone would take 29 s on it)
    alone = [predict_layout(c, "diloco", 1, cut, None, {"sync_every": 10}).comm_s for c in (_cal(), linked)]
    assert alone[0] == alone[1]


def test_the_model_figures_of_the_mlps_plan():
    # mlp on digits: Linear(64, 256) colwise, Linear(256, 256) rowwise, Linear(256, 10) whole
    figures = model_figures(RunConfig(model="mlp", tensor_parallel=2))
    # the rowwise layer's 256 outputs in the forward; the colwise layer's input is the data: no gradient
    assert (figures["tp_activation_values"], figures["tp_all_reduces"]) == (256, 1)
    fwd = {"a": 2 * 64 * 256, "b": 2 * 256 * 256, "c": 2 * 256 * 10}
    split = 2 * fwd["a"] + 3 * fwd["b"]  # backward: the first layer's weight gradient only
    assert figures["split_share"] == pytest.approx(split / (split + 3 * fwd["c"]))
    assert figures["units"] == 3  # the three Linear layers (ReLU and Flatten hold nothing)
    assert model_figures(RunConfig(model="mlp"))["split_share"] == 0.0
    cut = layout_of(RunConfig(model="mlp", fsdp=2, tensor_parallel=2, reshard_after_forward=False))
    assert (cut.fsdp, cut.tensor_parallel, cut.reshard_after_forward) == (2, 2, False)
    assert cut.held_params == (64 * 256) // 2 + 256 // 2 + (256 * 256) // 2 + 256 + 256 * 10 + 10


def test_a_model_three_times_a_workers_budget_gets_the_smallest_d_that_fits():
    wide = RunConfig(task=WIDE, task_args={"width": 64}, workers=2, batch_size=16, worker_memory="100KiB")
    layouts, why = planned_layouts(wide)
    # ~0.3 MiB of parameters, gradients and Adam state: D = 3 still holds a whole unit gathered, D = 4 fits
    assert [(lay.fsdp, lay.tensor_parallel) for lay in layouts] == [(4, 1)]  # WideMLP has no TP plan
    assert why.startswith("one worker would hold ~0.3 MiB, over --worker-memory 100KiB")
    assert layouts[0].training_state <= 100 * 1024
    assert planned_layouts(wide.replace(worker_memory=""))[0] == []  # no budget: nothing to propose
    assert planned_layouts(wide.replace(worker_memory="10MiB"))[0] == []  # fits one worker
    given, why = planned_layouts(RunConfig(model="mlp", fsdp=2))
    assert [lay.fsdp for lay in given] == [2] and why == "the run's --fsdp 2"
    # the mlp has a plan: T = 2 is proposed beside D alone
    mlp = RunConfig(model="mlp", worker_memory="1MiB")
    assert {(lay.fsdp, lay.tensor_parallel) for lay in planned_layouts(mlp)[0]} == {(3, 1), (1, 2)}


def test_the_choice_across_cut_replicas():
    cut = Layout(fsdp=4, held_params=P)
    cheap = recommend_layout(_cal(), 2, cut, "because", LINK)
    assert (cheap.strategy, cheap.settings) == ("bsp", {"fsdp": 4})
    assert cheap.reason.startswith("because; 2 replicas x 4 shards under BSP")
    # a slow link across replicas: DiLoCo amortises the cross-replica part
    slow = Hardware("slow", bandwidth=1e6, latency_s=0.0)
    big = Layout(fsdp=2, held_params=P, reshard_after_forward=False)
    rec = recommend_layout(_cal(num_params=P), 8, big, "because", slow)
    assert rec.strategy == "diloco" and rec.settings == {"fsdp": 2, "sync_every": planner.default("diloco", "period")}
    assert recommend_layout(_cal(), 1, big, "because", slow).strategy == "bsp"  # one replica: nothing to amortise
    # among layouts, the one predicted fastest: T = 2 splitting most of the compute beats D = 4 on a slow link
    tp = Layout(tensor_parallel=2, held_params=P // 2, split_share=0.9)
    assert recommend_among(_cal(), 1, [cut, tp], "because", slow).settings == {"tensor_parallel": 2}


def test_calibration_runs_plain_workers_and_measures_the_layouts_collectives(tmp_path):
    cfg = RunConfig(model="mlp", fsdp=2, tensor_parallel=2, worker_memory="1MiB")
    plain = calibrate.uncut(cfg)
    assert plain.replica_grid[:2] == (1, 1) and not plain.worker_memory and plain.model == "mlp"
    cut = Layout(fsdp=2, tensor_parallel=2, reshard_after_forward=False, held_params=P, units=3)
    assert calibrate.cut_config(plain, cut).replica_grid[:2] == (2, 2)
    assert not calibrate.cut_config(plain, cut).reshard_after_forward
    # the scale makes BSP's predicted step at R = 1 the measured one
    p = predict_layout(_cal(), "bsp", 1, cut)
    rest = p.step_s - p.comm_s
    assert layout_scale_of(_cal(), cut, rest + 3 * p.comm_s) == pytest.approx(3.0)
    assert layout_scale_of(_cal(), cut, rest / 2) == 0.0  # faster than compute alone: nothing to charge
    assert predict_layout(_cal(layout_scale=3.0), "bsp", 1, cut).step_s == pytest.approx(rest + 3 * p.comm_s)
    # read from the tiny run's metrics: a steady 30 ms step
    run = tmp_path / "cut-1"
    run.mkdir()
    rows = [{"kind": "step", "worker": 0, "step": i, "wall_time": 0.03 * i, "compute_s": 0.002, "comm_s": 0.0,
             "wait_s": 0.0} for i in range(20)]  # fmt: skip
    pd.DataFrame(rows).to_parquet(run / "metrics.parquet")
    fitted = calibrate.fit_layout(_cal(), tmp_path, cut)
    assert fitted.layout_scale == pytest.approx(layout_scale_of(_cal(), cut, 0.03))
    assert fitted.measured["cut_1"]["step_s"] == pytest.approx(0.03) and fitted.measured["cut_1"]["fsdp"] == 2


def _saved(tmp_path: Path) -> Path:
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"calibration": _cal(num_params=85_002).to_dict()}))
    return saved


@pytest.mark.usefixtures("no_ray")
def test_plan_shows_each_candidates_layout_and_predicts_the_runs_own(tmp_path):
    out = tmp_path / "plan"
    args = ["plan", "--workers", "1,2", "--calibration", str(_saved(tmp_path)), "--model", "mlp", "--fsdp", "2"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "layout" in result.output and "2 replicas x 2 shards" in result.output
    frame = pd.read_parquet(out / "predictions.parquet")
    cut = frame[frame.fsdp == 2]
    assert sorted(set(cut.strategy)) == ["bsp", "diloco"] and set(cut.workers) == {1, 2}
    assert len(frame) == 2 * len(planner.CANDIDATES) + len(cut)  # the plain rows stay, named as such
    assert set(frame[(frame.fsdp == 1) & (frame.workers == 2)]["layout"]) == {"2 workers"}
    layout = layout_of(RunConfig(model="mlp", fsdp=2))
    row = cut[(cut.strategy == "bsp") & (cut.workers == 2)].iloc[0]
    assert row["bytes_per_worker"] == pytest.approx(predict_layout(_cal(), "bsp", 2, layout).bytes_per_worker)
    assert row["memory_per_worker"] == layout.memory_per_worker and row["layout"] == "2 replicas x 2 shards"
    record = json.loads((out / "plan.json").read_text())
    assert record["layouts"][0]["fsdp"] == 2 and record["layout_reason"] == "the run's --fsdp 2"
    assert record["recommendations"]["2"]["settings"]["fsdp"] == 2
    assert "recommended at N=2: --strategy" in result.output and "--fsdp 2" in result.output


@pytest.mark.usefixtures("no_ray")
def test_plan_proposes_a_layout_when_the_model_does_not_fit_one_worker(tmp_path):
    out = tmp_path / "plan"
    task = ["--task", WIDE, "--task-arg", "width=64", "--batch-size", "16", "--worker-memory", "100KiB"]
    result = CliRunner().invoke(app, ["plan", "--workers", "2", "--calibration", str(_saved(tmp_path)), *task,
                                      "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "layouts: one worker would hold ~0.3 MiB, over --worker-memory 100KiB: --fsdp 4" in result.output
    rec = json.loads((out / "plan.json").read_text())["recommendations"]["2"]
    assert rec["strategy"] in ("bsp", "diloco") and rec["settings"]["fsdp"] == 4


def test_strategy_auto_chooses_a_layout_when_the_model_does_not_fit(monkeypatch):
    measured = []

    def fake_calibrate(*args, layout=None, **kwargs):
        measured.append(layout)
        return _cal(num_params=16_640, task=WIDE)

    monkeypatch.setattr(calibrate, "calibrate", fake_calibrate)
    values = {"strategy": "auto", "task": WIDE, "task_args": {"width": 64}, "workers": 2, "batch_size": 16,
              "worker_memory": "100KiB"}  # fmt: skip
    overrides, record = auto_strategy.choose(values, None)
    assert overrides["fsdp"] == 4 and overrides["strategy"] in ("bsp", "diloco")
    assert overrides["transport"] == "collective" and record["layout"] == "2 replicas x 4 shards"
    assert "over --worker-memory 100KiB" in record["reason"]
    assert measured[0].fsdp == 4  # the calibration measured the layout it chose among
    chosen = RunConfig.resolve(None, values | overrides)  # the choice is a run the config accepts...
    memory.check_worker(chosen, memory.estimate(chosen, 16_640))  # ...and the run's budget check too
    fits = dict(values, worker_memory="")
    overrides, record = auto_strategy.choose(fits, None)
    assert "fsdp" not in overrides and record["layout"] == "2 workers"


@pytest.mark.parametrize(
    ("flags", "says"),
    [(["--model", "mlp", "--tensor-parallel", "3"], "--tensor-parallel 3 does not divide"),
     (["--model", "linear", "--tensor-parallel", "2"], "--model linear has none")],
)  # fmt: skip
@pytest.mark.usefixtures("no_ray")
def test_plan_refuses_a_layout_the_run_would_refuse(flags, says, tmp_path):
    out = tmp_path / "plan"
    result = CliRunner().invoke(app, ["plan", "--calibration", str(_saved(tmp_path)), *flags, "--out", str(out)])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and says in lines[0], result.output
    assert not out.exists()



@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_gathers_half_the_bytes_as_the_run_counts_them(precision):
    """--precision bf16/fp16 --fsdp D: FSDP gathers the parameters in half precision and reduce-scatters
    float32 gradients, the bytes strategies/sharded_bsp.py records (gathered = its tp_numel x 2)."""
    from distrain.strategies.sharded_bsp import fsdp_bytes_per_step

    fp32 = layout_of(RunConfig(model="mlp", workers=2, fsdp=2))
    half = layout_of(RunConfig(model="mlp", workers=2, fsdp=2, precision=precision))
    p = fp32.held_params
    assert half.held_params == p and half.value_bytes == 2
    sent = predict_layout(_cal(), "bsp", 2, half, LINK).bytes_per_worker
    assert sent == fsdp_bytes_per_step(p * 4, 2, 2, True, p * 2)
    # two half-size gathers and a float32 reduce-scatter, (D-1)/D each, plus HSDP's float32 all-reduce
    assert sent == pytest.approx((2 * p * 2 + p * 4) / 2 + 2 * (1 / 2) * p * 4 / 2, abs=4)
    assert sent < predict_layout(_cal(), "bsp", 2, fp32, LINK).bytes_per_worker
    assert half.memory_per_worker < fp32.memory_per_worker

@pytest.mark.parametrize("codec", ["fp16", "int8", "topk:0.05", "powersgd:4"])
@pytest.mark.usefixtures("loopback")
def test_a_compressed_cut_replica_plans_the_bytes_its_workers_count(codec):
    """--fsdp 2 --workers 2 --compress CODEC: FSDP's traffic inside the replica (no HSDP all-reduce) plus
    the codec's average of the worker's part across the replicas, what CompressedAllReduce counts for the
    part's shapes (the run's rows carry the same: test_layout_compress.py); DiLoCo that once a round."""
    import torch

    from distrain.compression import parse_codec
    from distrain.planning.layout_figures import part_shapes
    from distrain.strategies.compressed_collective import CompressedAllReduce
    from distrain.strategies.sharded_bsp import fsdp_bytes_per_step

    cfg = RunConfig(model="mlp", workers=2, fsdp=2, batch_size=16, compress=codec)
    part = [torch.Size(s) for s in part_shapes(cfg)]
    assert part == [(128, 64), (128,), (128, 256), (128,), (5, 256), (5,)]  # the mlp's rows halved
    n = sum(s.numel() for s in part)
    counted = CompressedAllReduce(parse_codec(codec), 2, n, part).all_reduce_mean_(torch.randn(n))
    layout = layout_of(cfg)
    inside = fsdp_bytes_per_step(layout.param_bytes, 1, 2, True)
    bsp = predict_layout(_cal(), "bsp", 2, layout, LINK)
    assert bsp.bytes_per_worker == inside + counted
    plain = predict_layout(_cal(), "bsp", 2, Layout(fsdp=2, held_params=layout.held_params), LINK)
    assert plain.bytes_per_worker == fsdp_bytes_per_step(layout.param_bytes, 2, 2, True)  # HSDP, float32
    assert bsp.bytes_per_worker < plain.bytes_per_worker
    cal = _cal()
    diloco = predict_layout(cal, "diloco", 2, layout, LINK, {"sync_every": 10})
    rounds = cal.rounds_per_step(10, 4)
    assert diloco.bytes_per_worker == pytest.approx(inside + counted * rounds)


@pytest.mark.usefixtures("no_ray")
def test_plan_shows_a_compressed_cut_replica_below_its_float32_bytes(tmp_path):
    """`distrain plan --fsdp 2 --compress int8` from a kept calibration: the layout's rows are predicted
    with the codec's bytes of each worker's part (before: HSDP's float32 all-reduce whatever the codec)."""
    sent = {}
    for codec in ("", "int8"):
        out = tmp_path / f"plan{codec}"
        args = ["plan", "--workers", "2", "--calibration", str(_saved(tmp_path)), "--model", "mlp", "--fsdp", "2"]
        result = CliRunner().invoke(app, [*args, *(["--compress", codec] if codec else []), "--out", str(out)])
        assert result.exit_code == 0, result.output
        frame = pd.read_parquet(out / "predictions.parquet")
        sent[codec] = frame[(frame.fsdp == 2) & (frame.strategy == "bsp")].iloc[0]["bytes_per_worker"]
    layout = layout_of(RunConfig(model="mlp", fsdp=2, workers=2, compress="int8"))
    assert sent["int8"] == pytest.approx(predict_layout(_cal(), "bsp", 2, layout).bytes_per_worker)
    assert sent["int8"] < sent[""]
