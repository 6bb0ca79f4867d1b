"""The driver of one run: start actors, hand out work, evaluate, record, checkpoint, clean up.

    run_training(config, on_event) -> RunResult

Data flow: every worker loads its own data; the driver only sends work units ((epoch, step, slice)
lists) and receives metrics rows in batches, evaluation partial sums, and the state to checkpoint.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from distrain.config import RunConfig
from distrain.errors import ConfigError, DistrainError
from distrain.orchestrator import cluster
from distrain.orchestrator.checkpoint import checkpoint_name, load_checkpoint_for, save_checkpoint
from distrain.orchestrator.files import atomic_write_text, choose_run_dir
from distrain.orchestrator.metrics import MetricsSink
from distrain.orchestrator.phases import PhaseSpan, plan_phases
from distrain.orchestrator.ps import ShardGroup
from distrain.orchestrator.summary import summarize
from distrain.orchestrator.work import WorkPlan
from distrain.orchestrator.worker import TrainWorker
from distrain.strategies import STRATEGIES
from distrain.trainers.datasets import DATASETS, check_dataset
from distrain.trainers.models import count_parameters
from distrain.trainers.optim_state import FlatOptimizerState


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
    evaluated: bool = False  # True on the event that carries a fresh evaluation


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    worker_info: list[dict[str, Any]] = field(default_factory=list)
    shard_nodes: list[str] = field(default_factory=list)  # node id of each PS shard (PS runs)


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


@dataclass
class Plan:
    """What preflight found: where to write, and what to start from."""

    run_dir: Path
    num_params: int
    checkpoint: dict[str, Any] | None


def preflight(config: RunConfig) -> Plan:
    """Checks that need no cluster. Writes nothing."""
    check_dataset(config.dataset, config.data_dir, config.global_batch_size)
    num_params = count_parameters(config.model, DATASETS.get(config.dataset).info)
    if config.transport == "ps" and config.ps_shards and config.ps_shards > num_params:
        raise ConfigError(f"--ps-shards {config.ps_shards} exceeds the model's {num_params} parameters")
    checkpoint = load_checkpoint_for(config.init_from, config.model, num_params) if config.init_from else None
    return Plan(choose_run_dir(config.run_dir, config.strategy), num_params, checkpoint)


def run_training(config: RunConfig, on_event: EventHandler | None = None) -> RunResult:
    emit = on_event or (lambda event: None)
    plan = preflight(config)
    connection = cluster.connect(config)
    pg = None
    actors: list[Any] = []  # everything started here, killed on the way out
    try:
        cluster.check_resources(config)
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(plan.run_dir / "config.yaml", _recorded(config, plan.run_dir).to_yaml())
        pg = cluster.reserve(config)
        run_start = time.time()
        worker_actor = ray.remote(TrainWorker)
        workers = [
            worker_actor.options(
                num_cpus=config.cpus_per_worker,
                num_gpus=config.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote(config, rank, run_start)
            for rank in range(config.workers)
        ]
        actors.extend(workers)
        return _Driver(config, plan, workers, pg, actors, run_start, emit).train()
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        cluster.release(pg)
        connection.close()


def _recorded(config: RunConfig, run_dir: Path) -> RunConfig:
    return RunConfig(**(config.to_dict() | {"run_dir": str(run_dir)}))


class RateMeter:
    """Samples per second over the last few seconds of completed work."""

    def __init__(self, window_s: float = 3.0) -> None:
        self.window_s = window_s
        self.events: deque[tuple[float, int]] = deque()
        self.start = time.perf_counter()

    def add(self, samples: int) -> float:
        now = time.perf_counter()
        self.events.append((now, samples))
        while len(self.events) > 1 and now - self.events[0][0] > self.window_s:
            self.events.popleft()
        first = self.events[0][0] if len(self.events) > 1 else self.start
        counted = sum(n for _, n in self.events) - (self.events[0][1] if len(self.events) > 1 else 0)
        return counted / max(now - first, 1e-9)


class _Driver:
    def __init__(
        self,
        config: RunConfig,
        plan: Plan,
        workers: list[Any],
        pg: Any,
        actors: list[Any],
        run_start: float,
        emit: EventHandler,
    ) -> None:
        self.config = config
        self.run_dir = plan.run_dir
        self.checkpoint = plan.checkpoint
        self.workers = workers
        self.pg = pg
        self.actors = actors
        self.run_start = run_start
        self.emit = emit
        self.impl = STRATEGIES.get(config.strategy).implementation(config)
        self.sink = MetricsSink(plan.run_dir.name)
        self.config_dict = _recorded(config, plan.run_dir).to_dict()
        self.shards: ShardGroup | None = None
        self.phases: list[PhaseSpan] = []
        self.steps_per_epoch = 0  # known once the workers have loaded their data
        self.start_step = int(plan.checkpoint["global_step"]) if plan.checkpoint else 0
        self.steps_done = self.start_step

    # ------------------------------------------------------------------ start
    def _start(self) -> list[dict[str, Any]]:
        timeout = self.config.collective_timeout_s
        info = _get([w.describe.remote() for w in self.workers], timeout=timeout)
        self.steps_per_epoch = info[0]["steps_per_epoch"]
        if self.checkpoint is not None:
            state = {"model": self.checkpoint["model"], "optimizer": self.checkpoint["optimizer"]}
            _get([w.load_state.remote(state) for w in self.workers], timeout=timeout)
        return info

    def _enter(self, phase: PhaseSpan, optimizer: FlatOptimizerState | None) -> None:
        """Set `phase`'s strategy up on every worker; PS shards start from worker 0's θ and `optimizer`."""
        timeout = self.config.collective_timeout_s
        self.impl = STRATEGIES.get(phase.config.strategy).implementation(phase.config)
        rule = self.impl.ps_rule(phase.config)
        if rule is not None:
            theta = _get(self.workers[0].flat_params.remote())
            nodes = cluster.quietest_nodes(self.pg, phase.config.ps_shards or 1)
            self.shards = ShardGroup(phase.config, rule, theta, optimizer, nodes)
            self.actors.extend(self.shards.shards)
        rendezvous = "" if rule is not None else _get(self.workers[0].rendezvous_address.remote())
        shards, bounds = (self.shards.shards, self.shards.bounds) if self.shards else ([], [])
        _get([w.setup.remote(rendezvous, shards, bounds, phase.config) for w in self.workers], timeout=timeout)

    def _switch(self, at_step: int) -> FlatOptimizerState:
        """Between phases: take the state out of the transport, tear it down, load the state everywhere.

        The state handed over is also kept as checkpoints/switch-EPOCH.pt (a run can start from it)."""
        timeout = self.config.collective_timeout_s
        state = _get(self.workers[0].state.remote(), timeout=timeout)
        epoch = at_step // self.steps_per_epoch
        self._save(f"switch-{epoch:04d}.pt", state, epoch, at_step)
        _get([w.shutdown.remote() for w in self.workers], timeout=timeout)
        if self.shards is not None:
            for shard in self.shards.shards:
                ray.kill(shard, no_restart=True)
            self.shards = None
        _get([w.load_state.remote(state) for w in self.workers], timeout=timeout)
        return FlatOptimizerState.from_dict(state["optimizer"])

    def train(self) -> RunResult:
        status = "failed"
        try:
            info = self._start()
            total = self.config.epochs * self.steps_per_epoch
            if self.config.max_steps:
                total = min(total, self.config.max_steps)
            if self.start_step >= total:
                raise ConfigError(
                    f"the checkpoint is at step {self.start_step}, past this run's {total} steps; "
                    "raise --epochs or --max-steps"
                )
            nodes = len({i["node_id"] for i in info})
            self.emit(RunStarted(self.run_dir, total, self.steps_per_epoch, info[0]["num_params"], nodes))
            optimizer = FlatOptimizerState.from_dict(self.checkpoint["optimizer"]) if self.checkpoint else None
            self.phases = plan_phases(self.config, self.steps_per_epoch, self.start_step, total)
            for i, phase in enumerate(self.phases):
                if i:
                    optimizer = self._switch(phase.start_step)
                self._enter(phase, optimizer)
                self._loop(phase.end_step, phase.start_step)
            status = "completed"
            summary = self._finish(status)
            self._leave_transports()
            shard_nodes = self.shards.node_ids() if self.shards else []
            return RunResult(self.run_dir, summary, info, shard_nodes)
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            if status != "completed":
                self._finish(status, checkpoint=False)

    # ------------------------------------------------------------------ the event loop
    def _loop(self, total: int, start_step: int) -> None:
        """Keep every worker fed with segments; evaluate (and checkpoint) each epoch as it completes.

        Static plans queue an epoch's evaluation on each worker right behind its last step of that
        epoch, and a second segment behind the first, so no worker ever waits for the driver; an
        actor runs its calls in order, so the evaluation sees the end-of-epoch parameters. Shared
        plans (independent workers) evaluate an epoch once its last unit is done.
        """
        n = len(self.workers)
        shared = self.impl.independent_workers
        work = WorkPlan(total, self.steps_per_epoch, n, self.config.segment_steps, shared, start_step)
        depth = 1 if shared else 2  # queued segments per worker (shared: keep units for whoever is free)
        pending: dict[Any, tuple[str, int, Any]] = {}
        in_flight = [0] * n
        open_epoch: list[int | None] = [None] * n  # static: epoch of the last segment given to each worker
        eval_parts: dict[int, list[tuple[float, int, int, float]]] = defaultdict(list)
        rate = RateMeter()
        last_acc: float | None = None
        last_loss = float("nan")

        last_epoch = (total - 1) // self.steps_per_epoch

        def queue_eval(rank: int, epoch: int) -> None:
            every = self.config.eval_every
            if epoch == last_epoch or (every and (epoch + 1) % every == 0):
                pending[self.workers[rank].evaluate.remote(rank, n)] = ("eval", rank, epoch)
            if rank == 0 and self._checkpoint_due(epoch, total):
                pending[self.workers[0].state.remote()] = ("state", 0, epoch)

        def feed(rank: int) -> None:
            while in_flight[rank] < depth:
                units = work.next_segment(rank)
                epoch = open_epoch[rank]
                if not shared and epoch is not None and (not units or units[0][0] != epoch):
                    queue_eval(rank, epoch)  # this worker is through with `epoch`
                    open_epoch[rank] = None
                if not units:
                    return
                open_epoch[rank] = units[-1][0]
                pending[self.workers[rank].run_segment.remote(units)] = ("segment", rank, units)
                in_flight[rank] += 1

        for rank in range(n):
            feed(rank)
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            kind, rank, payload = pending.pop(ref)
            result = _get(ref)
            if kind == "segment":
                in_flight[rank] -= 1
                self.sink.add_steps(result)
                finished_epochs = work.complete(payload)
                if shared:
                    for epoch in finished_epochs:
                        for r in range(n):
                            queue_eval(r, epoch)
                self.steps_done = work.steps_done
                last_loss = result["loss"][-1]
                speed = rate.add(sum(result["samples"]))
                epoch = payload[-1][0]
                self.emit(Progress(epoch, self.config.epochs, self.steps_done, total, last_loss, speed, last_acc))
                feed(rank)
            elif kind == "eval":
                eval_parts[payload].append(result)
                if len(eval_parts[payload]) == n:
                    last_acc = self._record_eval(payload, eval_parts.pop(payload))
                    self.emit(
                        Progress(payload, self.config.epochs, self.steps_done, total, last_loss, 0.0, last_acc, True)
                    )
            else:  # "state": a periodic checkpoint, taken in the worker's queue at the epoch's end
                epochs_done = payload + 1
                self._save(checkpoint_name(epochs_done), result, epochs_done, epochs_done * self.steps_per_epoch)
        if not work.finished:
            raise RuntimeError("work plan stalled before all units were done")  # a bug, not user error

    def _leave_transports(self) -> None:
        """Destroy process groups cleanly after a completed run (the actors are killed afterwards anyway)."""
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=10)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            pass

    def _checkpoint_due(self, epoch: int, total: int) -> bool:
        every = self.config.checkpoint_every
        return bool(every) and (epoch + 1) % every == 0 and (epoch + 1) * self.steps_per_epoch <= total

    def _record_eval(self, epoch: int, parts: list[tuple[float, int, int, float]]) -> float:
        """Workers scored disjoint shares of the test set; add up their partial sums."""
        loss_sum = sum(p[0] for p in parts)
        correct = sum(p[1] for p in parts)
        count = sum(p[2] for p in parts)
        acc = correct / count
        now = time.time() - self.run_start
        self.sink.add_eval(epoch, self.steps_done, loss_sum / count, acc, now, max(p[3] for p in parts))
        return acc

    # ------------------------------------------------------------------ state
    def _save(self, name: str, state: dict[str, Any], epochs_done: int, steps_done: int) -> None:
        save_checkpoint(
            self.run_dir / "checkpoints",
            name,
            state,
            config=self.config_dict,
            epoch=epochs_done,
            global_step=steps_done,
        )

    def _finish(self, status: str, checkpoint: bool = True) -> dict[str, Any]:
        epochs_done = self.steps_done // self.steps_per_epoch if self.steps_per_epoch else 0
        if checkpoint and self.steps_done:
            # Every worker is done: worker 0's state (a PS snapshot under the PS) is the final model.
            self._save(checkpoint_name(None), _get(self.workers[0].state.remote()), epochs_done, self.steps_done)
        df = self.sink.table().to_pandas()
        self.sink.write(self.run_dir / "metrics.parquet")
        summary = summarize(df, self.config_dict, self.run_start, time.time() - self.run_start, status, epochs_done)
        if self.config.schedule:
            summary["phases"] = [phase.describe() for phase in self.phases]
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary
