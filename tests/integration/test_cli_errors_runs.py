"""`distrain` on bad input: exit code 2, one line of error text, no traceback, nothing written.

All but the last test fail before Ray would start, and a guard makes starting Ray fail the test.
"""

from __future__ import annotations

import pytest

from distrain.cli import app
from tests.unit.test_cli_errors import EXPECTED_REFUSAL, assert_one_line_error, runner, tcp_server


def silent(conn):
    pass  # accepts, reads nothing, says nothing (held open until the test ends)


def test_address_probe_lets_a_real_gcs_through(ray_cluster):
    """The session's Ray (token authentication on, as Ray 2.60 starts it) passes the probe."""
    from distrain.orchestrator import address

    gcs = ray_cluster.get_runtime_context().gcs_address
    address.probe(gcs)




@pytest.mark.integration
def test_address_that_accepts_and_says_nothing_is_one_line_in_seconds(tmp_path, monkeypatch, capfd):
    """A port that takes TCP connections but is not Ray: ray.init took 32 s and printed 20 warning lines
    before its error. The console entry point (`cli.main`, in this process: a fresh one only added its
    cold start): one line, from the probe, before Ray is asked; any output, Ray's C++ included, is read
    at the file descriptors."""
    import sys

    import ray

    from distrain import cli
    from distrain.orchestrator import ray_start

    def refuse(*a, **k):
        raise AssertionError("Ray must not be started or joined for an address where Ray does not answer")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process
    begin = ray_start.begin

    def begin_none(*a, **k):  # nor begun early, on the CLI's thread (not for --address)
        begin(*a, **k)
        assert not ray_start.pending(), "a local Ray was begun for a run with --address"

    monkeypatch.setattr(ray_start, "begin", begin_none)
    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)  # main() sets it for a pipe: put back after the test
    monkeypatch.chdir(tmp_path)
    with tcp_server(silent) as where:
        monkeypatch.setattr(sys, "argv", ["distrain", "run", "--address", where, "--model", "linear", "--epochs", "1"])
        code = cli.main()
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert out == "" and len(err.strip().splitlines()) == 1, err
    line = err.strip()
    assert line.startswith(EXPECTED_REFUSAL.format(where=where)) and "(it said nothing for 3s)" in line, line
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- needs the cluster
def test_more_gpus_than_the_cluster_has(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ray_cluster.cluster_resources().get("GPU", 0) == 0
    run_dir = tmp_path / "r"
    result = runner.invoke(app, ["run", "--gpus-per-worker", "1", "--run-dir", str(run_dir)])
    line = assert_one_line_error(result, "GPU")
    assert "--gpus-per-worker" in line
    assert not run_dir.exists()  # the resource check comes before the run directory is made
    assert not (tmp_path / "runs").exists()
    assert ray_cluster.is_initialized()  # a cluster the command did not start is left running


def test_more_backup_workers_than_the_cluster_can_place(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "r"
    args = ["run", "--transport", "ps", "--backup-workers", "20", "--run-dir", str(run_dir)]
    line = assert_one_line_error(runner.invoke(app, args), "the run needs 23 CPUs", "22 workers")
    assert "cluster has 8" in line
    assert not run_dir.exists()


def test_kill_node_on_a_one_node_cluster_is_refused_before_anything_is_written(ray_cluster, tmp_path, monkeypatch):
    """kill-node never kills the driver's node, so on a one-node cluster it could never fire."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "r"
    args = ["run", "--model", "mlp", "--epochs", "1", "--chaos", "kill-node@5", "--run-dir", str(run_dir)]
    assert_one_line_error(runner.invoke(app, args), "'kill-node@5' needs a cluster of 2 or more nodes", "has 1")
    assert not run_dir.exists()


def test_tune_trial_larger_than_the_cluster(ray_cluster, tmp_path, monkeypatch):
    """8 workers x 1 CPU + the trial driver's bundle cannot fit the 8-CPU test cluster: refused
    before Tune starts a trial (Tune would otherwise wait for the resources forever). The cluster's size
    is known only once connected, so the sweep's size (printed before Ray) comes first, on stdout."""
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "s"
    result = runner.invoke(app, ["tune", "--workers", "2,8", "--epochs", "1", "--sweep-dir", str(sweep)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.stdout.strip().startswith(f"sweep {sweep}  |  2 trial(s)") and len(result.stdout.splitlines()) == 1
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("error:"), result.stderr
    for fragment in ("8 workers needs 8.01 CPUs", "cluster has 8 CPUs", "--workers"):
        assert fragment in line, (fragment, line)
    assert not sweep.exists()
