"""The TRAINING stage of BSP and local SGD over the collective transport under `--workers MIN..MAX`
(issue 18; strategies/elastic_group.py has the group both share, bsp.py and local_sgd.py the worker
sides): the controller's phase loop (orchestrator/controller/loop.py) hands such a phase to
`ElasticCollective`, which runs it in blocks over the controller's `RayWorkerGroup` and books joins and
leaves in the same `Membership`. Whether a
lost member leaves or the attempt ends is the failure policy's decision (`LEAVE` while the run keeps
MIN), as in every other run.

Under the collective transport every member holds the whole state (θ, optimizer state, fp16 loss
scale) and trains in lock-step, so a membership change means a new process group. The loop runs in
*blocks*: the next `--segment-steps` rounds (local SGD: τ, the block ending in its average) are
dealt to every member at once (orchestrator/rounds.py) and the loop waits for all of them; between
blocks is the step boundary every member shares, where it
- evaluates an epoch just completed and takes the checkpoints due (from one member: all are equal);
- handles a draining node (preemption): at the next step boundary a checkpoint is written, then the
  members on that node leave (cause "node draining"); their slots ask for room again elsewhere;
- takes in joiners: a slot whose placement group got placed starts a worker as soon as it is seen;
  once the worker is built (its data loaded) it joins at the next boundary;
- re-forms the group when anything changed (`_reform`): a fresh rendezvous address hosted by the new
  group's rank 0, every member leaves its old group and joins the new one, and the whole replica
  state is broadcast from a member that trained on (`TrainWorker.reform`); nothing is read from
  disk. Each re-form is recorded (membership summary `reforms`): who, the source, the parameters'
  digest on every member before and after, and the seconds it took.

`--chaos` works as in a fixed run: blocks stop at the next event's step (`WorkPlan.hold`), the fault
is injected at that boundary, and the next block finds it as it would find a crash: a killed
member's all-reduce peers fail, it leaves (a shrink while >= MIN) and its slot asks for room again; a
hung one is found when the group's timeout passes. `kill-node` is a node lost.

A node lost without warning fails the block's all-reduce: gloo raises on the closed peer
connection (or, at worst, the group's --collective-timeout-s passes), the survivors abandon the
round without applying it (`GroupBroken`, strategies/elastic_group.py) and return the rounds they
completed. Rounds every survivor completed stand (an all-reduce completes only with every member's
share, the lost one's included); the rest are redone after the re-form, which broadcasts from a
survivor at that round (in the rare case where some survivors completed a round the others did not,
the broadcast undoes it for them and their rows of it are dropped). The lost member's units in
rounds that stand were applied, but their rows died with it: they are listed in its leave event
(`units_without_row`) and never invented, as replacement.py does for BSP over the PS. A loss is a
shrink, not a failure, while the membership stays >= MIN (the policy's LEAVE); below MIN it ends the
attempt (RunLost) and the controller restarts from the last checkpoint.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray

from distrain.orchestrator.checkpoint import checkpoint_name, step_checkpoint_name
from distrain.orchestrator.controller.ray_group import RayWorkerGroup, start_worker
from distrain.orchestrator.controller.status import Stage
from distrain.orchestrator.dispatcher import evaluates
from distrain.orchestrator.failure_policy import LEAVE as LEAVES
from distrain.orchestrator.failure_policy import USER_CODE, Situation
from distrain.orchestrator.membership import JOIN, LEAVE, Membership, leave_cause
from distrain.orchestrator.recovery import RunLost
from distrain.orchestrator.rounds import RoundPlan, real_units

if TYPE_CHECKING:
    from distrain.orchestrator.controller.attempt import Attempt
    from distrain.orchestrator.work import Unit


class ElasticCollective:
    def __init__(self, attempt: Attempt) -> None:
        assert attempt.membership is not None and isinstance(attempt.group, RayWorkerGroup)
        self.d = attempt
        self.group: RayWorkerGroup = attempt.group  # re-forming a process group is Ray actors' business
        self.config = attempt.config
        self.membership: Membership = attempt.membership
        self.members: list[int] = []  # the ranks of the current process group, in group-rank order
        self.source: int | None = None  # after a loss: the survivor whose state the others take
        self.joining: dict[int, tuple[Any, Any]] = {}  # rank -> (actor being built, its describe call)
        self.changes: list[dict[str, Any]] = []  # membership events since the last re-form
        self.drains: list[dict[str, Any]] = []  # draining nodes waiting for a step boundary

    # ------------------------------------------------------------------ the loop
    def run(self, total: int, start_step: int) -> None:
        d, config = self.d, self.config
        plan = RoundPlan(total, d.steps_per_epoch, config.worker_slots, start_step, config.checkpoint_steps)
        self.plan = plan
        d.total_steps = total
        chaos = d.state.chaos
        plan.hold = chaos.next_step()  # blocks stop at the next --chaos step until the fault is injected
        self.last_loss, metrics = float("nan"), {}
        stopping = False
        self._reform("start")
        while not plan.finished:
            self._preempted()
            self._join()
            if not stopping and d.hooks.poll():  # a callback asked to stop: finish the step dealt
                stopping = True
                total = d.total_steps = plan.stop()
                for epoch in plan.completed_by_stop:
                    metrics = self._evaluate(epoch, metrics)
                if plan.finished:  # the step dealt last was complete already
                    break
            if plan.hold is not None and plan.steps_done >= plan.hold:  # every unit before it done: strike
                self.group.strike(chaos, plan.steps_done)
                plan.hold = chaos.next_step()  # the next block finds the fault as a crash would be found
            if self.changes:
                self._reform("resize")
            rounds = d.impl.block_rounds(config)  # BSP: --segment-steps; local SGD: τ (a block ends in its average)
            block = plan.deal(self.members, rounds, to_step_boundary=bool(self.drains))
            if not block:
                raise RuntimeError("elastic round plan stalled before all units were done")  # a bug
            finished, loss = self._run_block(block)
            if self.changes:  # a member lost: the survivors agree again before anyone reads the model
                self._reform("resize")
            if loss is not None:
                self.last_loss = loss
            d.steps_done = d.state.steps_done = plan.steps_done
            epoch = next(iter(block.values()))[0][0]
            d.progress(epoch, total, self.last_loss, metrics)
            for done in finished:
                metrics = self._evaluate(done, metrics)
            self._checkpoints(finished)

    def _run_block(self, block: dict[int, list[Unit]]) -> tuple[list[int], float | None]:
        """Run one block on every member; returns the epochs it completed and its last loss. A member
        lost on the way leaves (or, below MIN, the attempt ends) and the block's abandoned rounds go
        back to the plan."""
        d, plan = self.d, self.plan
        calls = {self.group.submit("segment", rank, units): rank for rank, units in block.items()}
        results: dict[int, dict[str, list[Any]]] = {}
        lost: dict[int, RunLost] = {}
        waiting = dict(calls)
        deadline = time.monotonic() + self.config.hang_timeout_s + self.config.collective_timeout_s
        while waiting:
            ready = self.group.wait(list(waiting), 1.0, num_returns=len(waiting))
            for ref in ready:
                rank = waiting.pop(ref)
                try:
                    results[rank] = d.result(ref, rank)
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
                d.record_rows(rows)
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
                self.membership.samples_redone += len(redo) * self.config.batch_size
            self.source = min((r for r in results if done[r] == kept), default=None)
            for i, (rank, gone) in enumerate(sorted(lost.items())):  # the abandoned rounds' units: on the first
                self._leave(rank, leave_cause(gone), gone, redo if i == 0 else [], without_row.get(rank, []))
            if lost:  # the policy decides on the first (a peer's failure names no rank: this call's)
                rank, gone = next(iter(lost.items()))
                if not self._leaves(RunLost(gone.kind, rank, gone.detail), len(d.members()) + 1):
                    raise gone  # below MIN: a failure (restart from a checkpoint)
            if not lost:  # a broken group with everyone still here (a timeout): re-form all the same
                self.changes.append({"cause": "group broken"})
        return sorted(set(finished)), last_loss

    # ------------------------------------------------------------------ membership
    def _leaves(self, lost: RunLost, members: int) -> bool:
        """The failure policy's word on `lost` (`members`: the run's size with it): a leave, or a failure."""
        situation = Situation(elastic_min=self.config.workers, members=members, member=True)
        return self.d.decide(lost, situation=situation).action == LEAVES

    def _leave(self, rank: int, cause: str, lost: RunLost | None, redo: list[Unit], without_row: list[Unit]) -> None:
        d = self.d
        d.machine.to(Stage.RESIZING)
        self.group.kill(rank)
        self.membership.renew(rank)
        members = len(d.members())
        event = self.membership.record(LEAVE, rank, cause, members, d.steps_done, d.now(), d.emit, len(redo))
        if lost is not None:
            event["detail"] = lost.detail
        event["units_without_row"] = [list(u) for u in without_row]
        self.changes.append(event)

    def _join(self) -> None:
        """Start a worker in each newly placed slot; a built one joins at this boundary."""
        d, group = self.d, self.group
        for rank in self.membership.joinable(d.members()):
            if rank not in self.joining:
                worker = start_worker(self.config, group.placement, rank, d.run_start)
                group.actors.append(worker)
                self.joining[rank] = (worker, worker.describe.remote())
        for rank, (worker, ref) in list(self.joining.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del self.joining[rank]
            try:
                ray.get(ref)
                ray.get(worker.setup.remote("", [], [], None, d.phase_config), timeout=self.config.collective_timeout_s)
            except ray.exceptions.RayActorError:  # it died being built (its node went): ask for room again
                self.membership.renew(rank)
                continue
            d.machine.to(Stage.RESIZING)
            group.workers[rank] = worker
            members = len(d.members())
            self.changes.append(self.membership.record(JOIN, rank, "placed", members, d.steps_done, d.now(), d.emit))

    def _preempted(self) -> None:
        """A draining node: checkpoint at the next step boundary, then its members leave."""
        for node, ranks in self.membership.draining(self.d.members()).items():
            if ranks:
                self.drains.append({"node": node, "ranks": ranks})
        if not self.drains or not self.plan.aligned:
            return
        d = self.d
        for drain in self.drains:
            ranks = [r for r in drain["ranks"] if r in d.members()]
            staying = [r for r in d.members() if r not in ranks]
            entry = {"node": drain["node"], "step": d.steps_done, "path": None, "wall_time": None, "ranks": ranks}
            self.membership.drain_checkpoints.append(entry)
            src = (staying or ranks)[0]
            state = self.group.state(src, self.config.hang_timeout_s)
            epochs = d.steps_done // d.steps_per_epoch
            d.save(step_checkpoint_name(d.steps_done), state, epochs, d.steps_done)  # fills entry's path
            if not ranks or not self._leaves(RunLost("node", ranks[0], "draining"), len(staying) + 1):
                continue  # leaving would go below MIN: they stay until it goes
            for rank in ranks:
                self._leave(rank, "node draining", None, [], [])
        self.drains = []

    def _reform(self, cause: str) -> None:
        """A new process group of the members, the state broadcast from one that trained on."""
        d = self.d
        for _attempt in range(3):
            self._drop_dead()
            members = d.members()
            survivors = [r for r in members if r in self.members]
            source = self.source if self.source in members else (survivors or members)[0]
            address = self.group.rendezvous_address(members[0])
            t0 = time.monotonic()
            calls = {
                self.group.workers[r].reform.remote(address, i, len(members), members.index(source)): r
                for i, r in enumerate(members)
            }
            results, failed = {}, {}
            for ref, rank in calls.items():
                try:
                    results[rank] = d.result(ref, rank, self.config.collective_timeout_s + 10)
                except RunLost as gone:  # its actor died, or (target None) its new group could not form
                    if gone.kind == USER_CODE:
                        raise
                    failed[rank] = gone
            if not failed:
                break
            for rank, gone in failed.items():  # died during the re-form: leave; the others form again
                if gone.target == rank:
                    self._leave(rank, leave_cause(gone), gone, [], [])
        else:
            raise next(iter(failed.values()))
        seconds = round(time.monotonic() - t0, 3)
        reform = {
            "cause": cause,
            "step": d.steps_done,
            "units_done": sum(self.plan.units_done.values()),
            "members": members,
            "source": source,
            "before": {str(r): results[r]["before"] for r in members},
            "after": {str(r): results[r]["after"] for r in members},
            "survivors": survivors,
            "seconds": seconds,
        }
        self.membership.reforms.append(reform)
        if self.changes and "change" in self.changes[-1]:
            self.changes[-1]["setup_s"] = seconds  # the summary's reform_s adds these up
        self.members, self.source, self.changes = members, None, []
        d.machine.to(Stage.TRAINING)

    def _drop_dead(self) -> None:
        """Members whose actor is gone (a node lost while its results had come in) leave before the
        re-form, which would otherwise wait --collective-timeout-s for them to join."""
        d = self.d
        for rank in d.members():
            try:
                ray.get(self.group.workers[rank].describe.remote(), timeout=self.config.collective_timeout_s)
            except ray.exceptions.RayActorError as e:
                gone = RunLost("worker", rank, type(e).__name__)
                gone.__cause__ = e
                self._leave(rank, leave_cause(gone), gone, [], [])
            except ray.exceptions.GetTimeoutError:
                self._leave(rank, "worker hung", RunLost("hang", rank, "no answer before the re-form"), [], [])
        if len(d.members()) < self.config.workers:
            raise RunLost("worker", None, "below --workers MIN before the re-form")

    # ------------------------------------------------------------------ evaluations and checkpoints
    def _evaluate(self, epoch: int, metrics: dict[str, float]) -> dict[str, float]:
        d = self.d
        last = (self.plan.total_steps - 1) // d.steps_per_epoch
        if not evaluates(epoch, last, self.config.eval_every):
            return metrics
        rank = self.members[0]
        handle = self.group.submit("eval", rank, epoch, whole_test_set=True)
        result = d.result(handle, rank, self.config.hang_timeout_s)
        step = min((epoch + 1) * d.steps_per_epoch, self.plan.total_steps)
        return d.record_eval(epoch, [result], step, self.last_loss)

    def _checkpoints(self, finished: list[int]) -> None:
        d, plan, config = self.d, self.plan, self.config
        due: list[tuple[str, int]] = []
        every = config.checkpoint_every
        for epoch in finished:
            if every and (epoch + 1) % every == 0 and (epoch + 1) * d.steps_per_epoch <= plan.total_steps:
                due.append((checkpoint_name(epoch + 1), (epoch + 1) * d.steps_per_epoch))
        step = plan.steps_done
        if config.checkpoint_steps and plan.aligned and step % config.checkpoint_steps == 0 and step < plan.total_steps:
            due.append((step_checkpoint_name(step), step))
        for name, at in due:
            if at != step or not plan.aligned:
                continue
            state = self.group.state(self.members[0], config.hang_timeout_s)
            d.save(name, state, at // d.steps_per_epoch, at)
