"""The driver of one run: start workers, drive their segments, evaluate, record, checkpoint, clean up.

    run_training(config, on_event) -> RunResult

Data flow: every worker loads its own shard; the driver only sends (epoch, step range) and receives
metrics rows in batches, evaluation partial sums, and the state to checkpoint.
"""

from __future__ import annotations

import dataclasses
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
    check_dataset(config.dataset, config.data_dir, config.global_batch_size)
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
        self.steps_per_epoch = 0  # known once the workers have loaded their data
        self.steps_done = 0

    def train(self) -> RunResult:
        status = "failed"
        try:
            info = _get([w.describe.remote() for w in self.workers], timeout=self.config.collective_timeout_s)
            rendezvous = _get(self.workers[0].rendezvous_address.remote())
            _get([w.setup.remote(rendezvous) for w in self.workers], timeout=self.config.collective_timeout_s)
            self.steps_per_epoch = info[0]["steps_per_epoch"]
            total = self.config.epochs * self.steps_per_epoch
            if self.config.max_steps:
                total = min(total, self.config.max_steps)
            self.emit(
                RunStarted(
                    self.run_dir,
                    total,
                    self.steps_per_epoch,
                    info[0]["num_params"],
                    len({i["node_ip"] for i in info}),
                )
            )
            self._loop(total)
            status = "completed"
            return RunResult(self.run_dir, self._finish(status), info)
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            if status != "completed":
                self._finish(status, checkpoint=False)

    def _loop(self, total: int) -> None:
        """Drive segments until `total` global steps are done; evaluate at each epoch end."""
        spe = self.steps_per_epoch
        last_acc: float | None = None
        while self.steps_done < total:
            epoch, start = divmod(self.steps_done, spe)
            stop = min(start + self.config.segment_steps, spe, start + total - self.steps_done)
            t0 = time.perf_counter()
            parts = _get([w.run_segment.remote(epoch, start, stop) for w in self.workers])
            elapsed = time.perf_counter() - t0
            for part in parts:
                self.sink.add_steps(part)
            self.steps_done += stop - start
            samples = sum(sum(p["samples"]) for p in parts)
            last_losses = [p["loss"][-1] for p in parts]
            loss = sum(last_losses) / len(last_losses)
            progress = Progress(
                epoch, self.config.epochs, self.steps_done, total, loss, samples / elapsed, last_acc
            )
            self.emit(progress)
            # Evaluate at every epoch end, and once more where --max-steps stops mid-epoch.
            if stop == spe or self.steps_done >= total:
                last_acc = self._evaluate(epoch, self.steps_done)
                self.emit(dataclasses.replace(progress, samples_per_s=0.0, test_accuracy=last_acc))
                every = self.config.checkpoint_every
                if stop == spe and every and (epoch + 1) % every == 0:
                    self._checkpoint(checkpoint_name(epoch + 1), epoch + 1, self.steps_done)

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
        epochs_done = self.steps_done // self.steps_per_epoch if self.steps_per_epoch else 0
        if checkpoint and self.steps_done:
            self._checkpoint(checkpoint_name(None), epochs_done, self.steps_done)
        self.sink.write(self.run_dir / "metrics.parquet")
        summary = summarize(df, self.config_dict, time.time() - self.run_start, status, epochs_done)
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary
