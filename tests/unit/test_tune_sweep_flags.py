"""`distrain tune`'s sweep flags for strategy options come from the strategies that own them
(`Strategy.sweep_flags`), not from a list in commands/tune.py."""

from __future__ import annotations

from distrain.commands import tune
from distrain.strategies import STRATEGIES


def test_ssp_declares_its_staleness_sweep_flag_and_tune_offers_it():
    assert "staleness" in STRATEGIES.get("ssp").sweep_flags
    assert tune.swept_flags()["staleness"] == ("staleness", "--staleness")
    names = [p.name for p in tune.parameters()]
    assert names.count("staleness") == 1


def test_an_option_a_strategy_declares_becomes_a_flag_with_its_help(monkeypatch):
    local_sgd = STRATEGIES.get("local-sgd")
    monkeypatch.setattr(local_sgd, "sweep_flags", {"tau": "Local SGD periods, e.g. 1,4,16."})
    assert tune.swept_flags()["tau"] == ("tau", "--tau")
    (tau,) = [p for p in tune.parameters() if p.name == "tau"]
    assert "Local SGD periods" in tau.annotation.__metadata__[0].help


def test_the_generic_sweep_flags_stay():
    assert {"batch_sizes", "lr", "lr_scaling", "warmup_epochs", "workers", "strategies"} <= set(tune.swept_flags())
