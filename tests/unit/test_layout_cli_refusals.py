"""Issue 28's bad input through `distrain run`: a layout that cannot work (T not dividing the heads or a
split layer's width, D or T below 1, an optimizer that needs whole tensors on a cut replica, T > 1 for a
model with no plan, more R x D x T x S workers than an `--address` cluster holds) is one line on stderr,
exit code 2, and no run directory.

Every refusal but the last comes before Ray would start (a guard fails the test if it does); the last
stands in a cluster of known size for `--address` (`cluster.connect` and `ray.cluster_resources`
replaced), since a local Ray is sized for the run and may oversubscribe: CI runs D = 4 on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distrain.cli import app
from tests.unit.test_cli_errors import assert_one_line_error, runner

EXAMPLES = Path(__file__).parents[2] / "examples"
CHAR_LM = f"{EXAMPLES / 'char_lm.py'}:CharLM"
DIABETES = f"{EXAMPLES / 'diabetes_regression.py'}:Diabetes"

BSP_PS_CUT = ["--model", "mlp", "--strategy", "bsp", "--transport", "ps", "--fsdp", "2"]
# (arguments, fragments the one line must contain)
REFUSED = [
    # T that does not divide a split layer's width (the mlp's first Linear: 256 outputs, column-wise)
    (["--model", "mlp", "--tensor-parallel", "3"], ["--tensor-parallel 3 does not divide", "256 outputs"]),
    # T that does not divide the char transformer's attention heads (4)
    (["--task", CHAR_LM, "--tensor-parallel", "3"], ["--tensor-parallel 3 does not fit", "4 attention heads"]),
    (["--fsdp", "0"], ["--fsdp must be >= 1, got 0"]),
    (["--fsdp", "-2", "--workers", "1"], ["--fsdp must be >= 1, got -2"]),
    (["--tensor-parallel", "0"], ["--tensor-parallel must be >= 1, got 0"]),
    (["--model", "mlp", "--fsdp", "1", "--tensor-parallel", "-1"], ["--tensor-parallel must be >= 1, got -1"]),
    # optimizers that need whole tensors: FSDP's shards and TP's splits cut them
    (["--fsdp", "2", "--optimizer", "Adafactor"], ["--optimizer Adafactor is not supported", "whole tensors"]),
    (["--model", "mlp", "--tensor-parallel", "2", "--optimizer", "muon"], ["--optimizer muon", "whole"]),
    # T > 1 for a model without a tensor-parallel plan: a built-in one, and a task's own
    (["--model", "linear", "--tensor-parallel", "2"], ["--model linear has none", "Task.tensor_parallel_plan()"]),
    (["--task", DIABETES, "--tensor-parallel", "2"], [f"--task {DIABETES} has none", "or drop --tensor-parallel"]),
    # the PS strategies across cut replicas (strategies/sharded_ps.py): exactly D PS shards, --fsdp alone
    (
        ["--model", "mlp", "--strategy", "async", "--transport", "ps", "--fsdp", "2", "--ps-shards", "3"],
        ["--ps-shards 3 with --fsdp 2", "PS shard d holds FSDP chunk d", "exactly 2"],
    ),
    (
        ["--model", "mlp", "--strategy", "bsp", "--transport", "ps", "--fsdp", "2", "--ps-shards", "1"],
        ["--ps-shards 1 with --fsdp 2"],
    ),
    # backup workers across cut replicas run (tests/integration/test_sharded_ps_backup_runs.py); their bad
    # input is refused as without sharding, the straggler's rank counted over the (N + K) x D workers
    # backup tasks across cut replicas run under --fsdp D at a fixed size (test_sharded_ps_backup_runs.py);
    # not yet under --tensor-parallel or a range, and a portion must split into D equal parts
    (
        ["--model", "mlp", "--strategy", "bsp", "--transport", "ps", "--tensor-parallel", "2", "--backup-tasks"],
        ["--tensor-parallel 2 over --transport ps does not compose with --backup-tasks yet", "not yet"],
    ),
    (
        [*BSP_PS_CUT, "--workers", "1..2", "--backup-tasks"],
        ["--backup-tasks does not compose with --workers MIN..MAX yet", "not yet"],
    ),
    (
        [*BSP_PS_CUT, "--backup-tasks", "--portions", "4", "--batch-size", "3"],
        ["--portions 4 with --fsdp 2", "4 x 2 does not divide the global batch 12"],
    ),
    (
        ["--model", "mlp", "--strategy", "bsp", "--transport", "ps", "--fsdp", "2", "--backup-workers", "-1"],
        ["--backup-workers must be >= 0, got -1"],
    ),
    (
        ["--model", "mlp", "--strategy", "bsp", "--fsdp", "2", "--backup-workers", "1"],
        ["--backup-workers needs synchronous rounds on the parameter server", "--transport ps"],
    ),
    (
        [*BSP_PS_CUT, "--workers", "2", "--backup-workers", "1", "--straggler", "6:x3"],
        ["--straggler '6:x3'", "0 <= RANK < 6"],
    ),
    # a range across cut replicas over the PS runs (tests/integration/test_sharded_ps_runs.py: --fsdp D,
    # --tensor-parallel T, D x T, --precision bf16), with backup workers too (the referee decides each
    # round among its member replicas: test_sharded_ps_backup_runs.py) as long as MIN exceeds them (a round
    # applies members - K); --compress composes there (each worker's push keeps its own residual:
    # test_sharded_ps_runs.py), but not PowerSGD (a shard's chunk is flat)
    (
        [*BSP_PS_CUT, "--workers", "1..3", "--backup-workers", "1"],
        ["--workers 1..3 with --backup-workers 1", "none at MIN 1", "raise MIN above 1"],
    ),
    (
        [*BSP_PS_CUT, "--workers", "1..2", "--compress", "powersgd:2"],
        ["--compress powersgd:2 needs whole matrices", "holds a flat chunk"],
    ),
    (
        [*BSP_PS_CUT, "--backup-workers", "1", "--compress", "powersgd:2"],
        ["--compress powersgd:2 needs whole matrices", "holds a flat chunk", "or --transport collective"],
    ),
    (
        ["--model", "mlp", "--strategy", "ssp", "--transport", "ps", "--tensor-parallel", "2", "--ps-shards", "1"],
        ["--ps-shards 1 with --tensor-parallel 2", "exactly 2"],
    ),
    (
        "--model mlp --strategy ssp --transport ps --tensor-parallel 2 --fsdp 2 --ps-shards 2".split(),
        ["--ps-shards 2 with --fsdp 2 --tensor-parallel 2", "exactly 4"],
    ),
    (["--model", "mlp", "--strategy", "sandblaster", "--fsdp", "2", "--tensor-parallel", "2"], ["not yet"]),
    # --compress across cut replicas runs over the collective transport (tests/integration/test_layout_compress.py)
    # and the PS (test_sharded_ps_runs.py, under a range too), not PowerSGD there (a shard's chunk is flat); with
    # pipeline stages, and under a range over the collective (a compressed all-reduce's codec state), it is refused
    (
        ["--model", "mlp", "--strategy", "async", "--transport", "ps", "--fsdp", "2", "--compress", "powersgd:1"],
        ["--compress powersgd:1 needs whole matrices"],
    ),
    (
        ["--model", "mlp", "--fsdp", "2", "--pipeline-stages", "2", "--compress", "int8"],
        ["--compress does not compose with --pipeline-stages"],
    ),
    (
        ["--model", "mlp", "--fsdp", "2", "--workers", "1..2", "--compress", "topk:0.1"],
        ["--workers 1..2 does not compose with --compress over the collective transport", "--transport ps"],
    ),
    # local SGD and DiLoCo run under a range across cut replicas (tests/integration/test_elastic_cut_averaging.py);
    # AdaComm under a range is refused as over plain replicas
    (
        ["--model", "mlp", "--strategy", "local-sgd", "--fsdp", "2", "--workers", "1..2", "--adaptive-tau"],
        ["--adaptive-tau does not compose with --workers MIN..MAX"],
    ),
    # ... with --fsdp and --tensor-parallel (the cnn's hybrid plan included), --precision, the emulated link and
    # --balance speed (tests/integration/test_heterogeneous.py), but not static weights (as for plain workers)
    (
        ["--model", "cnn", "--strategy", "diloco", "--tensor-parallel", "2", "--workers", "1..2", "--worker-weights", "3,1"],  # noqa: E501
        ["--worker-weights 3,1 does not compose with --workers MIN..MAX", "use --balance speed"],
    ),
    # Streaming DiLoCo runs across cut replicas (tests/integration/test_layout_streaming.py); under a range,
    # and with more fragments than the model's whole tensors, it is refused as over plain replicas
    (
        ["--model", "mlp", "--strategy", "diloco", "--fsdp", "2", "--workers", "1..3", "--fragments", "2"],
        ["--fragments (Streaming DiLoCo) does not compose with --workers MIN..MAX"],
    ),
    (
        ["--model", "mlp", "--strategy", "diloco", "--tensor-parallel", "2", "--workers", "1..2", "--fragments", "2"],
        ["--fragments (Streaming DiLoCo) does not compose with --workers MIN..MAX"],
    ),
    (
        ["--model", "mlp", "--strategy", "diloco", "--fsdp", "2", "--workers", "2", "--fragments", "7"],
        ["--fragments 7 exceeds the model's 6 parameter tensors"],
    ),
    # --precision across cut replicas runs over either transport (tests/integration/test_layout_precision.py);
    # fp16 with --compress (as without sharding) is still refused
    (
        ["--model", "mlp", "--fsdp", "2", "--precision", "fp16", "--compress", "int8"],
        ["--precision fp16 cannot be combined with --compress", "use --precision bf16"],
    ),
]


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """An empty working directory: where `runs/` would appear if a refusal wrote anything."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    from distrain.orchestrator import cluster

    def refuse(*args, **kwargs):
        raise AssertionError("Ray must not be started for input that is already known to be bad")

    monkeypatch.setattr(cluster, "connect", refuse)
    monkeypatch.setattr(ray, "init", refuse)


@pytest.mark.parametrize(
    ("args", "fragments"), REFUSED, ids=[" ".join(a[-2:]) + f"-{i}" for i, (a, _) in enumerate(REFUSED)]
)
def test_a_layout_that_cannot_work_is_one_line_exit_2_and_no_run_directory(cwd, no_ray, args, fragments):
    run_dir = cwd / "fresh"
    result = runner.invoke(app, ["run", "--run-dir", str(run_dir), "--epochs", "1", *args])
    assert_one_line_error(result, *fragments)
    assert not run_dir.exists()
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize(
    ("layout", "fragments"),
    [("fsdp: 0", ["--fsdp must be >= 1, got 0"]), ("tensor_parallel: 3", ["--tensor-parallel 3 does not divide"])],
)
def test_a_yaml_layout_section_is_refused_as_its_flag_is(cwd, no_ray, tmp_path, layout, fragments):
    config = tmp_path / "layout.yaml"
    config.write_text(f"model: mlp\nlayout:\n  {layout}\n")
    run_dir = cwd / "fresh"
    assert_one_line_error(runner.invoke(app, ["run", "--config", str(config), "--run-dir", str(run_dir)]), *fragments)
    assert list(cwd.iterdir()) == []


@pytest.fixture
def small_cluster(monkeypatch):
    """`--address` joins a cluster of 4 CPUs and 2 GPUs (nothing is started or contacted)."""
    from distrain.orchestrator import cluster

    monkeypatch.setattr(cluster, "connect", lambda config, keep=False: cluster.RayConnection(started_here=False))
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 4.0, "GPU": 2.0, "memory": 2.0**40})


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            ["--workers", "2", "--fsdp", "2", "--tensor-parallel", "2", "--model", "mlp"],
            ["needs 8 CPUs (R x D x T x S = 2 x 2 x 2 x 1 = 8 workers x 1)", "cluster has 4",
             "lower --workers, --fsdp or --tensor-parallel, or the CPUs per actor"],
        ),
        (
            ["--workers", "1", "--fsdp", "4", "--gpus-per-worker", "1"],
            ["needs 4 GPUs (R x D x T x S = 1 x 4 x 1 x 1 = 4 workers x 1)", "cluster has 2",
             "lower --gpus-per-worker, --workers or --fsdp, or add GPU nodes"],
        ),
        (
            ["--workers", "1", "--pipeline-stages", "3", "--cpus-per-worker", "2", "--model", "mlp"],
            ["needs 6 CPUs (R x D x T x S = 1 x 1 x 1 x 3 = 3 workers x 2)", "lower --workers or --pipeline-stages"],
        ),
        (["--workers", "5"], ["needs 5 CPUs (5 workers x 1)", "lower --workers or the CPUs per actor"]),
        (
            ["--workers", "1", "--fsdp", "2", "--strategy", "bsp", "--transport", "ps", "--backup-workers", "1",
             "--model", "mlp"],
            ["R x D x T x S = 2 x 2 x 1 x 1 = 4 workers", "lower --workers, --backup-workers or --fsdp"],
        ),
    ],
)  # fmt: skip
def test_more_workers_than_an_address_cluster_holds_names_the_grid(cwd, small_cluster, args, fragments):
    run_dir = cwd / "fresh"
    cmd = ["run", "--address", "127.0.0.1:6379", "--run-dir", str(run_dir), "--epochs", "1", *args]
    assert_one_line_error(runner.invoke(app, cmd), *fragments)
    assert not run_dir.exists()
    assert list(cwd.iterdir()) == []


def test_a_grid_that_fits_the_cluster_passes_the_resource_check(small_cluster):
    from distrain.config import RunConfig
    from distrain.orchestrator import cluster

    cluster.check_resources(RunConfig(workers=1, fsdp=2, tensor_parallel=2, model="mlp"))  # 4 workers, 4 CPUs
    assert cluster.workers_text(RunConfig(workers=3)) == ("3 workers", ["--workers"])


@pytest.mark.parametrize(
    "kw",
    [
        dict(strategy="async", transport="ps", workers="1..2", compress="int8"),
        dict(strategy="ssp", transport="ps", workers="1..2", compress="topk:0.1"),
        dict(model="mlp", strategy="bsp", transport="ps", fsdp=2, workers="1..2", compress="int8"),
        dict(model="mlp", strategy="async", transport="ps", tensor_parallel=2, workers="1..2", compress="bf16"),
    ],
    ids=["async", "ssp", "bsp-fsdp2", "async-tp2"],
)
def test_compress_under_a_range_over_the_ps_passes_the_checks(kw):
    """Over the PS each worker's push keeps its own error-feedback residual: a leaver's goes with it, a joiner
    starts at zero, nothing has to agree across workers; so a range composes with --compress there, plain
    workers and cut replicas alike (tests/integration/test_compress_runs.py, test_sharded_ps_runs.py)."""
    from distrain.config import RunConfig
    from distrain.config.checks import run_checks

    run_checks(RunConfig(**kw))
