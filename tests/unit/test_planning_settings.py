"""The planner reads each strategy's planned options from its declaration (Strategy.planning), by role.
No Ray, no torch."""

from __future__ import annotations

from distrain.planning import planner
from distrain.strategies.diloco import DEFAULT_SYNC_EVERY
from distrain.strategies.local_sgd import DEFAULT_TAU
from distrain.strategies.ps import DEFAULT_STALENESS
from tests.unit.test_planner import _cal


def test_each_strategy_is_planned_at_its_declared_run_defaults():
    cal = _cal()
    assert planner.predict(cal, "local-sgd", "collective", 4).setting == f"--tau {DEFAULT_TAU}"
    assert planner.predict(cal, "diloco", "collective", 4).setting == f"--sync-every {DEFAULT_SYNC_EVERY}"
    assert planner.predict(cal, "ssp", "ps", 4).setting == f"--staleness {DEFAULT_STALENESS}"
    assert planner.predict(cal, "ssp", "ps", 4, settings={"staleness": 0}).setting == "--staleness 0"
    # an option that is off by default is named only when on
    assert planner.predict(cal, "bsp", "ps", 4).setting == ""
    assert planner.predict(cal, "bsp", "ps", 4, settings={"backup_workers": 1}).setting == "--backup-workers 1"
    assert planner.predict(cal, "async", "ps", 4).setting == ""


def test_a_role_maps_to_the_strategy_s_own_option():
    assert planner.settings_for("local-sgd", "period", 5) == {"tau": 5}
    assert planner.settings_for("diloco", "period", 50) == {"sync_every": 50}
    assert planner.default("ssp", "bound") == DEFAULT_STALENESS
    # the period is what the model uses: a longer one averages less often, so less traffic per step
    cal = _cal()
    short = planner.predict(cal, "local-sgd", "collective", 4, settings=planner.settings_for("local-sgd", "period", 2))
    long = planner.predict(cal, "local-sgd", "collective", 4, settings=planner.settings_for("local-sgd", "period", 20))
    assert long.bytes_per_worker < short.bytes_per_worker


def test_backup_workers_declared_by_bsp_make_more_workers_busy():
    cal = _cal(spread=[0.9, 1.0, 1.1, 1.4])
    plain = planner.predict(cal, "bsp", "ps", 4)
    backed = planner.predict(cal, "bsp", "ps", 4, settings={"backup_workers": 2})
    assert backed.compute_s > plain.compute_s  # 6 busy workers share the cores, not 4
    assert backed.wait_s < plain.wait_s  # the round waits for the 4th fastest of 6, not the slowest of 4
