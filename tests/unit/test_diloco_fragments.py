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
