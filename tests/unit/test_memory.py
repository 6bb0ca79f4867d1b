"""The memory estimate (orchestrator/memory.py): its parts, the refusal, and start-up progress."""

from __future__ import annotations

from pathlib import Path

import pytest

from distrain.config import RunConfig
from distrain.errors import ResourceError
from distrain.orchestrator import memory
from distrain.orchestrator.memory import GiB, MiB


def test_activations_are_counted_from_the_layers_output_shapes():
    # mlp on digits: input 64, flatten 64, then 256, relu 256, 256, relu 256, 10
    assert memory.activation_values("mlp", "digits") == 64 + 64 + 4 * 256 + 10
    assert memory.activation_values("resnet18", "cifar10") > 100 * memory.activation_values("mlp", "digits")


def test_model_part_counts_parameters_gradients_buffer_and_optimizer_state():
    n = 1_000_000
    sgd = memory.estimate(RunConfig(), n)
    assert sgd.model == n * 4 * 4  # θ, gradients, communication buffer, momentum
    assert memory.estimate(RunConfig(momentum=0.0), n).model == n * 4 * 3
    assert memory.estimate(RunConfig(optimizer="adam"), n).model == n * 4 * 5
    assert sgd.process == memory.PROCESS_BYTES
    assert sgd.activations == 2 * 32 * memory.activation_values("cnn", "digits") * 4
    assert memory.estimate(RunConfig(batch_size=64), n).activations == 2 * sgd.activations
    assert sgd.data == 1797 * (64 * 4 + 8)
    assert sgd.total == memory.SHARED_BYTES + 2 * sgd.per_worker



def test_half_precision_halves_the_activations_and_adds_a_half_copy_of_the_weights():
    """--precision bf16/fp16: float32 masters, gradients and optimizer state; the forward's values (the
    activations and the weights cast for it) at 2 bytes."""
    n = 1_000_000
    fp32, bf16 = memory.estimate(RunConfig(), n), memory.estimate(RunConfig(precision="bf16"), n)
    assert bf16.model == n * (4 * 4 + 2)
    assert bf16.activations * 2 == fp32.activations
    assert memory.estimate(RunConfig(precision="fp16"), n) == bf16
    # --fsdp 2: a worker's half of the float32 copies, and the largest unit gathered in bf16, not float32
    cut = memory.CutSizes(total=n, held=n, largest_unit=n // 4)
    sharded = RunConfig(fsdp=2, precision="bf16")
    assert memory.estimate(sharded, n, cut).model == n // 2 * 4 * 4 + n // 4 * 2
    assert memory.estimate(sharded.replace(precision="fp32"), n, cut).model == n // 2 * 4 * 4 + n // 4 * 4

def test_shards_and_backup_workers_are_counted():
    n = 1_000_000
    ps = memory.estimate(RunConfig(strategy="ssp", ps_shards=4, workers=3, backup_workers=0), n)
    assert ps.shards == 4 and ps.per_shard == memory.PROCESS_BYTES + n // 4 * 4 * 3  # θ, gradient sum, momentum
    backup = memory.estimate(RunConfig(transport="ps", workers=3, backup_workers=2), n)
    assert backup.workers == 5 and backup.total == memory.SHARED_BYTES + 5 * backup.per_worker + backup.per_shard


WIDE = str(Path(__file__).parents[1] / "pipeline_task.py") + ":WideMLP"


def test_a_pipeline_stage_holds_its_share_of_the_model():
    """4 equal blocks of Linear(64, 64): each of S stages holds 1/S of the parameter copies."""
    wide = dict(task=WIDE, task_args={"width": 64}, workers=1, batch_size=16)
    one = memory.estimate(RunConfig(**wide), 4 * 4160)
    assert one.model == 4 * 4160 * 4 * 4  # θ, gradient, buffer, momentum
    for stages in (2, 4):
        est = memory.estimate(RunConfig(**wide, pipeline_stages=stages, microbatches=2), 4 * 4160)
        assert est.model * stages == one.model and est.stages == stages and est.workers == stages


def test_a_pipeline_stage_holds_the_activations_of_its_layers_for_its_micro_batches_in_flight():
    # mlp on digits cut in 3: [flatten, fc 64->256] [relu, fc 256->256] [relu, fc 256->10]; each stage's
    # layers' outputs plus its input (the data, or the previous stage's last output).
    shares = memory.stage_shares(RunConfig(model="mlp", pipeline_stages=3, microbatches=2))
    assert shares == [(64 * 256 + 256, 64 + 64 + 256), (256 * 256 + 256, 256 + 256 + 256), (2570, 256 + 10 + 256)]
    assert sum(p for p, _ in shares) == 85002  # the whole mlp
    # GPipe: every micro-batch's activations before the first backward; 1F1B: at most S - stage of them.
    assert memory.in_flight_fraction("gpipe", 4, 8, 0) == 1.0
    assert [memory.in_flight_fraction("1f1b", 4, 8, s) for s in range(4)] == [4 / 8, 3 / 8, 2 / 8, 1 / 8]
    assert memory.in_flight_fraction("1f1b", 4, 2, 0) == 1.0
    cfg = dict(model="mlp", pipeline_stages=3, microbatches=4, batch_size=32, momentum=0.0)
    gpipe = memory.estimate(RunConfig(**cfg), 0)
    assert gpipe.model == (256 * 256 + 256) * 4 * 3  # the middle stage holds the most
    assert gpipe.activations == 2 * 32 * 768 * 4
    assert memory.estimate(RunConfig(**cfg, pipeline_schedule="1f1b"), 0).activations == 2 * 32 * 768 * 4 * 2 // 4


def test_a_worker_memory_budget_refuses_one_worker_and_names_the_stages_that_fit():
    wide = dict(task=WIDE, task_args={"width": 64}, workers=1, batch_size=16, worker_memory="100KiB")
    one = RunConfig(**wide)
    with pytest.raises(ResourceError) as info:
        memory.check_worker(one, memory.estimate(one, 4 * 4160))
    assert str(info.value) == (
        "one worker would hold ~0.3 MiB (0.3 MiB of parameters, gradients and optimizer state, 0.0 MiB of "
        "activations), over --worker-memory 100KiB (0.1 MiB); --pipeline-stages 4 splits it so each stage fits or "
        "--fsdp 4 shards it so each worker fits"
    )
    four = RunConfig(**wide, pipeline_stages=4, microbatches=2)
    memory.check_worker(four, memory.estimate(four, 4 * 4160))  # 65 KiB a stage: accepted
    memory.check_worker(one.replace(worker_memory=""), memory.estimate(one, 4 * 4160))  # no budget stated


def test_a_run_that_does_not_fit_is_refused_with_the_figures():
    est = memory.estimate(RunConfig(workers=64, batch_size=8), 150_000)
    memory.check(est, est.total)  # exactly enough: accepted
    with pytest.raises(ResourceError) as info:
        memory.check(est, 20 * GiB)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(f"64 workers need ~{est.total / GiB:.1f} GiB (0.4")
    assert "this machine has 20.0 GiB available; use fewer workers" in line


@pytest.mark.parametrize(("text", "value"), [("20GiB", 20 * GiB), ("512 MiB", 512 * MiB), ("1e9", 10**9), ("3gb", 3e9)])
def test_parse_bytes(text, value):
    assert memory.parse_bytes(text) == value


def test_available_memory_can_be_injected(monkeypatch):
    assert memory.local_available() > 0  # MemAvailable
    monkeypatch.setenv(memory.AVAILABLE_ENV, "3GiB")
    assert memory.local_available() == 3 * GiB


