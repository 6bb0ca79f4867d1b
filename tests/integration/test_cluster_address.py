"""`distrain run --address` against a Ray started by `ray start --head` elsewhere: the task's file,
in a third directory, reaches the workers through runtime_env, not through the driver's path.

Starts its own Ray head (its own port, temp dir and process group, stopped by that group: `ray stop`
would stop every Ray on the machine)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from distrain.config import RunConfig

pytestmark = pytest.mark.integration

RAY = Path(sys.executable).parent / "ray"

TASK = """
import torch
from torch.utils.data import TensorDataset

import distrain
import helper  # a sibling module: shipped with the task


class Shipped(distrain.Task):
    def build_model(self):
        return torch.nn.Linear(4, 2)

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(96, 4, generator=g)
        y = (x[:, 0] > 0).long()
        return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])

    def loss(self, model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    def metrics(self, model, batch):
        # Evaluated in the workers: 1 when this module and its sibling came from Ray's runtime_env copy.
        return {"from_runtime_env": float("runtime_resources" in __file__ and "runtime_resources" in helper.WHERE),
                "from_original": float(__file__.startswith(ORIGINAL))}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    """`ray start --head --block` in its own directory and process group; yields (address, temp dir)."""
    home = Path(tempfile.mkdtemp(prefix="drh"))  # short: Ray's socket paths must fit 107 characters
    port = _free_port()
    log = open(home / "start.log", "w")
    args = [str(RAY), "start", "--head", "--block", "--num-cpus", "4", "--port", str(port)]
    args += ["--temp-dir", str(home / "t"), "--include-dashboard", "false", "--disable-usage-stats"]
    args += ["--dashboard-port", str(_free_port()), "--dashboard-agent-listen-port", str(_free_port())]
    proc = subprocess.Popen(args, cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 90
        while "Ray runtime started" not in (home / "start.log").read_text():
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail("ray start --head failed:\n" + (home / "start.log").read_text()[-3000:])
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", home / "t"
    finally:
        # --block sat out 20 s of SIGTERM in CI, and every run here waited out the whole grace: a moment for
        # the processes' own handlers, then SIGKILL (the raylet's workers and agents end with it).
        for sig, wait in ((signal.SIGTERM, 1), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)  # the head's own group: raylet, GCS, its workers
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


def test_run_on_a_started_cluster_ships_the_task_file(ray_head, tmp_path):
    address, ray_tmp = ray_head
    code = tmp_path / "code"
    (code / "data").mkdir(parents=True)
    (code / "data" / "samples.bin").write_bytes(b"\0" * (1 << 20))  # next to the task: must not be uploaded
    (code / "helper.py").write_text("WHERE = __file__\n")
    (code / "shipped_task.py").write_text(f"ORIGINAL = {str(code)!r}\n" + TASK)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = dict(os.environ, RAY_AUTH_MODE="token")  # Ray 2.60 sends the head's token to an explicit address
    cmd = [sys.executable, "-m", "distrain.cli", "run", "--address", address, "--workers", "2"]
    cmd += ["--task", "../code/shipped_task.py:Shipped", "--max-steps", "2", "--batch-size", "16", "--run-dir", "run"]
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((cwd / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    assert summary["final_test_from_runtime_env"] == 1.0
    assert summary["final_test_from_original"] == 0.0
    shipped = [p.name for p in ray_tmp.rglob("runtime_resources/py_modules_files/*/*/*") if p.is_file()]
    assert sorted(shipped) == ["__init__.py", "helper.py", "shipped_task.py"]  # no data/samples.bin
    # config.yaml records what a repeat needs: the task's absolute path (on this machine) and the address.
    recorded = RunConfig.load_yaml(cwd / "run" / "config.yaml")
    assert recorded["task"] == f"{code / 'shipped_task.py'}:Shipped" and recorded["address"] == address
