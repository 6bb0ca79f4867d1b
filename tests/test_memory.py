"""The memory estimate (orchestrator/memory.py): its parts, the refusal, and start-up progress."""

from __future__ import annotations

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


def test_shards_and_backup_workers_are_counted():
    n = 1_000_000
    ps = memory.estimate(RunConfig(strategy="ssp", ps_shards=4, workers=3, backup_workers=0), n)
    assert ps.shards == 4 and ps.per_shard == memory.PROCESS_BYTES + n // 4 * 4 * 3  # θ, gradient sum, momentum
    backup = memory.estimate(RunConfig(transport="ps", workers=3, backup_workers=2), n)
    assert backup.workers == 5 and backup.total == memory.SHARED_BYTES + 5 * backup.per_worker + backup.per_shard


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


def test_start_up_progress_is_reported_before_the_run_starts(ray_cluster, tmp_path):
    from distrain.orchestrator.run import RunStarted, WorkersStarting, run_training

    events = []
    cfg = RunConfig(model="mlp", workers=3, epochs=1, max_steps=2, run_dir=str(tmp_path / "r"))
    run_training(cfg, events.append)
    starting = [e for e in events if isinstance(e, WorkersStarting)]
    assert starting[0] == WorkersStarting(0, 3) and starting[-1] == WorkersStarting(3, 3)
    assert [e.started for e in starting] == sorted(e.started for e in starting)
    assert isinstance(events[len(starting)], RunStarted)  # all of it before the run starts
