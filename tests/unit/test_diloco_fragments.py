"""Streaming DiLoCo's fragment arithmetic in one process (a one-member gloo group, no Ray): cutting θ into
fragments leaves the outer step exact, and an arriving fragment is mixed in as α·local + (1 − α)·global."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distrain.config import RunConfig
from distrain.strategies.base import StrategyContext
from distrain.strategies.collective import free_address
from distrain.strategies.diloco import DiLoCo
from distrain.trainers.local_trainer import LocalTrainer


def replica(**options) -> tuple[DiLoCo, LocalTrainer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))  # 4 tensors
    trainer = LocalTrainer(model, None, "sgd", 0.1, 0.0, None)
    config = RunConfig(strategy="diloco", **options)
    strategy = DiLoCo(config, StrategyContext(0, 1, "cpu", free_address("127.0.0.1")))
    strategy.setup(trainer)
    return strategy, trainer


def inner_steps(strategy: DiLoCo, trainer: LocalTrainer, steps: int) -> None:
    for k in range(steps):
        trainer.grads_flat.copy_(torch.randn(trainer.numel, generator=torch.Generator().manual_seed(k)))
        trainer.last_loss = 1.0
        strategy.step(trainer, 0.1)


@pytest.fixture
def teardown():
    made: list[DiLoCo] = []
    yield made
    for s in made:
        s.teardown()


def test_fragments_stepped_together_equal_one_outer_step_on_the_whole(teardown):
    whole, t1 = replica(sync_every=4)
    teardown.append(whole)
    inner_steps(whole, t1, 8)
    whole.teardown()
    split, t2 = replica(sync_every=4, fragments=2)
    teardown.append(split)
    for f in split.fragments:
        f.offset = 0  # both fragments sync at t % 4 == 0: then fragmenting must change nothing
    inner_steps(split, t2, 8)
    assert split.outer_steps == 2 * whole.outer_steps == 4
    assert torch.equal(t1.params_flat, t2.params_flat)  # element-wise outer optimizer: exact


def test_an_arriving_fragment_is_mixed_in_with_alpha(teardown):
    strategy, trainer = replica(sync_every=4, overlap_steps=1, mix_alpha=0.25)
    teardown.append(strategy)
    (f,) = strategy.fragments
    inner_steps(strategy, trainer, 4)  # launched at t = 4, arrives at t = 5
    assert f.work is not None and strategy.outer_steps == 0
    before = trainer.params_flat.clone()
    strategy.step(trainer, 0.1)  # t = 5: an inner step (with the gradient still in grads_flat), then it arrives
    assert f.work is None and strategy.outer_steps == 1
    local = before - 0.1 * trainer.grads_flat  # where the replica's own step took it meanwhile
    expected = 0.25 * local + 0.75 * f.param.detach()
    assert torch.allclose(trainer.params_flat, expected, atol=1e-7)
    assert not torch.allclose(trainer.params_flat, f.param.detach())  # α > 0: the replica keeps some of its own


def test_each_fragments_outer_step_count_comes_back_from_a_checkpoint(teardown):
    """Fragments step at different inner steps (H = 4, P = 2: fragment 1 at t = 2, 6, fragment 0 at 4, then
    both at the close after t = 7), so an outer Adam's step count is a fragment's own: the flat form keeps one number,
    the checkpoint keeps each fragment's beside it, and a resumed replica takes the next step as the
    uninterrupted one does."""
    options = dict(sync_every=4, fragments=2, outer_optimizer="adam", outer_lr=0.01)
    straight, t1 = replica(**options)
    teardown.append(straight)
    inner_steps(straight, t1, 7)
    straight.at_epoch_end(t1)  # a closed period (a checkpoint): fragment 0 stepped twice, fragment 1 three times
    steps = [f.scalars()["step"] for f in straight.fragments]
    assert steps == [2.0, 3.0]
    saved = straight.extra_state()
    assert saved["outer_optimizer"]["scalars"] == {"step": 2.0}  # the flat form's one number: fragment 0's
    theta = t1.params_flat.clone()
    inner_steps(straight, t1, 4)
    straight.teardown()  # (one process group at a time)
    resumed, t2 = replica(**options)
    teardown.append(resumed)
    t2.params_flat.copy_(theta)
    for f in resumed.fragments:
        f.param.data.copy_(theta[f.lo : f.hi])  # θ_g is the model at a closed period
    resumed.load_extra_state(saved)
    assert [f.scalars()["step"] for f in resumed.fragments] == steps
    inner_steps(resumed, t2, 4)
    assert torch.equal(t1.params_flat, t2.params_flat)
