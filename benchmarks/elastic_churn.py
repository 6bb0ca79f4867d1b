"""Goodput under churn (issue 18): elastic membership against restart-from-checkpoint, same schedule.

A simulated cluster (ray.cluster_utils.Cluster): the head has room for the PS shard and one worker,
a second node (2 CPUs) for two more. The second node is there for `--period` seconds, gone for
`--period` (removed without warning), back, and so on, for `--duration` seconds of training, by
wall clock from the moment the run's first rows come in (the same schedule for both modes).

- elastic: `--workers 1..3 --strategy async`: workers join as the node's groups are placed, leave
  when it goes (their units handed to the others), nobody stops.
- restart: the same run, but every membership change restarts every actor from the last checkpoint
  at the new size, which is what Ray Train's elastic mode does on each resize: a leave is taken as a
  failure (restart path, `--max-failures -1`), and a group becoming placed ends the attempt so that
  the restart picks the new size up. Both checkpoint every `--checkpoint-steps`.

Goodput = samples in the run's recorded step rows (a restart drops the rows after its checkpoint,
so only work that counts is in them) per second of wall time; also the time to the target accuracy.
Each mode runs in its own process (one Ray per process).

    python benchmarks/elastic_churn.py [--period 30] [--duration 150] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CONFIG = dict(
    strategy="async", model="mlp", workers="1..3", batch_size=16, epochs=200, segment_steps=2, seed=3,
    comm_delay_ms=40.0, checkpoint_steps=10, max_failures=-1, hang_timeout_s=30.0, collective_timeout_s=60.0,
    target_accuracy=0.9,
)  # fmt: skip


def restart_on_every_change() -> None:
    """Make the elastic driver behave as Ray Train's elastic mode: any membership change restarts every
    actor from the last checkpoint, at whatever size can be placed then."""
    from distrain.orchestrator import membership, run
    from distrain.orchestrator.recovery import RunLost

    membership.Membership.can_leave = lambda self, workers, lost: False  # a leave is a failure: restart
    original_join = run._Driver._join

    def join(self, dispatch):  # a slot placed: restart at the new size (the restart starts all placed ones)
        if self.membership.joinable(self.workers):
            raise RunLost("node", None, "membership grew: restart at the new size")
        original_join(self, dispatch)

    run._Driver._join = join
    original_wait = membership.ElasticPlacement.wait_for_min

    def wait_for_min(self, timeout_s):  # as Train's restart waits for the new group, not only MIN
        placed = original_wait(self, timeout_s)
        deadline = time.monotonic() + 3.0
        while len(placed) < len(self.groups) and time.monotonic() < deadline:
            time.sleep(0.2)
            placed = self.ready_ranks()
        return placed

    membership.ElasticPlacement.wait_for_min = wait_for_min


def one(mode: str, period: float, duration: float, run_dir: str) -> dict:
    import pandas as pd
    import ray
    from ray.cluster_utils import Cluster

    from distrain.config import RunConfig
    from distrain.orchestrator.callbacks import Callback
    from distrain.orchestrator.run import run_training

    if mode == "restart":
        restart_on_every_change()
    fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "_system_config": fast})
    ray.init(address=cluster.address)
    node = cluster.add_node(num_cpus=2)
    started = threading.Event()
    stop_at = [float("inf")]

    class Clock(Callback):
        def on_rows(self, rows):
            if not started.is_set():
                stop_at[0] = time.time() + duration
                started.set()
            return time.time() >= stop_at[0]  # True: stop after the segments under way

    result: dict = {}

    def train() -> None:
        try:
            result["run"] = run_training(RunConfig(run_dir=run_dir, **CONFIG), callbacks=[Clock()])
        except BaseException:  # noqa: BLE001 - reported below, with where it came from
            import traceback

            result["error"] = traceback.format_exc()

    thread = threading.Thread(target=train)
    thread.start()
    started.wait(300)
    schedule, t0 = [], time.time()
    while thread.is_alive():  # add_node/remove_node need the main thread
        thread.join(timeout=0.5)
        phase = int((time.time() - t0) // period)
        want = phase % 2 == 0  # present in even periods
        if want and node is None:
            node = cluster.add_node(num_cpus=2)
            schedule.append(("added", round(time.time() - t0, 1)))
        elif not want and node is not None:
            cluster.remove_node(node, allow_graceful=False)
            node = None
            schedule.append(("removed", round(time.time() - t0, 1)))
    if "error" in result:
        raise RuntimeError(result["error"])
    r = result["run"]
    rows = pd.read_parquet(r.run_dir / "metrics.parquet").query("kind == 'step'")
    s = r.summary
    out = {
        "mode": mode,
        "wall_time_s": s["wall_time_s"],
        "useful_samples": int(rows["samples"].sum()),
        "goodput": float(rows["samples"].sum()) / s["wall_time_s"],
        "time_to_target_s": s["time_to_target_s"],
        "final_test_accuracy": s.get("final_test_accuracy"),
        "restarts": s["failures"],
        "failure_kinds": [(e.get("kind"), e.get("target"), e.get("action")) for e in s.get("failure_events", [])],
        "membership": {k: v for k, v in s["membership"].items() if k not in ("events", "drain_checkpoints")},
        "schedule": schedule,
    }
    ray.shutdown()
    cluster.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--period", type=float, default=30.0)
    parser.add_argument("--duration", type=float, default=150.0)
    parser.add_argument("--one", choices=("elastic", "restart"), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.period, args.duration, args.run_dir)), flush=True)
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("elastic", "restart"):
            cmd = [sys.executable, __file__, "--one", mode, "--period", str(args.period),
                   "--duration", str(args.duration), "--run-dir", str(Path(tmp) / mode)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
            results.append(json.loads(line.removeprefix("RESULT ")))
            print(json.dumps(results[-1]), flush=True)
    elastic, restart = results
    print(
        f"goodput elastic {elastic['goodput']:.0f} samples/s, restart {restart['goodput']:.0f} samples/s: "
        f"{elastic['goodput'] / restart['goodput']:.2f}x; time to target {elastic['time_to_target_s']} s vs "
        f"{restart['time_to_target_s']} s"
    )


if __name__ == "__main__":
    main()
