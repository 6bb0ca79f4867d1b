"""Driver-side actors as specs (strategies/driver_actor.py): what the built-in strategies declare, what each
spec builds its actor from, and the controller's generic start (in order, earlier handles to later specs,
`ready` waited on, everything started listed for killing). No Ray: handles are plain objects."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.strategies.consistency import ConsistencyRule
from distrain.strategies.driver_actor import PS_SHARDS, ActorSetup, DriverActor, checked, ps_shards, start_in_order
from distrain.strategies.portion_scheduler import PortionScheduler
from distrain.strategies.sandblaster_coordinator import SandblasterCoordinator
from distrain.strategies.strategy_lookup import strategy_class


def declared(**values: Any) -> tuple[DriverActor, ...]:
    config = RunConfig(**values)
    return checked(config.strategy, strategy_class(config.strategy).driver_actors(config))


class Call:
    """Stands for an actor method: `.remote(*args)` records the call and returns it (as a ref would)."""

    def __init__(self, log: list[Any], name: str) -> None:
        self.log, self.name = log, name

    def remote(self, *args: Any) -> tuple[Any, ...]:
        self.log.append((self.name, *args))
        return (self.name, *args)


class FakeActor:
    def __init__(self, log: list[Any], name: str) -> None:
        self.log, self.name = log, name

    def __getattr__(self, method: str) -> Call:
        return Call(self.log, f"{self.name}.{method}")


def test_the_built_in_strategies_declare_their_actors_in_start_order():
    assert declared(strategy="bsp") == ()  # the collective transport: nothing on the driver
    assert [s.name for s in declared(strategy="bsp", transport="ps")] == [PS_SHARDS]
    assert [s.name for s in declared(strategy="ssp", staleness=1)] == [PS_SHARDS]
    with_tasks = declared(strategy="bsp", transport="ps", backup_tasks=True, workers=2)
    assert [s.name for s in with_tasks] == [PS_SHARDS, "portion_scheduler"]
    assert with_tasks[1].actor is PortionScheduler and set(with_tasks[1].notices) == {"worker_lost", "mark_slow"}
    sandblaster = declared(strategy="sandblaster", workers=2)
    assert [s.name for s in sandblaster] == [PS_SHARDS, "sandblaster_coordinator"]
    assert sandblaster[1].actor is SandblasterCoordinator and sandblaster[1].ready is not None
    assert declared(strategy="local-sgd") == ()


def test_the_portion_scheduler_is_built_from_the_phase_and_the_shards_counters():
    values = {"strategy": "bsp", "transport": "ps", "backup_tasks": True, "workers": 2, "portions": 8}
    config, spec = RunConfig(**values), declared(**values)[1]
    fresh = ActorSetup(config, 2, start_step=12, steps_per_epoch=5)
    expected = {"per_round": 8, "steps_per_epoch": 5, "start_step": 12, "first_tag": 0, "workers": 2, "replica_size": 1}
    assert spec.args(fresh) == expected
    # Across cut replicas (--fsdp 2) its clients are the 2 replicas of the 4 worker ranks.
    cut = RunConfig(**values, fsdp=2)
    assert spec.args(ActorSetup(cut, 4, 12, 5)) == expected | {"replica_size": 2}
    going_on = ActorSetup(config, 2, 12, 5, counters={"version": 9, "clocks": [9, 9]})
    assert spec.args(going_on)["first_tag"] == 9  # the round open now carries the shards' version
    assert spec.concurrency(2) == 64 and spec.concurrency(40) == 160 and spec.num_cpus == 0


def test_the_coordinator_is_built_with_the_shards_started_before_it_and_opens_the_first_pass():
    values = {"strategy": "sandblaster", "workers": 2, "tasks_per_pass": 4}
    config, coordinator = RunConfig(**values), declared(**values)[1]
    shards = SimpleNamespace(shards=["s0", "s1"], bounds=[(0, 3), (3, 5)])
    setup = ActorSetup(config, 2, start_step=7, steps_per_epoch=1, started={PS_SHARDS: shards})
    args = coordinator.args(setup)
    assert args["shards"] == ["s0", "s1"] and args["start_iteration"] == 7 and args["tasks_per_pass"] == 4
    log: list[Any] = []
    assert coordinator.ready(FakeActor(log, "c"), setup) == [("c.start",)]


@pytest.mark.parametrize(("strategy", "values", "clock"), [("ssp", {"staleness": 1}, 5), ("bsp", {}, 7)])
def test_the_shards_take_their_counters_back_when_the_run_goes_on(strategy, values, clock):
    values = {"strategy": strategy, "transport": "ps", "workers": 3, **values}
    config, spec = RunConfig(**values), declared(**values)[0]
    log: list[Any] = []
    group = SimpleNamespace(
        shards=[FakeActor(log, "s0"), FakeActor(log, "s1")], rebuilding=[], wait_rebuilt=lambda: log.append("wait")
    )
    assert spec.ready(group, ActorSetup(config, 3, 0, 1)) == []  # a fresh phase: nothing to restore
    counters = {"version": 7, "clocks": [3, 5, 4]}
    refs = spec.ready(group, ActorSetup(config, 3, 0, 1, counters=counters))
    # SSP's bounded rule goes on from the furthest clock; the others from the version.
    assert refs == [("s0.set_counters", 7, [clock] * 3), ("s1.set_counters", 7, [clock] * 3)]
    # A task's own scheduler stepped by the shards: its state goes back to every shard with the counters.
    scheduler = {"last_epoch": 6, "_last_lr": [0.01]}
    refs = spec.ready(group, ActorSetup(config, 3, 0, 1, counters=counters | {"scheduler": scheduler}))
    assert refs == [(f"s{i}.set_counters", 7, [clock] * 3, scheduler) for i in range(2)]


def test_warm_shards_are_rebuilt_before_the_workers_set_up_and_before_their_counters_are_set():
    values = {"strategy": "bsp", "transport": "ps", "workers": 2}
    config, spec = RunConfig(**values), declared(**values)[0]
    log: list[Any] = []
    group = SimpleNamespace(
        shards=[FakeActor(log, "s0")], rebuilding=["s0.rebuild"], wait_rebuilt=lambda: log.append("waited")
    )
    assert spec.ready(group, ActorSetup(config, 2, 0, 1)) == ["s0.rebuild"]  # the controller waits on it
    assert log == []
    refs = spec.ready(group, ActorSetup(config, 2, 0, 1, counters={"version": 3, "clocks": [3, 3]}))
    assert log == ["waited", ("s0.set_counters", 3, [3, 3])]  # in that order
    assert refs == [("s0.set_counters", 3, [3, 3])]


def test_start_in_order_hands_earlier_handles_to_later_specs_and_waits_on_each_ready():
    events: list[Any] = []
    config = RunConfig()

    def build(setup: ActorSetup) -> tuple[Any, list[Any]]:
        events.append("build group")
        return "group", ["member0", "member1"]

    specs = (
        DriverActor("group", build=build, ready=lambda h, s: [f"{h} ready"]),
        DriverActor("after", dict, args=lambda s: {"sees": s.started["group"]}, ready=lambda h, s: [f"{h} up"]),
        DriverActor("plain", dict),
    )

    def launch(spec: DriverActor, setup: ActorSetup) -> Any:
        events.append(f"launch {spec.name}")
        return spec.actor(**spec.args(setup))

    setup = ActorSetup(config, 2, 0, 1)
    processes: list[Any] = []
    start_in_order(specs, setup, launch, lambda refs: events.append(("wait", refs)), processes)
    after = {"sees": "group"}
    waits = [("wait", ["group ready"]), ("wait", [f"{after} up"])]
    assert events == ["build group", waits[0], "launch after", waits[1], "launch plain"]
    assert setup.started == {"group": "group", "after": after, "plain": {}}
    assert processes == ["member0", "member1", after, {}]


def test_a_failed_ready_leaves_what_started_to_be_killed():
    def wait(refs: list[Any]) -> None:
        raise TimeoutError("silent")

    specs = (DriverActor("a", dict), DriverActor("b", dict, ready=lambda h, s: ["x"]), DriverActor("c", dict))
    processes: list[Any] = []
    with pytest.raises(TimeoutError):
        start_in_order(specs, ActorSetup(RunConfig(), 1, 0, 1), lambda spec, s: spec.name, wait, processes)
    assert processes == ["a", "b"]


def test_theta_is_asked_of_the_worker_once_per_phase():
    asked: list[int] = []
    setup = ActorSetup(RunConfig(), 1, 0, 1, params=lambda: asked.append(1) or [1.0, 2.0])
    assert setup.theta() == [1.0, 2.0] and setup.theta() == [1.0, 2.0] and asked == [1]
    spec = ps_shards(ConsistencyRule.ssp(1))
    assert spec.name == PS_SHARDS and spec.build is not None and spec.actor is None


def test_bad_declarations_are_refused_with_the_way_over():
    with pytest.raises(ConfigError, match=r"returns distrain.DriverActor specs now, not names"):
        checked("mine.py:Mine", ("ps_shards", "portion_scheduler"))  # a plugin written for the old names
    with pytest.raises(ConfigError, match="names an actor twice"):
        checked("mine.py:Mine", (DriverActor("a", dict), DriverActor("a", list)))
    with pytest.raises(ConfigError, match="exactly one of actor= .* and build="):
        DriverActor("neither")
    with pytest.raises(ConfigError, match="exactly one of"):
        DriverActor("both", dict, build=lambda s: (None, []))
    with pytest.raises(ConfigError, match=r"unknown notices \['worker_joined'\]; known: mark_slow, worker_lost"):
        DriverActor("a", dict, notices=("worker_joined",))
