"""--precision: autocast forward passes, fp16's loss scale, its skip decision, and the GPU checks.

Unit tests (no Ray) pin the pieces; the integration tests run BSP with fp16 on a task whose gradient
overflows fp16 at the starting scale, and bf16 on the bundled data.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch import nn

from distrain.config import RunConfig
from distrain.errors import ConfigError, ResourceError
from distrain.strategies.base import CommStats, NonFinite, Strategy, StrategyContext
from distrain.trainers.local_trainer import LocalTrainer
from distrain.trainers.precision import LossScaler
from distrain.trainers.task import ClassificationTask


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


class Direct(ClassificationTask):
    """Cross-entropy of an MLP on random digits-shaped inputs (no data set needed)."""

    def loss(self, model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1])


BATCH = (torch.randn(16, 64, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 10)


def trainer(precision: str, seed: int = 0, task=None) -> LocalTrainer:
    return LocalTrainer(mlp(seed), task or Direct(), "sgd", 0.1, 0.0, 0.0, precision=precision)


class Lockstep(Strategy):
    """The smallest strategy: the gradient as it is (as after an all-reduce), then the update."""

    name = "lockstep-test"

    def step(self, trainer, lr):
        if self.usable_gradient(trainer, "gradient"):
            trainer.apply_update(lr)
            return CommStats()
        return CommStats(nonfinite=True)


def strategy(on_nonfinite: str = "stop") -> Lockstep:
    config = RunConfig(on_nonfinite=on_nonfinite)
    s = Lockstep.__new__(Lockstep)
    s.config, s.ctx, s.options = config, StrategyContext(0, 1, "cpu"), None
    return s


# ---------------------------------------------------------------------------------------- the scale
def test_loss_scaler_halves_on_overflow_and_doubles_after_the_growth_interval():
    s = LossScaler(growth_interval=3)
    s.update(overflow=True)
    assert (s.scale, s.overflows, s.clean_steps) == (2.0**15, 1, 0)
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 2.0**15 and s.clean_steps == 2
    s.update(overflow=False)
    assert s.scale == 2.0**16 and s.clean_steps == 0
    copy = LossScaler()
    copy.load_state_dict(s.state_dict())
    assert copy == s


def test_bf16_and_fp16_run_the_forward_pass_in_their_dtype_and_keep_float32_gradients():
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        t = trainer(precision)
        seen = []
        t.model[0].register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.dtype))
        t.compute_gradients(BATCH)
        assert seen == [dtype], precision
        assert t.grads_flat.dtype == torch.float32 and t.params_flat.dtype == torch.float32


def test_fp16_gradient_is_scaled_until_the_strategy_unscales_it_and_then_matches_fp32():
    reference = trainer("fp32")
    reference.compute_gradients(BATCH)
    half = trainer("fp16")
    half.compute_gradients(BATCH)
    scale = half.scaler.scale
    scaled = half.grads_flat.clone()
    assert strategy().usable_gradient(half, "gradient")
    torch.testing.assert_close(half.grads_flat * scale, scaled)  # exactly: the scale is a power of two
    torch.testing.assert_close(half.grads_flat, reference.grads_flat, rtol=2e-2, atol=2e-3)
    half.unscale_grads_()  # once per backward: a second call changes nothing
    torch.testing.assert_close(half.grads_flat * scale, scaled)
    bf = trainer("bf16")
    bf.compute_gradients(BATCH)
    torch.testing.assert_close(bf.grads_flat, reference.grads_flat, rtol=5e-2, atol=1e-2)


class Loud(Direct):
    """A loss 1e4 times larger: its fp16 backward overflows at the starting scale of 2**16."""

    def loss(self, model, batch):
        return super().loss(model, batch) * 1e4


def test_an_fp16_overflow_is_skipped_and_halves_the_scale_even_under_on_nonfinite_stop():
    t = trainer("fp16", task=Loud())
    before = t.params_flat.clone()
    s = strategy("stop")
    skipped = 0
    for _ in range(30):
        t.compute_gradients(BATCH)
        if s.step(t, 1e-6).nonfinite:
            skipped += 1
        else:
            break
    assert 0 < skipped < 30 and t.scaler.overflows == skipped
    assert s.overflow_skips == skipped  # the worker marks these rows `overflow`: never counted as divergence
    assert t.scaler.scale == 2.0**16 / 2**skipped
    assert not torch.equal(t.params_flat, before)  # the first clean step was applied
    assert torch.isfinite(t.params_flat).all()


def test_a_gradient_non_finite_at_every_scale_is_divergence_under_on_nonfinite():
    class NaN(Direct):
        def loss(self, model, batch):
            return super().loss(model, batch) * float("nan")

    for on_nonfinite in ("stop", "skip"):
        t = trainer("fp16", task=NaN())
        s = strategy(on_nonfinite)
        outcomes = []
        with pytest.raises(NonFinite) if on_nonfinite == "stop" else _nothing():
            for _ in range(20):
                t.compute_gradients(BATCH)
                outcomes.append(s.step(t, 0.1).nonfinite)
        # 16 halvings take 2**16 to 1; the 17th takes it below 1, where --on-nonfinite decides (stop raised).
        assert t.scaler.exhausted and t.scaler.overflows == (17 if on_nonfinite == "stop" else 20)
        assert all(outcomes) and len(outcomes) == (16 if on_nonfinite == "stop" else 20)
        assert s.overflow_skips == 16  # the skips at scales >= 1; those after are divergence (--on-nonfinite)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_fp32_keeps_on_nonfinite_as_it_was():
    class NaN(Direct):
        def loss(self, model, batch):
            return super().loss(model, batch) * float("nan")

    t = trainer("fp32", task=NaN())
    t.compute_gradients(BATCH)
    with pytest.raises(NonFinite):
        strategy("stop").step(t, 0.1)
    assert t.scaler is None


def test_the_loss_scale_is_part_of_the_trainer_state():
    t = trainer("fp16")
    t.scaler.update(overflow=True)
    state = t.state_dict()
    assert state["scaler"]["scale"] == 2.0**15
    fresh = trainer("fp16")
    fresh.load_state_dict(state)
    assert fresh.scaler == t.scaler
    assert "scaler" not in trainer("bf16").state_dict()


# ---------------------------------------------------------------------------------------- config, GPUs
@pytest.mark.parametrize(
    "kw, message",
    [
        ({"precision": "fp8"}, "unknown --precision 'fp8'; choose one of: fp32, bf16, fp16"),
        ({"precision": "fp16", "compress": "int8"}, "--precision fp16 cannot be combined with --compress"),
    ],
)
def test_bad_precision_is_one_line(kw, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**kw).validate()
    RunConfig(precision="bf16", compress="int8").validate()  # bf16 has no scale: it composes


def test_workers_with_a_gpu_each_use_nccl_and_workers_sharing_one_use_gloo():
    from distrain.strategies.collective import backend_for

    assert [backend_for("cuda", g) for g in (1.0, 2.0, 0.5, 0.25)] == ["nccl", "nccl", "gloo", "gloo"]
    assert backend_for("cpu", 0.0) == "gloo"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_worker_given_a_gpu_that_torch_cannot_see_fails_in_one_line():
    from distrain.orchestrator.worker import TrainWorker

    worker = TrainWorker(RunConfig(gpus_per_worker=1.0, model="mlp"), rank=1, run_start=0.0)
    with pytest.raises(ResourceError, match=r"worker 1 was given 1 GPU\(s\) but torch .* sees no CUDA device"):
        worker.describe()


# ---------------------------------------------------------------------------------------- real runs
def steps(run_dir) -> pd.DataFrame:
    df = pd.read_parquet(run_dir / "metrics.parquet")
    return df[df["kind"] == "step"]








def test_a_cluster_with_gpus_the_run_does_not_ask_for_gets_one_line(monkeypatch, capsys):
    from distrain.cli import RunDisplay
    from distrain.orchestrator import cluster
    from distrain.orchestrator.run import Notice

    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    assert cluster.unused_gpus(RunConfig()) == 1.0
    assert cluster.unused_gpus(RunConfig(gpus_per_worker=1.0)) == 0.0  # asked for: nothing to say
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 16.0})
    assert cluster.unused_gpus(RunConfig()) == 0.0
    text = "the cluster has 1 GPU(s) and this run uses none; --gpus-per-worker 1 uses them"
    RunDisplay(RunConfig()).on_event(Notice(text))
    assert capsys.readouterr().out.strip() == f"note: {text}"
