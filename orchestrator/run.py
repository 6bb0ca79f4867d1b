"""The driver of one run: the wiring around its controller.

    run_training(config, on_event, callbacks=[...]) -> RunResult

Preflight (checks that need no cluster, the run directory claimed), Ray started or joined, the
workers' placement, the controller built over a `RayWorkerGroup` (orchestrator/controller/), and the
teardown: every actor killed, the placement released, a refused run's directory given back. The run's
life itself (start, place, train, checkpoint, evaluate, recover, resize, finish, interrupt) is the
controller's state machine.

Data flow: every worker loads its own data; the driver only sends work units ((epoch, step, slice)
lists) and receives metrics rows in batches, evaluation partial sums, and the state to checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from distrain.config import RunConfig
from distrain.errors import RunFailed
from distrain.orchestrator import auto_choice, cluster, interrupts, memory, ray_start, startup, streaming, warm_pool
from distrain.orchestrator.callbacks import Callback, Callbacks
from distrain.orchestrator.chaos import refuse_on_cluster, refuse_unreachable
from distrain.orchestrator.controller.attempt import Attempt, record_no_space
from distrain.orchestrator.controller.controller import Controller, record_interrupted
from distrain.orchestrator.controller.events import (  # noqa: F401 - the CLI's and the API's, from here
    Event,
    EventHandler,
    Notice,
    Preparing,
    Progress,
    RunResult,
    RunStarted,
    StragglersChanged,
    WorkersStarting,
)
from distrain.orchestrator.controller.ray_group import RayWorkerGroup
from distrain.orchestrator.controller.run_state import Diverged, Plan, RunState, recorded  # noqa: F401
from distrain.orchestrator.dispatcher import evaluates  # noqa: F401 - evaluates: the CLI's, from here
from distrain.orchestrator.files import NoSpace, atomic_write_text, claim_run_dir
from distrain.orchestrator.membership import Membership
from distrain.orchestrator.remote_errors import user_exception
from distrain.orchestrator.resume import recorded_rows, resume_checkpoint, total_steps
from distrain.orchestrator.run_checks import check_init_from, check_runnable
from distrain.orchestrator.tasks import save_task_object


class _Driver(Attempt):
    """The attempt under its former name, its full-disk record written with this module's
    `atomic_write_text` (tests/unit/test_dispatcher.py and tests/unit/test_run_outcome.py drive both on stand-ins)."""

    def _no_space(self, full: NoSpace) -> RunFailed:
        return record_no_space(self, full, atomic_write_text)


def preflight(
    config: RunConfig,
    resume: bool = False,
    auto: dict[str, Any] | None = None,
    start_ray: Callable[[], None] | None = None,
) -> Plan:
    """Checks that need no cluster, then (a new run) the claim of its directory: before Ray starts, so a
    directory that cannot be made, or that another run holds, is refused at once. Writes nothing else.
    (A task whose training set is a Ray Dataset is the exception: `start_ray` starts Ray to count it.)"""
    num_params = check_runnable(config, start_ray)  # a sweep makes the same checks for each of its trials
    needs = memory.estimate(config, num_params)
    memory.check_worker(config, needs)  # --worker-memory: the budget each worker states, wherever it runs
    if not config.address and (ray_start.pending() or not ray.is_initialized()):  # the local Ray this run starts
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
        checkpoint.pop("strategy_state", None)  # SGD's τ, say) belongs to the run that wrote it, as do
        checkpoint.pop("channel", None)  # its workers' error-feedback residuals (orchestrator/channel_checkpoint.py)
    refuse_unreachable(config.chaos_events, total, int(checkpoint["global_step"]) if checkpoint else 0)
    claim = claim_run_dir(
        config.run_dir,
        config.strategy_name,
        lambda path: auto_choice.yaml_header(auto) + recorded(config, path).to_yaml(),
    )
    if auto is not None:
        auto_choice.write_choice(claim.path, auto)
    return Plan(claim.path, num_params, checkpoint, claim=claim, memory=needs, auto=auto)


def run_training(
    config: RunConfig,
    on_event: EventHandler | None = None,
    resume: bool = False,
    callbacks: list[Callback] | None = None,
    auto: dict[str, Any] | None = None,
    keep_ray: bool = False,
) -> RunResult:
    """Run `config` to its end. `on_event` gets the display's events; `callbacks` (orchestrator/callbacks.py)
    get the run's hooks and may stop it early (status "stopped"). `keep_ray` (distrain.fit): a local Ray
    started for the run stays up for the next one in this process (cluster.connect)."""
    startup.begin()  # this process's first run: its cold start is clocked (orchestrator/startup.py)
    startup.mark("ready")
    emit = on_event or (lambda event: None)
    hooks = Callbacks(callbacks)
    if config.tensorboard or config.loggers:
        from distrain.orchestrator.logger_choice import build_loggers

        hooks.callbacks.extend(build_loggers(config))
    if config.storage:  # last: it copies what the others wrote
        from distrain.orchestrator.storage import StorageSync, check_storage

        check_storage(config.storage)
        hooks.callbacks.append(StorageSync(config.storage, config.sharded))
    emit(Preparing("checking the task, its data and the run directory"))
    early: list[cluster.RayConnection] = []  # Ray started to count a task's Ray Dataset (orchestrator/streaming.py)

    def start_ray() -> None:
        emit(Preparing(_connecting(config) + " to count the task's Ray Dataset"))
        early.append(cluster.connect(config, keep=keep_ray, extra_cpus=streaming.DATA_CPUS))

    try:
        plan = preflight(config, resume, auto, start_ray)
    except BaseException:
        for started_early in early:
            started_early.close()
        raise
    startup.mark("checked")
    stream = streaming.prepared(config)
    connection = None
    group: RayWorkerGroup | None = None
    placement = None
    actors: list[Any] = []  # everything started here, killed on the way out
    started = False  # the run's actors were placed: from here on an interrupted run is recorded
    state: RunState | None = None
    try:
        if early:
            connection = early[0]
        else:
            emit(Preparing(_connecting(config), plan.run_dir))
            more = {"extra_cpus": streaming.DATA_CPUS} if stream else {}  # room for Ray Data (streaming.py)
            connection = cluster.connect(config, keep=keep_ray, **more)
        startup.mark("ray")
        cluster.check_resources(config)
        if stream is not None:
            free = cluster.check_data_cpus(config)
            rows = f"{stream.rows} rows"
            emit(Notice(f"Ray Data streams the training set ({rows}) on the {free} CPU(s) the workers leave free"))
        unused = cluster.unused_gpus(config)
        if unused:
            emit(Notice(f"the cluster has {unused:g} GPU(s) and this run uses none; --gpus-per-worker 1 uses them"))
        if not connection.started_here and plan.memory is not None:
            cluster.check_memory(plan.memory)
        refuse_on_cluster(config.chaos_events)
        if plan.resumed:  # the resumable flags given now are the run's from here on
            header = auto_choice.yaml_header(plan.auto)
            atomic_write_text(plan.run_dir / "config.yaml", header + recorded(config, plan.run_dir).to_yaml())
        emit(Preparing(f"placing {config.to_dict()['workers']} workers", plan.run_dir))
        placement = cluster.place(config)
        if not plan.resumed:
            save_task_object(config, plan.run_dir)  # a task object handed to fit(), for --resume
        state = RunState.create(config, plan)
        started = True
        warm = warm_pool.applies(config.uses_gpus, ray_ends_with_run=connection.started_here)
        if warm and not warm_pool.shards_apply(config.elastic):  # shards an earlier run kept: gone first
            warm_pool.release(keep_kind=warm_pool.WORKER)
        # The workers know where the run's directory is (a sharded replica writes its own checkpoint
        # shards there), whatever the working directory of their processes.
        at_run_dir = config.replace(run_dir=str(plan.run_dir.resolve()))
        group = RayWorkerGroup(
            at_run_dir, placement, state.run_start, actors, lambda up, n: emit(WorkersStarting(up, n)), warm, stream
        )
        if config.elastic:  # --workers MIN..MAX: its books go on across attempts
            state.membership = Membership(config, placement)  # type: ignore[arg-type]

        def placed_ranks() -> list[int]:
            """Each attempt's workers: every rank, or an elastic run's slots placed by now."""
            if state.membership is not None:  # a new attempt: its freshly reserved groups
                state.membership.placement = group.placement  # type: ignore[assignment]
            return group.placed_ranks()

        return Controller(config, plan, state, group, emit, hooks, placed_ranks).run()
    except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM (orchestrator/interrupts.py), a stopped trial
        # Before the run started, a new run's claimed directory is given back below (nothing written).
        if (started or plan.resumed) and plan.run_dir.is_dir():  # tells the CLI where what was recorded is
            interrupt.run_dir = plan.run_dir  # type: ignore[attr-defined]
            if started and not plan.resumed and not (plan.run_dir / "summary.json").exists():
                record_interrupted(config, plan, state or RunState.create(config, plan))
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
            cluster.release(group.placement if group is not None else placement)
            if connection is not None:
                connection.close()
            if not started and plan.claim is not None:  # refused before it began: leave no directory behind
                plan.claim.release()


def _connecting(config: RunConfig) -> str:
    if ray.is_initialized() and not ray_start.pending():
        return "joining the Ray already running in this process"
    return f"connecting to Ray at {config.address}" if config.address else "starting a local Ray"
