"""Elastic DiLoCo and local SGD across cut replicas (strategies/elastic_cut.py) without Ray, beside
tests/integration/test_elastic_cut_averaging.py (whose kill runs under DiLoCo only: local SGD's own piece of
a re-form, its books, is here). DiLoCo's round (`apply_round`) is the outer step on the mean over the replicas
that stepped, or none when none did; the pieces a joiner takes (`local_extra`) carry the outer optimizer's
state and outer steps, so a joiner's next round is the live worker's; local SGD's carry its books. Plain
tensors stand in for a worker's DTensor parts (`local_part` of a plain tensor is itself)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from distrain.config import RunConfig
from distrain.strategies.elastic_cut import ElasticShardedDiLoCo, ElasticShardedLocalSGD

SHAPES = [(3, 2), (4,)]


def _diloco(seed: int = 0) -> tuple[ElasticShardedDiLoCo, SimpleNamespace]:
    config = RunConfig(strategy="diloco", workers="1..3", fsdp=2, sync_every=2, outer_lr=0.7, outer_momentum=0.9)
    config.validate()
    strategy = ElasticShardedDiLoCo.__new__(ElasticShardedDiLoCo)  # no group, no channel: the round's arithmetic
    strategy.options, strategy.outer_steps = config.options_of("diloco"), 0
    g = torch.Generator().manual_seed(seed)
    trainer = SimpleNamespace(
        params=[torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES], names=["a.weight", "b.bias"]
    )
    strategy.make_fragments(trainer)  # θ_g = the parameters, the outer optimizer over them
    return strategy, trainer


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def test_diloco_s_round_steps_on_the_mean_over_the_replicas_that_stepped():
    strategy, trainer = _diloco()
    start = _flat(strategy.globals).clone()
    reference = torch.nn.Parameter(start.clone())
    outer = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        # two replicas stepped (w = 1) and one sat the block out (w = 0): Σ w Δ over Σ w = 2
        deltas = [torch.randn(start.numel(), generator=g) for _ in range(3)]
        sums = deltas[0] + deltas[1] + 0 * deltas[2]
        assert strategy.apply_round(sums.clone(), 2.0) == strategy.outer_steps
        reference.grad = (deltas[0] + deltas[1]) / 2
        outer.step()
        assert (_flat(strategy.globals) - reference.detach()).abs().max().item() <= 1e-6
        assert torch.equal(_flat(trainer.params), _flat(strategy.globals))  # every member continues from θ_g
    assert strategy.outer_steps == 2
    # No replica stepped in the block: no outer step, θ_i back to θ_g; a non-finite mean: skipped, counted.
    before = _flat(strategy.globals).clone()
    with torch.no_grad():
        trainer.params[0].add_(1.0)
    strategy.apply_round(torch.zeros_like(before), 0.0)
    assert strategy.outer_steps == 2 and torch.equal(_flat(strategy.globals), before)
    assert torch.equal(_flat(trainer.params), before)
    strategy.apply_round(None, 2.0)
    assert strategy.outer_steps == 3 and torch.equal(_flat(strategy.globals), before)


def test_a_diloco_joiner_takes_the_outer_state_so_its_next_round_is_the_live_worker_s():
    live, _ = _diloco()
    live.apply_round(torch.ones(10), 1.0)  # a momentum buffer and one outer step
    joiner, joiner_trainer = _diloco(seed=5)  # its own seeded start: different θ, no outer state
    pieces = live.local_extra()
    assert pieces["outer_steps"] == 1 and set(pieces["outer"]) == {"a.weight", "b.bias"}
    joiner.load_local_extra(pieces)
    with torch.no_grad():  # the re-form's copy of the parameters, then `reformed`: θ_g from them
        for mine, theirs in zip(joiner_trainer.params, live.trainer.params, strict=True):
            mine.copy_(theirs)
    joiner.begin_block = lambda: None  # (the block's start: the trainer's local_state, a cut trainer's)
    joiner.reformed(joiner_trainer)
    assert joiner.outer_steps == 1
    delta = torch.linspace(-1, 1, 10)
    live.apply_round(delta.clone(), 1.0)
    joiner.apply_round(delta.clone(), 1.0)
    assert torch.equal(_flat(joiner.globals), _flat(live.globals)) and joiner.outer_steps == live.outer_steps == 2
    # Without the outer state the joiner's step differs (momentum): the copy is what makes them equal.
    fresh, fresh_trainer = _diloco()
    with torch.no_grad():
        for mine, theirs in zip(fresh.globals, joiner.globals, strict=True):
            mine.copy_(theirs)
    fresh.apply_round(delta.clone(), 1.0)
    live.apply_round(delta.clone(), 1.0)
    assert not torch.equal(_flat(fresh.globals), _flat(live.globals))


def test_a_local_sgd_joiner_takes_the_live_worker_s_books():
    live = ElasticShardedLocalSGD.__new__(ElasticShardedLocalSGD)
    live.tau, live.rounds = 4, 7
    joiner = ElasticShardedLocalSGD.__new__(ElasticShardedLocalSGD)
    joiner.tau, joiner.rounds = 2, 0
    joiner.load_local_extra(live.local_extra())
    assert (joiner.tau, joiner.rounds) == (4, 7)
