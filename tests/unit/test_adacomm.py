"""AdaComm's τ rule and intervals as pure functions (no Ray, no torch), and --schedule parsing."""

from __future__ import annotations

import math

import pytest

from distrain.errors import ConfigError
from distrain.strategies.adacomm import AdaComm, TauInterval, adacomm_tau
from distrain.strategies.strategy_schedule import Phase, parse_schedule


def test_tau_follows_the_square_root_of_the_loss_ratio():
    tau0, loss0 = 16, 2.3
    losses = [2.3, 1.8, 1.2, 0.6, 0.3, 0.1, 0.01]
    taus = [adacomm_tau(tau0, loss0, f, tau_max=64) for f in losses]
    assert taus == [math.ceil(tau0 * math.sqrt(f / loss0)) for f in losses]
    assert taus[0] == tau0  # F_l = F_0 keeps τ_0
    assert taus == sorted(taus, reverse=True) and taus[-1] < taus[0]  # averaging grows frequent as loss falls
    assert taus == [16, 15, 12, 9, 6, 4, 2]


def test_tau_is_clipped_to_one_and_tau_max():
    assert adacomm_tau(8, 2.0, 1e-9, tau_max=8) == 1  # ceil of a tiny number is 1 anyway; never 0
    assert adacomm_tau(8, 2.0, 0.0, tau_max=8) == 1
    assert adacomm_tau(8, 1.0, 4.0, tau_max=64) == 16  # loss went up: sqrt(4) * 8
    assert adacomm_tau(8, 1.0, 4.0, tau_max=10) == 10
    assert adacomm_tau(8, 0.0, 1.0, tau_max=10) == 8  # no ratio to form: keep τ_0
    assert adacomm_tau(8, 1.0, float("nan"), tau_max=4) == 4


def test_learning_rate_decay_variant_multiplies_the_ratio_by_the_cubed_rate_ratio():
    tau0, loss0, loss = 4, 2.0, 0.5
    plain = adacomm_tau(tau0, loss0, loss, tau_max=1000)
    assert plain == math.ceil(4 * math.sqrt(0.25)) == 2
    # η halved: ratio · 2^3 = 0.25 · 8 = 2 -> ceil(4 · sqrt 2) = 6
    assert adacomm_tau(tau0, loss0, loss, 1000, lr0=0.1, lr=0.05) == 6
    assert adacomm_tau(tau0, loss0, loss, 1000, lr0=0.1, lr=0.05) == math.ceil(tau0 * math.sqrt(0.25 * 2**3))
    # a rate that rose (warmup) or stayed is not a decay: the plain rule
    assert adacomm_tau(tau0, loss0, loss, 1000, lr0=0.1, lr=0.2) == plain
    assert adacomm_tau(tau0, loss0, loss, 1000, lr0=0.1, lr=0.1) == plain
    assert adacomm_tau(tau0, loss0, loss, 5, lr0=0.1, lr=0.05) == 5  # and clipped


def test_tau_sequence_from_a_loss_and_rate_sequence():
    """The controller over rounds: F_0 is the first round's loss; τ changes only when an interval ends."""
    rule = AdaComm(tau0=10, tau_max=10, interval=TauInterval(steps=20))
    rule.start(lr=0.1)
    losses = [2.0, 1.5, 1.0, 0.5, 0.5, 0.2, 0.08]
    rates = [0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05]
    taus, steps = [], 0
    for loss, lr in zip(losses, rates, strict=True):
        steps += rule.tau
        if rule.after_round(loss, lr, elapsed_s=0.0, interval_steps=steps):
            steps = 0
        taus.append(rule.tau)
    # Recompute the expectation step by step, independently of the controller.
    expected, tau, since, loss0 = [], 10, 0, None
    for loss, lr in zip(losses, rates, strict=True):
        since += tau
        loss0 = loss if loss0 is None else loss0
        if since >= 20:
            ratio = loss / loss0 * ((0.1 / lr) ** 3 if lr < 0.1 else 1.0)
            tau, since = max(1, min(10, math.ceil(10 * math.sqrt(ratio)))), 0
        expected.append(tau)
    assert taus == expected
    assert taus[1] == 9 and taus[-1] < taus[0]  # shrinks as the loss falls, despite the rate halving


def test_wall_clock_intervals():
    rule = AdaComm(tau0=8, tau_max=8, interval=TauInterval.parse("5s"))
    rule.start(0.1)
    assert not rule.after_round(2.0, 0.1, elapsed_s=4.9, interval_steps=1000)  # steps do not matter
    assert rule.tau == 8
    assert rule.after_round(0.5, 0.1, elapsed_s=5.0, interval_steps=3)
    assert rule.tau == 4


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5s", TauInterval(seconds=5.0)),
        ("0.5s", TauInterval(seconds=0.5)),
        ("200", TauInterval(steps=200)),
        ("10%", TauInterval(share=0.1)),
        ("2.5 %", TauInterval(share=0.025)),
        ("100%", TauInterval(share=1.0)),
    ],
)
def test_tau_interval_parses(text, expected):
    assert TauInterval.parse(text) == expected


@pytest.mark.parametrize("text", ["", "0", "0s", "-3", "5m", "s", "1.5", "abc", "0%", "101%", "%", "10%s"])
def test_tau_interval_refuses(text):
    with pytest.raises(ConfigError, match="--tau-interval"):
        TauInterval.parse(text)


def test_a_share_of_the_run_becomes_steps_once_the_run_length_is_known():
    assert TauInterval.parse("10%").for_run(264) == TauInterval(steps=27)  # rounded up
    assert TauInterval.parse("1%").for_run(30) == TauInterval(steps=1)  # never 0
    assert TauInterval.parse("5s").for_run(264) == TauInterval(seconds=5.0)  # other forms unchanged
    assert TauInterval.parse("200").for_run(264) == TauInterval(steps=200)
    with pytest.raises(ValueError, match="length"):
        TauInterval.parse("10%").for_run(0)
    rule = AdaComm(tau0=8, tau_max=16, interval=TauInterval.parse("10%").for_run(100))
    rule.start(0.1)
    assert not rule.after_round(2.0, 0.1, elapsed_s=1e9, interval_steps=9)  # seconds do not matter
    assert rule.after_round(0.5, 0.1, elapsed_s=0.0, interval_steps=10) and rule.tau == 4


def test_default_tau_max_lets_tau_rise_above_tau0():
    from distrain.config import RunConfig

    options = RunConfig(strategy="local-sgd", adaptive_tau=True).options_of("local-sgd")
    assert (options.tau, options.tau_interval, options.tau_max) == (8, "10%", 16)
    rule = AdaComm(options.tau, options.tau_max, TauInterval.parse(options.tau_interval).for_run(264))
    rule.start(0.1)
    rule.after_round(1.0, 0.1, 0.0, 8)  # F_0
    assert rule.after_round(2.25, 0.1, 0.0, 27) and rule.tau == 12  # loss rose 2.25x: sqrt -> 1.5 x τ_0


def test_schedule_parses_into_epoch_spans():
    assert parse_schedule("bsp:2,local-sgd", 5) == [Phase("bsp", 0, 2), Phase("local-sgd", 2, 5)]
    assert parse_schedule(" ssp:1 , bsp:2 ", 3) == [Phase("ssp", 0, 1), Phase("bsp", 1, 3)]
    assert parse_schedule("async", 4) == [Phase("async", 0, 4)]


@pytest.mark.parametrize(
    ("text", "epochs", "fragment"),
    [
        ("bsp:x,local-sgd", 3, "whole number of epochs"),
        ("bsp,local-sgd", 3, "needs epochs"),
        ("nope:1,bsp", 3, "unknown strategy 'nope'"),
        ("bsp:0,bsp", 3, ">= 1 epoch"),
        ("bsp:3,local-sgd", 3, "leaves no epochs"),
        ("bsp:4,local-sgd", 3, "exceeds --epochs 3"),
        ("bsp:1,ssp:1", 3, "covers 2 epochs"),
        ("bsp:1,,ssp", 3, "empty entry"),
    ],
)
def test_schedule_refuses(text, epochs, fragment):
    with pytest.raises(ConfigError, match="--schedule") as info:
        parse_schedule(text, epochs)
    assert fragment in str(info.value)


def test_eta0_is_the_peak_rate_so_tau_grows_when_the_rate_decays_at_equal_loss():
    """With a warmup then a decay, η_0 is the peak: a rate climbing through warmup is not a decay (the
    plain rule), a rate that fell below a rate already used is (τ grows by the cubed ratio)."""
    peak = 0.4

    def tau_after(rates: list[float], loss: float = 1.0) -> int:
        rule = AdaComm(tau0=4, tau_max=100, interval=TauInterval(steps=1), peak_lr=peak)
        for lr in rates:
            rule.start(lr)
        rule.after_round(1.0, rates[-1], 0.0, 1)  # F_0 = 1
        rule.after_round(loss, rates[-1], 0.0, 1)
        return rule.tau

    assert tau_after([0.1, 0.2, 0.3]) == 4  # warmup, still climbing: not decayed, equal loss keeps τ_0
    assert tau_after([0.1, 0.4]) == 4  # at the peak
    assert tau_after([0.1, 0.4, 0.2]) == math.ceil(4 * math.sqrt(2**3)) == 12  # halved after the peak
    assert tau_after([0.4, 0.1]) == math.ceil(4 * math.sqrt(4**3)) == 32  # η_0 is the peak, not the first rate
    assert tau_after([0.1, 0.4, 0.2], loss=0.25) == math.ceil(4 * math.sqrt(0.25 * 8))  # and the loss still counts
    # The old η_0 (the first step's rate, here warmup's start) would have called 0.2 no decay at all.
    assert AdaComm(4, 100, TauInterval(steps=1)).lr0 is None


def test_local_sgd_gives_adacomm_the_peak_rate(monkeypatch):
    from distrain.config import RunConfig
    from distrain.strategies.base import StrategyContext
    from distrain.strategies.local_sgd import LocalSGD

    cfg = RunConfig(
        strategy="local-sgd", adaptive_tau=True, workers=4, batch_size=32, lr=0.1, base_batch_size=64, warmup_epochs=1
    )
    strategy = LocalSGD(cfg, StrategyContext(0, 4, "cpu", total_steps=264))
    assert strategy.adacomm is not None and strategy.adacomm.lr0 == pytest.approx(0.2)  # 0.1 x 128/64
