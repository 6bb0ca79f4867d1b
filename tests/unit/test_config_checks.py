"""The config's checks are registered by their owners (config/checks.py) and run when a config is built."""

from __future__ import annotations

import pytest

from distrain.config import RunConfig, config_check
from distrain.config import checks as registry
from distrain.errors import ConfigError


@pytest.fixture
def restored():
    """Leave the registry as it was: a check registered by a test goes with it."""
    saved = {stage: dict(found) for stage, found in registry._CHECKS.items()}
    yield
    registry._CHECKS.clear()
    registry._CHECKS.update(saved)


def test_a_registered_check_runs_when_a_config_is_built_and_its_line_is_the_error(restored):
    @config_check(stage="across")
    def no_seven_workers(config):
        if config.workers == 7:
            raise ConfigError("--workers 7 is refused by this test's check")

    assert RunConfig(workers=6).workers == 6
    with pytest.raises(ConfigError, match="refused by this test's check"):
        RunConfig(workers=7)
    with pytest.raises(ConfigError, match="refused by this test's check"):
        RunConfig(workers=6).replace(workers=7)  # replace builds, and so checks, a new config


def test_stages_run_in_order_whatever_the_order_of_registration(restored):
    ran = []

    @config_check(stage="last")
    def late(config):
        ran.append("last")

    @config_check(stage="across")
    def middle(config):
        ran.append("across")

    @config_check
    def early(config):
        ran.append("values")

    RunConfig()
    assert ran == ["values", "across", "last"]
    names = [check.__name__ for check in registry.registered()]
    assert names.index("early") < names.index("middle") < names.index("late")
    # The torch-loading optimizer check stays after every other, the new ones included.
    assert names[-1] == "late" and names.index("check_optimizer_arguments") > names.index("middle")


def test_registering_a_function_again_replaces_it(restored):
    def refuse(config):
        raise ConfigError("first")

    config_check(refuse)
    count = len(registry.registered())

    def refuse(config):  # noqa: F811 (the same module and name: a reloaded module)
        raise ConfigError("second")

    config_check(refuse)
    assert len(registry.registered()) == count
    with pytest.raises(ConfigError, match="second"):
        RunConfig()


def test_an_unknown_stage_is_refused():
    with pytest.raises(ValueError, match="unknown check stage"):
        config_check(stage="soon")


def test_every_section_has_its_checks_registered():
    """The built-in checks are all there (one per section, and those across sections)."""
    names = {check.__name__ for check in registry.registered()}
    assert {
        "check_data",
        "check_resources",
        "check_optimization",
        "check_checkpointing",
        "check_faults",
        "check_stragglers",
        "check_output",
        "check_task",
        "check_link",
        "check_strategy_options",
        "check_pipeline",
        "check_elastic",
        "check_optimizer_arguments",
    } <= names


def test_worker_memory_is_checked_without_the_orchestrator():
    """--worker-memory's size is read by units.parse_bytes (the spec layer imports no orchestrator)."""
    with pytest.raises(ConfigError, match="--worker-memory takes a size"):
        RunConfig(worker_memory="lots")
    assert RunConfig(worker_memory="3GiB").worker_memory == "3GiB"
    from distrain.orchestrator import memory
    from distrain.units import parse_bytes

    assert memory.parse_bytes is parse_bytes and parse_bytes("512MiB") == 512 * 2**20
