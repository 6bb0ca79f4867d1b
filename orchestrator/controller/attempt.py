"""One attempt of a run, over a `WorkerGroup`: start the workers, set each phase up, train, record
evaluations and checkpoints, finish. A loss the failure policy cannot take in place ends the attempt
(`RunLost`); the controller (orchestrator/controller/controller.py) starts the next one.

The event loop of a phase is orchestrator/controller/loop.py; an elastic run's joins and leaves are
its scaling policy (orchestrator/controller/scaling.py); this module records what they produce."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distrain.config import RunConfig
from distrain.config.shares_section import share_unit, unequal_shares
from distrain.errors import ConfigError, RunFailed
from distrain.orchestrator import auto_choice, channel_checkpoint, interrupts, outcome, startup
from distrain.orchestrator.balance import ShareBalancer
from distrain.orchestrator.best_checkpoint import BestKeeper
from distrain.orchestrator.callbacks import Callbacks, RunInfo
from distrain.orchestrator.checkpoint import CHECKPOINTS, checkpoint_name, save_checkpoint
from distrain.orchestrator.checkpoint_schedule import run_steps
from distrain.orchestrator.controller.events import (
    EventHandler,
    Notice,
    Progress,
    RunResult,
    RunStarted,
    StragglersChanged,
)
from distrain.orchestrator.controller.group import PhaseSetup, WorkerGroup
from distrain.orchestrator.controller.run_state import Diverged, Plan, RunState, recorded
from distrain.orchestrator.controller.status import Stage, StageMachine, Status
from distrain.orchestrator.elastic_balance import ElasticShareBalancer
from distrain.orchestrator.failure_policy import USER_CODE, Decision, Situation, decide
from distrain.orchestrator.files import NoSpace, atomic_write_text
from distrain.orchestrator.phases import PhaseSpan, plan_phases
from distrain.orchestrator.pipeline_balance import PipelineShareBalancer
from distrain.orchestrator.recovery import RestorePoint, RunLost
from distrain.orchestrator.stragglers import StragglerDetector
from distrain.orchestrator.summary import summarize
from distrain.orchestrator.tasks import build_task, run_target
from distrain.orchestrator.throughput import SteadyState
from distrain.strategies.channel import run_codec
from distrain.strategies.strategy_lookup import strategy_class
from distrain.trainers.optim_state import FlatOptimizerState
from distrain.trainers.sharded_checkpoint import is_complete
from distrain.trainers.splits import evaluation_figures, selection_note

RECOVERING = "recovering"  # an attempt's end (never a status): the run goes on in a new attempt
NO_SPACE = "no space"  # an attempt's end (never a status): the disk filled up; recorded as "failed"


def _shards_pending(run_dir: Path, state: dict[str, Any]) -> bool:
    """Whether a sharded run's workers are still writing the shards `state` names (in the background,
    while training goes on); False for any other state."""
    ref = state.get("sharded")
    return ref is not None and not is_complete(run_dir / CHECKPOINTS / ref["dir"])


def _finite_model(state: dict[str, Any]) -> bool:
    """Every floating-point tensor of the model state is finite (cheap next to writing it)."""
    import torch

    return all(bool(torch.isfinite(v).all()) for v in state["model"].values() if torch.is_floating_point(v))


class Attempt:
    def __init__(
        self,
        config: RunConfig,
        plan: Plan,
        group: WorkerGroup,
        state: RunState,
        emit: EventHandler,
        hooks: Callbacks | None = None,
        machine: StageMachine | None = None,
    ) -> None:
        self.config = config
        self.hooks = hooks if hooks is not None else Callbacks()
        self.machine = machine if machine is not None else StageMachine()
        self.run_dir = plan.run_dir
        self.plan = plan
        self.checkpoint = plan.checkpoint
        self.group = group
        self.state = state
        self.run_start = state.run_start
        self.emit = emit
        self.impl = strategy_class(config.strategy).implementation(config)
        self.sink = state.sink
        # The summary's samples/s, kept up to date for the display (rows of earlier attempts included).
        self.throughput = SteadyState()
        self.throughput.add_columns(self.sink.rows())
        self.config_dict = recorded(config, plan.run_dir).to_dict()
        self.detector = StragglerDetector(config.num_worker_actors, config.straggler_threshold)
        # --balance speed: each worker's share of a step, moved towards its measured speed (balance.py).
        self.balancer: ShareBalancer | None = None
        if config.balance == "speed" and config.elastic:  # over the members, told at each re-form
            # (a cut replica's slot is its D x T workers, its share whole units of D data-parallel ranks)
            self.balancer = ElasticShareBalancer(
                config.worker_slots, config.global_batch_size, config.replica_size, share_unit(config)
            )
        elif config.balance == "speed" and config.replica_size > 1:
            # A replica of several workers (a pipeline's stages, a cut replica's D x T): its share in whole
            # units (sets of micro-batches; multiples of D), its model its slowest worker's.
            self.balancer = PipelineShareBalancer(
                config.worker_slots,
                config.replica_size,
                share_unit(config),
                config.global_batch_size,
                config.worker_shares,
            )
        elif config.balance == "speed":
            self.balancer = ShareBalancer(config.worker_slots, config.global_batch_size, config.worker_shares)
        self.task = build_task(config)  # for its derived metrics and default target (no data is loaded)
        self.target = run_target(config, self.task)
        self.best = BestKeeper(config, Path(plan.run_dir), self.sink.rows())  # --checkpoint-best
        self.phases: list[PhaseSpan] = []
        self.steps_per_epoch = 0  # known once the workers have loaded their data
        self.start_step = int(plan.checkpoint["global_step"]) if plan.checkpoint else 0
        self.steps_done = self.start_step
        # global step -> the checkpoints of it waiting for its rows (an epoch's and a step one may share a step)
        self.saves: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        # Whether the phase's units go to whichever worker asks (orchestrator/work.py's shared plans: its
        # workers run independently, or an elastic run's over the PS), as the phase loop set it up.
        self.shared_plan = False
        self.channel_states = channel_checkpoint.ChannelStates()  # each rank's codec state, for its checkpoint
        self.nonfinite_shards: set[int] = set()  # steps a sharded worker saved non-finite parameters at
        self.pending: dict[Any, tuple[str, int, Any]] = {}  # calls in flight in the loop (handle -> what it is)
        self.phase_config: RunConfig | None = None  # the config of the phase running now (--schedule)
        # Worker replacement and leaves (PS transport): the shards' rule, each worker's clock after its
        # last segment whose rows came back, and global step minus round number.
        self.transport = PhaseSetup()
        self.confirmed_clock: list[int] = []
        self.diverged: dict[str, Any] | None = None  # summary.json's `diverged`: why the run diverged
        self.membership = state.membership  # --workers MIN..MAX (orchestrator/membership.py)

    def members(self) -> list[int]:
        return self.group.members()

    # ------------------------------------------------------------------ start
    def _start(self) -> list[dict[str, Any]]:
        timeout = self.config.collective_timeout_s
        ranks = self.members()
        info = self.group.describe(ranks, timeout)
        startup.workers_up(info)
        self.steps_per_epoch = self.state.steps_per_epoch = info[0]["steps_per_epoch"]
        selects = self.target is not None or self.best.monitor is not None
        if info[0].get("val_is_test") and selects and not self.start_step:
            self.emit(Notice(selection_note(self.task, self.config.val_fraction)))
        self.state.steps_done = self.steps_done
        if self.checkpoint is not None:
            # "sharded": a reference; "scheduler": a task's own scheduler's position (a replica's)
            keys = ("model", "optimizer", "sharded", "strategy_state", "scaler", "scheduler")
            per_rank, notice = channel_checkpoint.restore(self.checkpoint, ranks, run_codec(self.config))
            if notice is not None:
                self.emit(Notice(notice))
            shared = {k: self.checkpoint[k] for k in keys if k in self.checkpoint}
            self.group.load_state(ranks, shared, timeout, per_rank or None)
        if self.membership is not None:
            from distrain.orchestrator.membership import JOIN

            cause = "restart" if self.state.ledger.events else "start"  # a new attempt after a failure
            for rank in ranks:
                self.membership.record(JOIN, rank, cause, len(ranks), self.steps_done, self.now(), self.emit)
        return info

    def _enter(self, phase: PhaseSpan, optimizer: FlatOptimizerState | None) -> None:
        """Set `phase`'s strategy up on every worker; PS shards start from the first member's θ and `optimizer`."""
        self.machine.to(Stage.PLACING)
        self.impl = strategy_class(phase.config.strategy).implementation(phase.config)
        self.phase_config = phase.config
        # Continuing this run (not --init-from) in the phase its checkpoint was taken in: the shards'
        # versions and clocks go on.
        counters = (self.checkpoint or {}).get("ps") if phase.start_step == self.start_step else None
        spe = self.steps_per_epoch
        self.transport = self.group.enter_phase(phase.config, optimizer, counters, phase.start_step, spe)
        self.confirmed_clock = list(self.transport.clocks)

    def _switch(self, at_step: int) -> FlatOptimizerState:
        """Between phases: take the state out of the transport, tear it down, load the state everywhere.

        The state handed over is also kept as checkpoints/switch-EPOCH.pt (a run can start from it)."""
        timeout = self.config.collective_timeout_s
        state = self.group.state(0, timeout)
        epoch = at_step // self.steps_per_epoch
        self.save(f"switch-{epoch:04d}.pt", state, epoch, at_step)
        self.group.leave_phase(timeout)
        self.group.load_state(self.members(), state, timeout)
        return FlatOptimizerState.from_dict(state["optimizer"])

    def now(self) -> float:
        """Run seconds so far (a resumed run's go on)."""
        return time.time() - self.run_start

    # ------------------------------------------------------------------ the attempt
    def train(self) -> RunResult:
        try:
            return self._train()
        except NoSpace as full:  # the disk filled up under a write: record the run as failed where it fits
            self.machine.to(Stage.FAILED)
            raise self._no_space(full) from None

    def _train(self) -> RunResult:
        from distrain.orchestrator.controller.loop import run_phase

        status: str = Status.FAILED
        info: list[dict[str, Any]] = []
        try:
            info = self._start()
            total = run_steps(self.config.epochs, self.steps_per_epoch, self.config.max_steps)  # as the workers count
            if self.start_step >= total:
                raise ConfigError(
                    f"the checkpoint is at step {self.start_step}, past this run's {total} steps; "
                    "raise --epochs or --max-steps"
                )
            nodes = len({i["node_id"] for i in info})
            if not self.state.ledger.events or self.plan.resumed:  # a recovered attempt is the same run going on
                spe, params = self.steps_per_epoch, info[0]["num_params"]
                self.emit(RunStarted(self.run_dir, total, spe, params, nodes, self.start_step, self.now()))
                info_ = RunInfo(self.run_dir, self.config, total, spe, self.start_step, params, self.target)
                self.hooks.call("on_run_start", info_)
            # (a sharded checkpoint's optimizer state is in its shards: a sharded run's workers read it there)
            whole = bool(self.checkpoint) and "optimizer" in self.checkpoint
            optimizer = FlatOptimizerState.from_dict(self.checkpoint["optimizer"]) if whole else None
            self.state.chaos.skip_reached(self.start_step)  # a resumed run: events before its checkpoint are past
            self.phases = plan_phases(self.config, self.steps_per_epoch, self.start_step, total)
            for i, phase in enumerate(self.phases):
                if self.hooks.stop_requested:  # a callback stopped the run in an earlier phase
                    break
                if i:
                    optimizer = self._switch(phase.start_step)
                self._enter(phase, optimizer)
                if i == 0:
                    self.state.ledger.resumed(self.state.point, self.now())
                self.machine.to(Stage.TRAINING)
                run_phase(self, phase)
            with interrupts.deferred():  # a run that got to its end is recorded whole, as completed
                self.machine.to(Stage.FINISHING)
                status = Status.STOPPED if self.hooks.stop_requested else Status.COMPLETED
                if status == Status.COMPLETED:  # garbage is not a result: too many skipped updates, a NaN at the end
                    self.diverged = outcome.judge(self.sink.table(), self.steps_done)
                    status = Status.DIVERGED if self.diverged else status
                summary = self.finish(status, checkpoint=status != Status.DIVERGED)  # no final.pt of a diverged run
                self.group.shutdown()
                self.machine.to(Stage(status))
            self.hooks.end(summary)
            return RunResult(self.run_dir, summary, info, self.group.shard_nodes())
        except Diverged as stop:  # not a failure to retry: the same step would diverge again
            self.diverged, status = stop.describe(), Status.DIVERGED
            self.machine.to(Stage.DIVERGED)
            summary = self.finish(status, checkpoint=False)
            self.hooks.end(summary)
            return RunResult(self.run_dir, summary, info, self.group.shard_nodes())
        except KeyboardInterrupt:
            if status != Status.COMPLETED:  # a signal held while the completed run was recorded: it stays so
                status = Status.INTERRUPTED
                if not self.machine.ended:
                    self.machine.to(Stage.INTERRUPTED)
            raise
        except RunLost as lost:
            if lost.kind == USER_CODE:  # the worker's own error, as it is: its traceback is the user's to read
                self.machine.to(Stage.FAILED)
                raise (lost.__cause__ or lost) from None
            status = RECOVERING  # the run goes on in a new attempt; nothing to write yet
            raise
        except NoSpace:
            status = NO_SPACE  # train() records it, as far as the disk lets it
            raise
        except BaseException:
            if not self.machine.ended:  # (a callback's on_run_end may raise after the run ended)
                self.machine.to(Stage.FAILED)
            raise
        finally:
            # A resume refused before any step must leave the run's files as they were.
            wrote_nothing = self.plan.resumed and self.steps_done == self.start_step
            ended = (Status.COMPLETED, Status.STOPPED, RECOVERING, Status.DIVERGED, NO_SPACE)
            if status not in ended and not wrote_nothing:
                self.hooks.end(self.finish(Status(status), checkpoint=False), quiet=True)

    def _no_space(self, full: NoSpace) -> RunFailed:
        return record_no_space(self, full, atomic_write_text)

    # ------------------------------------------------------------------ decisions and display
    def result(self, handle: Any, rank: int, timeout: float | None = None) -> Any:
        """A call's value; a lost actor ends the attempt (RunLost)."""
        return self.group.result(handle, rank, timeout)

    def decide(self, lost: RunLost, training: bool = False, situation: Situation | None = None) -> Decision:
        """The failure policy's decision on `lost`; `training`: seen by the controller loop."""
        if situation is None:
            situation = Situation()  # outside the loop: nothing to replace into
        if training:
            config = self.phase_config or self.config  # the running phase's
            situation = Situation(
                training=True,
                transport=config.transport,
                # Backup workers/tasks keep books a replacement would upset (`Strategy.keeps_own_books`);
                # Sandblaster's coordinator hands a lost worker's portions out again (`reissues_lost_work`).
                own_books=strategy_class(config.strategy).keeps_own_books(config) and not self.impl.reissues_lost_work,
                cut_replicas=config.sharded,
                workers=config.workers,
                host_alive=self.group.host_alive(lost.target),
                elastic_min=situation.elastic_min,
                members=situation.members,
                member=situation.member,
            )
        return decide(lost.loss, self.state.ledger.view(self.state.point, self.run_dir), situation)

    def progress(self, epoch: int, total: int, loss: float, metrics: dict[str, float], evaluated: bool = False) -> None:
        """Tell the display where the run is; `metrics` are the last evaluation's (fresh if `evaluated`)."""
        self.emit(
            Progress(
                epoch=epoch,
                epochs=self.config.epochs,
                steps_done=self.steps_done,
                total_steps=total,
                loss=loss,
                samples_per_s=self.throughput.samples_per_s(),
                val_accuracy=metrics.get("val_accuracy"),
                evaluated=evaluated,
                val_loss=metrics.get("val_loss") if evaluated else None,
                elapsed_s=self.now(),
                figures=dict(metrics),
            )
        )

    def record_rows(self, rows: dict[str, list[Any]]) -> None:
        """A segment's metrics rows: the sink, the callbacks, the throughput figure."""
        from distrain.orchestrator.metrics import LOGGED_PREFIX
        from distrain.orchestrator.worker import STEP_COLUMNS

        self.sink.add_steps(rows)
        startup.steps(rows["step"], rows["wall_time"], self.run_start)
        if self.hooks:  # the step columns and the task's own scalars (train_<name>)
            self.hooks.call(
                "on_rows", {k: v for k, v in rows.items() if k in STEP_COLUMNS or k.startswith(LOGGED_PREFIX)}
            )
        self.throughput.add_steps(rows["step"], rows["samples"], rows["wall_time"], rows.get("dropped"))

    def watch_stragglers(self, rows: dict[str, list[Any]]) -> None:
        """Feed the detector; tell the display, and the portion scheduler, when its verdict changes."""
        compute = rows["compute_s"]
        if unequal_shares(self.config):  # a worker with a larger share is not slow: judged per equal share
            equal = self.config.global_batch_size / self.config.worker_slots
            taken = rows["samples"]
            if self.config.replica_size > 1:  # every worker of a replica runs its share (one counts it)
                taken = rows["replica_samples"]
            compute = [c * equal / n if n else c for c, n in zip(compute, taken, strict=True)]
        if self.balancer is not None:
            self.balancer.add_rows(rows)
        self.detector.add(rows["worker"], compute)
        if rows["step"] and self.detector.update(max(rows["step"])):
            slow = dict(self.detector.flagged)
            self.emit(StragglersChanged(max(rows["step"]), slow))
            self.group.mark_slow(list(slow))

    def record_eval(
        self, epoch: int, parts: list[tuple[dict[str, dict[str, tuple[float, float]]], float]], step: int, loss: float
    ) -> dict[str, float]:
        """Workers scored disjoint shares of the validation split (and of the test set, where asked) of the
        model after `step` steps; add up their (sum, count) pairs, record them by column (val_loss,
        test_loss, ...), tell the display and the callbacks."""
        with self.machine.during(Stage.EVALUATING):
            metrics = evaluation_figures(self.task, [p[0] for p in parts])
            now = self.now()
            eval_s = max(p[1] for p in parts)
            self.sink.add_eval(epoch, step, metrics, now, eval_s)
            self.throughput.add_eval(now, eval_s)
            self.best.seen(epoch, step, metrics)
            self.progress(epoch, self.total_steps, loss, metrics, evaluated=True)
            if self.hooks:
                figures = dict(metrics) | {"train_loss": loss, "steps_done": step, "elapsed_s": self.now()}
                self.hooks.call("on_epoch_end", epoch, figures)
        return metrics

    total_steps = 0  # the running phase loop's total (for the display), set by the loop

    # ------------------------------------------------------------------ state
    def save_complete(self, outstanding_evals: set[int], outstanding_checkpoints: set[int]) -> None:
        """Write the checkpoints whose steps' metrics rows (and evaluations) are all in: a run resumed or
        recovered from one has exactly the rows of the steps before it. In step order, whatever order
        their states came back in (a wait may hand a later call's result over first): the latest
        checkpoint, and the restore point, never move back to an earlier step."""
        for step in sorted(self.saves):
            epochs_before = step // self.steps_per_epoch
            if self.steps_done < step or any(e < epochs_before for e in outstanding_evals):
                return
            if any(s < step for s in outstanding_checkpoints):  # an earlier one's state is still to come
                return
            if not self.channel_states.complete(step, self.members()):  # a rank's residuals still to come
                return
            if any(_shards_pending(self.run_dir, state) for _, state in self.saves[step]):  # still being written
                return
            for name, state in self.saves.pop(step):
                self._save(name, state, epochs_before, step)

    def save(self, name: str, state: dict[str, Any], epochs_done: int, steps_done: int, progress: bool = True) -> None:
        """Write a checkpoint: parameters, optimizer state and small metadata. The metrics rows go to
        metrics.parquet first (a resume reads those before the checkpoint's step back from it), and,
        with `progress`, a summary.json that says the run has not finished: a driver killed after
        this leaves a directory `distrain report` reads and `--resume` continues."""
        if not self._finite(state):  # never a NaN checkpoint: the last good one stays the latest
            raise Diverged(steps_done, None, "parameters")
        codec = run_codec(self.phase_config or self.config)
        channel = self.channel_states.take(steps_done, self.members(), codec)
        if channel is not None:  # every rank's residuals at this step (see orchestrator/channel_checkpoint.py)
            state = state | {channel_checkpoint.KEY: channel}
        elif codec and self.shared_plan:  # none can be of this step: a resume says why
            state = state | {channel_checkpoint.WHY: channel_checkpoint.SHARED}
        with self.machine.during(Stage.CHECKPOINTING):
            now = self.now()
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
            payload = {"global_step": steps_done}
            kept = ("model", "optimizer", "sharded", "ps", "strategy_state", "scaler", "scheduler")
            for key in (*kept, channel_checkpoint.KEY, channel_checkpoint.WHY):
                if key in state:
                    payload[key] = state[key]
            self.state.point = RestorePoint(payload, steps_done, now, path)
            if self.membership is not None:  # a draining node's checkpoint: its members may leave now
                for drain in self.membership.drain_checkpoints:
                    if drain["path"] is None and steps_done >= drain["step"]:
                        drain["path"], drain["wall_time"] = str(path), now
            self.best.saved(path, steps_done, self.steps_per_epoch)
            self.hooks.call("on_checkpoint", path, steps_done)
            if progress:
                self._write_summary(Status.UNFINISHED, epochs_done, mitigation=False)

    def _finite(self, state: dict[str, Any]) -> bool:
        """The parameters are finite (a sharded run's workers each checked theirs when they began the
        save: rank 0's flag is in its reference, the others' came back with their rows)."""
        if "sharded" not in state:
            return _finite_model(state)
        return bool(state["sharded"]["finite"]) and state["sharded"]["step"] not in self.nonfinite_shards

    def _wait_for_shards(self, state: dict[str, Any]) -> None:
        """Until the shards `state` names are written (at the run's end: nothing else is left to do)."""
        deadline = time.monotonic() + self.config.hang_timeout_s
        while _shards_pending(self.run_dir, state):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not finish writing {state['sharded']['dir']} in time")
            time.sleep(0.05)

    _save = save  # what `save_complete` calls (tests/unit/test_dispatcher.py stands a recorder in for it)
    _save_complete = save_complete  # its former name (tests/unit/test_dispatcher.py)

    def finish(self, status: Status, checkpoint: bool = True) -> dict[str, Any]:
        epochs_done = self.steps_done // self.steps_per_epoch if self.steps_per_epoch else 0
        if checkpoint and self.steps_done:
            # Every worker is done: the first member's state (a PS snapshot under the PS) is the final model.
            first = self.members()[0]
            self._final_channel_states()
            final = self.group.state(first, self.config.hang_timeout_s)
            if "sharded" in final and final["sharded"]["step"] != self.steps_done:  # a stop between checkpoints
                if not self.group.save_shards(self.members(), self.steps_done, self.config.hang_timeout_s):
                    self.nonfinite_shards.add(self.steps_done)
                final = self.group.state(first, self.config.hang_timeout_s)
            self._wait_for_shards(final)  # a sharded run's last save; those before it are written by then
            self.save_complete(set(), set())
            self._final_test()
            self.save(checkpoint_name(None), final, epochs_done, self.steps_done, progress=False)  # + metrics
        else:
            self.sink.write(self.run_dir / "metrics.parquet")
        return self._write_summary(status, epochs_done)

    def _final_test(self) -> None:
        """The test set's figures on the last evaluation, where it lacks them: a callback's stop made an
        epoch the last after its evaluation was queued (as a validation-only one). Nobody trains any more,
        so the workers' model is the one that evaluation scored."""
        last = self.sink.last_eval()
        if last is None or last.get("test_loss") is not None:
            return
        elastic = self.membership is not None
        ranks = self.members()[:1] if elastic else self.members()
        with self.machine.during(Stage.EVALUATING):
            submit = self.group.submit
            handles = [(submit("eval", r, last["epoch"], whole_test_set=elastic, splits=("test",)), r) for r in ranks]
            parts = [self.group.result(h, r, self.config.hang_timeout_s)[0] for h, r in handles]
            figures = {k: v for k, v in evaluation_figures(self.task, parts).items() if k.startswith("test_")}
            self.sink.fill_last_eval(figures)

    def _final_channel_states(self) -> None:
        """Every member's codec state for the final checkpoint, where a segment did not ship it: no call
        is in flight and nobody trains any more, so a member's state now is its state at the run's end.
        A callback's stop moved the end after the segments ending there were sent (their workers could
        not know to ship it), and a shared plan's members end their last segments at other steps."""
        if not run_codec(self.phase_config or self.config):
            return
        for rank in self.channel_states.missing(self.steps_done, self.members()):
            state = self.group.channel_state(rank, self.config.hang_timeout_s)
            if state:
                self.channel_states.add(rank, {"step": self.steps_done, "state": state})

    def _write_summary(self, status: Status, epochs_done: int, mitigation: bool = True) -> dict[str, Any]:
        summary = self._summary(status, epochs_done, mitigation)
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    def _summary(self, status: Status, epochs_done: int, mitigation: bool = True) -> dict[str, Any]:
        """summary.json's figures (orchestrator/summary.py: only the keys that apply to this run)."""
        df = self.sink.table().to_pandas()
        summary = summarize(df, self.config_dict, self.run_start, self.now(), status.value, epochs_done, self.target)
        if self.best.monitor is not None:
            summary["best_checkpoint"] = self.best.summary()
        if mitigation:  # asks the actors (PS shards, scheduler): only once the run is over
            figures = self.group.actor_figures(self.config)
            if figures is not None:  # a failed run's actors may be gone; the metrics still tell
                summary |= {"stragglers": self.detector.summary()} | figures
        if unequal_shares(self.config):  # each worker's samples per step at the end (the report shows them)
            final = self.balancer.summary()["final_shares"] if self.balancer is not None else self.config.worker_shares
            summary["worker_shares"] = list(final or ())
        if self.balancer is not None:  # --balance speed: the shares it ended at, and when they moved
            summary["balance"] = self.balancer.summary()
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
            summary["membership"] = self.membership.summary(self.group.members())
        return summary


def record_no_space(attempt: Attempt, full: NoSpace, write_text: Callable[[Path, str], None]) -> RunFailed:
    """A write found the disk full (a checkpoint, metrics.parquet or summary.json). Every write is
    atomic, so what was written before is whole and the newest complete checkpoint is still the
    latest. The summary says `failed` if there is room for it (it goes first: it is small; written
    with `write_text`), then the metrics; the one line says what was and was not written, and how to
    go on."""
    epochs_done = attempt.steps_done // attempt.steps_per_epoch if attempt.steps_per_epoch else 0
    summary_file = attempt.run_dir / "summary.json"
    existed = summary_file.is_file()
    summary = attempt._summary(Status.FAILED, epochs_done)
    try:
        write_text(summary_file, json.dumps(summary, indent=2) + "\n")
        written = True
    except NoSpace:
        written = False
    try:
        attempt.sink.write(attempt.run_dir / "metrics.parquet")
    except NoSpace:  # the older file stays whole: it has the rows up to the last checkpoint at least
        pass
    attempt.hooks.end(summary, quiet=True)
    point = attempt.state.point
    line = outcome.no_space_line(full.filename, point.path, point.global_step, attempt.run_dir, written, existed)
    return RunFailed(line)
