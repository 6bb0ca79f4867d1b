"""Replacing a dead or hung worker in place under the parameter-server transport; the group goes on.

The shards hold θ, the optimizer state, the version and every worker's clock, so a worker process
holds nothing that cannot be rebuilt: the controller kills what is left of it, starts a fresh actor with
the same rank in the same placement-group bundle (loading nothing from disk), sets it up against the
live shards (`PSStrategy.setup` pulls θ and reads its clock from them) and re-issues the calls the
dead worker had queued, in the order they were sent (segments, evaluations, checkpoint states). The
other workers never stop; any of them blocked on the dead worker in a shard's rule is released by
the replacement's first push.

What is redone, per rule (the dead worker's *confirmed* clock is the clock after the last segment
whose rows reached the driver):
- bounded, static plan (SSP): its clock on every shard goes back to the confirmed clock and the
  replacement redoes the lost segments whole. The dead worker's pushes from them stay applied (they
  are ordinary stale-tolerant updates) and are counted as `updates_repeated`; every step keeps
  exactly one metrics row.
- bounded, shared plan (async): the same clock repair; the lost units go back to the work queue
  and whoever is free redoes them.
- sandblaster: no clock; the coordinator re-issues the dead worker's outstanding portions
  (`worker_lost`), and a copy it pushed before dying counts at most once (the shards' record).
- rounds (BSP over the PS): a round cannot be undone, and a round the dead worker pushed to is
  exact. The replacement continues from the dead worker's clock on the shards (the least over the
  shards), with the lost segments' units from that round on, so the parameters stay exactly those
  of the uninterrupted run. The units of rounds the dead worker completed whose rows never reached
  the driver are done but have no row: counted as `rows_lost`, never invented.

Which losses are replaced is the failure policy's rule (orchestrator/failure_policy.py); this module
carries the replacement out over the controller's `WorkerGroup` (orchestrator/controller/group.py),
so it needs no Ray itself; whether a bundle's node is alive (a worker whose node is gone takes the
restart path, which reserves a new placement group) is the group's `host_alive`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distrain.errors import RunFailed
from distrain.orchestrator.failure_policy import FAIL, Decision
from distrain.orchestrator.recovery import Failure, RunLost

if TYPE_CHECKING:
    from distrain.orchestrator.controller.attempt import Attempt
    from distrain.orchestrator.dispatcher import Dispatcher


def replace_worker(attempt: Attempt, lost: RunLost, decision: Decision, dispatch: Dispatcher) -> None:
    """Replace worker `lost.target` of `attempt` and re-issue its queued calls through `dispatch`; or,
    where the failure policy's `decision` is to fail (past --max-failures), count the loss as a
    replacement and stop the run with the decision's line."""
    rank = lost.target
    group, transport = attempt.group, attempt.transport
    assert rank is not None and group.has_shards()
    state, config, work, spe = attempt.state, attempt.config, dispatch.work, attempt.steps_per_epoch
    event = state.ledger.record_replacement(lost, attempt.steps_done, attempt.now())
    if decision.action == FAIL:
        raise RunFailed(decision.reason)
    group.kill(rank)  # a hung worker must not push again
    lost_calls = dispatch.take(rank)
    # ray.kill returns before the process is gone, and a dying worker may still push a round or two:
    # read the shards' clocks only once its calls have all ended (they fail once it is dead).
    group.discard([handle for handle, _ in lost_calls], config.collective_timeout_s)  # (read: no "Unhandled error")

    counters = group.shard_counters()
    dead_clock = min(c["clocks"][rank] for c in counters)
    segments = [entry[2] for _, entry in lost_calls if entry[0] == "segment"]
    if transport.ps_mode == "rounds":
        # Rounds up to the dead worker's clock are done (its gradient counts); its units from there on are redone.
        first_step = dead_clock + transport.step_offset
        done = [u for seg in segments for u in seg if u[0] * spe + u[1] < first_step]
        event["rows_lost"] = len(done)
        if done:
            work.complete(done)
            attempt.steps_done = state.steps_done = work.steps_done
        attempt.confirmed_clock[rank] = dead_clock
    elif transport.ps_mode == "sandblaster":
        # Nothing to repair on the shards: each portion counts once whoever pushes it, the coordinator
        # hands the dead worker's outstanding ones out again (below), and the replacement redoes its
        # lost iterations (a finished one returns its record at once).
        event["updates_repeated"] = 0
    else:
        confirmed = attempt.confirmed_clock[rank]
        group.rebase_clock(rank, confirmed)
        event["updates_repeated"] = max(c["clocks"][rank] for c in counters) - confirmed

    if attempt.impl.reissues_lost_work:  # Sandblaster: the dead worker's outstanding portions go out again
        group.worker_lost(rank, config.hang_timeout_s)
    group.start([rank])
    dispatch.track(group.set_up(rank, attempt.phase_config or config), ("setup", rank, event))
    for _, (kind, _, payload) in lost_calls:  # made on the replacement, now in `rank`'s slot
        if kind == "segment":
            if attempt.impl.independent_workers:  # shared plan: back to the queue, for whoever is free
                work.requeue(payload)
                continue
            units = payload
            if transport.ps_mode == "rounds":
                units = [u for u in payload if u[0] * spe + u[1] >= first_step]
            if units:
                dispatch.call("segment", rank, units)
        elif kind in ("eval", "state"):
            dispatch.call(kind, rank, payload)
        # "setup": an earlier replacement that died before it was set up; the new one has its own
    attempt.emit(
        Failure(len(state.ledger.events), lost.kind, rank, attempt.steps_done, attempt.steps_done,
                config.max_failures, replaced=True)
    )  # fmt: skip


def replacement_ready(attempt: Attempt, event: dict[str, Any]) -> None:
    """The replacement is set up: the failure cost the time from its detection to now."""
    event["time_lost_s"] = attempt.now() - event["wall_time"]
