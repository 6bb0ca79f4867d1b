"""The defaults of asynchronous training (async, ssp): the staleness-aware rate is on unless turned off.

With sgd's momentum 0.9 on top of the implicit momentum N asynchronous workers add (Mitliagkas et al.
2016), a user's well-conditioned regression oscillated and ended far from its optimum; dividing a stale
gradient's rate by its staleness (Zhang et al. 2016) converges. Unit tests (no Ray) pin the resolution,
the explicit flags that win, what config.yaml records, and SSP(0) = BSP at three workers; one CLI run
of the issue's exact command checks the outcome.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from distrain.cli import app
from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.strategies.ps_shard import ConsistencyRule, OptimizerSpec, ParameterShard
from distrain.strategies.strategy_lookup import strategy_class


def shard_rule(**kw) -> ConsistencyRule:
    config = RunConfig(**kw)
    return strategy_class(config.strategy).implementation(config).ps_rule(config)


def test_the_staleness_aware_rate_is_on_by_default_for_async_and_ssp_and_explicit_flags_win():
    assert shard_rule(strategy="async").staleness_lr is True
    assert shard_rule(strategy="ssp").staleness_lr is True
    assert shard_rule(strategy="ssp", staleness=4, workers=3, ps_shards=2).staleness_lr is True
    # --no-staleness-lr (False given) wins, through a flag or a config file
    assert shard_rule(strategy="async", staleness_lr=False).staleness_lr is False
    assert RunConfig.resolve(None, {"strategy": "ssp", "staleness_lr": False}).options_of("ssp").staleness_lr is False
    # an explicit --momentum is used as given, the rate still damped
    assert RunConfig(strategy="async", momentum=0.9).momentum == 0.9
    assert shard_rule(strategy="async", momentum=0.9).staleness_lr is True
    # the synchronous rules are left alone, and the switch is refused where nothing reads it
    assert shard_rule(strategy="bsp", transport="ps", backup_workers=1).mode == "rounds"
    with pytest.raises(ConfigError, match="--staleness-lr is not used by --strategy bsp"):
        RunConfig(strategy="bsp", staleness_lr=True)
    assert RunConfig(strategy="bsp", staleness_lr=False).strategy == "bsp"  # off asks nothing of bsp


def test_config_yaml_and_the_summary_record_what_ran():
    nested = yaml.safe_load(RunConfig(strategy="ssp").to_yaml())
    assert nested["strategy"]["ssp"]["staleness_lr"] is True  # a repeat with --config runs the same
    assert RunConfig.resolve(None, {"strategy": "ssp"}) == RunConfig(strategy="ssp", staleness_lr=True)
    for kw, applied in ((dict(strategy="async"), True), (dict(strategy="ssp", staleness=0), False)):
        config = RunConfig(**kw)
        assert strategy_class(config.strategy).actor_figures(config, {}) == {"staleness_lr": applied}


def test_ssp_zero_stays_bsp_with_three_workers_under_the_default():
    """SSP(0): every worker's gradient of a clock is computed on the same θ; the third to arrive finds
    two versions applied, which the default must not divide by (that would break SSP(0) = BSP)."""
    rule = shard_rule(strategy="ssp", staleness=0, workers=3)
    grads = [np.array([3.0], np.float32), np.array([6.0], np.float32), np.array([9.0], np.float32)]

    async def scenario():
        s = ParameterShard(0, 3, rule, OptimizerSpec("sgd", 0.0, 0.0), np.zeros(1, np.float32))
        replies = await asyncio.gather(*(s.push_pull(w, 0, g, 1.0, 0) for w, g in enumerate(grads)))
        return replies

    replies = asyncio.run(scenario())
    assert sorted(r.lag for r in replies) == [0, 1, 2]
    for reply in replies:
        np.testing.assert_allclose(reply.theta, [-6.0])  # θ - η·mean(g): one BSP step


def test_help_states_the_default():
    output = CliRunner().invoke(app, ["run", "--help"]).output
    help_text = " ".join(output.replace("│", " ").split())  # the words, whatever the terminal's width
    assert "Zhang et al. 2016" in help_text and "default on (async, ssp" in help_text




