"""Sweep specifications (`distrain tune` flags) parsed and checked without Ray."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from distrain.config import RunConfig
from distrain.errors import ConfigError, ResourceError
from distrain.orchestrator.trial_resources import trial_bundles, trial_cpus
from distrain.tuning.sweep_spec import (
    VARIANTS,
    Choice,
    Range,
    SweepSpec,
    flatten,
    parse_dimension,
    parse_param,
    sort_by_objective,
    trial_config,
)


def base(**kw) -> dict:
    return RunConfig(**kw).to_dict()


def test_lists_and_ranges_parse_by_field_type():
    assert parse_dimension("batch_size", "16, 32,64") == Choice((16, 32, 64))
    assert parse_dimension("batch_size", "16,16,32") == Choice((16, 32))  # a repeat would rerun a trial
    assert parse_dimension("lr_scaling", "linear,none") == Choice(("linear", "none"))
    assert parse_dimension("lr", "0.01:0.5:log") == Range(0.01, 0.5, True)
    assert parse_dimension("warmup_epochs", "0:2") == Range(0.0, 2.0, False)
    assert parse_dimension("lr", "0.1") == Choice((0.1,))
    assert parse_param("momentum=0.8,0.9") == ("momentum", Choice((0.8, 0.9)))
    assert parse_param("staleness_lr=true,false") == ("staleness_lr", Choice((True, False)))


@pytest.mark.parametrize(
    "name, text, fragment",
    [
        ("batch_size", "", "is empty"),
        ("batch_size", "16,x", "not an integer"),
        ("lr", "0.5:0.1", "low end must be below"),
        ("lr", "-1:1:log", "positive low end"),
        ("lr", "a:b", "not a number"),
        ("lr", "inf,1", "not a number"),
        ("workers", "1:4", "comma list of positive worker counts"),
        ("workers", "2,0", "comma list of positive worker counts"),
        ("workers", "2.5", "comma list of positive worker counts"),
        ("nope", "1", "unknown config field"),
    ],
)
def test_bad_dimensions(name, text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_dimension(name, text)


def test_trial_config_switches_strategy_defaults_like_resolve():
    b = base(strategy="async", ps_shards=2)
    assert RunConfig(**b).transport == "ps"
    bsp = trial_config(b, {"strategy": "bsp"}, "some/dir")
    assert (bsp.transport, bsp.ps_shards, bsp.run_dir, bsp.eval_every) == ("collective", None, "some/dir", 1)
    ssp = trial_config(base(), {"strategy": "ssp", "staleness": 4})
    assert (ssp.transport, ssp.ps_shards, ssp.options_of("ssp").staleness) == ("ps", 1, 4)


def test_trial_config_switches_optimizer_and_data_set_defaults_like_resolve(tmp_path):
    adam = trial_config(base(), {"optimizer": "adam"})  # the base's sgd momentum stays with sgd
    assert adam.momentum is None
    assert trial_config(base(optimizer="adam"), {"optimizer": "sgd"}).momentum is None  # sgd's own: 0.9
    with pytest.raises(ConfigError, match="--momentum is not used by --optimizer adam"):
        trial_config(base(), {"optimizer": "adam", "momentum": 0.5})
    mnist = base(dataset="mnist", data_dir=str(tmp_path))
    assert trial_config(mnist, {"dataset": "digits"}).data_dir == ""
    assert trial_config(mnist, {"dataset": "cifar10"}).data_dir == str(tmp_path)


def test_grid_counts_and_every_combination_is_checked():
    spec = SweepSpec(
        base(),
        {"batch_size": Choice((16, 32)), "lr_scaling": Choice(("linear", "sqrt", "none")), "lr": Choice((0.1,))},
    )
    spec.validate()
    assert spec.num_trials() == 6
    assert len(spec.sample_configs()) == 6
    bad = SweepSpec(base(), {"staleness": Choice((0, 2))})
    with pytest.raises(ConfigError, match="--staleness is not used by --strategy bsp"):
        bad.validate()  # one strategy (the base's bsp), which does not read staleness


def test_a_strategy_field_goes_only_to_the_strategies_that_read_it():
    """bsp x 1 + ssp x 2 staleness bounds = 3 trials (the full 2 x 2 grid gave bsp a staleness)."""
    spec = SweepSpec(base(), {"strategy": Choice(("bsp", "ssp")), "staleness": Choice((0, 2)), "lr": Choice((0.1,))})
    spec.validate()
    assert spec.num_trials() == 3
    runs = {(c.strategy, c.to_dict().get("staleness")) for c in spec.sample_configs()}
    assert runs == {("bsp", None), ("ssp", 0), ("ssp", 2)}
    assert set(spec.axes()) == {VARIANTS, "lr"}
    point = {VARIANTS: {"strategy": "ssp", "staleness": 2}, "lr": 0.1}
    assert flatten(point) == {"strategy": "ssp", "staleness": 2, "lr": 0.1}
    assert trial_config(base(), point).options_of("ssp").staleness == 2
    # three strategies, two of their fields: each strategy gets its own (local-sgd tau, ssp staleness)
    mixed = SweepSpec(
        base(),
        {"strategy": Choice(("bsp", "ssp", "local-sgd")), "staleness": Choice((0, 2)), "tau": Choice((2, 4, 8))},
        search="grid",
        num_samples=2,
    )
    mixed.validate()
    assert mixed.num_trials() == (1 + 2 + 3) * 2
    # a field that no listed strategy reads is still refused, naming the strategies that do read it
    with pytest.raises(ConfigError, match="--staleness is not used by any of --strategies bsp,async.*ssp"):
        SweepSpec(base(), {"strategy": Choice(("bsp", "async")), "staleness": Choice((0, 2))}).validate()


def test_every_trial_gets_the_checks_run_makes_before_starting():
    """A global batch larger than the data set: RunConfig accepts it, `distrain run` refuses it in its
    preflight (data set size), and so must the sweep, for the trial that has it."""
    with pytest.raises(ConfigError, match="global batch \\(200000\\) exceeds the 1294 training samples"):
        SweepSpec(base(), {"batch_size": Choice((16, 100000))}).validate()
    with pytest.raises(ConfigError, match="global batch \\(1600\\) exceeds"):  # batch x workers together
        SweepSpec(base(), {"batch_size": Choice((16, 400)), "workers": Choice((2, 4))}, search="grid").validate()
    shards = SweepSpec(base(strategy="async"), {"ps_shards": Choice((1, 10**9))})
    with pytest.raises(ConfigError, match="--ps-shards 1000000000 exceeds the model's"):
        shards.validate()


def test_cluster_cpus_checked_before_ray():
    spec = SweepSpec(base(), {"workers": Choice((2, 4))})  # the largest trial: 4 x 1 CPU + 0.01
    spec.check_cluster_cpus(0)  # this machine's cores
    spec.check_cluster_cpus(5)
    with pytest.raises(ConfigError, match="--cluster-cpus must be >= 0"):
        spec.check_cluster_cpus(-4)
    with pytest.raises(ResourceError, match="needs 4.01 CPUs but --cluster-cpus is 4"):
        spec.check_cluster_cpus(4)
    with pytest.raises(ConfigError, match="drop it with --address"):
        SweepSpec(base(address="auto"), {}).check_cluster_cpus(8)


def test_random_search_takes_ranges_and_counts_samples():
    spec = SweepSpec(base(), {"lr": Range(0.01, 0.5, True)}, search="random", num_samples=5)
    spec.validate()
    assert spec.num_trials() == 5
    with pytest.raises(ConfigError, match="grid search cannot enumerate"):
        SweepSpec(base(), {"lr": Range(0.01, 0.5, True)}).validate()
    with pytest.raises(ConfigError, match="unknown --scheduler"):
        SweepSpec(base(), {}, scheduler="pbt").validate()
    with pytest.raises(ConfigError, match="--grace-period"):
        SweepSpec(base(epochs=2), {}, scheduler="asha", grace_period=3).validate()


def test_trial_bundles_one_per_actor_and_the_largest_trial():
    ps = RunConfig(strategy="async", workers=3, ps_shards=2, cpus_per_worker=0.5, cpus_per_shard=0.25)
    assert trial_bundles(ps) == [{"CPU": 0.01}] + [{"CPU": 0.5}] * 3 + [{"CPU": 0.25}] * 2
    assert math.isclose(trial_cpus(ps), 0.01 + 1.5 + 0.5)
    gpu = RunConfig(workers=2, gpus_per_worker=1)
    assert trial_bundles(gpu)[1:] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    spec = SweepSpec(base(), {"workers": Choice((2, 4)), "strategy": Choice(("bsp", "async"))})
    largest = spec.largest_trial()
    assert (largest.workers, largest.strategy) == (4, "async")  # 4 workers + a shard: 5.01 CPUs


def test_objective_order():
    table = pd.DataFrame(
        {
            "trial_id": list("abcde"),
            "status": ["completed", "completed", "stopped", "completed", "error"],
            "time_to_target_s": [9.0, None, 3.0, 5.0, None],
            "final_accuracy": [0.97, 0.99, 0.96, 0.95, None],
        }
    )
    assert list(sort_by_objective(table, "time_to_target")["trial_id"]) == ["c", "d", "a", "b", "e"]
    assert list(sort_by_objective(table, "final_accuracy")["trial_id"]) == ["b", "a", "c", "d", "e"]


def test_workers_dimension_reads_plans_grammar():
    """`tune --workers` and `plan --workers` read one grammar (units.parse_worker_counts): a comma list,
    in the order given, repeats dropped (a repeat would run the same trials twice)."""
    from distrain.units import parse_worker_counts

    assert parse_dimension("workers", "4, 2,4,1") == Choice(tuple(parse_worker_counts("4, 2,4,1"))) == Choice((4, 2, 1))


class _SweepStarted(Exception):
    """Raised by the stand-in `run_sweep`: the CLI got as far as starting the sweep with `spec`."""

    def __init__(self, spec: SweepSpec) -> None:
        super().__init__("sweep started")
        self.spec = spec


def _tune_spec(monkeypatch, tmp_path, *args: str) -> SweepSpec:
    """The SweepSpec `distrain tune ARGS` would start (the real CLI, up to where Ray would load)."""
    import sys
    import types

    from typer.testing import CliRunner

    from distrain.cli import app

    def run_sweep(spec, *rest, **kwargs):
        raise _SweepStarted(spec)

    monkeypatch.setitem(sys.modules, "distrain.tuning.tune", types.SimpleNamespace(run_sweep=run_sweep))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["tune", "--model", "mlp", "--epochs", "1", *args])
    assert isinstance(result.exception, _SweepStarted), result.output
    return result.exception.spec


def _lr_by_strategy(spec: SweepSpec) -> dict[str, float]:
    return {config.strategy: config.lr for config in spec.sample_configs()}


def test_each_trial_takes_its_own_strategy_s_defaults_unless_the_sweep_sets_them(monkeypatch, tmp_path):
    """`tune --strategies bsp,diloco`: the diloco trial runs at diloco's own inner rate (0.01), not the
    0.05 the base config resolved for bsp; a rate the sweep sets (a --lr axis, or --config) wins for both."""
    spec = _tune_spec(monkeypatch, tmp_path, "--strategies", "bsp,diloco")
    assert _lr_by_strategy(spec) == {"bsp": 0.05, "diloco": 0.01}
    assert spec.base_config.lr == 0.05 and spec.base_config.epochs == 1  # the base alone: bsp's
    swept = _tune_spec(monkeypatch, tmp_path, "--strategies", "bsp,diloco", "--lr", "0.2")
    assert _lr_by_strategy(swept) == {"bsp": 0.2, "diloco": 0.2}
    (tmp_path / "base.yaml").write_text("lr: 0.02\n")
    filed = _tune_spec(monkeypatch, tmp_path, "--config", "base.yaml", "--strategies", "diloco,bsp")
    assert _lr_by_strategy(filed) == {"bsp": 0.02, "diloco": 0.02}
