"""The driver of one run: start actors, hand out work, evaluate, record, checkpoint, clean up.

    run_training(config, on_event, callbacks=[...]) -> RunResult

Data flow: every worker loads its own data; the driver only sends work units ((epoch, step, slice)
lists) and receives metrics rows in batches, evaluation partial sums, and the state to checkpoint.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from distrain.config import RunConfig
from distrain.errors import ConfigError, DistrainError, RunFailed
from distrain.orchestrator import auto_choice, cluster, interrupts, memory, outcome
from distrain.orchestrator.callbacks import STOPPED, Callback, Callbacks, RunInfo
from distrain.orchestrator.chaos import ChaosMonkey, refuse_on_cluster, refuse_unreachable
from distrain.orchestrator.checkpoint import checkpoint_name, save_checkpoint, step_checkpoint_name
from distrain.orchestrator.dispatcher import Dispatcher, evaluates  # noqa: F401 - evaluates: the CLI's, from here
from distrain.orchestrator.elastic_collective import ElasticCollective
from distrain.orchestrator.failure_policy import FAIL, REPLACE, USER_CODE, Decision, Situation, decide
from distrain.orchestrator.files import Claim, NoSpace, atomic_write_text, claim_run_dir
from distrain.orchestrator.membership import JOIN, Membership, MembershipChanged
from distrain.orchestrator.metrics import MetricsSink
from distrain.orchestrator.phases import PhaseSpan, plan_phases
from distrain.orchestrator.portion_scheduler import PortionScheduler
from distrain.orchestrator.recovery import (
    Failure,
    FailureLedger,
    RestorePoint,
    RunLost,
    classify,
    discard,
    kill_all,
)
from distrain.orchestrator.remote_errors import user_exception
from distrain.orchestrator.replacement import bundle_alive, replace_worker, replacement_ready, start_worker
from distrain.orchestrator.resume import recorded_rows, resume_checkpoint, total_steps
from distrain.orchestrator.run_checks import check_init_from, check_runnable
from distrain.orchestrator.shard_group import ShardGroup
from distrain.orchestrator.stragglers import StragglerDetector
from distrain.orchestrator.summary import summarize
from distrain.orchestrator.tasks import build_task, run_target, save_task_object
from distrain.orchestrator.throughput import SteadyState
from distrain.orchestrator.work import WorkPlan
from distrain.orchestrator.worker import STEP_COLUMNS
from distrain.strategies.strategy_lookup import strategy_class
from distrain.trainers.optim_state import FlatOptimizerState
from distrain.trainers.task import reduce_metrics


@dataclass
class RunStarted:
    run_dir: Path
    total_steps: int
    steps_per_epoch: int
    num_params: int
    nodes: int
    start_step: int = 0  # global steps already done (a resumed run, or one started --init-from)
    elapsed_s: float = 0.0  # run time so far, as Progress counts it (a resumed run's goes on)


@dataclass
class Progress:
    epoch: int
    epochs: int
    steps_done: int
    total_steps: int
    loss: float
    samples_per_s: float | None  # steady-state figure over the rows so far (orchestrator/throughput.py)
    test_accuracy: float | None
    evaluated: bool = False  # True on the event that carries a fresh evaluation
    test_loss: float | None = None  # set on evaluated events
    elapsed_s: float = 0.0  # run time so far (a resumed run's goes on from where it stopped)
    test_metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation's figures, by name


@dataclass
class Preparing:
    """Start-up progress before the workers start: what the driver does now (the run's checks, starting
    or joining Ray, placing the workers), with the run's directory once it is claimed."""

    stage: str
    run_dir: Path | None = None


@dataclass
class WorkersStarting:
    """Start-up progress: `started` of `total` worker actors are up (each imports torch and loads its
    data, which takes a while with many workers on few cores)."""

    started: int
    total: int


@dataclass
class Notice:
    """One line the user should read before the run starts (e.g. GPUs present but not asked for)."""

    text: str


@dataclass
class StragglersChanged:
    """The straggler detector's verdict changed: `slow` maps each flagged worker to its pace ratio."""

    step: int
    slow: dict[int, float]


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    worker_info: list[dict[str, Any]] = field(default_factory=list)
    shard_nodes: list[str] = field(default_factory=list)  # node id of each PS shard (PS runs)


Event = RunStarted | Progress | StragglersChanged | Failure | Preparing | WorkersStarting | Notice | MembershipChanged


class Diverged(Exception):
    """--on-nonfinite stop: a worker's loss, gradient or average, or the parameters to checkpoint, are
    not finite. The run ends with status "diverged"; nothing after the last good checkpoint is saved."""

    def __init__(self, step: int, worker: int | None, what: str) -> None:
        super().__init__(step, worker, what)
        self.step, self.worker, self.what = step, worker, what

    def describe(self) -> dict[str, Any]:
        """summary.json's `diverged` record (the other reasons: orchestrator/outcome.py's `judge`)."""
        return {"reason": "nonfinite", "step": self.step, "worker": self.worker, "what": self.what}


def _finite_model(state: dict[str, Any]) -> bool:
    """Every floating-point tensor of the model state is finite (cheap next to writing it)."""
    import torch

    return all(bool(torch.isfinite(v).all()) for v in state["model"].values() if torch.is_floating_point(v))


EventHandler = Callable[[Event], None]

UNFINISHED = "unfinished"  # summary.json status written with each checkpoint, until the run ends
NO_SPACE = "no space"  # an attempt's state (never a status): the disk filled up; recorded as "failed"


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
    resumed: bool = False  # --resume: the run directory is an existing run, continued from its checkpoint
    checkpoint_path: Path | None = None
    claim: Claim | None = None  # a new run's directory, given back if the run is refused before it starts
    rows: dict[str, list[Any]] | None = None  # --resume: the metrics rows before the checkpoint's step
    memory: memory.MemoryEstimate | None = None
    # --strategy auto: what the planner chose and why (planning/auto_strategy.py; recorded by auto_choice.py)
    auto: dict[str, Any] | None = None


def preflight(config: RunConfig, resume: bool = False, auto: dict[str, Any] | None = None) -> Plan:
    """Checks that need no cluster, then (a new run) the claim of its directory: before Ray starts, so a
    directory that cannot be made, or that another run holds, is refused at once. Writes nothing else."""
    num_params = check_runnable(config)  # a sweep makes the same checks for each of its trials
    needs = memory.estimate(config, num_params)
    memory.check_worker(config, needs)  # --worker-memory: the budget each worker states, wherever it runs
    if not config.address and not ray.is_initialized():  # the local Ray this run will start: this machine
        memory.check(needs, memory.local_available())
    total = total_steps(config)  # the run's length is known before anything starts (as the workers count it)
    if resume:
        path, checkpoint = resume_checkpoint(config, num_params)
        refuse_unreachable(config.chaos_events, total)  # events before the checkpoint: not fired (skip_reached)
        rows = recorded_rows(config, checkpoint)
        recorded_auto = auto_choice.recorded_choice(Path(config.run_dir))
        return Plan(
            Path(config.run_dir), num_params, checkpoint, True, path, rows=rows, memory=needs, auto=recorded_auto
        )
    checkpoint = check_init_from(config, num_params)
    if checkpoint is not None:  # --init-from takes model, optimizer and step; a strategy's own state (local
        checkpoint.pop("strategy_state", None)  # SGD's τ, say) belongs to the run that wrote it
    refuse_unreachable(config.chaos_events, total, int(checkpoint["global_step"]) if checkpoint else 0)
    claim = claim_run_dir(
        config.run_dir,
        config.strategy_name,
        lambda path: auto_choice.yaml_header(auto) + _recorded(config, path).to_yaml(),
    )
    if auto is not None:
        auto_choice.write_choice(claim.path, auto)
    return Plan(claim.path, num_params, checkpoint, claim=claim, memory=needs, auto=auto)


@dataclass
class RunState:
    """What outlives one attempt of a run (a failure ends an attempt; the run goes on in a new one)."""

    sink: MetricsSink
    ledger: FailureLedger
    chaos: ChaosMonkey
    point: RestorePoint  # where the next attempt starts from
    run_start: float
    steps_per_epoch: int = 0
    steps_done: int = 0  # global steps complete (as the current attempt's driver counts them)
    membership: Membership | None = None  # --workers MIN..MAX: its books go on across attempts

    @classmethod
    def create(cls, config: RunConfig, plan: Plan) -> RunState:
        sink = MetricsSink(plan.run_dir.name)
        for strategy in config.strategy_classes:  # their own step columns (a resumed run's rows have them)
            sink.declare(strategy.implementation(config).metric_columns)  # e.g. a pipeline's, under bsp
        ledger = FailureLedger(config.max_failures)
        ckpt = plan.checkpoint
        start = int(ckpt["global_step"]) if ckpt else 0
        run_start = time.time()
        if plan.resumed and ckpt is not None:
            sink.add_rows(plan.rows or {})
            ledger.events = list(ckpt.get("failures") or [])
            run_start -= float(ckpt.get("elapsed_s", 0.0))  # run time goes on from where it stopped
        point = RestorePoint(ckpt, start, time.time() - run_start, plan.checkpoint_path)
        return cls(sink, ledger, ChaosMonkey(config.chaos_events), point, run_start)


def run_training(
    config: RunConfig,
    on_event: EventHandler | None = None,
    resume: bool = False,
    callbacks: list[Callback] | None = None,
    auto: dict[str, Any] | None = None,
) -> RunResult:
    """Run `config` to its end. `on_event` gets the display's events; `callbacks` (orchestrator/callbacks.py)
    get the run's hooks and may stop it early (status "stopped")."""
    emit = on_event or (lambda event: None)
    hooks = Callbacks(callbacks)
    if config.tensorboard:
        from distrain.orchestrator.tensorboard import TensorBoardWriter

        hooks.callbacks.append(TensorBoardWriter(config.tensorboard))
    emit(Preparing("checking the task, its data and the run directory"))
    plan = preflight(config, resume, auto)
    connection = None
    placement = None
    actors: list[Any] = []  # everything started here, killed on the way out
    started = False  # the run's actors were placed: from here on an interrupted run is recorded
    state: RunState | None = None
    try:
        emit(Preparing(_connecting(config), plan.run_dir))
        connection = cluster.connect(config)
        cluster.check_resources(config)
        unused = cluster.unused_gpus(config)
        if unused:
            emit(Notice(f"the cluster has {unused:g} GPU(s) and this run uses none; --gpus-per-worker 1 uses them"))
        if not connection.started_here and plan.memory is not None:
            cluster.check_memory(plan.memory)
        refuse_on_cluster(config.chaos_events)
        if plan.resumed:  # the resumable flags given now are the run's from here on
            header = auto_choice.yaml_header(plan.auto)
            atomic_write_text(plan.run_dir / "config.yaml", header + _recorded(config, plan.run_dir).to_yaml())
        emit(Preparing(f"placing {config.to_dict()['workers']} workers", plan.run_dir))
        placement = cluster.place(config)
        if not plan.resumed:
            save_task_object(config, plan.run_dir)  # a task object handed to fit(), for --resume
        state = RunState.create(config, plan)
        started = True
        while True:  # one attempt per failure survived (orchestrator/recovery.py)
            workers = _start_workers(config, placement, state.run_start)
            actors.extend(w for w in workers if w is not None)
            driver = _Driver(config, plan, workers, placement, actors, state, emit, hooks)
            try:
                return driver.train()
            except RunLost as lost:
                try:
                    _recover(lost, config, plan, state, actors, emit, list(driver.pending))
                except DistrainError:  # past --max-failures: record what there is, then say so
                    hooks.end(driver._finish("failed", checkpoint=False), quiet=True)
                    raise
                # A fresh placement group: after a node loss the old one may be unplaceable.
                cluster.release(placement)
                placement = None
                placement = cluster.place(config)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM (orchestrator/interrupts.py), a stopped trial
        # Before the run started, a new run's claimed directory is given back below (nothing written).
        if (started or plan.resumed) and plan.run_dir.is_dir():  # tells the CLI where what was recorded is
            interrupt.run_dir = plan.run_dir  # type: ignore[attr-defined]
            if started and not plan.resumed and not (plan.run_dir / "summary.json").exists():
                _record_interrupted(config, plan, state or RunState.create(config, plan))
        raise
    except ray.exceptions.RayTaskError as error:  # the user's code raised in a worker: never retried (policy)
        exc = user_exception(error)  # their own exception, the worker's traceback chained to it in plain text
        if exc is error:
            raise
        raise exc from exc.__cause__
    finally:
        with interrupts.deferred():  # a teardown cut short would leave actors (or all of Ray) running
            for actor in actors:
                ray.kill(actor, no_restart=True)
            cluster.release(placement)
            if connection is not None:
                connection.close()
            if not started and plan.claim is not None:  # refused before it began: leave no directory behind
                plan.claim.release()


def _connecting(config: RunConfig) -> str:
    if ray.is_initialized():
        return "joining the Ray already running in this process"
    return f"connecting to Ray at {config.address}" if config.address else "starting a local Ray"


def _record_interrupted(config: RunConfig, plan: Plan, state: RunState) -> None:
    """Interrupted before a driver could record anything (placement, workers starting): the run
    directory still gets its metrics (none, or those of earlier attempts) and a summary that says so."""
    epochs_done = state.steps_done // state.steps_per_epoch if state.steps_per_epoch else 0
    df = state.sink.table().to_pandas()
    state.sink.write(plan.run_dir / "metrics.parquet")
    recorded = _recorded(config, plan.run_dir).to_dict()
    summary = summarize(df, recorded, state.run_start, time.time() - state.run_start, "interrupted", epochs_done)
    summary.update(state.ledger.summary())
    atomic_write_text(plan.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")


def _start_workers(config: RunConfig, placement: cluster.Placement, run_start: float) -> list[Any]:
    """A worker per rank; an elastic run's only in the slots placed by now (None in the others)."""
    if config.elastic:
        placed = set(placement.ready_ranks())  # type: ignore[attr-defined]
        return [
            start_worker(config, placement, rank, run_start) if rank in placed else None
            for rank in range(config.num_worker_actors)
        ]
    return [start_worker(config, placement, rank, run_start) for rank in range(config.num_worker_actors)]


def _recover(
    lost: RunLost, config: RunConfig, plan: Plan, state: RunState, actors: list[Any], emit: Any, dropped: list[Any]
) -> None:
    """End the attempt `lost` ended and count the failure; then, as the failure policy decides, restart
    from the restore point or (past --max-failures) stop the run with its one line."""
    # Outside the loop: restart or fail.
    decision = decide(lost.loss, state.ledger.view(state.point, plan.run_dir), Situation())
    steps_per_epoch, at_step = state.steps_per_epoch, state.steps_done
    kill_all(actors)
    discard(dropped, min(10.0, config.collective_timeout_s))  # the attempt's calls in flight: one line per failure
    event = state.ledger.record(lost, at_step, state.point, time.time() - state.run_start)
    if decision.action == FAIL:
        raise RunFailed(decision.reason)
    state.sink.keep_before(state.point.global_step, steps_per_epoch)
    plan.checkpoint = state.point.payload
    emit(
        Failure(
            len(state.ledger.events),
            event["kind"],
            event["target"],
            at_step,
            state.point.global_step,
            config.max_failures,
            from_start=state.point.payload is None,
        )
    )


def _recorded(config: RunConfig, run_dir: Path) -> RunConfig:
    return config.replace(run_dir=str(run_dir))


# The driver-side actors a strategy may ask for by name (`Strategy.driver_actors`): the parameter-server
# shards (strategies/ps_shard.py, grouped by orchestrator/shard_group.py) and backup tasks' portion scheduler.
# Sandblaster's coordinator (strategies/sandblaster_coordinator.py) reaches the workers in the same slot
# as the portion scheduler: it is the one that hands out their portions.
DRIVER_ACTORS = frozenset({"ps_shards", "portion_scheduler", "sandblaster_coordinator"})


class _Driver:
    def __init__(
        self,
        config: RunConfig,
        plan: Plan,
        workers: list[Any],
        placement: cluster.Placement,
        actors: list[Any],
        state: RunState,
        emit: EventHandler,
        hooks: Callbacks | None = None,
    ) -> None:
        self.config = config
        self.hooks = hooks if hooks is not None else Callbacks()
        self.run_dir = plan.run_dir
        self.plan = plan
        self.checkpoint = plan.checkpoint
        self.workers = workers
        self.placement = placement
        self.actors = actors
        self.state = state
        self.run_start = state.run_start
        self.emit = emit
        self.impl = strategy_class(config.strategy).implementation(config)
        self.sink = state.sink
        # The summary's samples/s, kept up to date for the display (rows of earlier attempts included).
        self.throughput = SteadyState()
        self.throughput.add_columns(self.sink.rows())
        self.config_dict = _recorded(config, plan.run_dir).to_dict()
        self.shards: ShardGroup | None = None
        self.portion_scheduler: Any = None  # backup tasks only
        self.detector = StragglerDetector(len(workers), config.straggler_threshold)
        self.task = build_task(config)  # for its derived metrics and default target (no data is loaded)
        self.target = run_target(config, self.task)
        self.phases: list[PhaseSpan] = []
        self.steps_per_epoch = 0  # known once the workers have loaded their data
        self.start_step = int(plan.checkpoint["global_step"]) if plan.checkpoint else 0
        self.steps_done = self.start_step
        self.saves: dict[int, tuple[str, dict[str, Any]]] = {}  # global step -> checkpoint waiting for its rows
        self.pending: dict[Any, tuple[str, int, Any]] = {}  # calls in flight in `_loop` (ref -> what it is)
        # Worker replacement (PS transport, orchestrator/replacement.py): the shards' rule, each worker's
        # clock after its last segment whose rows came back, and global step minus round number.
        self.ps_mode: str | None = None
        self.phase_config: RunConfig | None = None  # the config of the phase running now (--schedule)
        self.confirmed_clock: list[int] = []
        self.step_offset = 0
        self.diverged: dict[str, Any] | None = None  # summary.json's `diverged`: why the run diverged
        # --workers MIN..MAX (orchestrator/membership.py): `workers` has None in the slots with no worker.
        self.membership = state.membership
        if config.elastic and self.membership is None:
            self.membership = state.membership = Membership(config, placement)  # type: ignore[arg-type]
        elif self.membership is not None:  # a new attempt: its freshly reserved groups
            self.membership.placement = placement  # type: ignore[assignment]
        self.in_rounds: set[int] = set()  # elastic BSP over the PS: members the rounds wait for (`_sync_rounds`)

    def members(self) -> list[int]:
        """The ranks with a worker now (every rank of a fixed-size run)."""
        return [rank for rank, worker in enumerate(self.workers) if worker is not None]

    # ------------------------------------------------------------------ start
    def _start(self) -> list[dict[str, Any]]:
        timeout = self.config.collective_timeout_s
        ranks = self.members()
        refs = [self.workers[r].describe.remote() for r in ranks]
        self._report_start_up(refs, timeout)
        info = self._get_all(refs, timeout=timeout, ranks=ranks)
        self.steps_per_epoch = self.state.steps_per_epoch = info[0]["steps_per_epoch"]
        self.state.steps_done = self.steps_done
        if self.checkpoint is not None:
            keys = ("model", "optimizer", "strategy_state", "scaler")
            state = {k: self.checkpoint[k] for k in keys if k in self.checkpoint}
            self._get_all([self.workers[r].load_state.remote(state) for r in ranks], timeout=timeout, ranks=ranks)
        if self.membership is not None:
            cause = "restart" if self.state.ledger.events else "start"  # a new attempt after a failure
            for rank in ranks:
                self.membership.record(self, JOIN, rank, cause)
        return info

    def _report_start_up(self, refs: list[Any], timeout: float, every_s: float = 1.0) -> None:
        """Emit WorkersStarting as the workers come up (at most every `every_s`, and when all are up).
        Errors and timeouts are left to the _get_all that follows."""
        total, started, last = len(refs), 0, time.monotonic()
        deadline = last + timeout
        self.emit(WorkersStarting(0, total))
        pending = list(refs)
        while pending and time.monotonic() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(every_s, deadline - time.monotonic()))
            started += len(ready)
            if ready and (not pending or time.monotonic() - last >= every_s):
                self.emit(WorkersStarting(started, total))
                last = time.monotonic()

    def _enter(self, phase: PhaseSpan, optimizer: FlatOptimizerState | None) -> None:
        """Set `phase`'s strategy up on every worker; PS shards start from worker 0's θ and `optimizer`."""
        timeout = self.config.collective_timeout_s
        declared = strategy_class(phase.config.strategy)
        self.impl = declared.implementation(phase.config)
        self.phase_config = phase.config
        actors = declared.driver_actors(phase.config)  # what the strategy needs the driver to start
        unknown = set(actors) - DRIVER_ACTORS
        if unknown:
            raise ConfigError(
                f"--strategy {phase.config.strategy} asks for unknown driver actors {sorted(unknown)}; "
                f"known: {', '.join(sorted(DRIVER_ACTORS))}"
            )
        rule = self.impl.ps_rule(phase.config)
        counters = None
        if "ps_shards" in actors:
            assert rule is not None, f"{declared.__name__} asks for ps_shards but has no consistency rule"
            first = self.members()[0]
            theta = self._get_all([self.workers[first].flat_params.remote()], timeout=timeout, ranks=[first])[0]
            where = self.placement.shards(self.config.num_worker_actors, phase.config.ps_shards or 1)
            self.shards = ShardGroup(phase.config, rule, theta, optimizer, where)
            self.actors.extend(self.shards.shards)
            # Continuing this run (not --init-from) in the phase its checkpoint was taken in: the shards'
            # versions and clocks go on.
            counters = (self.checkpoint or {}).get("ps") if phase.start_step == self.start_step else None
            if counters is not None:
                clock = max(counters["clocks"]) if rule.mode == "bounded" else counters["version"]
                clocks = [clock] * self.config.num_worker_actors
                self._shard_call([s.set_counters.remote(counters["version"], clocks) for s in self.shards.shards])
        if "portion_scheduler" in actors:
            portions = phase.config.options_of("bsp").portions
            first_tag = counters["version"] if counters is not None else 0  # the shards' version right now
            self.portion_scheduler = (
                ray.remote(PortionScheduler)
                .options(num_cpus=0, max_concurrency=max(64, 4 * len(self.workers)))
                .remote(portions, self.steps_per_epoch, phase.start_step, first_tag)
            )
            self.actors.append(self.portion_scheduler)
        if "sandblaster_coordinator" in actors:
            from distrain.strategies.sandblaster_coordinator import SandblasterCoordinator

            assert self.shards is not None, "the coordinator drives the parameter-server shards"
            self.portion_scheduler = (
                ray.remote(SandblasterCoordinator)
                .options(num_cpus=0, max_concurrency=max(64, 4 * len(self.workers)))
                .remote(self.shards.shards, start_iteration=phase.start_step, **declared.coordinator_args(phase.config))
            )
            self._shard_call([self.portion_scheduler.start.remote()])
            self.actors.append(self.portion_scheduler)
        first = self.workers[self.members()[0]]  # an elastic run's slot 0 may have no worker
        rendezvous = "" if "ps_shards" in actors else _get(first.rendezvous_address.remote())
        shards, bounds = (self.shards.shards, self.shards.bounds) if self.shards else ([], [])
        ranks = self.members()
        scheduler = self.portion_scheduler
        self._get_all(
            [self.workers[r].setup.remote(rendezvous, shards, bounds, scheduler, phase.config) for r in ranks],
            timeout=timeout,
            ranks=ranks,
        )
        if self.shards is not None:
            counters = self._shard_call([self.shards.shards[0].counters.remote()])[0]
            self.ps_mode, self.confirmed_clock = rule.mode, list(counters["clocks"])
            self.step_offset = phase.start_step - counters["version"]
        else:
            self.ps_mode, self.confirmed_clock, self.step_offset = None, [], 0

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

    def _get_all(self, refs: list[Any], timeout: float | None = None, ranks: list[int] | None = None) -> list[Any]:
        """ray.get of calls to the workers (in rank order, or to `ranks`), where a lost actor ends the
        attempt (RunLost)."""
        results = []
        for i, ref in enumerate(refs):
            results.append(self._result(ref, ranks[i] if ranks is not None else i, timeout))
        return results

    def _shard_nodes(self) -> list[str]:
        """Where the shards ran, for the result; empty if they are gone by now (a node lost as the run
        ended, as under churn: the run is recorded already and must not fail on this question)."""
        try:
            return self.shards.node_ids() if self.shards else []
        except ray.exceptions.RayError:
            return []

    def _shard_call(self, refs: list[Any]) -> list[Any]:
        """ray.get of calls to the shards, where a dead or silent shard ends the attempt (RunLost)."""
        try:
            return ray.get(refs, timeout=self.config.hang_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise RunLost("hang", None, "a parameter-server shard did not answer") from e
        except ray.exceptions.RayActorError as e:
            raise RunLost("shard", None, "a parameter-server shard died") from e

    def _result(self, ref: Any, rank: int, timeout: float | None = None) -> Any:
        try:
            return _get(ref, timeout=timeout)
        except ray.exceptions.RayError as e:
            lost = classify(e, rank, self.config.transport)
            if lost is None:  # the worker's own code raised: the failure policy never retries that
                lost = RunLost(USER_CODE, rank, type(e).__name__)
                if self._decide(lost).action == FAIL:
                    raise  # that error as it is: its traceback is the user's to read
            raise lost from e

    def train(self) -> RunResult:
        try:
            return self._train()
        except NoSpace as full:  # the disk filled up under a write: record the run as failed where it fits
            raise self._no_space(full) from None

    def _train(self) -> RunResult:
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
            if not self.state.ledger.events or self.plan.resumed:  # a recovered attempt is the same run going on
                spe, params = self.steps_per_epoch, info[0]["num_params"]
                elapsed = time.time() - self.run_start
                self.emit(RunStarted(self.run_dir, total, spe, params, nodes, self.start_step, elapsed))
                info_ = RunInfo(self.run_dir, self.config, total, spe, self.start_step, params, self.target)
                self.hooks.call("on_run_start", info_)
            optimizer = FlatOptimizerState.from_dict(self.checkpoint["optimizer"]) if self.checkpoint else None
            self.state.chaos.skip_reached(self.start_step)  # a resumed run: events before its checkpoint are past
            self.phases = plan_phases(self.config, self.steps_per_epoch, self.start_step, total)
            for i, phase in enumerate(self.phases):
                if self.hooks.stop_requested:  # a callback stopped the run in an earlier phase
                    break
                if i:
                    optimizer = self._switch(phase.start_step)
                self._enter(phase, optimizer)
                if i == 0:
                    self.state.ledger.resumed(self.state.point, time.time() - self.run_start)
                if (
                    self.membership is not None
                    and self.impl.elastic
                    and (self.phase_config or self.config).transport == "collective"
                ):
                    ElasticCollective(self).run(phase.end_step, phase.start_step)  # re-formed groups
                else:
                    self._loop(phase.end_step, phase.start_step)
            with interrupts.deferred():  # a run that got to its end is recorded whole, as completed
                status = STOPPED if self.hooks.stop_requested else "completed"
                if status == "completed":  # garbage is not a result: too many skipped updates, a NaN at the end
                    self.diverged = outcome.judge(self.sink.table(), self.steps_done)
                    status = "diverged" if self.diverged else status
                summary = self._finish(status, checkpoint=status != "diverged")  # no final.pt of a diverged run
                self._leave_transports()
            self.hooks.end(summary)
            shard_nodes = self._shard_nodes()
            return RunResult(self.run_dir, summary, info, shard_nodes)
        except Diverged as stop:  # not a failure to retry: the same step would diverge again
            self.diverged, status = stop.describe(), "diverged"
            summary = self._finish(status, checkpoint=False)
            self.hooks.end(summary)
            return RunResult(self.run_dir, summary, info, self._shard_nodes())
        except KeyboardInterrupt:
            if status != "completed":  # a signal held while the completed run was recorded: it stays so
                status = "interrupted"
            raise
        except RunLost:
            status = "recovering"  # the run goes on in a new attempt; nothing to write yet
            raise
        except NoSpace:
            status = NO_SPACE  # train() records it, as far as the disk lets it
            raise
        finally:
            # A resume refused before any step must leave the run's files as they were.
            wrote_nothing = self.plan.resumed and self.steps_done == self.start_step
            if status not in ("completed", STOPPED, "recovering", "diverged", NO_SPACE) and not wrote_nothing:
                self.hooks.end(self._finish(status, checkpoint=False), quiet=True)

    def _no_space(self, full: NoSpace) -> RunFailed:
        """A write found the disk full (a checkpoint, metrics.parquet or summary.json). Every write is
        atomic, so what was written before is whole and the newest complete checkpoint is still the
        latest. The summary says `failed` if there is room for it (it goes first: it is small), then
        the metrics; the one line says what was and was not written, and how to go on."""
        epochs_done = self.steps_done // self.steps_per_epoch if self.steps_per_epoch else 0
        summary_file = self.run_dir / "summary.json"
        existed = summary_file.is_file()
        summary = self._summary("failed", epochs_done)
        try:
            atomic_write_text(summary_file, json.dumps(summary, indent=2) + "\n")
            written = True
        except NoSpace:
            written = False
        try:
            self.sink.write(self.run_dir / "metrics.parquet")
        except NoSpace:  # the older file stays whole: it has the rows up to the last checkpoint at least
            pass
        self.hooks.end(summary, quiet=True)
        point = self.state.point
        line = outcome.no_space_line(full.filename, point.path, point.global_step, self.run_dir, written, existed)
        return RunFailed(line)

    # ------------------------------------------------------------------ the event loop
    def _loop(self, total: int, start_step: int) -> None:
        """React to the results of the calls the dispatcher keeps in flight (orchestrator/dispatcher.py):
        record rows, evaluations and checkpoints, inject --chaos faults at their hold, and carry out
        the failure policy's decision on a lost worker (orchestrator/failure_policy.py)."""
        n = len(self.workers)
        # An elastic run's units go to whoever asks (a slot may have no worker to take slice r).
        shared = self.impl.independent_workers or self.membership is not None
        every = self.config.checkpoint_steps
        work = WorkPlan(total, self.steps_per_epoch, n, self.config.segment_steps, shared, start_step, every)
        chaos = self.state.chaos
        work.hold = chaos.next_step()  # work stops at the next --chaos step until the fault is injected
        dispatch = Dispatcher(
            work,
            self._submit,
            eval_every=self.config.eval_every,
            checkpoint_every=self.config.checkpoint_every,
            checkpoint_steps=every,
        )
        pending = self.pending = dispatch.pending  # a failed attempt's are read and dropped (recovery.discard)
        if self.membership is not None:
            dispatch.elastic, dispatch.members = True, self.members()
            self.in_rounds = set(self.members())
            self.sync_members(entering=self.members())
        eval_needs = 1 if self.membership is not None else n  # parts of an evaluation
        eval_parts: dict[int, list[tuple[dict[str, tuple[float, float]], float]]] = defaultdict(list)
        last_metrics: dict[str, float] = {}
        last_loss = float("nan")

        def lose(lost: RunLost) -> None:
            """A worker is gone: replace it in place if the failure policy says so, else end the attempt
            (run_training restarts it, or stops the run past --max-failures)."""
            if self.membership is not None and self.membership.can_leave(self.workers, lost):
                self.membership.leave(self, lost, dispatch)  # not a failure: the run stays at MIN or more
                return
            decision = self._decide(lost, training=True)
            if decision.remedy != REPLACE:
                raise lost
            replace_worker(self, lost, decision, dispatch)  # past --max-failures: counted, then it raises
            heard[lost.target] = time.monotonic()
            go_on(lost.target)  # the units it completes may be the last before a --chaos hold

        def go_on(rank: int) -> None:
            """At the hold (every worker waits there, the checkpoints up to it taken): inject the faults
            due, hold at the next one and feed everyone; else feed `rank`."""
            if not dispatch.reached_hold():
                dispatch.feed(rank)
                return
            chaos.strike(self.steps_done, self.workers, self.shards.shards if self.shards else [])
            dispatch.lift_hold(chaos.next_step())

        heard = [time.monotonic()] * n  # when each worker last answered (idle workers count as heard)
        stopping = False
        dispatch.feed_all()
        while pending:
            if self.membership is not None and not stopping:
                self._preempted(dispatch)
                for rank in self._join(dispatch):  # its silence is timed from now
                    heard[rank] = time.monotonic()
                self._leave_rounds_if_idle(dispatch)  # after every result, join and leave
            if not stopping and self.hooks.poll():
                # A callback asked to stop: end the plan at the last step already handed out (every worker
                # gets there, so the transports end as at a normal end), evaluate the last partial epoch.
                stopping = True
                total = dispatch.stop()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(1.0, self.config.hang_timeout_s))
            silent = self._silent_worker(pending, heard)
            if silent is not None:
                lose(silent)
                continue
            if not ready:
                continue
            ref = ready[0]
            kind, rank, payload = pending[ref]
            try:
                result = self._result(ref, rank)
            except RunLost as lost:
                lose(lost)
                continue
            dispatch.done(ref)
            heard[rank] = time.monotonic()
            if kind == "setup" and payload.get("change") == JOIN:  # a joiner is set up (fed already)
                payload["setup_s"] = round(time.time() - self.run_start - payload["wall_time"], 3)
            elif kind == "setup":  # a replacement worker is ready (its queued calls run next)
                replacement_ready(self, payload)
            elif kind == "segment":
                diverged = result.pop("diverged", None)
                if diverged:  # --on-nonfinite stop: keep the rows up to that step, then end the run
                    self.sink.add_steps(result)
                    raise Diverged(**diverged[0])
                if result["clock"]:
                    self.confirmed_clock[rank : rank + 1] = result["clock"][-1:]
                self.sink.add_steps(result)
                if self.hooks:
                    self.hooks.call("on_rows", {k: v for k, v in result.items() if k in STEP_COLUMNS})
                self.throughput.add_steps(result["step"], result["samples"], result["wall_time"], result.get("dropped"))
                self._watch_stragglers(result)
                dispatch.completed(rank, payload)  # shared plans: the evaluations and checkpoints this makes due
                self.steps_done = self.state.steps_done = work.steps_done
                if result["loss"]:  # empty when every unit was skipped (k-of-n) or taken by others (backup tasks)
                    last_loss = result["loss"][-1]
                self._progress(payload[-1][0], total, last_loss, last_metrics)
                go_on(rank)
            elif kind == "eval":
                eval_parts[payload].append(result)
                if len(eval_parts[payload]) == eval_needs:
                    # The model evaluated is the one after the epoch's last step (static plans queue each
                    # worker's evaluation behind that step), whatever rows have come back by now; a shared
                    # plan's workers go on, so its evaluation is of the steps done so far.
                    epoch_end = min((payload + 1) * self.steps_per_epoch, work.total_steps)
                    evaluated = self.steps_done if work.shared else epoch_end
                    last_metrics = self._record_eval(payload, eval_parts.pop(payload), evaluated)
                    self._progress(payload, total, last_loss, last_metrics, evaluated=True)
                    if self.hooks:
                        figures = {f"test_{k}": v for k, v in last_metrics.items()} | {
                            "train_loss": last_loss,
                            "steps_done": evaluated,
                            "elapsed_s": time.time() - self.run_start,
                        }
                        self.hooks.call("on_epoch_end", payload, figures)
            else:  # "state": a periodic checkpoint, taken in the worker's queue right after its step
                name, step = payload
                self.saves[step] = (name, result)
                go_on(rank)  # a --chaos fault at this step waited for its checkpoint
            self._save_complete(set(eval_parts) | dispatch.evals_outstanding(), dispatch.checkpoints_outstanding())
            if self.membership is not None:
                self._drained(dispatch)
        if not work.finished:
            raise RuntimeError("work plan stalled before all units were done")  # a bug, not user error

    def _join(self, dispatch: Dispatcher) -> list[int]:
        """Elastic: start a worker in each slot placed since the last look; it is set up against the
        live shards (θ, its clock: nothing from disk), then fed (its calls queue behind the setup)."""
        assert self.membership is not None and self.shards is not None
        joined = self.membership.joinable(self.workers)
        for rank in joined:
            worker = start_worker(self.config, self.placement, rank, self.run_start)
            self.workers[rank] = worker
            self.actors.append(worker)
            event = self.membership.record(self, JOIN, rank, "placed")
            self.in_rounds.add(rank)  # it is fed at once
            self.sync_members(entering=[rank])  # before its setup, which reads its clock from the shards
            bounds = self.shards.bounds
            setup = worker.setup.remote("", self.shards.shards, bounds, self.portion_scheduler, self.phase_config)
            dispatch.track(setup, ("setup", rank, event))
            dispatch.members = self.members()
            dispatch.feed(rank)
        return joined

    def sync_members(self, entering: list[int] | None = None) -> None:
        """Tell the shards who is in (the bound holds among members; a joiner's clock is raised). BSP
        rounds: who each round waits for (`_sync_rounds`); `entering`: ranks that join the rounds."""
        if self.shards is None:
            return
        if self.ps_mode == "rounds":
            self._sync_rounds(entering or [])
            return
        self._shard_call([s.set_members.remote(self.members()) for s in self.shards.shards])

    def _sync_rounds(self, entering: list[int]) -> None:
        """Elastic BSP over the PS: a round closes on its members' pushes, so the shards must know
        who takes part: the members with work (`in_rounds`; one with none would hold every round up:
        at a --chaos hold, at the end of the run). A rank entering goes in at a round boundary every
        shard agrees on: the open round when nobody else is in (nobody has pushed to it), else the one
        after the furthest shard's open round, which cannot close before the rank is in unless a whole
        round passed meanwhile: then a shard refuses and the next boundary is tried."""
        assert self.shards is not None
        members = sorted(self.in_rounds & set(self.members()))
        entering = [r for r in entering if r in members]
        others = [r for r in members if r not in entering]
        for _ in range(100):
            versions = [c["version"] for c in self._shard_call([s.counters.remote() for s in self.shards.shards])]
            start = max(versions) + 1 if others else max(versions)
            calls = [s.set_round_members.remote(members, entering, start) for s in self.shards.shards]
            if all(self._shard_call(calls)):
                return
        raise RunLost("hang", None, "the parameter-server shards' rounds moved on faster than a member could enter")

    def _leave_rounds_if_idle(self, dispatch: Dispatcher) -> None:
        """Elastic BSP over the PS: a member the work plan has nothing for now (the rest of the epoch is
        with others, a --chaos hold, the end) leaves the rounds until it is fed again (`_submit`)."""
        if self.membership is None or self.ps_mode != "rounds":
            return
        idle = {r for r in self.in_rounds if dispatch.in_flight(r) == 0}
        if idle:
            self.in_rounds -= idle
            self.sync_members()

    def _preempted(self, dispatch: Dispatcher) -> None:
        """Elastic: a node is draining (preemption). Checkpoint now: the state is asked of a member off
        that node, behind its queued segment, and the loop goes on meanwhile (under SSP that segment may
        wait for the very workers about to leave); once it is written (`_drained`), they leave."""
        assert self.membership is not None
        for node, ranks in self.membership.draining(self.workers).items():
            if not ranks:
                continue
            keep = [r for r in self.members() if r not in ranks] or ranks  # ask one not on the node
            dispatch.call("state", keep[0], (step_checkpoint_name(self.steps_done), self.steps_done))
            self.membership.drain_checkpoints.append(
                {"node": node, "step": self.steps_done, "path": None, "wall_time": None, "ranks": ranks}
            )

    def _drained(self, dispatch: Dispatcher) -> None:
        """The members of a draining node whose checkpoint is written leave (their slots ask for room
        elsewhere); orchestrator/membership.py says when they stay instead."""
        assert self.membership is not None
        for drain in self.membership.drain_checkpoints:
            if drain["path"] is None or drain.get("done"):
                continue
            drain["done"] = True
            for rank in drain["ranks"]:
                lost = RunLost("node", rank, f"node {drain['node'][:8]} is draining")
                if self.membership.can_leave(self.workers, lost):
                    self.membership.leave(self, lost, dispatch, cause="node draining")

    def _submit(self, kind: str, rank: int, payload: Any) -> Any:
        """The dispatcher's calls, made on the worker now holding `rank`."""
        worker = self.workers[rank]
        if kind == "segment":
            if self.membership is not None and self.ps_mode == "rounds" and rank not in self.in_rounds:
                self.in_rounds.add(rank)  # fed again: it enters the rounds at the next boundary
                self.sync_members(entering=[rank])
            return worker.run_segment.remote(payload)
        if kind == "eval":
            if self.membership is not None:  # one member scores the whole test set (membership changes)
                return worker.evaluate.remote(0, 1)
            return worker.evaluate.remote(rank, len(self.workers))
        assert kind == "state", kind
        return worker.state.remote()

    def _decide(self, lost: RunLost, training: bool = False) -> Decision:
        """The failure policy's decision on `lost`; `training`: seen by the controller loop (`_loop`)."""
        situation = Situation()  # outside the loop: nothing to replace into
        if training:
            config = self.phase_config or self.config  # the running phase's
            situation = Situation(
                training=True,
                transport=config.transport,
                # Backup workers/tasks keep books a replacement would upset (`Strategy.keeps_own_books`);
                # Sandblaster's coordinator hands a lost worker's portions out again (`reissues_lost_work`).
                own_books=strategy_class(config.strategy).keeps_own_books(config) and not self.impl.reissues_lost_work,
                workers=config.workers,
                host_alive=bundle_alive(self.placement, lost.target),
            )
        return decide(lost.loss, self.state.ledger.view(self.state.point, self.run_dir), situation)

    def _progress(
        self, epoch: int, total: int, loss: float, metrics: dict[str, float], evaluated: bool = False
    ) -> None:
        """Tell the display where the run is; `metrics` are the last evaluation's (fresh if `evaluated`)."""
        self.emit(
            Progress(
                epoch=epoch,
                epochs=self.config.epochs,
                steps_done=self.steps_done,
                total_steps=total,
                loss=loss,
                samples_per_s=self.throughput.samples_per_s(),
                test_accuracy=metrics.get("accuracy"),
                evaluated=evaluated,
                test_loss=metrics.get("loss") if evaluated else None,
                elapsed_s=time.time() - self.run_start,
                test_metrics=dict(metrics),
            )
        )

    def _silent_worker(self, pending: dict[Any, tuple[str, int, Any]], heard: list[float]) -> RunLost | None:
        """A worker with calls queued that has not answered for --hang-timeout-s (a replacement being
        started gets --collective-timeout-s), as a hang; under the PS the one the others wait on."""
        now = time.monotonic()
        starting = {r for k, r, _ in pending.values() if k == "setup"}
        busy = {r for _, r, _ in pending.values()}
        for rank in range(len(heard)):
            if rank not in busy or (starting and rank not in starting):  # others may wait on a replacement
                heard[rank] = now
        limit = self.config.hang_timeout_s
        silent = [r for r in busy if now - heard[r] > (self.config.collective_timeout_s if r in starting else limit)]
        if not silent:
            return None
        culprit = min(silent, key=lambda r: heard[r])
        if self.shards is not None and self.confirmed_clock:
            # Workers blocked in a shard's rule are silent too: the culprit has the least clock.
            clocks = self._shard_call([s.counters.remote() for s in self.shards.shards])
            culprit = min(silent, key=lambda r: (min(c["clocks"][r] for c in clocks), heard[r]))
        return RunLost("hang", culprit, f"no answer for {limit:g} s")

    def _watch_stragglers(self, rows: dict[str, list[Any]]) -> None:
        """Feed the detector; tell the display, and the portion scheduler, when its verdict changes."""
        self.detector.add(rows["worker"], rows["compute_s"])
        if rows["step"] and self.detector.update(max(rows["step"])):
            slow = dict(self.detector.flagged)
            self.emit(StragglersChanged(max(rows["step"]), slow))
            if self.portion_scheduler is not None:
                self.portion_scheduler.mark_slow.remote(list(slow))

    def _mitigation_figures(self) -> dict[str, Any]:
        """Summary figures of straggler handling: who was flagged (the driver's detector), and what the
        strategy's own driver-side actors saw (`Strategy.actor_figures`: e.g. gradients dropped)."""
        figures: dict[str, Any] = {"stragglers": self.detector.summary()}
        actors = {
            "ps_shards": self.shards,
            "portion_scheduler": self.portion_scheduler,
            "sandblaster_coordinator": self.portion_scheduler,
        }
        figures |= strategy_class(self.config.strategy).actor_figures(
            self.config, {name: actor for name, actor in actors.items() if actor is not None}
        )
        return figures

    def _leave_transports(self) -> None:
        """Destroy process groups cleanly after a completed run (the actors are killed afterwards anyway)."""
        try:
            ray.get([w.shutdown.remote() for w in self.workers if w is not None], timeout=10)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            pass

    def _record_eval(
        self, epoch: int, parts: list[tuple[dict[str, tuple[float, float]], float]], step: int
    ) -> dict[str, float]:
        """Workers scored disjoint shares of the test set (of the model after `step` steps); add up their
        (sum, count) pairs."""
        metrics = reduce_metrics(self.task, [p[0] for p in parts])
        now = time.time() - self.run_start
        eval_s = max(p[1] for p in parts)
        self.sink.add_eval(epoch, step, metrics, now, eval_s)
        self.throughput.add_eval(now, eval_s)
        return metrics

    # ------------------------------------------------------------------ state
    def _save_complete(self, outstanding_evals: set[int], outstanding_checkpoints: set[int]) -> None:
        """Write the checkpoints whose steps' metrics rows (and evaluations) are all in: a run resumed or
        recovered from one has exactly the rows of the steps before it. In step order, whatever order
        their states came back in (ray.wait may hand a later call's result over first): the latest
        checkpoint, and the restore point, never move back to an earlier step."""
        for step in sorted(self.saves):
            epochs_before = step // self.steps_per_epoch
            if self.steps_done < step or any(e < epochs_before for e in outstanding_evals):
                return
            if any(s < step for s in outstanding_checkpoints):  # an earlier one's state is still to come
                return
            name, state = self.saves.pop(step)
            self._save(name, state, epochs_before, step)

    def _save(self, name: str, state: dict[str, Any], epochs_done: int, steps_done: int, progress: bool = True) -> None:
        """Write a checkpoint: parameters, optimizer state and small metadata. The metrics rows go to
        metrics.parquet first (a resume reads those before the checkpoint's step back from it), and,
        with `progress`, a summary.json that says the run has not finished: a driver killed after
        this leaves a directory `distrain report` reads and `--resume` continues."""
        if not _finite_model(state):  # never a NaN checkpoint: the last good one stays the latest
            raise Diverged(steps_done, None, "parameters")
        now = time.time() - self.run_start
        self.sink.write(self.run_dir / "metrics.parquet")
        extra = {"failures": self.state.ledger.events, "elapsed_s": now}
        path = save_checkpoint(
            self.run_dir / "checkpoints",
            name,
            state,
            config=self.config_dict,
            epoch=epochs_done,
            global_step=steps_done,
            extra=extra,
        )
        payload = {"model": state["model"], "optimizer": state["optimizer"], "global_step": steps_done}
        for key in ("ps", "strategy_state", "scaler"):
            if key in state:
                payload[key] = state[key]
        self.state.point = RestorePoint(payload, steps_done, now, path)
        if self.membership is not None:  # a draining node's checkpoint: its members may leave now
            for drain in self.membership.drain_checkpoints:
                if drain["path"] is None and steps_done >= drain["step"]:
                    drain["path"], drain["wall_time"] = str(path), now
        self.hooks.call("on_checkpoint", path, steps_done)
        if progress:
            self._write_summary(UNFINISHED, epochs_done, mitigation=False)

    def _finish(self, status: str, checkpoint: bool = True) -> dict[str, Any]:
        epochs_done = self.steps_done // self.steps_per_epoch if self.steps_per_epoch else 0
        if checkpoint and self.steps_done:
            # Every worker is done: worker 0's state (a PS snapshot under the PS) is the final model.
            first = self.members()[0]
            final = self._result(self.workers[first].state.remote(), first, self.config.hang_timeout_s)
            self._save(checkpoint_name(None), final, epochs_done, self.steps_done, progress=False)  # + metrics
        else:
            self.sink.write(self.run_dir / "metrics.parquet")
        return self._write_summary(status, epochs_done)

    def _write_summary(self, status: str, epochs_done: int, mitigation: bool = True) -> dict[str, Any]:
        summary = self._summary(status, epochs_done, mitigation)
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    def _summary(self, status: str, epochs_done: int, mitigation: bool = True) -> dict[str, Any]:
        """summary.json's figures (orchestrator/summary.py: only the keys that apply to this run)."""
        df = self.sink.table().to_pandas()
        summary = summarize(
            df, self.config_dict, self.run_start, time.time() - self.run_start, status, epochs_done, self.target
        )
        try:
            if mitigation:  # asks the actors (PS shards, scheduler): only once the run is over
                summary |= self._mitigation_figures()
        except ray.exceptions.RayError:  # a failed run's actors may be gone; the metrics still tell
            pass
        summary.update(self.state.ledger.summary())
        steps = df[df["kind"] == "step"]
        for strategy in self.config.strategy_classes:  # the strategies' own figures, from their step rows
            columns = {c: steps[c].tolist() for c in steps.columns}
            summary |= strategy.implementation(self.config).summary_figures(columns)
        info = self.task.describe()
        if info:
            summary["task_info"] = info
        if self.diverged is not None:
            summary["diverged"] = self.diverged  # why (orchestrator/outcome.py's reasons)
        if self.plan.auto is not None:
            summary["strategy_auto"] = auto_choice.summary_entry(self.plan.auto)
        if self.config.chaos:
            summary["chaos"] = self.state.chaos.summary(self.steps_done)
        if self.config.schedule:
            summary["phases"] = [phase.describe() for phase in self.phases]
        if self.membership is not None:
            summary["membership"] = self.membership.summary(self.workers)
        return summary
