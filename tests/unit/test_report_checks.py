"""`distrain report` on real runs (BSP all-reduce, SSP on the parameter server, asynchronous with a
worker killed, a BSP -> AdaComm schedule), and on bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from distrain.cli import app
from distrain.config import RunConfig
from distrain.orchestrator.run import run_training

runner = CliRunner()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, ray_cluster) -> list[Path]:
    root = tmp_path_factory.mktemp("runs")
    bsp = run_training(RunConfig(strategy="bsp", epochs=2, run_dir=str(root / "bsp-allreduce")))
    ssp = run_training(RunConfig(strategy="ssp", staleness=1, epochs=2, run_dir=str(root / "ssp-s1")))
    return [bsp.run_dir, ssp.run_dir]


@pytest.fixture(scope="module")
def report(two_runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "out"
    result = runner.invoke(app, ["report", *map(str, two_runs), "--out", str(out)])
    return result, out














































def test_strategy_text_names_each_strategy_with_its_settings():
    from distrain.reporting.report import strategy_text

    def text(**kw):
        return strategy_text(RunConfig(**kw).to_dict())

    assert text() == "bsp"
    assert text(strategy="ssp", staleness=3, ps_shards=2) == "ssp s=3 (ps, 2 shards) staleness-lr"  # on by default
    assert text(strategy="ssp", staleness=0) == "ssp s=0 (ps)"  # SSP(0) is BSP: it divides by nothing
    assert text(strategy="async", staleness_lr=False) == "async (ps)"
    assert text(strategy="bsp", transport="ps", backup_workers=1, workers=3) == "bsp (ps) backup-workers=1"
    assert text(strategy="local-sgd", tau=4) == "local-sgd tau=4"
    assert text(strategy="local-sgd", adaptive_tau=True, tau_interval="50") == "local-sgd tau=8 adaptive (50, max 16)"
    assert text(schedule="ssp:1,local-sgd", epochs=3) == "schedule ssp:1 s=2 (ps) -> local-sgd tau=8"
    assert text(strategy="diloco", sync_every=50) == "diloco H=50 outer sgd lr 0.7 nesterov 0.9"
    streaming = text(strategy="diloco", fragments=4, overlap_steps=2, mix_alpha=0.5, compress="int8")
    assert streaming == "diloco H=8 outer sgd lr 0.7 nesterov 0.9 fragments=4 overlap=2 alpha=0.5 + int8"
    assert text(compress="powersgd:4") == "bsp + powersgd:4"


def test_distinct_dirs_keeps_the_first_spelling_of_each_directory(tmp_path):
    from distrain.reporting.report import distinct_dirs

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = tmp_path / "a", tmp_path / "b"
    kept, repeats = distinct_dirs([a, b, tmp_path / "b" / ".." / "a", a])  # by index: paths[2] repeats paths[0]
    assert kept == [0, 1] and repeats == [(2, 0), (3, 0)]
