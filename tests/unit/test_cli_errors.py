"""`distrain` on bad input: exit code 2, one line of error text, no traceback, nothing written.

All but the last test fail before Ray would start, and a guard makes starting Ray fail the test.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from distrain.cli import app

runner = CliRunner()
WIDE = [
    "--task",
    f"{Path(__file__).parents[1] / 'pipeline_task.py'}:WideMLP",  # tests/pipeline_task.py
    "--task-arg",
    "width=64",
    "--workers",
    "1",
]

GROUPS = ["--worker-group", "fast:1:48:fast=1", "--worker-group", "slow:1:16:slow=1"]  # issue 31's resource groups


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under root with its content and modification time."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()
    } | {str(p.relative_to(root)) + "/": (b"", 0) for p in root.rglob("*") if p.is_dir()}


@pytest.fixture
def no_ray(monkeypatch):
    """Fail loudly if the command gets as far as connecting to (or starting) Ray."""
    import ray

    from distrain.orchestrator import cluster

    def refuse(*args, **kwargs):
        raise AssertionError("Ray must not be started for input that is already known to be bad")

    monkeypatch.setattr(cluster, "connect", refuse)
    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture(scope="module")
def prepared_inputs(tmp_path_factory) -> Path:
    """A few prepared inputs, made once for the module (building them took most of each test's time):
    every test that uses them checks that it left them as they were (`snapshot`)."""
    inputs = tmp_path_factory.mktemp("inputs")
    (inputs / "malformed.yaml").write_text("workers: 2\nlr: 0.1: 2\nmodel: cnn\n")
    (inputs / "empty_data").mkdir()
    (inputs / "binary.yaml").write_bytes(bytes(range(256)))  # e.g. a checkpoint passed by mistake
    (inputs / "twice.yaml").write_text("workers: 8\nmodel: mlp\nworkers: 2\n")
    (inputs / "elastic.yaml").write_text("resources:\n  workers: 2..3\nstrategy:\n  name: async\n")
    (inputs / "elastic_bad.yaml").write_text("workers: 3..2\nstrategy: async\n")
    (inputs / "groups_bad.yaml").write_text(
        "resources:\n  worker_groups:\n    - {name: a, workers: 1, batch_size: 8, gpus: 1}\n"
    )
    full = inputs / "full_run"
    full.mkdir()
    (full / "metrics.parquet").write_bytes(b"precious results")
    (full / "sub").mkdir()
    (full / "sub" / "notes.txt").write_text("keep me")
    _resume_inputs(inputs)
    _bad_data_inputs(inputs)
    return inputs


@pytest.fixture
def workdir(tmp_path, monkeypatch, no_ray, prepared_inputs):
    """An empty current directory, with the prepared inputs elsewhere (outside it)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd, prepared_inputs


def _resume_inputs(inputs: Path) -> None:
    """Run directories that --resume must refuse (issue 7): corrupt, truncated, foreign, no checkpoint."""
    import io

    import torch

    from distrain.config import RunConfig
    from distrain.orchestrator.checkpoint import FORMAT

    def run_dir(name: str, checkpoint: bytes | None) -> None:
        d = inputs / name
        (d / "checkpoints").mkdir(parents=True)
        (d / "config.yaml").write_text(RunConfig(run_dir=str(d)).to_yaml())
        if checkpoint is not None:
            (d / "checkpoints" / "step-00000010.pt").write_bytes(checkpoint)
            (d / "checkpoints" / "latest.json").write_text('{"name": "step-00000010.pt", "global_step": 10}')

    def saved(payload: dict) -> bytes:
        buf = io.BytesIO()
        torch.save(payload, buf)
        return buf.getvalue()

    whole = saved({"format": FORMAT, "model_name": "cnn", "model": {"w": torch.zeros(100_000)}})
    run_dir("run_corrupt", b"not a checkpoint at all")
    run_dir("run_truncated", whole[: len(whole) // 2])
    run_dir("run_foreign", saved({"format": FORMAT, "model_name": "mlp", "model": {}, "optimizer": {}}))
    run_dir("run_unchecked", None)
    # Issue 26: runs that ended before their first checkpoint (failed, diverged): config.yaml and results,
    # no checkpoints/ at all.
    for name, status in (("run_failed_early", "failed"), ("run_diverged_early", "diverged")):
        d = inputs / name
        d.mkdir()
        (d / "config.yaml").write_text(RunConfig(run_dir=str(d)).to_yaml())
        (d / "summary.json").write_text(f'{{"status": "{status}"}}\n')

    # Loadable cnn checkpoints (issue 13): a finished run, an edited config.yaml, rows gone missing.
    from distrain.orchestrator.resume import total_steps
    from distrain.trainers.datasets import DATASETS
    from distrain.trainers.models import build_model

    def checkpoint(name: str, step: int, **recorded) -> bytes:
        config = RunConfig(run_dir=str(inputs / name)).to_dict() | recorded
        model = build_model("cnn", DATASETS.get("digits").info, 0).state_dict()
        optimizer = {"vectors": {}, "scalars": {}}
        payload = {"format": FORMAT, "version": 1, "strategy": "bsp", "model_name": "cnn", "config": config}
        return saved(payload | {"epoch": 0, "global_step": step, "model": model, "optimizer": optimizer})

    total = total_steps(RunConfig())
    run_dir("run_finished", checkpoint("run_finished", total))
    run_dir("run_edited", checkpoint("run_edited", 10, lr=0.05))
    (inputs / "run_edited" / "config.yaml").write_text(RunConfig(run_dir=str(inputs / "run_edited"), lr=5.0).to_yaml())
    run_dir("run_no_metrics", checkpoint("run_no_metrics", 10))


def _bad_data_inputs(inputs: Path) -> None:
    """Data directories whose files are there but broken (issue 13): refused before any worker starts."""
    import numpy as np

    from tests.unit.test_datasets_files import write_idx_images, write_idx_labels

    def mnist(name: str, images: int, labels: int, cut: int = 0) -> None:
        raw = inputs / name / "MNIST" / "raw"
        raw.mkdir(parents=True)
        for split, n in (("train", images), ("t10k", 8)):
            write_idx_images(raw / f"{split}-images-idx3-ubyte", np.zeros((n, 28, 28), np.uint8))
            write_idx_labels(raw / f"{split}-labels-idx1-ubyte", np.zeros(labels if split == "train" else n, np.uint8))
        if cut:
            path = raw / "train-images-idx3-ubyte"
            path.write_bytes(path.read_bytes()[:-cut])

    mnist("mnist_truncated", 400, 400, cut=1000)
    mnist("mnist_mismatched", 400, 100)
    cifar = inputs / "cifar_corrupt" / "cifar-10-batches-py"
    cifar.mkdir(parents=True)
    for name in ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch"):
        (cifar / name).write_bytes(b"\x80\x02 half a pickle")
    (cifar / "batches.meta").write_bytes(b"meta")


def assert_one_line_error(result, *fragments: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    line = lines[0]
    assert "error:" in line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert result.stdout == ""  # the error goes to stderr
    assert result.stderr.strip() == line.strip()
    return line


# (arguments, fragments the one-line message must contain); "{in}" is the inputs directory
BAD_INPUTS = [
    (["--strategy", "nope"], ["unknown strategy 'nope'", "bsp"]),
    (["--model", "vgg"], ["unknown model 'vgg'", "cnn, linear, mlp, resnet18"]),
    (["--dataset", "imagenet"], ["unknown dataset 'imagenet'", "digits"]),
    (["--workers", "0"], ["--workers must be >= 1"]),
    # elastic membership (issue 18): the same parser for flags and YAML
    (["--strategy", "async", "--workers", "3..2"], ["--workers 3..2: MIN (3) is above MAX (2)"]),
    (["--strategy", "async", "--workers", "0..2"], ["--workers 0..2: MIN must be >= 1"]),
    (["--strategy", "async", "--workers", "2..x"], ["--workers must be an integer, got '2..x'", "MIN..MAX"]),
    (["--transport", "ps", "--workers", "1..4", "--backup-workers", "1"], ["raise MIN above 1"]),
    (
        ["--transport", "ps", "--workers", "2..4", "--backup-tasks", "--portions", "4"],
        ["--portions (4) must exceed the MAX of --workers (4)"],
    ),
    (
        ["--workers", "2..4", "--compress", "int8"],
        ["--workers 2..4 does not compose with --compress over the collective transport", "--transport ps"],
    ),
    (["--strategy", "async", "--workers", "2..4", "--compress", "powersgd:2"], ["needs whole matrices"]),
    (
        ["--strategy", "sandblaster", "--workers", "2..4"],
        ["--strategy sandblaster cannot change its membership", "that can: async, ssp, bsp over collective/ps"],
    ),
    (["--strategy", "async", "--workers", "2..4", "--straggler", "4:0.1"], ["--straggler '4:0.1'", "RANK < 4"]),
    (["--config", "{in}/elastic_bad.yaml"], ["--workers 3..2: MIN (3) is above MAX (2)"]),
    (["--config", "{in}/elastic.yaml", "--strategy", "sandblaster"], ["--strategy sandblaster cannot change its"]),
    (
        ["--strategy", "diloco", "--workers", "1..3", "--fragments", "2"],
        ["--fragments (Streaming DiLoCo) does not compose with --workers MIN..MAX"],
    ),
    (["--batch-size", "0"], ["--batch-size must be >= 1"]),
    (["--lr", "0"], ["--lr must be a positive number"]),
    (["--lr", "-1"], ["--lr must be a positive number"]),
    (["--lr", "nan"], ["--lr must be a positive number"]),
    (["--momentum", "1"], ["--momentum must be < 1"]),
    (["--warmup-epochs", "9", "--epochs", "2"], ["--warmup-epochs"]),
    (["--lr-scaling", "cubic"], ["--lr-scaling", "linear, sqrt, none"]),
    (["--dataset", "mnist"], ["--data-dir"]),
    (["--dataset", "mnist", "--data-dir", ""], ["--data-dir"]),
    (
        ["--dataset", "mnist", "--data-dir", "{in}/empty_data"],
        ["MNIST files missing", "train-images-idx3-ubyte"],
    ),
    (["--dataset", "cifar10", "--data-dir", "{in}/empty_data"], ["CIFAR-10 files missing"]),
    (
        ["--dataset", "mnist", "--data-dir", "{in}/mnist_truncated", "--model", "mlp"],
        ["train-images-idx3-ubyte is truncated"],
    ),
    (
        ["--dataset", "mnist", "--data-dir", "{in}/mnist_mismatched", "--model", "mlp"],
        ["MNIST train files", "400 images but 100 labels"],
    ),
    (["--dataset", "cifar10", "--data-dir", "{in}/cifar_corrupt"], ["corrupt or truncated", "data_batch_1"]),
    (["--config", "{in}/malformed.yaml"], ["malformed YAML", "malformed.yaml", "line 2"]),
    (["--config", "{in}/missing.yaml"], ["not found", "missing.yaml"]),
    (["--config", "{in}/binary.yaml"], ["binary.yaml' is not a text (UTF-8 YAML) file"]),
    (["--config", "{in}/empty_data"], ["empty_data' is a directory; pass a YAML file"]),
    (["--config", "{in}/twice.yaml"], ["key 'workers' appears twice", "twice.yaml", "lines 1 and 3"]),
    (["--optimizer", "adam", "--momentum", "0.5"], ["--momentum is not used by --optimizer adam", "sgd"]),
    (["--optimizer", "adagrad", "--momentum", "0"], ["--momentum is not used by --optimizer adagrad"]),
    (["--data-dir", "{in}/empty_data"], ["--data-dir is not used by --dataset digits", "cifar10, mnist"]),
    (["--dataset", "synthetic", "--data-dir", "{in}/empty_data"], ["--data-dir is not used by --dataset synthetic"]),
    (["--run-dir", "{in}/full_run"], ["not empty", "full_run"]),
    (["--run-dir", "{in}/full_run/metrics.parquet"], ["not a directory"]),
    (["--run-dir", "{in}/full_run/metrics.parquet/run"], ["--run-dir", "cannot be written", "Not a directory"]),
    # parameter-server strategies (issue 3)
    (["--strategy", "ssp", "--staleness", "-1"], ["--staleness must be >= 0"]),
    (["--staleness", "2"], ["--staleness is not used by --strategy bsp", "ssp"]),
    (["--strategy", "async", "--staleness", "2"], ["--staleness is not used by --strategy async"]),
    (["--staleness-lr"], ["--staleness-lr is not used by --strategy bsp", "async, ssp"]),
    (["--strategy", "async", "--ps-shards", "0"], ["--ps-shards must be >= 1"]),
    (["--ps-shards", "2"], ["--ps-shards needs the parameter-server transport"]),
    (["--strategy", "ssp", "--ps-shards", "1000000"], ["--ps-shards 1000000 exceeds", "151306"]),
    (["--strategy", "async", "--transport", "collective"], ["cannot carry --strategy async", "ps"]),
    (["--transport", "carrier-pigeon"], ["unknown --transport"]),
    (["--straggler", "9:0.1"], ["--straggler '9:0.1'", "RANK:SECONDS"]),
    (["--straggler", "1"], ["--straggler '1'"]),
    (["--straggler", "1:x0.5"], ["--straggler '1:x0.5'", "RANK:xF", "F >= 1"]),
    (["--init-from", "{in}/missing.pt"], ["--init-from", "not a file"]),
    # heterogeneous workers (issue 31)
    (["--worker-weights", "3,1,1"], ["--worker-weights '3,1,1' gives 3 weights for 2 workers"]),
    (["--worker-weights", "3,0"], ["--worker-weights '3,0' must be positive numbers"]),
    (["--worker-weights", "3,-1"], ["--worker-weights '3,-1' must be positive numbers"]),
    (["--worker-weights", "3;1"], ["--worker-weights '3;1' must be positive numbers"]),
    (["--worker-weights", "3,1", "--strategy", "ssp"], ["applies to --strategy bsp", "not --strategy ssp"]),
    (["--worker-weights", "3,1", "--transport", "ps", "--backup-tasks"], ["does not compose with --backup-tasks"]),
    (["--worker-weights", "3,1", "--workers", "2..3"], ["does not compose with --workers MIN..MAX"]),
    (["--worker-weights", "3,1,1,1", "--pipeline-stages", "2"], ["gives 4 weights for 2 pipeline replicas"]),
    # cut replicas (--fsdp/--tensor-parallel) take one weight per replica, over the collective transport
    (["--worker-weights", "3,1,1,1", "--fsdp", "2"], ["gives 4 weights for 2 cut replicas", "one per replica"]),
    (
        ["--worker-weights", "3,1", "--fsdp", "2", "--transport", "ps", "--ps-shards", "2"],
        ["across cut replicas", "collective transport only"],
    ),
    (
        ["--balance", "speed", "--fsdp", "2", "--pipeline-stages", "2", "--model", "mlp"],
        ["does not compose with --pipeline-stages and --fsdp/--tensor-parallel together"],
    ),
    # (--balance speed across cut replicas under a range runs: tests/integration/test_heterogeneous.py)
    (["--worker-weights", "2,1,1", "--fsdp", "2", "--workers", "2..3"], ["--worker-weights 2,1,1 does not compose"]),
    (["--balance", "fastest"], ["unknown --balance 'fastest'", "none, speed"]),
    # resource groups (issue 31): --worker-group NAME:COUNT:BATCH[:RESOURCE=AMOUNT,...]
    (["--worker-group", "fast:1:48:fast"], ["--worker-group 'fast:1:48:fast'", "'fast' must be RESOURCE=AMOUNT"]),
    (["--worker-group", "fast:1:48:fast=many"], ["'fast=many' must be RESOURCE=AMOUNT"]),
    (["--worker-group", "fast:1:48:cpu=2"], ["write CPU=2", "not cpu="]),
    (["--worker-group", "fast:1:48:fast=0"], ["fast=0 must be > 0"]),
    (["--worker-group", "fast:1"], ["--worker-group 'fast:1' must be NAME:COUNT:BATCH"]),
    (["--worker-group", "fast:0:48"], ["COUNT and BATCH must be >= 1, got 0 and 48"]),
    (["--worker-group", "fast:-1:48"], ["COUNT and BATCH must be >= 1, got -1 and 48"]),
    (["--worker-group", "fast:1:0"], ["COUNT and BATCH must be >= 1, got 1 and 0"]),
    (["--worker-group", "a:1:8", "--worker-group", "a:1:8"], ["group 'a' is named twice"]),
    (["--worker-group", "g:1:8:GPU=1", "--worker-group", "c:1:8"], ["ask for 0 and 1 GPUs per worker"]),
    ([*GROUPS, "--workers", "3"], ["--workers 3 cannot be combined with it; drop --workers"]),
    ([*GROUPS, "--batch-size", "32"], ["--batch-size 32 cannot be combined with it; drop --batch-size"]),
    ([*GROUPS, "--worker-weights", "3,1"], ["--worker-weights 3,1 cannot be combined with it"]),
    ([*GROUPS, "--strategy", "ssp"], ["--worker-group applies to --strategy bsp", "not --strategy ssp"]),
    ([*GROUPS, "--fsdp", "2"], ["--worker-group does not compose with --fsdp/--tensor-parallel"]),
    (["--config", "{in}/groups_bad.yaml"], ["worker_groups entry", "unknown key(s) gpus", "cpus_per_worker"]),
    (["--balance", "speed", "--strategy", "async"], ["--balance speed applies to", "not --strategy async"]),
    # straggler mitigation (issue 4)
    (["--transport", "ps", "--backup-workers", "-1"], ["--backup-workers must be >= 0"]),
    (["--backup-workers", "1"], ["--backup-workers needs", "--strategy bsp --transport ps"]),
    (["--strategy", "ssp", "--backup-workers", "1"], ["--backup-workers is not used by --strategy ssp", "bsp"]),
    (["--strategy", "async", "--backup-tasks"], ["--backup-tasks is not used by --strategy async", "bsp"]),
    (["--transport", "ps", "--backup-tasks", "--backup-workers", "1"], ["alternatives; choose one"]),
    (["--transport", "ps", "--portions", "8"], ["--portions", "add --backup-tasks"]),
    (["--transport", "ps", "--backup-tasks", "--portions", "2"], ["--portions (2) must exceed --workers (2)"]),
    (["--transport", "ps", "--backup-tasks", "--portions", "5"], ["--portions 5 does not divide", "64"]),
    (["--transport", "ps", "--backup-workers", "1", "--straggler", "3:0.1"], ["--straggler '3:0.1'", "RANK < 3"]),
    (["--straggler-threshold", "1"], ["--straggler-threshold must be a number > 1"]),
    (["--schedule", "bsp:1,ssp", "--backup-tasks"], ["--backup-tasks cannot be combined with --schedule"]),
    (["--init-from", "{in}/full_run/metrics.parquet"], ["cannot read checkpoint"]),
    # fault tolerance and --resume (issue 7)
    (["--max-failures", "-2"], ["--max-failures must be >= 0, or -1"]),
    (["--checkpoint-steps", "-1"], ["--checkpoint-steps must be >= 0"]),
    (["--hang-timeout-s", "0"], ["--hang-timeout-s must be a positive number"]),
    (["--chaos", "explode@3"], ["--chaos 'explode@3'", "kill-worker"]),
    (["--chaos", "kill-worker@0"], ["STEP >= 1"]),
    (["--chaos", "kill-worker@5:7"], ["target 7 does not exist"]),
    (["--chaos", "kill-ps@5"], ["needs the parameter-server transport"]),
    (["--chaos", "kill-node@5:1"], ["kill-node takes no target"]),
    (["--model", "mlp", "--epochs", "2", "--chaos", "kill-worker@44"], ["step 44 is not before the end", "40 steps"]),
    (["--epochs", "2", "--max-steps", "10", "--chaos", "hang-worker@12:0"], ["step 12", "(10 steps"]),
    (["--val-fraction", "1.5"], ["--val-fraction must be in [0, 1)"]),
    (["--checkpoint-best", "best:val_loss"], ["--checkpoint-best 'best:val_loss' must be METRIC"]),
    (["--checkpoint-best", "val_f1"], ["names val_f1, which the task does not report"]),
    (["--target", "test_accuracy>=0.9"], ["selects on the test set", "--test-every-epoch"]),
    (["--resume", "{in}/missing_run"], ["--resume", "is not a directory"]),
    (["--resume", "{in}/full_run"], ["is not a distrain run", "no config.yaml"]),
    (["--resume", "{in}/run_corrupt"], ["cannot read checkpoint", "step-00000010.pt"]),
    (["--resume", "{in}/run_truncated"], ["cannot read checkpoint", "is it complete"]),
    (["--resume", "{in}/run_foreign"], ["holds a 'mlp' model"]),
    (["--resume", "{in}/run_unchecked"], ["run_unchecked has no checkpoint to resume from", "--checkpoint-steps"]),
    (["--resume", "{in}/run_failed_early"], ["run_failed_early has no checkpoint to resume from"]),
    (["--resume", "{in}/run_diverged_early"], ["run_diverged_early has no checkpoint to resume from"]),
    (["--resume", "{in}/run_corrupt", "--lr", "0.3"], ["--resume cannot change --lr", "0.05"]),
    (["--resume", "{in}/run_corrupt", "--strategy", "ssp"], ["--resume cannot change --strategy"]),
    (["--resume", "{in}/run_corrupt", "--run-dir", "{in}/elsewhere"], ["drop --run-dir"]),
    (["--resume", "{in}/run_corrupt", "--config", "{in}/malformed.yaml"], ["drop --config"]),
    # issue 13: a finished run answers at once; an edited config.yaml is refused as the flag would be
    (["--resume", "{in}/run_finished"], ["is finished", "raise --epochs or --max-steps"]),
    (["--resume", "{in}/run_edited"], ["--resume cannot change --lr", "0.05", "5.0", "config.yaml"]),
    (["--resume", "{in}/run_no_metrics"], ["metrics.parquet", "missing", "--init-from"]),
    # local SGD, AdaComm, schedules, emulated delay (issue 5)
    (["--strategy", "local-sgd", "--tau", "0"], ["--tau must be >= 1"]),
    (["--strategy", "diloco", "--sync-every", "0"], ["--sync-every must be >= 1"]),
    (["--comm-bandwidth", "fast"], ["--comm-bandwidth 'fast' is not a rate", "100mbit"]),
    (["--strategy", "diloco", "--fragments", "0"], ["--fragments must be >= 1"]),
    (["--strategy", "diloco", "--fragments", "9"], ["--fragments (9) exceeds --sync-every (8)"]),
    (["--strategy", "diloco", "--model", "mlp", "--fragments", "7"], ["--fragments 7 exceeds the model's 6 parameter"]),
    (["--strategy", "diloco", "--overlap-steps", "8"], ["--overlap-steps must be in [0, --sync-every)"]),
    (["--strategy", "diloco", "--mix-alpha", "1.5"], ["--mix-alpha must be in [0, 1]"]),
    (["--comm-bandwidth", "-5mbit"], ["--comm-bandwidth must be a positive rate"]),
    (["--strategy", "diloco", "--outer-lr", "0"], ["--outer-lr must be a positive number"]),
    (["--strategy", "diloco", "--outer-optimizer", "lbfgs"], ["unknown --outer-optimizer 'lbfgs'", "adamw"]),
    (["--strategy", "diloco", "--outer-optimizer", "adam", "--outer-momentum", "0.5"], ["--outer-momentum applies to"]),
    (["--strategy", "diloco", "--outer-momentum", "1"], ["--outer-momentum must be in [0, 1)"]),
    (["--strategy", "bsp", "--sync-every", "4"], ["--sync-every is not used by --strategy bsp", "diloco"]),
    (["--strategy", "diloco", "--transport", "ps"], ["--transport ps cannot carry --strategy diloco"]),
    (["--strategy", "local-sgd", "--adaptive-tau", "--tau", "8", "--tau-max", "4"], ["--tau-max (4) is below --tau"]),
    (["--adaptive-tau"], ["--adaptive-tau is not used by --strategy bsp", "local-sgd"]),
    (["--strategy", "ssp", "--tau", "4"], ["--tau is not used by --strategy ssp", "local-sgd"]),
    (["--strategy", "local-sgd", "--tau-interval", "5s"], ["--tau-interval only applies with --adaptive-tau"]),
    (["--strategy", "local-sgd", "--adaptive-tau", "--tau-interval", "5m"], ["--tau-interval '5m'"]),
    (["--schedule", "bsp:two,local-sgd"], ["--schedule", "whole number of epochs"]),
    (["--schedule", "bsp:1,sgd-deluxe"], ["--schedule", "unknown strategy 'sgd-deluxe'", "local-sgd"]),
    (["--schedule", "bsp:3,local-sgd", "--epochs", "2"], ["--schedule", "exceeds --epochs 2"]),
    (["--schedule", "bsp:1,ssp", "--tau", "4"], ["--tau is not used by --schedule bsp:1,ssp"]),
    (["--schedule", "ssp:1,bsp", "--transport", "collective"], ["cannot carry --strategy ssp"]),
    (["--comm-delay-ms", "-5"], ["--comm-delay-ms must be >= 0"]),
    # issue 26: an emulated delay per transfer that reaches the hang timeout was run, then reported as a hang
    (["--comm-delay-ms", "60000", "--hang-timeout-s", "20"], ["--comm-delay-ms 60000 (60 s per transfer) reaches"]),
    (["--comm-delay-ms", "20000", "--hang-timeout-s", "20"], ["--hang-timeout-s 20", "raise --hang-timeout-s"]),
    # issue 28: across cut replicas the link delays what crosses them through the channel; HSDP's all-reduce does not
    (
        ["--fsdp", "2", "--comm-delay-ms", "50"],
        ["--fsdp 2 with --strategy bsp does not compose with --comm-delay-ms", "HSDP", "--compress", "diloco"],
    ),
    # issue 26: --tensorboard that cannot be written was found after Ray started, leaving a failed run directory
    (["--tensorboard", "{in}/full_run/metrics.parquet"], ["--tensorboard", "exists and is not a directory"]),
    (["--tensorboard", "{in}/full_run/metrics.parquet/tb"], ["--tensorboard", "lies under", "a file"]),
    # compression (issue 15)
    (["--compress", "zip"], ["--compress", "unknown codec 'zip'", "powersgd:RANK"]),
    (["--compress", "topk:1.5"], ["--compress", "(0, 1]"]),
    (["--compress", "topk:0"], ["--compress", "(0, 1]"]),
    (["--compress", "powersgd:0"], ["--compress", "rank"]),
    # mixed precision
    (["--precision", "fp8"], ["unknown --precision 'fp8'", "fp32, bf16, fp16"]),
    (["--precision", "fp16", "--compress", "int8"], ["--precision fp16 cannot be combined with --compress"]),
    (["--compress", "powersgd"], ["--compress", "powersgd:RANK"]),
    (["--strategy", "async", "--compress", "powersgd:2"], ["needs whole matrices", "flat slice", "topk:FRACTION"]),
    (["--strategy", "bsp", "--transport", "ps", "--compress", "powersgd:2"], ["needs whole matrices"]),
    (["--strategy", "bsp", "--transport", "ps", "--backup-tasks", "--compress", "int8"], ["--backup-tasks portions"]),
    # pipelines (issue 16)
    (["--pipeline-stages", "9", "--model", "mlp"], ["--pipeline-stages 9 needs 8 cuts", "5 places to cut"]),
    (["--pipeline-stages", "2", "--model", "resnet18"], ["--pipeline-stages needs", "nn.Sequential", "ResNet"]),
    (["--pipeline-stages", "0"], ["--pipeline-stages must be >= 1, got 0"]),
    (["--pipeline-stages", "2", "--microbatches", "0"], ["--microbatches must be >= 1, got 0"]),
    (["--pipeline-stages", "2", "--microbatches", "5"], ["--microbatches 5 does not divide", "--batch-size 32"]),
    (["--microbatches", "4"], ["--microbatches cuts a pipeline's batch", "--pipeline-stages"]),
    (["--pipeline-stages", "2", "--pipeline-schedule", "zb"], ["unknown --pipeline-schedule 'zb'", "gpipe, 1f1b"]),
    (["--pipeline-stages", "2", "--strategy", "local-sgd"], ["--pipeline-stages runs with --strategy bsp"]),
    (["--pipeline-stages", "2", "--strategy", "async"], ["--pipeline-stages runs with --strategy bsp"]),
    (["--pipeline-stages", "2", "--transport", "ps"], ["--pipeline-stages runs with --strategy bsp"]),
    (["--pipeline-stages", "2", "--compress", "int8"], ["--compress does not compose with --pipeline-stages"]),
    # optimizers and LR decay (issue 14)
    (["--optimizer", "lion"], ["unknown --optimizer 'lion'", "sgd, adam, adamw"]),
    (["--optimizer", "LBFGS"], ["--optimizer LBFGS is not supported", "closure", "element-wise"]),
    (["--optimizer", "Adafactor"], ["is not supported", "whole tensors"]),
    (["--optimizer", "adam", "--momentum", "0.5"], ["--momentum is not used by --optimizer adam", "sgd, rmsprop"]),
    (["--optimizer", "adam", "--optimizer-arg", "nesterov=true"], ["takes no argument 'nesterov'", "betas"]),
    (["--optimizer", "adam", "--optimizer-arg", "betas=[1,2]"], ["refuses its arguments", "beta"]),
    (["--optimizer-arg", "nesterov"], ["--optimizer-arg 'nesterov' must be KEY=VALUE"]),
    (["--lr-decay", "exp"], ["unknown --lr-decay 'exp'", "none, cosine, step"]),
    (["--lr-decay-gamma", "0.5"], ["--lr-decay-gamma applies to --lr-decay step"]),
    # Sandblaster (issue 20)
    (["--strategy", "sandblaster", "--history", "0"], ["--history must be >= 1"]),
    (["--strategy", "sandblaster", "--tasks-per-pass", "1"], ["--tasks-per-pass (1) must be at least --workers (2)"]),
    (["--strategy", "sandblaster", "--tasks-per-pass", "5000"], ["--tasks-per-pass (5000) exceeds the 1294 training"]),
    (
        ["--strategy", "sandblaster", "--workers", "1", "--fsdp", "2", "--tasks-per-pass", "1000"],
        ["--tasks-per-pass (1000) cuts the 1294 training samples into portions smaller than --fsdp 2"],
    ),
    (["--strategy", "sandblaster", "--batch-optimizer", "newton"], ["unknown --batch-optimizer 'newton'", "lbfgs, gd"]),
    (["--strategy", "sandblaster", "--momentum", "0.5"], ["--strategy sandblaster ignores --momentum"]),
    (["--strategy", "sandblaster", "--lr", "0.3"], ["ignores --lr", "L-BFGS takes no learning rate"]),
    (["--strategy", "sandblaster", "--optimizer", "adam"], ["--strategy sandblaster ignores --optimizer"]),
    (["--strategy", "sandblaster", "--lr-decay", "cosine"], ["--strategy sandblaster ignores --lr-decay"]),
    (["--strategy", "sandblaster", "--precision", "bf16"], ["--strategy sandblaster ignores --precision"]),
    (["--pipeline-stages", "2", "--precision", "bf16"], ["--precision bf16 does not compose with --pipeline-stages"]),
    (["--pipeline-stages", "2", "--gpus-per-worker", "0.5"], ["--pipeline-stages with --gpus-per-worker 0.5", "gloo"]),
    # a worker's memory budget: 4 equal blocks of 4160 parameters, x 4 copies (θ, gradient, buffer, momentum)
    (["--worker-memory", "lots"], ["--worker-memory takes a size such as 3GiB", "'lots'"]),
    ([*WIDE, "--worker-memory", "100KiB"], ["one worker would hold ~0.3 MiB", "--pipeline-stages 4 splits it"]),
    ([*WIDE, "--worker-memory", "100KiB", "--pipeline-stages", "2"], ["the largest of 2 pipeline stages", "stages 4"]),
    ([*WIDE, "--worker-memory", "10KiB"], ["one worker would hold", "use a smaller --model or --batch-size"]),
    (["--strategy", "sandblaster", "--compress", "int8"], ["--strategy sandblaster does not apply --compress"]),
    (["--strategy", "sandblaster", "--portions", "8"], ["--portions is not used by --strategy sandblaster"]),
    (["--schedule", "bsp:1,sandblaster"], ["--strategy sandblaster ignores --schedule"]),
    (["--history", "3"], ["--history is not used by --strategy bsp", "sandblaster"]),
]


# `distrain tune` (issue 6): refused before Ray starts, so before any trial
TUNE_BAD_INPUTS = [
    (["--batch-sizes", ""], ["--batch-sizes is empty"]),
    (["--batch-sizes", "16,abc"], ["--batch-sizes", "'abc' is not an integer"]),
    (["--batch-sizes", "16,,32"], ["--batch-sizes", "empty value"]),
    (["--batch-sizes", "0,16"], ["--batch-size must be >= 1"]),
    (["--lr", "0.5:0.01", "--search", "random"], ["--lr", "low end must be below its high end"]),
    (["--lr", "0.1:0.1:log", "--search", "random"], ["--lr", "low end must be below"]),
    (["--lr", "0:0.5:log", "--search", "random"], ["a log range needs a positive low end"]),
    (["--lr", "0.01:0.5:ln", "--search", "random"], ["LOW:HIGH or LOW:HIGH:log"]),
    (["--lr", "0.01:0.5"], ["grid search cannot enumerate", "--search random"]),
    (["--workers", "2:4", "--search", "random"], ["--workers '2:4' must be a comma list of positive worker counts"]),
    (["--workers", "2,0"], ["--workers '2,0' must be a comma list of positive worker counts"]),  # as `plan` says
    (["--param", "workers=4,x"], ["--param workers '4,x' must be a comma list"]),
    (["--lr-scaling", "linear,cubic"], ["--lr-scaling", "linear, sqrt, none"]),
    (["--scheduler", "hyperband"], ["unknown --scheduler 'hyperband'", "none, asha"]),
    (["--search", "bayes"], ["unknown --search 'bayes'", "grid, random"]),
    (["--objective", "speed"], ["unknown --objective"]),
    (["--num-samples", "0"], ["--num-samples must be >= 1"]),
    (["--staleness", "0,2"], ["--staleness is not used by --strategy bsp"]),
    (["--strategies", "bsp,async", "--staleness", "0,2"], ["not used by any of --strategies bsp,async", "ssp"]),
    (["--batch-sizes", "16,100000"], ["global batch (200000) exceeds the 1294 training samples"]),  # as `run` says
    (["--cluster-cpus", "-4"], ["--cluster-cpus must be >= 0"]),
    (["--cluster-cpus", "2", "--workers", "2,4"], ["needs 4.01 CPUs but --cluster-cpus is 2"]),
    (["--cluster-cpus", "4", "--address", "auto"], ["--cluster-cpus sizes a local Ray", "--address"]),
    (["--num-samples", "40"], ["40 trials (more than 32)", "no terminal", "add --yes"]),
    (["--param", "bogus=1,2"], ["unknown config field 'bogus'"]),
    (["--workers", "2..4"], ["--workers '2..4'", "fixed placement group", "not ranges"]),
    (["--param", "workers=2,2..4"], ["fixed placement group"]),
    (["--config", "{in}/elastic.yaml", "--batch-sizes", "16"], ["--workers 2..3 (the base config's)", "not ranges"]),
    (["--param", "momentum"], ["--param 'momentum' must be NAME=VALUES"]),
    (["--param", "run_dir=a,b"], ["cannot be swept"]),
    (["--sweep-dir", "{in}/full_run"], ["--sweep-dir", "not empty"]),
    (["--resume", "{in}/full_run"], ["not a sweep directory"]),
    (["--resume", "{in}/full_run", "--epochs", "3"], ["--resume continues a sweep with its own settings"]),
    (["--config", "{in}/malformed.yaml", "--batch-sizes", "16"], ["malformed YAML"]),
    (["--config", "{in}/binary.yaml", "--batch-sizes", "16"], ["not a text (UTF-8 YAML) file"]),
    (["--config", "{in}/twice.yaml", "--batch-sizes", "16"], ["key 'workers' appears twice"]),
    (["--dataset", "digits", "--data-dir", "{in}/empty_data"], ["--data-dir is not used by --dataset digits"]),
    (["--param", "optimizer=adam", "--param", "momentum=0.5,0.9"], ["--momentum is not used by --optimizer adam"]),
]


@pytest.mark.parametrize(("args", "fragments"), TUNE_BAD_INPUTS, ids=[" ".join(a) for a, _ in TUNE_BAD_INPUTS])
def test_tune_bad_input_is_one_line_exit_2_and_writes_nothing(workdir, args, fragments):
    cwd, inputs = workdir
    before = snapshot(inputs)
    result = runner.invoke(app, ["tune", *[a.replace("{in}", str(inputs)) for a in args]])
    assert_one_line_error(result, *fragments)
    assert list(cwd.iterdir()) == []  # in particular, no sweep/
    assert snapshot(inputs) == before


class SweepStarts(Exception):
    """Raised by a stand-in for run_sweep: the command got past its checks and its confirmation."""


@pytest.fixture
def sweep_starts(monkeypatch):
    from distrain.tuning import tune

    def start(*args, **kwargs):
        raise SweepStarts()

    monkeypatch.setattr(tune, "run_sweep", start)


@pytest.mark.parametrize("answer, starts", [("n\n", False), ("\n", False), ("", False), ("y\n", True)])
def test_a_large_sweep_asks_on_a_terminal(workdir, sweep_starts, monkeypatch, answer, starts):
    """Above 32 trials a terminal is asked, after the trial count is shown; no (the default) or end of
    input starts nothing and writes nothing; yes goes on to the sweep."""
    import distrain.cli

    cwd, _ = workdir
    monkeypatch.setattr(distrain.cli, "_stdin_is_terminal", lambda: True)
    args = ["tune", "--model", "mlp", "--batch-sizes", "16,32", "--num-samples", "20"]
    result = runner.invoke(app, args, input=answer)
    assert "40 trial(s), grid search" in result.stdout and "start 40 trials? [y/N]" in result.stdout
    assert result.stdout.index("40 trial(s)") < result.stdout.index("start 40 trials?")
    if starts:
        assert isinstance(result.exception, SweepStarts), result.output
    else:
        assert result.exit_code == 1 and "sweep not started; nothing written" in result.stderr, result.output
    assert list(cwd.iterdir()) == []


def test_yes_starts_a_large_sweep_without_a_terminal_and_a_small_one_needs_no_answer(workdir, sweep_starts):
    result = runner.invoke(app, ["tune", "--model", "mlp", "--num-samples", "40", "--yes"])
    assert isinstance(result.exception, SweepStarts), result.output
    assert "40 trial(s)" in result.stdout and "start" not in result.stdout.split("trial(s)")[1]
    result = runner.invoke(app, ["tune", "--model", "mlp", "--num-samples", "32"])  # at the threshold: no question
    assert isinstance(result.exception, SweepStarts), result.output
    assert "32 trial(s)" in result.stdout


@pytest.mark.parametrize(("args", "fragments"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(workdir, args, fragments):
    cwd, inputs = workdir
    before = snapshot(inputs)
    args = [a.replace("{in}", str(inputs)) for a in args]
    result = runner.invoke(app, ["run", *args])
    assert_one_line_error(result, *fragments)
    assert list(cwd.iterdir()) == []  # in particular, no runs/
    assert snapshot(inputs) == before  # the non-empty run dir and every other input untouched


def test_flag_overrides_a_bad_yaml_value_and_a_bad_flag_overrides_a_good_file(workdir):
    cwd, _ = workdir
    inputs = cwd.parent  # this test's own files, outside the current directory (not the shared inputs)
    (inputs / "c.yaml").write_text("workers: 3\n")
    result = runner.invoke(app, ["run", "--config", str(inputs / "c.yaml"), "--workers", "0"])
    assert_one_line_error(result, "--workers must be >= 1, got 0")
    (inputs / "d.yaml").write_text("workers: 0\nbogus_key: 1\n")
    result = runner.invoke(app, ["run", "--config", str(inputs / "d.yaml"), "--workers", "2"])
    assert_one_line_error(result, "bogus_key", "d.yaml")
    assert list(cwd.iterdir()) == []


def test_error_text_with_brackets_is_printed_verbatim(workdir):
    result = runner.invoke(app, ["run", "--strategy", "[/]"])
    assert_one_line_error(result, "unknown strategy '[/]'")


def test_strategies_lists_bsp():
    result = runner.invoke(app, ["strategies"])
    assert result.exit_code == 0, result.output
    names = [line.split()[0] for line in result.stdout.splitlines() if line.strip() and not line.startswith(" ")]
    assert names == ["async", "bsp", "diloco", "local-sgd", "sandblaster", "ssp"]
    assert "transports: collective, ps; options: --backup-workers --backup-tasks --portions" in result.stdout


def test_help():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    assert "run" in result.output and "strategies" in result.output
    result = runner.invoke(app, ["run", "--help"])
    assert result.exit_code == 0, result.output
    for flag in ("--workers", "--strategy", "--config", "--run-dir", "--gpus-per-worker"):
        assert flag in result.output


def test_no_arguments_prints_help():
    result = runner.invoke(app, [])
    assert "Usage" in result.output
    assert "Traceback" not in result.output


def _closed_port() -> int:
    """A local TCP port nothing listens on (bound once, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --address that names no cluster: (arguments, RAY_ADDRESS, what ray_current_cluster says, fragments)
BAD_ADDRESSES = [
    (["--address", "auto"], None, None, ["--address auto found no Ray cluster", "ray start --head"]),
    (["--address", "auto"], "127.0.0.1:{port}", None, ["no Ray cluster answers at 127.0.0.1:{port}"]),
    (["--address", "auto"], None, "127.0.0.1:{port}", ["no Ray cluster answers at 127.0.0.1:{port}"]),  # stale
    (["--address", "127.0.0.1:{port}"], None, None, ["no Ray cluster answers at 127.0.0.1:{port}", "refused"]),
    (["--address", "ray://127.0.0.1:{port}"], None, None, ["no Ray cluster answers at ray://127.0.0.1:{port}"]),
    (["--address", "headnode"], None, None, ["--address 'headnode' must be auto or HOST:PORT"]),
    (["--address", "10.0.0.1:99999"], None, None, ["must be auto or HOST:PORT"]),
]


@pytest.mark.parametrize("command", ["run", "tune"])
@pytest.mark.parametrize(
    ("args", "env", "recorded", "fragments"), BAD_ADDRESSES, ids=[f"{a[1]}-{e}-{r}" for a, e, r, _ in BAD_ADDRESSES]
)
def test_address_with_no_cluster_is_one_line_and_ray_is_never_asked(
    tmp_path, monkeypatch, command, args, env, recorded, fragments
):
    """Ray would retry an unreachable address for a long time, then print a traceback; `auto` with no
    cluster was a ConnectionError traceback. Both are refused before ray.init, and nothing is written."""
    import ray

    def refuse(*a, **k):
        raise AssertionError("ray.init must not be called for an address with no cluster")

    monkeypatch.setattr(ray, "init", refuse)
    port = str(_closed_port())
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "raytmp"))  # where Ray looks for ray_current_cluster
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if env is not None:
        monkeypatch.setenv("RAY_ADDRESS", env.replace("{port}", port))
    if recorded is not None:
        (tmp_path / "raytmp" / "ray").mkdir(parents=True)
        (tmp_path / "raytmp" / "ray" / "ray_current_cluster").write_text(recorded.replace("{port}", port))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    extra = ["--batch-sizes", "16", "--epochs", "1"] if command == "tune" else []
    result = runner.invoke(app, [command, *[a.replace("{port}", port) for a in args], *extra])
    if command == "tune":  # the sweep's size comes first (stdout, before Ray is asked); then the error
        assert result.stdout.strip().startswith("sweep ") and len(result.stdout.strip().splitlines()) == 1
        result = SimpleNamespace(exit_code=result.exit_code, output=result.stderr, stdout="", stderr=result.stderr)
    assert_one_line_error(result, *[f.replace("{port}", port) for f in fragments])
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--workers", "64", "--batch-size", "8"], ["64 workers need ~30", "GiB each", "has 8.0 GiB available"]),
        (["--strategy", "ssp", "--ps-shards", "12", "--workers", "14", "--batch-size", "8"], ["fewer --ps-shards"]),
        (["--model", "resnet18", "--workers", "1"], ["1 workers need", "use a smaller --model or --batch-size"]),
    ],
)
def test_workers_that_cannot_fit_in_memory_are_refused_before_ray_starts(workdir, monkeypatch, args, fragments):
    """`--workers 64` on a small machine ran minutes, then died of Ray's OutOfMemoryError."""
    import ray

    cwd, inputs = workdir
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as on a machine with no Ray running
    monkeypatch.setenv("DISTRAIN_AVAILABLE_MEMORY", "8GiB" if "64" in args else "1GiB")
    assert_one_line_error(runner.invoke(app, ["run", *args]), *fragments)
    assert list(cwd.iterdir()) == []


@contextlib.contextmanager
def tcp_server(answer):
    """A local TCP server (in a thread) that accepts every connection and calls answer(conn) on it;
    yields its HOST:PORT."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            held.append(conn)
            answer(conn)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
        for conn in held:
            conn.close()


def grpc_like(conn):
    """What a gRPC server (Ray's GCS) answers to an HTTP/2 connection preface: its SETTINGS frame."""
    conn.recv(64)
    conn.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00" + b"\x00\x03\x00\x00\x00\x64")


def http1(conn):
    conn.recv(64)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    conn.close()


def test_address_probe_lets_a_grpc_server_through(monkeypatch):
    from distrain.orchestrator import address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with tcp_server(grpc_like) as where:
        assert address.reachable(where) == where
        monkeypatch.setenv("RAY_ADDRESS", where)
        assert address.reachable("auto") == where  # what `ray job submit` sets for the job's driver
    assert address.reachable("local") == "local"


EXPECTED_REFUSAL = "error: no Ray cluster answers at {where}: something accepts connections there but does not speak"


def test_address_that_answers_http1_is_refused_by_the_probe(tmp_path, monkeypatch):
    """A web server (or any service but Ray) on the port: refused in one line before ray.init is asked."""
    import ray

    def refuse(*a, **k):
        raise AssertionError("ray.init must not be called for an address where Ray does not answer")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.chdir(tmp_path)
    with tcp_server(http1) as where:
        result = runner.invoke(app, ["run", "--address", where, "--model", "linear", "--epochs", "1"])
    line = assert_one_line_error(result, "Ray's protocol (it answered 'HTTP/1.1 ')")
    assert line.startswith(EXPECTED_REFUSAL.format(where=where)), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, expected",
    [
        (["run", "--workers", "abc"], "--workers must be an integer, got 'abc'"),  # N or MIN..MAX: read by config
        (["run", "--no-such-flag"], "No such option"),
        (["no-such-command"], "No such command"),
    ],
)
def test_console_script_usage_errors_are_one_line(tmp_path, args, expected):
    """The installed entry point (not only CliRunner) turns click's usage errors into one line, exit 2."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from distrain.cli import main; sys.exit(main())", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_help_piped_into_a_reader_that_stops_early_is_quiet(tmp_path):
    """`distrain tune --help | head`: rich ends the process with SystemExit(1) on the broken pipe, which
    must pass main()'s except clauses without a traceback (an except naming a missing click class did)."""
    import subprocess
    import sys

    entry = f"{sys.executable} -c 'import sys; from distrain.cli import main; sys.exit(main())'"
    proc = subprocess.run(
        ["bash", "-c", f"{entry} tune --help | head -3"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in proc.stdout + proc.stderr and "Error" not in proc.stderr, proc.stderr
    assert "Usage" in proc.stdout


def test_address_where_something_else_listens_is_one_line(tmp_path, monkeypatch):
    """The TCP probe passes (a proxy, another service), then ray.init fails after its own retries."""
    import ray

    def no_gcs(*a, **k):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")

    monkeypatch.setattr(ray, "init", no_gcs)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr("distrain.orchestrator.address.probe", lambda *a, **k: None)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["run", "--address", "10.0.0.1:6379"])
    assert_one_line_error(result, "10.0.0.1:6379 accepts connections but did not answer as a Ray cluster")
    assert list(tmp_path.iterdir()) == []
