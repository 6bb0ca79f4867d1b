"""Pipelines end to end on real Ray actors over real gloo groups: the GPipe/1F1B identity with one
process, with data-parallel replicas, the bubble, the per-stage memory split, a stage killed, restore
to another S, a model over one worker's memory budget trained at S = 4 and resumed, and the usual
quality on digits and on the language-model example."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from distrain.config import RunConfig
from distrain.errors import ConfigError, ResourceError
from distrain.orchestrator.resume import resume_config
from distrain.orchestrator.run import run_training
from distrain.reporting.plots import PlotRun, plot_pipeline_timeline
from distrain.strategies.pipeline import bubble_fraction
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")
HERE = Path(__file__).resolve().parents[1]  # tests/
# Plain SGD on the mlp (no batch norm), 12 steps of one epoch.
BASE = dict(
    model="mlp", optimizer="sgd", momentum=0.0, lr=0.1, lr_scaling="none", epochs=1, max_steps=12, seed=3,
    segment_steps=4, eval_every=0,
)  # fmt: skip
TOL = 1e-5


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    return RunConfig(**(BASE | {"run_dir": str(tmp_path / name)} | kw))



@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process on the same global batches: B = 32 (for R = 1) and B = 64 (for R = 2 x 32)."""
    base = tmp_path_factory.mktemp("one")
    return {b: final_params(run_training(cfg(base, f"b{b}", workers=1, batch_size=b)).run_dir) for b in (32, 64)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_four_microbatches_equal_one_process(tmp_path, one_process, schedule):
    run = run_training(
        cfg(tmp_path, schedule, workers=1, batch_size=32, pipeline_stages=2, microbatches=4, pipeline_schedule=schedule)
    )
    assert run.summary["status"] == "completed"
    assert (final_params(run.run_dir) - one_process[32]).abs().max().item() <= TOL
    rows = steps_of(run.run_dir, sort_by=("worker", "step"))
    assert sorted(set(rows["worker"])) == [0, 1] and list(rows.groupby("worker")["stage"].first()) == [0, 1]
    assert (rows.groupby("step").size() == 2).all()  # one row per stage and step
    # Both stages report the replica's loss; only the last stage counts its samples.
    by_step = rows.pivot(index="step", columns="stage", values="loss")
    assert (by_step[0] == by_step[1]).all()
    assert rows.groupby("stage")["samples"].sum().tolist() == [0, 12 * 32]
    # Each stage holds its own slice of the parameters (and of the gradient): together the whole model.
    held = rows.groupby("stage")["mem_param_bytes"].first()
    assert held.sum() == one_process[32].numel() * 4 and held.min() > 0
    assert (rows["mem_grad_bytes"] == rows["mem_param_bytes"]).all()
    # Steps 1-3 of each stage keep their spans: M forwards and M backwards each (the report's timeline).
    spans = rows[rows["pipe_spans"].notna()]
    assert sorted(spans["step"]) == [1, 1, 2, 2, 3, 3]
    for text in spans["pipe_spans"]:
        kinds = sorted((k, mb) for k, mb, _, _ in json.loads(text))
        assert kinds == [("B", i) for i in range(4)] + [("F", i) for i in range(4)]
    assert plot_pipeline_timeline([PlotRun("p", "p", "C0", pd.read_parquet(run.run_dir / "metrics.parquet"), {})])
    figures = run.summary["pipeline_stages_figures"]
    assert sorted(figures) == ["0", "1"] and [figures[s]["param_bytes"] for s in "01"] == held.tolist()
    assert all(0 <= figures[s]["idle_frac"] < 1 and figures[s]["compute_s"] > 0 for s in "01")


def test_two_stages_times_two_replicas_equal_one_process_on_the_global_batch(tmp_path, one_process):
    run = run_training(cfg(tmp_path, "s2r2", workers=2, batch_size=32, pipeline_stages=2, microbatches=4))
    assert (final_params(run.run_dir) - one_process[64]).abs().max().item() <= TOL
    rows = steps_of(run.run_dir, sort_by=("worker", "step"))
    # rank = replica x S + stage; a replica's stages read the same slice of the global batch.
    assert rows.groupby("worker")[["replica", "stage"]].first().values.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert (rows["slice"] == rows["replica"]).all()
    assert rows["samples"].sum() == 12 * 64


def test_a_killed_stage_restarts_from_its_checkpoint_and_ends_equal(tmp_path, one_process):
    run = run_training(
        cfg(tmp_path, "chaos", workers=1, batch_size=32, pipeline_stages=2, microbatches=4, checkpoint_steps=4,
            chaos=["kill-worker@6:1"])
    )  # fmt: skip
    s = run.summary
    assert s["status"] == "completed" and s["failures"] == 1, s["failure_events"]
    event = s["failure_events"][0]
    assert event["action"] == "restarted" and event["at_step"] == 6 and event["restored_step"] == 4
    assert (final_params(run.run_dir) - one_process[32]).abs().max().item() <= TOL


def test_a_pipeline_checkpoint_restores_to_another_number_of_stages(tmp_path):
    """The checkpoint is one full state dict (momentum buffer included): S = 3 and one process go on
    from it identically."""
    momentum = dict(momentum=0.9, workers=1, batch_size=32)
    first = run_training(cfg(tmp_path, "s2", pipeline_stages=2, microbatches=2, max_steps=4, **momentum))
    ckpt = str(first.run_dir / "checkpoints" / "final.pt")
    go_on = dict(max_steps=8, init_from=ckpt, **momentum)  # the checkpoint is at step 4: steps 4..7 from it
    three = run_training(cfg(tmp_path, "s3", pipeline_stages=3, microbatches=2, **go_on))
    one = run_training(cfg(tmp_path, "s1", **go_on))
    assert (final_params(three.run_dir) - final_params(one.run_dir)).abs().max().item() <= TOL
    assert (final_params(three.run_dir) - final_params(first.run_dir)).abs().max().item() > 1e-3  # it trained on


def test_a_model_over_one_workers_budget_trains_at_four_stages_and_resumes_exactly(tmp_path):
    """--worker-memory 100KiB against WideMLP(width 64): 4 equal blocks of 4160 parameters x 4 copies
    (θ, gradient, buffer, momentum) = 260 KiB in one worker, refused before anything starts; 65 KiB a
    stage at S = 4, which trains. One epoch, then `--resume` for a second, ends where one process's
    two epochs end (momentum SGD: the optimizer state crosses the checkpoint; the second epoch's
    shuffle is the resumed run's to get right)."""
    wide = dict(
        task=f"{HERE / 'pipeline_task.py'}:WideMLP", task_args={"width": 64, "samples": 96}, optimizer="sgd",
        momentum=0.9, lr=0.05, lr_scaling="none", workers=1, batch_size=16, eval_every=0, segment_steps=2, seed=3,
    )  # fmt: skip
    budget = dict(worker_memory="100KiB")
    with pytest.raises(ResourceError, match=r"^one worker would hold ~0\.3 MiB .* --pipeline-stages 4 splits it"):
        run_training(RunConfig(**wide, **budget, epochs=2, run_dir=str(tmp_path / "s1")))
    assert not (tmp_path / "s1").exists()
    four = dict(pipeline_stages=4, microbatches=2, **budget)
    first = run_training(RunConfig(**wide, **four, epochs=1, run_dir=str(tmp_path / "s4")))
    assert first.summary["status"] == "completed" and first.summary["steps_completed"] == 2
    after_one = final_params(first.run_dir)  # the resumed run writes its own final.pt in the same directory
    # --resume may change S only where the global batch stays (the data order with it).
    with pytest.raises(ConfigError, match=r"--resume cannot change --batch-size, --pipeline-stages here: .* 16 to 8"):
        resume_config(first.run_dir, {"pipeline_stages": 2, "batch_size": 8})
    resumed = run_training(resume_config(first.run_dir, {"epochs": 2}), resume=True)
    assert resumed.summary["status"] == "completed"
    one = run_training(RunConfig(**wide, epochs=2, run_dir=str(tmp_path / "one")))
    assert (final_params(resumed.run_dir) - final_params(one.run_dir)).abs().max().item() <= TOL
    assert (final_params(resumed.run_dir) - after_one).abs().max().item() > 1e-3  # it went on
    rows = steps_of(resumed.run_dir, sort_by=("worker", "step"))
    assert sorted(set(rows["step"])) == [0, 1, 2, 3] and (rows.groupby("step").size() == 4).all()
    assert (rows["mem_param_bytes"] == 4160 * 4).all()  # each stage holds one block: a quarter
    # What each stage measurably held (θ, gradient, momentum, peak saved activations) is within the budget.
    held = rows[["mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes", "mem_activation_peak_bytes"]].sum(axis=1)
    assert held.max() <= 100 * 1024 and held.min() >= 3 * 4160 * 4, held.tolist()


def wide(tmp_path, name: str, schedule: str) -> RunConfig:
    return RunConfig(
        task=f"{HERE / 'pipeline_task.py'}:WideMLP", task_args={"blocks": 4, "samples": 2048}, optimizer="adam",
        lr=1e-4, workers=1, batch_size=256, pipeline_stages=2, microbatches=4, pipeline_schedule=schedule, epochs=1,
        max_steps=6, segment_steps=6, eval_every=0, run_dir=str(tmp_path / name),
    )  # fmt: skip


def test_bubble_and_per_stage_memory_on_a_compute_heavy_model(tmp_path):
    """Two equal stages of 2 x Linear(1024, 1024) (2.1M parameters each), M = 4 micro-batches of 64 rows
    (~0.27 GMAC forward per micro-batch and stage, against a 256 KiB activation over gloo).

    Idle fraction per stage, 1 - (forward + backward time) / step time (median of steps 2..5; the first
    steps include torch's shape inference), against (S - 1)/(M + S - 1) = 0.2, within 0.25 absolute: the
    two actors share 2 cores with the driver, Ray and other jobs (load average 6-12 when this was
    written, measured 0.28-0.37; once, in a full run of this file, outside 0.2), and every hand-off
    between the stages waits for the other process to be scheduled, so the measured idle sits above
    the formula. Memory: each stage holds half the
    parameters, gradients and Adam's two moments; 1F1B keeps at most S micro-batches' activations on
    stage 0 where GPipe keeps all M."""
    gpipe = steps_of(run_training(wide(tmp_path, "gpipe", "gpipe")).run_dir, sort_by=("worker", "step"))
    one_f = steps_of(run_training(wide(tmp_path, "1f1b", "1f1b")).run_dir, sort_by=("worker", "step"))
    expected = bubble_fraction(2, 4)
    stage_bytes = 2 * (1024 * 1024 + 1024) * 4
    for rows in (gpipe, one_f):
        idle = rows[rows["step"] >= 2].groupby("stage")["pipe_idle_frac"].median()
        assert ((idle - expected).abs() <= 0.25).all(), idle.tolist()
        held = rows.groupby("stage")[["mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes"]].first()
        assert (held["mem_param_bytes"] == stage_bytes).all() and (held["mem_grad_bytes"] == stage_bytes).all()
        # exp_avg and exp_avg_sq of the stage's slice, plus Adam's step counter (one 4-byte tensor)
        assert held["mem_optim_bytes"].between(2 * stage_bytes, 2 * stage_bytes + 16).all()
    # (Step 0 also holds what torch's shape inference saved; counting bytes is deterministic after it.)
    peak_g = gpipe[gpipe["step"] >= 1].groupby("stage")["mem_activation_peak_bytes"].max()
    peak_1 = one_f[one_f["step"] >= 1].groupby("stage")["mem_activation_peak_bytes"].max()
    assert peak_1[0] * 2 == peak_g[0], (peak_1.tolist(), peak_g.tolist())  # 2 micro-batches in flight, not 4


def test_an_nn_sequential_on_digits_reaches_the_usual_accuracy(tmp_path):
    run = run_training(
        RunConfig(model="cnn", workers=1, batch_size=32, pipeline_stages=2, microbatches=2, epochs=3,
                  segment_steps=20, run_dir=str(tmp_path / "cnn"), seed=1)
    )  # fmt: skip
    assert run.summary["final_test_accuracy"] >= 0.93, run.summary["final_test_accuracy"]


def test_the_language_model_example_as_a_pipeline_beats_the_unigram_baseline(tmp_path):
    run = run_training(
        RunConfig(
            task=f"{HERE.parent / 'examples' / 'char_lm.py'}:CharLM",
            task_args={"max_bytes": 60000, "seq_len": 32, "dim": 32, "layers": 2},
            optimizer="adam", lr=0.005, epochs=2, workers=1, batch_size=32, pipeline_stages=2, microbatches=2,
            pipeline_schedule="1f1b", run_dir=str(tmp_path / "lm"),
        )
    )  # fmt: skip
    s = run.summary
    assert s["final_test_perplexity"] < s["task_info"]["unigram_test_perplexity"], s
