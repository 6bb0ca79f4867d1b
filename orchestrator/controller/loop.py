"""The TRAINING stage of one phase: react to the results of the calls the dispatcher keeps in flight
(orchestrator/dispatcher.py): record rows, evaluations and checkpoints, inject --chaos faults at their
hold, and carry out the failure policy's decision on a lost worker (orchestrator/failure_policy.py):
replace it in place (orchestrator/replacement.py), let it leave (an elastic run above MIN: the scaling
policy, orchestrator/controller/scaling.py), or end the attempt (the controller restarts it, or stops
the run past --max-failures).

An elastic run over the collective transport changes members only at boundaries every member shares,
so its phases run in lock-step blocks (`BlockLoop`), between which its scaling policy
(orchestrator/controller/collective_scaling.py, `needs_blocks`) takes joiners in, lets draining nodes'
members go and re-forms the process group; a member lost in a block goes through the same failure
policy (LEAVE while the run keeps MIN, else the attempt ends).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from distrain.orchestrator.checkpoint import checkpoint_name, step_checkpoint_name
from distrain.orchestrator.controller.collective_scaling import CollectiveScaling, needs_blocks
from distrain.orchestrator.controller.run_state import Diverged
from distrain.orchestrator.controller.status import Stage
from distrain.orchestrator.dispatcher import Dispatcher, evaluates
from distrain.orchestrator.failure_policy import LEAVE, REPLACE, USER_CODE
from distrain.orchestrator.membership import JOIN
from distrain.orchestrator.phases import PhaseSpan
from distrain.orchestrator.recovery import RunLost
from distrain.orchestrator.replacement import replace_worker, replacement_ready
from distrain.orchestrator.rounds import RoundPlan, real_units
from distrain.orchestrator.work import Unit, WorkPlan
from distrain.strategies.channel import run_codec

if TYPE_CHECKING:
    from distrain.orchestrator.controller.attempt import Attempt


def run_phase(attempt: Attempt, phase: PhaseSpan) -> None:
    """Train `phase` to its end step."""
    if needs_blocks(attempt):
        BlockLoop(attempt, phase.end_step, phase.start_step).run()  # re-formed groups between blocks
    else:
        PhaseLoop(attempt, phase.end_step, phase.start_step).run()


class PhaseLoop:
    def __init__(self, attempt: Attempt, total: int, start_step: int) -> None:
        from distrain.orchestrator.controller.scaling import ElasticScaling

        self.a = attempt
        config = attempt.config
        n = config.num_worker_actors
        self.total = attempt.total_steps = total
        # An elastic run's units go to whoever asks (a slot may have no worker to take slice r).
        shared = attempt.impl.independent_workers or attempt.membership is not None
        every = config.checkpoint_steps
        self.work = WorkPlan(total, attempt.steps_per_epoch, n, config.segment_steps, shared, start_step, every)
        attempt.channel_states.wait = run_codec(attempt.phase_config or config) is not None and not shared
        self.chaos = attempt.state.chaos
        self.work.hold = self.chaos.next_step()  # work stops at the next --chaos step until the fault is injected
        self.dispatch = Dispatcher(
            self.work,
            self._submit,
            eval_every=config.eval_every,
            checkpoint_every=config.checkpoint_every,
            checkpoint_steps=every,
        )
        attempt.pending = self.dispatch.pending  # a failed attempt's are read and dropped (recovery.discard)
        self.scaling = ElasticScaling(attempt, self.dispatch) if attempt.membership is not None else None
        self.eval_needs = 1 if attempt.membership is not None else n  # parts of an evaluation
        self.eval_parts: dict[int, list[tuple[dict[str, tuple[float, float]], float]]] = defaultdict(list)
        self.last_metrics: dict[str, float] = {}
        self.last_loss = float("nan")
        self.heard = [time.monotonic()] * n  # when each worker last answered (idle workers count as heard)

    def _submit(self, kind: str, rank: int, payload: Any) -> Any:
        """The dispatcher's calls, made on the worker now holding `rank`."""
        if kind == "segment" and self.scaling is not None:
            self.scaling.fed(rank)
        # An elastic run's one member scores the whole test set (membership changes).
        return self.a.group.submit(kind, rank, payload, whole_test_set=self.a.membership is not None)

    # ------------------------------------------------------------------ losses
    def lose(self, lost: RunLost) -> None:
        """A worker is gone: it leaves (elastic, above MIN), is replaced in place, or the attempt ends,
        as the failure policy decides."""
        a = self.a
        situation = self.scaling.situation(lost) if self.scaling is not None else None
        decision = a.decide(lost, training=True, situation=situation)
        if decision.action == LEAVE:
            assert self.scaling is not None
            self.scaling.leave(lost)  # not a failure: the run stays at MIN or more
            return
        if decision.remedy != REPLACE:
            raise lost
        a.machine.to(Stage.RECOVERING)
        replace_worker(a, lost, decision, self.dispatch)  # past --max-failures: counted, then it raises
        a.machine.to(Stage.TRAINING)
        self.heard[lost.target] = time.monotonic()  # type: ignore[index]
        self.go_on(lost.target)  # type: ignore[arg-type]  # its units may be the last before a --chaos hold

    def go_on(self, rank: int) -> None:
        """At the hold (every worker waits there, the checkpoints up to it taken): inject the faults
        due, hold at the next one and feed everyone; else feed `rank`."""
        if not self.dispatch.reached_hold():
            self.dispatch.feed(rank)
            return
        self.a.group.strike(self.chaos, self.a.steps_done)
        self.dispatch.lift_hold(self.chaos.next_step())

    def silent_worker(self) -> RunLost | None:
        """A worker with calls queued that has not answered for --hang-timeout-s (a replacement being
        started gets --collective-timeout-s), as a hang; under the PS the one the others wait on."""
        a, heard, pending = self.a, self.heard, self.dispatch.pending
        now = time.monotonic()
        starting = {r for k, r, _ in pending.values() if k == "setup"}
        busy = {r for _, r, _ in pending.values()}
        for rank in range(len(heard)):
            if rank not in busy or (starting and rank not in starting):  # others may wait on a replacement
                heard[rank] = now
        limit = a.config.hang_timeout_s
        silent = [r for r in busy if now - heard[r] > (a.config.collective_timeout_s if r in starting else limit)]
        if not silent:
            return None
        culprit = min(silent, key=lambda r: heard[r])
        if a.group.has_shards() and a.confirmed_clock:
            # Workers blocked in a shard's rule are silent too: the culprit has the least clock.
            clocks = a.group.shard_counters()
            culprit = min(silent, key=lambda r: (min(c["clocks"][r] for c in clocks), heard[r]))
        return RunLost("hang", culprit, f"no answer for {limit:g} s")

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        a, dispatch, pending = self.a, self.dispatch, self.dispatch.pending
        stopping = False
        if self.scaling is not None:
            self.scaling.begin()
        dispatch.feed_all()
        while pending:
            if self.scaling is not None and not stopping:
                for rank in self.scaling.poll():  # joined: its silence is timed from now
                    self.heard[rank] = time.monotonic()
            if not stopping and a.hooks.poll():
                # A callback asked to stop: end the plan at the last step already handed out (every worker
                # gets there, so the transports end as at a normal end), evaluate the last partial epoch.
                stopping = True
                self.total = a.total_steps = dispatch.stop()
            ready = a.group.wait(list(pending), min(1.0, a.config.hang_timeout_s))
            silent = self.silent_worker()
            if silent is not None:
                self.lose(silent)
                continue
            if not ready:
                continue
            handle = ready[0]
            kind, rank, payload = pending[handle]
            try:
                result = a.result(handle, rank)
            except RunLost as lost:
                if lost.kind != USER_CODE:
                    self.lose(lost)
                    continue
                raise
            dispatch.done(handle)
            self.heard[rank] = time.monotonic()
            self.react(kind, rank, payload, result)
            a.save_complete(set(self.eval_parts) | dispatch.evals_outstanding(), dispatch.checkpoints_outstanding())
            if self.scaling is not None:
                self.scaling.drained()
        if not self.work.finished:
            raise RuntimeError("work plan stalled before all units were done")  # a bug, not user error

    def react(self, kind: str, rank: int, payload: Any, result: Any) -> None:
        a = self.a
        if kind == "setup" and payload.get("change") == JOIN:  # a joiner is set up (fed already)
            payload["setup_s"] = round(a.now() - payload["wall_time"], 3)
        elif kind == "setup":  # a replacement worker is ready (its queued calls run next)
            replacement_ready(a, payload)
        elif kind == "segment":
            diverged = result.pop("diverged", None)
            if diverged:  # --on-nonfinite stop: keep the rows up to that step, then end the run
                a.sink.add_steps(result)
                raise Diverged(**diverged[0])
            channel = result.pop("channel_state", None)  # not a metrics column: the codec state for a checkpoint
            if channel:
                a.channel_states.add(rank, channel[0])
            if payload:
                a.channel_states.reported_to(rank, payload[-1][0] * a.steps_per_epoch + payload[-1][1] + 1)
            # The clock of its last row that has one: backup tasks' rows carry none (a portion is not a
            # clock tick), and a None rebased onto the shards at a leave would break their books.
            clocks = [c for c in result["clock"] if c is not None]
            if clocks:
                a.confirmed_clock[rank : rank + 1] = clocks[-1:]
            a.record_rows(result)
            a.watch_stragglers(result)
            self.dispatch.completed(rank, payload)  # shared plans: the evaluations and checkpoints this makes due
            a.steps_done = a.state.steps_done = self.work.steps_done
            if result["loss"]:  # empty when every unit was skipped (k-of-n) or taken by others (backup tasks)
                self.last_loss = result["loss"][-1]
            a.progress(payload[-1][0], self.total, self.last_loss, self.last_metrics)
            self.go_on(rank)
        elif kind == "eval":
            self.eval_parts[payload].append(result)
            if len(self.eval_parts[payload]) == self.eval_needs:
                # The model evaluated is the one after the epoch's last step (static plans queue each
                # worker's evaluation behind that step), whatever rows have come back by now; a shared
                # plan's workers go on, so its evaluation is of the steps done so far.
                epoch_end = min((payload + 1) * a.steps_per_epoch, self.work.total_steps)
                evaluated = a.steps_done if self.work.shared else epoch_end
                self.last_metrics = a.record_eval(payload, self.eval_parts.pop(payload), evaluated, self.last_loss)
        else:  # "state": a periodic checkpoint, taken in the worker's queue right after its step
            name, step = payload
            a.saves[step] = (name, result)
            self.go_on(rank)  # a --chaos fault at this step waited for its checkpoint


class BlockLoop:
    """The TRAINING stage of an elastic phase over the collective transport: lock-step blocks dealt to
    every member (orchestrator/rounds.py), the scaling policy's turn at each boundary between them."""

    def __init__(self, attempt: Attempt, total: int, start_step: int) -> None:
        self.a = attempt
        config = self.config = attempt.config
        self.plan = RoundPlan(total, attempt.steps_per_epoch, config.worker_slots, start_step, config.checkpoint_steps)
        attempt.total_steps = total
        self.chaos = attempt.state.chaos
        self.plan.hold = self.chaos.next_step()  # blocks stop at the next --chaos step until the fault is injected
        self.scaling = CollectiveScaling(attempt, self.plan)
        self.last_loss = float("nan")

    def run(self) -> None:
        a, config, plan, scaling = self.a, self.config, self.plan, self.scaling
        metrics: dict[str, float] = {}
        stopping = False
        scaling.begin()
        while not plan.finished:
            scaling.boundary()
            if not stopping and a.hooks.poll():  # a callback asked to stop: finish the step dealt
                stopping = True
                a.total_steps = plan.stop()
                for epoch in plan.completed_by_stop:
                    metrics = self._evaluate(epoch, metrics)
                if plan.finished:  # the step dealt last was complete already
                    break
            if plan.hold is not None and plan.steps_done >= plan.hold:  # every unit before it done: strike
                a.group.strike(self.chaos, plan.steps_done)
                plan.hold = self.chaos.next_step()  # the next block finds the fault as a crash would be found
            scaling.settle()
            rounds = a.impl.block_rounds(config)  # BSP: --segment-steps; local SGD: τ (a block ends in its average)
            block = plan.deal(scaling.members, rounds, to_step_boundary=scaling.to_step_boundary)
            if not block:
                raise RuntimeError("elastic round plan stalled before all units were done")  # a bug
            finished, loss = self._run_block(block)
            scaling.settle()  # a member lost: the survivors agree again before anyone reads the model
            if loss is not None:
                self.last_loss = loss
            a.steps_done = a.state.steps_done = plan.steps_done
            epoch = next(iter(block.values()))[0][0]
            a.progress(epoch, a.total_steps, self.last_loss, metrics)
            for done in finished:
                metrics = self._evaluate(done, metrics)
            self._checkpoints(finished)

    def _run_block(self, block: dict[int, list[Unit]]) -> tuple[list[int], float | None]:
        """Run one block on every member; returns the epochs it completed and its last loss. A member
        lost on the way goes to the scaling policy (a leave, or below MIN the attempt ends) and the
        block's abandoned rounds go back to the plan."""
        a, plan, group = self.a, self.plan, self.a.group
        calls = {group.submit("segment", rank, units): rank for rank, units in block.items()}
        results: dict[int, dict[str, list[Any]]] = {}
        lost: dict[int, RunLost] = {}
        waiting = dict(calls)
        deadline = time.monotonic() + self.config.hang_timeout_s + self.config.collective_timeout_s
        while waiting:
            ready = group.wait(list(waiting), 1.0, num_returns=len(waiting))
            for handle in ready:
                rank = waiting.pop(handle)
                try:
                    results[rank] = a.result(handle, rank)
                except RunLost as gone:
                    if gone.kind == USER_CODE:
                        raise
                    lost[rank] = gone
            if waiting and time.monotonic() > deadline:  # hung: nobody answers past the group's timeout
                for rank in waiting.values():
                    lost[rank] = RunLost("hang", rank, f"no answer for {self.config.hang_timeout_s:g} s")
                waiting = {}
        rounds = len(next(iter(block.values())))
        done = {rank: r["broken"][0]["rounds"] if "broken" in r else rounds for rank, r in results.items()}
        kept = min(done.values(), default=0)  # rounds every survivor applied: they stand
        last_loss = None
        finished: list[int] = []
        for rows in results.values():
            rows.pop("broken", None)
            rows = {k: v[:kept] for k, v in rows.items()}  # a round only some survivors completed is undone
            if rows["step"]:
                a.record_rows(rows)
                last_loss = rows["loss"][-1]
        redo: list[Unit] = []
        without_row: dict[int, list[Unit]] = {}
        for rank, units in block.items():
            applied, abandoned = real_units(units[:kept]), real_units(units[kept:])
            finished += plan.complete(applied)
            redo += abandoned
            if rank in lost:
                without_row[rank] = applied
        if lost or redo:
            if redo:
                plan.requeue(redo)
                self.scaling.membership.samples_redone += len(redo) * self.config.batch_size
            source = min((r for r in results if done[r] == kept), default=None)
            self.scaling.lost(lost, redo, without_row, source)
        return sorted(set(finished)), last_loss

    # ------------------------------------------------------------------ evaluations and checkpoints
    def _evaluate(self, epoch: int, metrics: dict[str, float]) -> dict[str, float]:
        a = self.a
        last = (self.plan.total_steps - 1) // a.steps_per_epoch
        if not evaluates(epoch, last, self.config.eval_every):
            return metrics
        rank = self.scaling.members[0]
        handle = a.group.submit("eval", rank, epoch, whole_test_set=True)
        result = a.result(handle, rank, self.config.hang_timeout_s)
        step = min((epoch + 1) * a.steps_per_epoch, self.plan.total_steps)
        return a.record_eval(epoch, [result], step, self.last_loss)

    def _checkpoints(self, finished: list[int]) -> None:
        a, plan, config = self.a, self.plan, self.config
        due: list[tuple[str, int]] = []
        every = config.checkpoint_every
        for epoch in finished:
            if every and (epoch + 1) % every == 0 and (epoch + 1) * a.steps_per_epoch <= plan.total_steps:
                due.append((checkpoint_name(epoch + 1), (epoch + 1) * a.steps_per_epoch))
        step = plan.steps_done
        if config.checkpoint_steps and plan.aligned and step % config.checkpoint_steps == 0 and step < plan.total_steps:
            due.append((step_checkpoint_name(step), step))
        for name, at in due:
            if at != step or not plan.aligned:
                continue
            state = a.group.state(self.scaling.members[0], config.hang_timeout_s)
            a.save(name, state, at // a.steps_per_epoch, at)
