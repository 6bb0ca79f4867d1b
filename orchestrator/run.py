"""The driver of one run: start workers, drive their segments, evaluate, record, checkpoint, clean up.

    run_training(config, on_event) -> RunResult

Data flow: every worker loads its own shard; the driver only sends (epoch, step range) and receives
metrics rows in batches, evaluation partial sums, and the state to checkpoint.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from distrain.config import RunConfig
from distrain.errors import DistrainError
from distrain.orchestrator import cluster
from distrain.orchestrator.checkpoint import checkpoint_name, save_checkpoint
from distrain.orchestrator.files import atomic_write_text, choose_run_dir
from distrain.orchestrator.metrics import MetricsSink
from distrain.orchestrator.summary import summarize
from distrain.orchestrator.worker import TrainWorker
from distrain.trainers.datasets import check_dataset


@dataclass
class RunStarted:
    run_dir: Path
    total_steps: int
    steps_per_epoch: int
    num_params: int
    nodes: int


@dataclass
class Progress:
    epoch: int
    epochs: int
    steps_done: int
    total_steps: int
    loss: float
    samples_per_s: float
    test_accuracy: float | None


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    worker_info: list[dict[str, Any]] = field(default_factory=list)


Event = RunStarted | Progress
EventHandler = Callable[[Event], None]


def _get(refs: Any, timeout: float | None = None) -> Any:
    """ray.get that surfaces a worker's user-facing error as itself, not as a remote traceback."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DistrainError):
            raise e.cause from None
        raise


def preflight(config: RunConfig) -> Path:
    """Checks that need no cluster; returns the run directory to use. Writes nothing."""
    check_dataset(config.dataset, config.data_dir)
    return choose_run_dir(config.run_dir, config.strategy)


def run_training(config: RunConfig, on_event: EventHandler | None = None) -> RunResult:
    emit = on_event or (lambda event: None)
    run_dir = preflight(config)
    connection = cluster.connect(config)
    pg = None
    workers: list[Any] = []
    try:
        cluster.check_resources(config)
        run_dir.mkdir(parents=True, exist_ok=True)
        config_dict = config.to_dict() | {"run_dir": str(run_dir)}
        atomic_write_text(run_dir / "config.yaml", RunConfig(**config_dict).to_yaml())
        pg = cluster.reserve_workers(config)
        run_start = time.time()
        actor = ray.remote(TrainWorker)
        workers = [
            actor.options(
                num_cpus=config.cpus_per_worker,
                num_gpus=config.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote(config, rank, run_start)
            for rank in range(config.workers)
        ]
        driver = _Driver(config, run_dir, workers, run_start, emit)
        return driver.train()
    finally:
        for w in workers:
            ray.kill(w, no_restart=True)
        cluster.release(pg)
        connection.close()


class _Driver:
    def __init__(
        self, config: RunConfig, run_dir: Path, workers: list[Any], run_start: float, emit: EventHandler
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.workers = workers
        self.run_start = run_start
        self.emit = emit
        self.sink = MetricsSink(run_dir.name)
        self.config_dict = config.to_dict() | {"run_dir": str(run_dir)}

    def train(self) -> RunResult:
        status = "failed"
        try:
            info = _get([w.describe.remote() for w in self.workers], timeout=self.config.collective_timeout_s)
            rendezvous = _get(self.workers[0].rendezvous_address.remote())
            _get([w.setup.remote(rendezvous) for w in self.workers], timeout=self.config.collective_timeout_s)
            steps_per_epoch = info[0]["steps_per_epoch"]
            total = self.config.epochs * steps_per_epoch
            if self.config.max_steps:
                total = min(total, self.config.max_steps)
            self.emit(
                RunStarted(
                    self.run_dir,
                    total,
                    steps_per_epoch,
                    info[0]["num_params"],
                    len({i["node_ip"] for i in info}),
                )
            )
            self._loop(steps_per_epoch, total)
            status = "completed"
            return RunResult(self.run_dir, self._finish(status), info)
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            if status != "completed":
                self._finish(status, checkpoint=False)

    def _loop(self, steps_per_epoch: int, total: int) -> None:
        done = 0
        last_acc: float | None = None
        epoch = 0
        while done < total:
            start = 0
            while start < steps_per_epoch and done < total:
                stop = min(start + self.config.segment_steps, steps_per_epoch, start + total - done)
                t0 = time.perf_counter()
                parts = _get([w.run_segment.remote(epoch, start, stop) for w in self.workers])
                elapsed = time.perf_counter() - t0
                for part in parts:
                    self.sink.add_steps(part)
                done += stop - start
                samples = sum(sum(p["samples"]) for p in parts)
                losses = [loss for p in parts for loss in p["loss"][-1:]]
                self.emit(
                    Progress(
                        epoch,
                        self.config.epochs,
                        done,
                        total,
                        sum(losses) / len(losses),
                        samples / elapsed,
                        last_acc,
                    )
                )
                start = stop
            if start == steps_per_epoch:  # a whole epoch: evaluate and maybe checkpoint
                last_acc = self._evaluate(epoch, done)
                self.emit(
                    Progress(epoch, self.config.epochs, done, total, sum(losses) / len(losses), 0.0, last_acc)
                )
                every = self.config.checkpoint_every
                if every and (epoch + 1) % every == 0:
                    self._checkpoint(checkpoint_name(epoch + 1), epoch + 1, done)
            epoch += 1

    def _evaluate(self, epoch: int, steps_done: int) -> float:
        """Each worker scores its share of the test set; the driver adds the partial sums."""
        t0 = time.perf_counter()
        n = len(self.workers)
        parts = _get([w.evaluate.remote(rank, n) for rank, w in enumerate(self.workers)])
        loss_sum = sum(p[0] for p in parts)
        correct = sum(p[1] for p in parts)
        count = sum(p[2] for p in parts)
        acc = correct / count
        self.sink.add_eval(
            epoch, steps_done, loss_sum / count, acc, time.time() - self.run_start, time.perf_counter() - t0
        )
        return acc

    def _checkpoint(self, name: str, epoch: int, steps_done: int) -> None:
        state = _get(self.workers[0].state.remote())
        save_checkpoint(
            self.run_dir / "checkpoints",
            name,
            state,
            config=self.config_dict,
            epoch=epoch,
            global_step=steps_done,
        )

    def _finish(self, status: str, checkpoint: bool = True) -> dict[str, Any]:
        table = self.sink.table()
        df = table.to_pandas()
        if checkpoint and not df.empty:
            steps = df[df["kind"] == "step"]
            done = int(steps["step"].max()) + 1 if not steps.empty else 0
            epochs_done = (
                int(df[df["kind"] == "eval"]["epoch"].max()) + 1 if (df["kind"] == "eval").any() else 0
            )
            self._checkpoint(checkpoint_name(None), epochs_done, done)
        self.sink.write(self.run_dir / "metrics.parquet")
        summary = summarize(df, self.config_dict, time.time() - self.run_start, status)
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary
