"""The TRAINING stage of one phase: react to the results of the calls the dispatcher keeps in flight
(orchestrator/dispatcher.py): record rows, evaluations and checkpoints, inject --chaos faults at their
hold, and carry out the failure policy's decision on a lost worker (orchestrator/failure_policy.py):
replace it in place (orchestrator/replacement.py), let it leave (an elastic run above MIN: the scaling
policy, orchestrator/controller/scaling.py), or end the attempt (the controller restarts it, or stops
the run past --max-failures).

One loop for every plan. Lock-step is a property of the work source, not of the loop: an elastic run
over the collective transport changes members only at boundaries every member shares, so its work
comes from orchestrator/block_dispatcher.py's `BlockDispatcher` (blocks dealt to every member, the next
one once the whole block is back; the boundary's evaluations and checkpoints as ordinary calls), and
its scaling policy (orchestrator/controller/collective_scaling.py, `needs_blocks`) has its turn at each
boundary through the same hooks as the parameter server's (`begin`, `poll`, `situation`, `leave`,
`drained`): it takes joiners in, lets draining nodes' members go and re-forms the process group. A
member lost in a block goes through `lose` (the failure policy: LEAVE while the run keeps MIN, else the
attempt ends) once the block is whole and the rounds that stand are known.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from distrain.config.layout_section import data_ranks_per_replica
from distrain.orchestrator.best_checkpoint import checkpoint_period
from distrain.orchestrator.block_dispatcher import BlockDispatcher
from distrain.orchestrator.controller.collective_scaling import CollectiveScaling, needs_blocks
from distrain.orchestrator.controller.run_state import Diverged
from distrain.orchestrator.controller.status import Stage
from distrain.orchestrator.dispatcher import Dispatcher
from distrain.orchestrator.failure_policy import LEAVE, REPLACE, USER_CODE
from distrain.orchestrator.membership import JOIN
from distrain.orchestrator.phases import PhaseSpan
from distrain.orchestrator.recovery import RunLost
from distrain.orchestrator.replacement import replace_worker, replacement_ready
from distrain.orchestrator.replica_dispatcher import ReplicaDispatcher
from distrain.orchestrator.rounds import RoundPlan, StepRoundPlan
from distrain.orchestrator.work import WorkPlan
from distrain.strategies.channel import run_codec

if TYPE_CHECKING:
    from distrain.orchestrator.controller.attempt import Attempt


def run_phase(attempt: Attempt, phase: PhaseSpan) -> None:
    """Train `phase` to its end step."""
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
        every, spe = config.checkpoint_steps, attempt.steps_per_epoch
        attempt.channel_states.wait = run_codec(attempt.phase_config or config) is not None and not shared
        self.chaos = attempt.state.chaos
        books = dict(eval_every=config.eval_every, checkpoint_every=checkpoint_period(config), checkpoint_steps=every)
        self.scaling: ElasticScaling | CollectiveScaling | None = None
        self.hang_limit = config.hang_timeout_s  # seconds a worker with calls queued may stay silent
        blocks = needs_blocks(attempt)
        attempt.shared_plan = shared and not blocks  # a block's members all stop at its checkpoints' steps
        if blocks:  # lock-step blocks, the group re-formed between them
            # A step is MAX x the data-parallel ranks a replica has (D, or D x T under a hybrid plan; one
            # for a plain replica), whose T tensor-parallel workers take each of their units together.
            data_ranks = data_ranks_per_replica(config)
            per_unit = config.replica_size // data_ranks
            # --balance speed: a round is a whole step cut by the members' shares (elastic_balance.py)
            self.work: WorkPlan = (
                StepRoundPlan(total, spe, start_step, every)
                if attempt.balancer is not None
                else RoundPlan(total, spe, config.worker_slots * data_ranks, start_step, every, per_unit)
            )
            rounds = attempt.impl.block_rounds(config)  # BSP: --segment-steps; local SGD: τ (ends in its average)
            self.dispatch: Dispatcher = BlockDispatcher(self.work, self._submit, rounds, **books)
            self.scaling = CollectiveScaling(attempt, self)
            self.hang_limit += config.collective_timeout_s  # the others wait on a hung one that long first
        elif attempt.membership is not None and config.replica_size > 1:  # cut replicas over the PS
            # A unit is a replica's (its D data-parallel ranks take one slice each, a rank's T workers together;
            # under a hybrid plan each of its D x T workers its own): the plan is over the MAX replicas.
            self.work = WorkPlan(total, spe, config.worker_slots, config.segment_steps, True, start_step, every)
            ranks = data_ranks_per_replica(config)
            self.dispatch = ReplicaDispatcher(self.work, self._submit, config.replica_size, ranks, **books)
        else:
            self.work = WorkPlan(total, spe, n, config.segment_steps, shared, start_step, every)
            self.dispatch = Dispatcher(self.work, self._submit, **books)
        if not blocks and attempt.membership is not None:
            self.scaling = ElasticScaling(attempt, self.dispatch)
        self.work.hold = self.chaos.next_step()  # work stops at the next --chaos step until the fault is injected
        attempt.pending = self.dispatch.pending  # a failed attempt's are read and dropped (recovery.discard)
        self.eval_needs = 1 if attempt.membership is not None else n  # parts of an evaluation
        self.eval_parts: dict[int, list[tuple[dict[str, tuple[float, float]], float]]] = defaultdict(list)
        self.last_metrics: dict[str, float] = {}
        self.eval_splits: dict[int, tuple[str, ...]] = {}  # epoch -> what its evaluation scores (`splits_of`)
        self.last_loss = float("nan")
        self.heard = [time.monotonic()] * n  # when each worker last answered (idle workers count as heard)

    def _submit(self, kind: str, rank: int, payload: Any) -> Any:
        """The dispatcher's calls, made on the worker now holding `rank`."""
        if kind == "segment" and self.scaling is not None:
            self.scaling.fed(rank)
        # An elastic run's one member scores the whole test set (membership changes).
        whole = self.a.membership is not None
        balancer = self.a.balancer
        if kind == "segment" and balancer is not None and payload:  # --balance speed: the same for every worker
            epoch, step, _ = payload[0]
            shares = balancer.shares_for(epoch * self.a.steps_per_epoch + step)
            return self.a.group.submit(kind, rank, payload, whole_test_set=whole, shares=shares)
        if kind == "eval":
            return self.a.group.submit(kind, rank, payload, whole_test_set=whole, splits=self.splits_of(payload))
        return self.a.group.submit(kind, rank, payload, whole_test_set=whole)

    def splits_of(self, epoch: int) -> tuple[str, ...]:
        """What the evaluation of `epoch` scores: validation, and the test set at the run's last epoch as
        the plan stands (a callback's stop moves it) or at every one with --test-every-epoch. Decided once
        per epoch: its workers' calls are queued at different times, and the stages or shards of a cut
        replica score together, so all must score the same splits (a stop that comes in between leaves the
        test set to `Attempt._final_test`)."""
        if epoch not in self.eval_splits:
            last = (self.work.total_steps - 1) // self.work.steps_per_epoch
            test = self.a.config.test_every_epoch or epoch >= last
            self.eval_splits[epoch] = ("val", "test") if test else ("val",)
        return self.eval_splits[epoch]

    # ------------------------------------------------------------------ losses
    def lose(self, lost: RunLost, rank: int | None = None) -> None:
        """A worker is gone (`rank`: whose call said so): it leaves (elastic, above MIN), is replaced in
        place, or the attempt ends, as the failure policy decides. A member of a lock-step block is
        decided on once the block is whole (the scaling policy's `poll` calls this again)."""
        a = self.a
        if self.dispatch.defer(lost, rank):
            self.scaling.cut_loose()  # type: ignore[union-attr]  (a lock-step block's: CollectiveScaling)
            return
        situation = self.scaling.situation(lost) if self.scaling is not None else None
        decision = a.decide(lost, training=True, situation=situation)
        if decision.action == LEAVE:
            assert self.scaling is not None
            self.scaling.leave(lost)  # not a failure: the run stays at MIN or more
            # Whoever waited on the leaver (SSP's bound, a BSP round) goes on now: time its silence from here.
            self.heard[:] = [time.monotonic()] * len(self.heard)
            return
        if decision.remedy != REPLACE:
            raise lost
        a.machine.to(Stage.RECOVERING)
        replace_worker(a, lost, decision, self.dispatch)  # past --max-failures: counted, then it raises
        a.machine.to(Stage.TRAINING)
        self.heard[lost.target] = time.monotonic()  # type: ignore[index]
        self.go_on(lost.target)  # type: ignore[arg-type]  # its units may be the last before a --chaos hold

    def go_on(self, rank: int | None) -> None:
        """At the hold (every worker waits there, the checkpoints up to it taken): inject the faults
        due, hold at the next one and feed everyone; else feed `rank` (None: everyone)."""
        if not self.dispatch.reached_hold():
            if rank is None:
                self.dispatch.feed_all()
            else:
                self.dispatch.feed(rank)
            return
        self.a.group.strike(self.chaos, self.a.steps_done)
        self.dispatch.lift_hold(self.chaos.next_step())

    def heard_from(self, ready: list[Any]) -> None:
        """Ranks whose calls have finished answered, though the loop reads one result a turn: a driver slowed
        by load or by a callback must not call a worker silent whose answer waits in line (under load that
        replaced live workers as hung, and an elastic run saw them leave and re-join)."""
        now = time.monotonic()
        for handle in ready:
            self.heard[self.dispatch.pending[handle][1]] = now

    def silent_worker(self) -> RunLost | None:
        """A worker with calls queued that has not answered for --hang-timeout-s (a replacement being
        started gets --collective-timeout-s; a lock-step block's member --hang-timeout-s plus
        --collective-timeout-s: its peers time out first), as a hang; under the PS the one the others wait on."""
        a, heard, pending = self.a, self.heard, self.dispatch.pending
        now = time.monotonic()
        starting = {r for k, r, _ in pending.values() if k == "setup"}
        busy = {r for _, r, _ in pending.values()}
        for rank in range(len(heard)):
            if rank not in busy or (starting and rank not in starting):  # others may wait on a replacement
                heard[rank] = now
        limit = self.hang_limit
        silent = [r for r in busy if now - heard[r] > (a.config.collective_timeout_s if r in starting else limit)]
        if not silent:
            return None
        culprit = min(silent, key=lambda r: heard[r])
        if a.group.has_shards() and a.confirmed_clock:
            # Workers blocked in a shard's rule are silent too: the culprit has the least clock.
            clocks = a.group.shard_counters()
            culprit = min(silent, key=lambda r: (min(c["clocks"][r] for c in clocks), heard[r]))
        return RunLost("hang", culprit, f"no answer for {a.config.hang_timeout_s:g} s")

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        a, dispatch, pending = self.a, self.dispatch, self.dispatch.pending
        stopping = False
        if self.scaling is not None:
            self.scaling.begin()
        dispatch.feed_all()
        while pending or not self.work.finished:
            if self.scaling is not None:
                for rank in self.scaling.poll(stopping):  # joined: its silence is timed from now
                    self.heard[rank] = time.monotonic()
            if not stopping and a.hooks.poll():
                # A callback asked to stop: end the plan at the last step already handed out (every worker
                # gets there, so the transports end as at a normal end), evaluate the last partial epoch.
                stopping = True
                self.total = a.total_steps = dispatch.stop()
            if not pending:  # between lock-step blocks, the scaling policy's turn taken: strike, deal
                self.go_on(None)
                self.heard[:] = [time.monotonic()] * len(self.heard)  # nobody was busy: silence is timed from now
                if not pending and not self.work.finished:
                    break  # nothing to hand out: stalled (a bug, raised below)
                continue
            ready = a.group.wait(list(pending), min(1.0, a.config.hang_timeout_s))
            self.heard_from(ready)
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
                    self.lose(lost, rank)
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
            if "broken" in result and isinstance(self.dispatch, ReplicaDispatcher):
                # A cut replica's collective failed (a mate gone): the replica leaves as for that mate's loss.
                lost = self.scaling.broken_replica(rank, payload, result["broken"][0]["error"])  # type: ignore[union-attr]
                self.lose(lost, lost.target)
                return
            if self.dispatch.collect(rank, payload, result):  # lock-step: its block's books take it when whole
                if isinstance(self.scaling, CollectiveScaling):
                    self.scaling.cut_loose()
                return
            diverged = result.pop("diverged", None)
            if diverged:  # --on-nonfinite stop: keep the rows up to that step, then end the run
                a.sink.add_steps(result)
                raise Diverged(**diverged[0])
            a.nonfinite_shards.update(result.pop("nonfinite_shards", []))  # not a metrics column either
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
            a.saves.setdefault(step, []).append((name, result))
            self.go_on(rank)  # a --chaos fault at this step waited for its checkpoint
