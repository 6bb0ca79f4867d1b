"""--workers N | MIN..MAX (issue 18): one parser for flags and YAML, recorded as given, compared as a range."""

from __future__ import annotations

import pytest

from distrain.config import RunConfig, format_workers, parse_workers
from distrain.errors import ConfigError
from distrain.orchestrator.checkpoint import LATEST
from distrain.orchestrator.resume import _same, resume_config


@pytest.mark.parametrize(
    "given, expected",
    [
        (3, (3, 0)),
        ("3", (3, 0)),
        (3.0, (3, 0)),
        ("2..4", (2, 4)),
        (" 2 .. 4 ", (2, 4)),
        ("3..3", (3, 0)),
        ((2, 4), (2, 4)),
    ],
)
def test_parse_workers(given, expected):
    assert parse_workers(given) == expected


@pytest.mark.parametrize(
    "given, message",
    [
        ("4..2", r"MIN \(4\) is above MAX \(2\)"),
        ("0..2", "MIN must be >= 1, got 0"),
        ("-1..2", "MIN must be >= 1, got -1"),
        (0, "--workers must be >= 1"),
        ("2...4", "must be an integer"),
        ("2..", "must be an integer"),
        (True, "must be an integer"),
    ],
)
def test_bad_workers(given, message):
    with pytest.raises(ConfigError, match=message):
        parse_workers(given)


def test_a_range_is_recorded_as_given_and_read_back_the_same(tmp_path):
    cfg = RunConfig(workers="2..4", strategy="async", batch_size=8)
    assert (cfg.workers, cfg.max_workers, cfg.worker_range, cfg.elastic) == (2, 4, (2, 4), True)
    # The books (ranks, slices of a step, shard clocks) are kept for MAX; each update is one worker's B.
    assert cfg.num_worker_actors == 4 and cfg.samples_per_step == 32 and cfg.global_batch_size == 32
    assert cfg.to_dict()["workers"] == "2..4" and "max_workers" not in cfg.to_dict()
    assert cfg.to_nested()["resources"]["workers"] == "2..4"
    text = cfg.to_yaml()
    assert "workers: 2..4" in text and "max_workers" not in text
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert RunConfig.resolve(str(path), {}) == cfg
    assert cfg.replace(lr=0.2).worker_range == (2, 4)
    # Flat YAML, nested YAML and the flag's string give the same config.
    flat = tmp_path / "flat.yaml"
    flat.write_text("workers: 2..4\nstrategy: async\nbatch_size: 8\n")
    assert RunConfig.resolve(str(flat), {}) == cfg
    assert RunConfig.resolve(None, {"workers": "2..4", "strategy": "async", "batch_size": 8}) == cfg
    fixed = RunConfig(workers="3")
    assert (fixed.workers, fixed.max_workers, fixed.elastic, fixed.to_dict()["workers"]) == (3, 0, False, 3)
    assert format_workers(2, 4) == "2..4" and format_workers(3, 0) == 3


def test_a_range_refused_for_a_strategy_that_cannot_change_membership_names_those_that_can():
    with pytest.raises(
        ConfigError,
        match="cannot change its membership mid-run.*that can: async, ssp, bsp over collective/ps, "
        "diloco over collective, local-sgd over collective$",
    ):
        RunConfig(workers="2..3", strategy="sandblaster")
    assert RunConfig(workers="2..3", strategy="ssp").elastic
    # BSP over the PS takes a range (rounds of the current members), and backup workers with it.
    assert RunConfig(workers="2..3", strategy="bsp", transport="ps").elastic
    assert RunConfig(workers="2..3", strategy="bsp", transport="ps", backup_workers=1).num_worker_actors == 3
    tasks = RunConfig(workers="2..4", strategy="bsp", transport="ps", backup_tasks=True, batch_size=8)
    assert tasks.elastic and tasks.options_of("bsp").portions == 8  # 2 x MAX
    # BSP over the collective transport re-forms its group (orchestrator/controller/collective_scaling.py).
    assert RunConfig(workers="2..3", strategy="bsp").elastic
    assert RunConfig(workers="2..3", strategy="local-sgd").elastic  # re-formed at its averaging rounds
    with pytest.raises(ConfigError, match="--adaptive-tau does not compose with --workers MIN..MAX"):
        RunConfig(workers="2..3", strategy="local-sgd", adaptive_tau=True)
    # DiLoCo re-forms at its outer steps; Streaming DiLoCo's fragments sync inside a block: refused.
    assert RunConfig(workers="2..3", strategy="diloco").elastic
    for flag, value in (("fragments", 2), ("overlap_steps", 1)):
        with pytest.raises(ConfigError, match="does not compose with --workers MIN..MAX"):
            RunConfig(workers="2..3", strategy="diloco", **{flag: value})
    with pytest.raises(ConfigError, match="--workers 2..3 does not compose with --compress"):
        RunConfig(workers="2..3", strategy="bsp", compress="int8")
    assert RunConfig(workers="2..3", strategy="bsp", chaos=["kill-worker@3:1"]).elastic  # a leave, then a rejoin
    RunConfig(workers="2..2", strategy="bsp")  # MIN == MAX is a fixed size


def test_resume_compares_ranges_as_ranges(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / LATEST).write_text('{"name": "step-00000004.pt", "global_step": 4}\n')  # --resume wants one
    (run / "config.yaml").write_text(RunConfig(workers="2..4", strategy="async", run_dir=str(run)).to_yaml())
    assert resume_config(run, {"workers": "2..4"}).worker_range == (2, 4)
    assert resume_config(run, {"workers": " 2 .. 4"}).worker_range == (2, 4)
    for other in ("2..5", "2", "4"):
        with pytest.raises(ConfigError, match=rf"--resume cannot change --workers \(the run has 2..4, got {other}\)"):
            resume_config(run, {"workers": other})
    cfg = RunConfig(workers="2..4", strategy="async")
    assert _same("workers", "2..4", cfg) and not _same("workers", 2, cfg) and not _same("workers", "2..3", cfg)
    assert _same("workers", 3, RunConfig(workers=3)) and _same("workers", "3..3", RunConfig(workers=3))
