"""Issue 32's cold start: `distrain --help` lists the commands from stand-ins (no torch, no Ray, no
strategy, no config field loaded) with the very text the built commands give; the start-up clock's
phases; the local Ray begun early (orchestrator/ray_start.py) and the config checks' hook that begins it."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from distrain.config import RunConfig
from distrain.config.checks import before_torch
from distrain.errors import ConfigError
from distrain.orchestrator import ray_start
from distrain.orchestrator.startup import StartupClock

HELP = (
    "import contextlib, io, sys\n"
    "import distrain.cli as cli\n"
    "{before}"
    "sys.argv = ['distrain', '--help']\n"
    "out = io.StringIO()\n"
    "with contextlib.redirect_stdout(out):\n"
    "    code = cli.main()\n"
    "loaded = [m for m in ('torch', 'ray', 'distrain.config', 'distrain.strategies', 'distrain.commands.options')\n"
    "          if m in sys.modules]\n"
    "print(repr((code, loaded, out.getvalue())))\n"
)


def top_level_help(before: str = "") -> tuple[int, list[str], str]:
    done = subprocess.run(
        [sys.executable, "-c", HELP.format(before=before)],
        capture_output=True,
        text=True,
        check=True,
        env={"COLUMNS": "80", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
    )
    return eval(done.stdout)  # noqa: S307 - our own repr


def test_top_level_help_loads_neither_torch_nor_ray_nor_the_strategies():
    code, loaded, text = top_level_help()
    assert code == 0
    assert loaded == []
    assert "run " in text and "plan " in text and "tune " in text


def test_the_stand_ins_list_the_commands_as_the_built_commands_do():
    _, _, light = top_level_help()
    code, loaded, built = top_level_help("cli.build_commands()\n")
    assert code == 0 and "distrain.config" in loaded  # built for real this time
    assert light == built


def test_a_command_line_naming_run_builds_its_options():
    from distrain import cli

    cli.prepare_commands(["run", "--workers", "2"])
    assert cli._built
    run = next(c for c in cli._app.registered_commands if c.name == "run")
    assert run.callback.__name__ == "run" and "workers" in run.callback.__signature__.parameters


def test_the_clock_s_phases_add_up_to_the_first_step_s_end():
    clock = StartupClock(launched=100.0)
    for name, at in (("ready", 102.0), ("checked", 102.5), ("ray", 103.0), ("workers", 106.0)):
        clock.mark(name, at)
    clock.mark("ready", 109.0)  # a later attempt's mark is ignored
    assert clock.phases() is None  # no step yet
    clock.steps([0, 1], [7.0, 7.5], run_start=100.0)  # rank 0's rows
    clock.steps([2], [8.0], run_start=100.0)
    clock.steps([0, 1], [7.2, 7.6], run_start=100.0)  # rank 1: the slower, so step 0 ends at 107.2
    phases = clock.phases()
    assert phases == pytest.approx({"imports": 2.0, "checks": 0.5, "Ray start": 0.5, "actors": 3.0, "first step": 1.2})
    assert sum(phases.values()) == pytest.approx(clock.first_step_end - clock.launched)
    clock.ray_init_s, clock.ray_in_background, clock.data_s = 2.5, True, 0.4
    assert clock.line() == (
        "start-up 7.2 s to the end of step 0: imports 2.0 s, checks 0.5 s, Ray start 0.5 s "
        "(ray.init 2.5 s, begun in the background), actors 3.0 s (data 0.4 s of it), first step 1.2 s"
    )


def test_a_resumed_run_s_first_step_is_its_own():
    clock = StartupClock(launched=0.0)
    clock.steps([41, 42], [3.0, 4.0], run_start=0.0)
    clock.steps([40], [2.0], run_start=0.0)  # an earlier step arriving later (another rank's segment)
    assert (clock.first_step, clock.first_step_end) == (40, 2.0)


@pytest.fixture
def early_ray_enabled(monkeypatch):
    monkeypatch.setattr(ray_start, "_enabled", True)
    monkeypatch.setattr(ray_start, "_pending", None)
    yield
    ray_start.discard()


PLAIN = SimpleNamespace(address="", task="", strategy="bsp")


def test_the_early_ray_is_taken_when_its_size_is_the_run_s(early_ray_enabled):
    stopped = []
    ray_start.begin(PLAIN, lambda config: 2, lambda: stopped.append(True))
    assert ray_start.pending()
    assert ray_start.take(2) is True and not ray_start.pending() and stopped == []


def test_an_early_ray_of_another_size_is_stopped(early_ray_enabled):
    stopped = []
    ray_start.begin(PLAIN, lambda config: 2, lambda: stopped.append(True))
    assert ray_start.take(4) is False and stopped == [True]


def test_an_early_ray_s_error_is_raised_by_the_run_that_takes_it(early_ray_enabled):
    def fails(config):
        raise RuntimeError("no room for the object store")

    ray_start.begin(PLAIN, fails, lambda: None)
    with pytest.raises(RuntimeError, match="no room"):
        ray_start.take(2)


def test_an_early_ray_never_taken_is_stopped(early_ray_enabled):
    stopped = []
    ray_start.begin(PLAIN, lambda config: 2, lambda: stopped.append(True))
    ray_start.discard()
    assert stopped == [True] and not ray_start.pending()


@pytest.mark.parametrize("given", [{"address": "10.0.0.1:6379"}, {"task": "my.py:Task"}, {"strategy": "auto"}])
def test_no_early_ray_for_a_cluster_a_task_or_auto(early_ray_enabled, given):
    ray_start.begin(SimpleNamespace(**(vars(PLAIN) | given)), lambda config: 2, lambda: None)
    assert not ray_start.pending()


def test_no_early_ray_outside_the_console_entry(monkeypatch):
    monkeypatch.setattr(ray_start, "_pending", None)
    ray_start.begin(PLAIN, lambda config: 2, lambda: None)  # not within main(): a test, a notebook
    assert not ray_start.pending()
    with ray_start.enabled():
        pass
    ray_start.begin(PLAIN, lambda config: 2, lambda: None)  # main() has returned
    assert not ray_start.pending()


def test_the_torch_free_checks_pass_before_the_hook_sees_a_config():
    seen = []
    with before_torch(seen.append):
        with pytest.raises(ConfigError):
            RunConfig.resolve(None, {"workers": 0})
        assert seen == []  # refused by a torch-free check: no Ray is begun for bad input
        RunConfig.resolve(None, {"model": "mlp", "workers": 3})
    assert seen and all(config.workers == 3 for config in seen)
    RunConfig.resolve(None, {"model": "mlp"})
    assert all(config.workers == 3 for config in seen)  # the hook is gone after its block
