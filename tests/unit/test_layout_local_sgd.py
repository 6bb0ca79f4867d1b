"""Local SGD across cut replicas without Ray: which class runs it, what it refuses in one line, the
optimizer state vectors a round averages, and the period books it shares with plain local SGD."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.strategies.base import CommStats
from distrain.strategies.local_periods import LocalPeriods
from distrain.strategies.local_sgd import LocalSGD
from distrain.strategies.sharded_local_sgd import ShardedLocalSGD, state_vectors
from distrain.trainers.optim_state import make_optimizer


def test_local_sgd_across_cut_replicas_is_its_own_implementation():
    for layout in (dict(fsdp=2), dict(tensor_parallel=2), dict(fsdp=2, tensor_parallel=2)):
        config = RunConfig(strategy="local-sgd", workers=2, model="mlp", adaptive_tau=True, **layout)
        config.validate()
        assert LocalSGD.implementation(config) is ShardedLocalSGD, layout
    assert LocalSGD.implementation(RunConfig(strategy="local-sgd", workers=2)) is LocalSGD


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(workers="1..2", adaptive_tau=True), r"^--adaptive-tau does not compose with --workers MIN..MAX"),
        (dict(workers="1..2", compress="int8"), r"^--workers 1..2 does not compose with --compress"),
        (dict(schedule="bsp:1,local-sgd"), r"^--fsdp 2 runs with --strategy bsp, diloco or local-sgd over"),
    ],
)
def test_what_is_not_built_across_cut_replicas_is_refused_in_one_line(given, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**({"strategy": "local-sgd", "fsdp": 2, "workers": 2} | given)).validate()


def _stepped(name: str, **kw) -> SimpleNamespace:
    """A trainer-shaped holder of two parameters whose optimizer has taken one step."""
    params = [torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(4))]
    optimizer = make_optimizer(name, params, 0.1, **kw)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    optimizer.step()
    return SimpleNamespace(params=params, optimizer=optimizer)


def test_a_round_averages_each_state_vector_but_not_adams_step():
    sgd = _stepped("sgd", momentum=0.9, weight_decay=None)
    vectors = state_vectors(sgd)
    assert list(vectors) == ["momentum_buffer"]
    # The very tensors the optimizer holds (a round writes the average into them), in parameter order.
    assert [t.data_ptr() for t in vectors["momentum_buffer"]] == [
        sgd.optimizer.state[p]["momentum_buffer"].data_ptr() for p in sgd.params
    ]
    adam = _stepped("adam", momentum=None, weight_decay=None)
    assert sorted(state_vectors(adam)) == ["exp_avg", "exp_avg_sq"]  # "step" is the same on every worker
    fresh = SimpleNamespace(params=sgd.params, optimizer=make_optimizer("sgd", sgd.params, 0.1, 0.9, None))
    assert state_vectors(fresh) == {}  # no state before the first step


class Books(LocalPeriods):
    """The books alone, with a round that records the statistics it would send and gets back their
    mean over two workers: this worker's and another whose period loss sum is 2.0 over as many steps."""

    def __init__(self, **options) -> None:
        config = RunConfig(strategy="local-sgd", workers=2, lr=0.1, **options)
        config.validate()
        self.init_periods(config, config.options_of("local-sgd"), total_steps=40)
        self.sent: list[list[float]] = []

    def average(self, trainer) -> CommStats:
        mine = self.period_statistics()
        self.sent.append(mine)
        self.round_closed((mine[0] + 2.0) / 2, mine[1], mine[2])
        return CommStats(bytes_sent=1)


def test_the_books_average_every_tau_steps_and_leave_a_skipped_steps_loss_out():
    books = Books(tau=3)
    trainer = SimpleNamespace(last_loss=1.0)
    rows = [books.book_step(trainer, 0.1, ok=step != 1) for step in range(6)]
    assert [r.bytes_sent for r in rows] == [0, 0, 1, 0, 0, 1]
    assert [r.period for r in rows] == [3] * 6 and [r.averaging_round for r in rows] == [0, 0, 1, 1, 1, 2]
    assert [r.nonfinite for r in rows] == [None, True, None, None, None, None]
    assert [s[:2] for s in books.sent] == [[2.0, 2.0], [3.0, 3.0]]  # step 1's loss is not in the period's
    trainer.last_loss = float("nan")  # a step applied but whose loss is not finite: not in the loss either
    books.book_step(trainer, 0.1, ok=True)
    assert books.loss_count == 0 and books.pending == 1


def test_adacomm_chooses_tau_from_the_worker_averaged_loss_of_the_round():
    books = Books(tau=4, adaptive_tau=True, tau_interval="4")
    assert books.extra_state()["adacomm"]["loss0"] is None
    trainer = SimpleNamespace(last_loss=2.0)
    for _ in range(4):  # first round: F_0 = (4 x 2.0 + 2.0) / 2 / 4 = 1.25
        books.book_step(trainer, 0.1, ok=True)
    assert books.tau == 4 and books.extra_state()["adacomm"]["loss0"] == pytest.approx(1.25)
    trainer.last_loss = 0.0  # F_1 = (0 + 2.0) / 2 / 4 = 0.25: tau = ceil(4 x sqrt(0.25 / 1.25)) = 2
    for _ in range(4):
        books.book_step(trainer, 0.1, ok=True)
    assert books.tau == 2 and books.rounds == 2
    again = Books(tau=4, adaptive_tau=True, tau_interval="4")
    again.load_extra_state(books.extra_state())
    assert (again.tau, again.rounds, again.adacomm.loss0) == (2, 2, pytest.approx(1.25))
