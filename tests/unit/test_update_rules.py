"""Issue 30: gradient accumulation, gradient clipping, a task's own optimizer and scheduler, and the rate
schedule on torch.optim.lr_scheduler (trainers/accumulation.py, local_trainer.py, own_optimizer.py,
schedule.py; docs/optimization.md)."""

from __future__ import annotations

import collections
import copy
import math

import pytest
import torch
from torch import nn

from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.trainers.accumulation import split_batch
from distrain.trainers.local_trainer import LocalTrainer
from distrain.trainers.own_optimizer import build_own, check_own_optimizer
from distrain.trainers.schedule import LRSchedule
from distrain.trainers.task import Task


class Regression(Task):
    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def loss(self, model, batch):
        return nn.functional.mse_loss(model(batch[0]), batch[1])


class OwnAdam(Regression):
    """Adam at 0.01, halved every 2 updates by its own StepLR."""

    def configure_optimizers(self, params):
        optimizer = torch.optim.Adam(params, lr=0.01)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


class FlatAdam(OwnAdam):
    elementwise_optimizer = True


def batch(n: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def trainer(task: Task = None, k: int = 1, clip: float = 0.0, optimizer: str = "sgd") -> LocalTrainer:
    task = task or Regression()
    return LocalTrainer(task.build_model(), task, optimizer, 0.1, 0.0, None, accumulate_steps=k, clip_grad_norm=clip)


# ---------------------------------------------------------------------- the rate schedule on torch
def closed_form(s: LRSchedule, step: int) -> float:
    """The hand-written rates distrain used before torch's schedulers (trainers/schedule.py's docstring)."""
    if s.warmup_steps > 0 and step < s.warmup_steps:
        return s.base_lr + (s.peak_lr - s.base_lr) * step / s.warmup_steps
    t = step - s.warmup_steps
    if s.decay == "cosine":
        span = s.total_steps - s.warmup_steps
        if span <= 0:
            return s.peak_lr
        return s.min_lr + (s.peak_lr - s.min_lr) * (1 + math.cos(math.pi * min(t, span) / span)) / 2
    if s.decay == "step":
        return s.peak_lr * s.gamma ** (t // s.decay_every)
    return s.peak_lr


@pytest.mark.parametrize("global_batch", [256, 16])  # a rising warmup, and a falling one (below base 64)
@pytest.mark.parametrize("warmup", [0.0, 1.5])
@pytest.mark.parametrize(
    "decay",
    [
        {},
        {"decay": "cosine", "min_lr": 0.001},
        {"decay": "cosine"},
        {"decay": "step", "decay_epochs": 1.5, "gamma": 0.5},
    ],
)
def test_torch_schedulers_give_the_old_rates_at_every_step(global_batch, warmup, decay):
    s = LRSchedule.create(0.05, global_batch, 64, "linear", warmup, 10, total_steps=120, **decay)
    for step in range(121):
        assert s.lr_at(step) == pytest.approx(closed_form(s, step), rel=1e-12, abs=1e-15), step
    assert s.lr_at(7) == pytest.approx(closed_form(s, 7), rel=1e-12)  # an earlier step again (a resume)


def test_the_default_schedule_is_the_peak_rate_to_the_bit():
    s = LRSchedule.create(0.05, 128, 64, "linear", 0.0, 10, total_steps=50)
    assert {s.lr_at(k) for k in range(50)} == {0.1}


# ---------------------------------------------------------------------- accumulation
def test_k_micro_batches_give_the_whole_batch_gradient_and_mean_loss():
    one, four = trainer(), trainer(k=4)
    loss1, loss4 = one.compute_gradients(batch()), four.compute_gradients(batch())
    assert torch.allclose(one.grads_flat, four.grads_flat, atol=1e-7) and one.grads_flat.abs().max() > 1e-3
    assert loss4 == pytest.approx(loss1, rel=1e-6)


def test_uneven_micro_batches_are_weighted_by_their_samples():
    one, three = trainer(), trainer(k=3)
    one.compute_gradients(batch(10))  # 3 + 3 + 4 samples
    three.compute_gradients(batch(10))
    assert torch.allclose(one.grads_flat, three.grads_flat, atol=1e-7)



def test_a_share_smaller_than_k_is_cut_into_one_sample_micro_batches():
    """Under --worker-weights/--balance speed a worker's share may fall below --accumulate-steps k (the
    balancer gives each worker one sample at least): it trains on what it has (it used to raise)."""
    one, four = trainer(), trainer(k=4)
    loss1, loss4 = one.compute_gradients(batch(2)), four.compute_gradients(batch(2))
    assert torch.allclose(one.grads_flat, four.grads_flat, atol=1e-7) and one.grads_flat.abs().max() > 1e-3
    assert loss4 == pytest.approx(loss1, rel=1e-6)

def test_the_gradient_hooks_fire_once_per_update_after_the_last_micro_batch():
    """BSP's overlapped all-reduce launches a bucket from post-accumulate-grad hooks: they must see the
    whole accumulated gradient, once."""
    t = trainer(k=3)
    seen = []
    for p in t.params:
        p.register_post_accumulate_grad_hook(lambda p: seen.append(t.grads_flat.clone()))
    t.compute_gradients(batch())
    assert len(seen) == len(t.params)
    reference = trainer()
    reference.compute_gradients(batch())
    assert torch.allclose(seen[-1], reference.grads_flat, atol=1e-7)


def test_split_batch_cuts_batch_tensors_and_shares_the_rest():
    x, y, table = torch.arange(8), torch.arange(16).view(8, 2), torch.ones(3)
    parts = split_batch({"x": x, "pair": (y, table), "name": "a"}, 2, 8)
    assert [p["x"].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parts[1]["pair"][0].shape == (4, 2) and parts[1]["pair"][1] is table and parts[0]["name"] == "a"
    pair = collections.namedtuple("Pair", "x y")(x, y)
    assert split_batch(pair, 2, 8)[1].y.tolist() == y[4:].tolist()
    with pytest.raises(ValueError, match="cannot be cut"):
        split_batch(x[:2], 3, 2)


# ---------------------------------------------------------------------- clipping
@pytest.mark.parametrize("limit", [0.05, 100.0])
def test_clipping_matches_torch_clip_grad_norm(limit):
    t = trainer(clip=limit)
    reference = copy.deepcopy(t.model)  # the same θ, as separate tensors with their own .grad
    t.compute_gradients(batch())
    x, y = batch()
    nn.functional.mse_loss(reference(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), limit)
    t.clip_gradient_()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    assert torch.allclose(t.grads_flat, expected, atol=1e-7)
    assert (limit < norm) == (t.grads_flat.norm() < norm - 1e-4)  # clipped only above the limit


def test_an_update_applies_the_clipped_gradient():
    clipped, plain = trainer(clip=0.01), trainer()
    for t in (clipped, plain):
        t.compute_gradients(batch())
    before = clipped.params_flat.clone()
    clipped.apply_update(0.1)
    assert (before - clipped.params_flat).norm().item() == pytest.approx(0.1 * 0.01, rel=1e-4)


# ---------------------------------------------------------------------- the task's own optimizer
def test_a_task_optimizer_and_scheduler_run_at_their_own_rates():
    t = trainer(OwnAdam())
    assert isinstance(t.optimizer, torch.optim.Adam) and t.opt_params == t.params  # whole tensors
    rates = []
    for _ in range(5):
        t.compute_gradients(batch())
        t.apply_update(123.0)  # distrain's rate does not apply
        rates.append(t.applied_lr)
    assert rates == [0.01, 0.01, 0.005, 0.005, 0.0025]
    state = t.state_dict()
    assert state["scheduler"]["last_epoch"] == 5 and "exp_avg" in state["optimizer"]["vectors"]


def test_an_elementwise_task_optimizer_steps_the_flat_tensor_as_whole_tensors_would():
    whole, flat = trainer(OwnAdam()), trainer(FlatAdam())
    assert flat.opt_params == [flat.flat_param]
    for _ in range(3):
        for t in (whole, flat):
            t.compute_gradients(batch())
            t.apply_update(0.0)
    assert torch.allclose(whole.params_flat, flat.params_flat, atol=1e-7)


def test_a_task_optimizer_of_the_wrong_kind_is_refused_in_one_line():
    class Wrong(Regression):
        def configure_optimizers(self, params):
            return "adam"

    with pytest.raises(ConfigError, match="must return a torch.optim.Optimizer"):
        build_own(Wrong(), list(Wrong().build_model().parameters()))
    assert build_own(Regression(), []) is None


@pytest.mark.parametrize(
    ("task", "kw", "error"),
    [
        (OwnAdam(), {"strategy": "async", "transport": "ps"}, "elementwise_optimizer = True"),
        (FlatAdam(), {"strategy": "sandblaster"}, "does not apply"),
    ],
)
def test_own_optimizers_are_refused_where_they_cannot_run(task, kw, error):
    config = RunConfig(**kw)
    with pytest.raises(ConfigError, match=error):
        check_own_optimizer(task, config, task.build_model())
    check_own_optimizer(FlatAdam(), RunConfig(strategy="async", transport="ps"), FlatAdam().build_model())


# ---------------------------------------------------------------------- config
def test_accumulation_multiplies_the_global_batch_and_the_samples_per_step():
    config = RunConfig(workers=2, batch_size=16, accumulate_steps=3)
    assert config.global_batch_size == 96 and config.samples_per_step == 96 and config.unit_samples == 48
    assert RunConfig(workers=2, batch_size=16).global_batch_size == 32


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"accumulate_steps": 0}, "--accumulate-steps must be >= 1"),
        ({"clip_grad_norm": -1.0}, "--clip-grad-norm must be >= 0"),
        ({"accumulate_steps": 2, "strategy": "sandblaster"}, "sandblaster ignores --accumulate-steps"),
        ({"clip_grad_norm": 1.0, "strategy": "sandblaster"}, "sandblaster ignores --clip-grad-norm"),
    ],
)
def test_bad_or_unsupported_update_rules_are_refused_in_one_line(kw, error):
    with pytest.raises(ConfigError, match=error):
        RunConfig(**kw)


@pytest.mark.parametrize(
    ("layout", "global_batch"),
    [
        ({"tensor_parallel": 2, "model": "mlp"}, 2 * 16),  # the T workers share a slice
        ({"tensor_parallel": 2, "model": "cnn"}, 2 * 2 * 16),  # the hybrid: each its own
        ({"tensor_parallel": 2, "fsdp": 2, "model": "mlp"}, 2 * 2 * 16),
        ({"pipeline_stages": 2, "fsdp": 2, "model": "mlp"}, 2 * 2 * 16),
    ],
)
def test_cut_replicas_take_accumulation_and_clipping(layout, global_batch):
    """Tensor-parallel replicas and pipelines of FSDP stages accumulate and clip (trainers/cut_gradient_norm.py):
    no refusal, and the global batch counts the k micro-steps."""
    config = RunConfig(**layout, workers=1, batch_size=16, accumulate_steps=2, clip_grad_norm=1.0)
    assert config.global_batch_size == global_batch


def test_a_replica_resumed_from_its_state_goes_on_at_its_scheduler_s_rates():
    """The checkpoint's flat optimizer state carries no param_groups, and a StepLR computes its next rate
    from the group's current one: the scheduler's state must bring its rates back (restore_scheduler)."""
    straight, first = trainer(OwnAdam()), trainer(OwnAdam())
    rates = []
    for t, steps in ((straight, 5), (first, 3)):
        for _ in range(steps):
            t.compute_gradients(batch())
            t.apply_update(0.0)
            rates.append(t.applied_lr)
    resumed = trainer(OwnAdam())
    resumed.load_state_dict(first.state_dict())
    for _ in range(2):
        resumed.compute_gradients(batch())
        resumed.apply_update(0.0)
        rates.append(resumed.applied_lr)
    assert rates[:5] == [0.01, 0.01, 0.005, 0.005, 0.0025] and rates[5:] == rates[:5]
    assert torch.equal(resumed.params_flat, straight.params_flat)
