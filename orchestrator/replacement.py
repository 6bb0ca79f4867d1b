"""Replacing a dead or hung worker in place under the parameter-server transport; the group goes on.

The shards hold θ, the optimizer state, the version and every worker's clock, so a worker process
holds nothing that cannot be rebuilt: the driver kills what is left of it, starts a fresh actor with
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
answers the one question of it that needs Ray (`bundle_alive`: a worker whose bundle's node is gone
takes the restart path, which reserves a new placement group) and carries the replacement out.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray

from distrain.config import RunConfig
from distrain.errors import RunFailed
from distrain.orchestrator.cluster import Placement
from distrain.orchestrator.failure_policy import FAIL, Decision
from distrain.orchestrator.recovery import Failure, RunLost, discard
from distrain.orchestrator.worker import TrainWorker

if TYPE_CHECKING:
    from distrain.orchestrator.dispatcher import Dispatcher


def start_worker(config: RunConfig, placement: Placement, rank: int, run_start: float) -> Any:
    """A TrainWorker actor for `rank`, in its placement-group bundle."""
    return (
        ray.remote(TrainWorker)
        .options(
            num_cpus=config.cpus_per_worker,
            num_gpus=config.gpus_per_worker,
            scheduling_strategy=placement.worker(rank),
        )
        .remote(config, rank, run_start)
    )


def bundle_alive(placement: Placement, rank: int | None) -> bool:
    """Whether worker `rank`'s placement-group bundle is on a live node (a replacement can start there)."""
    if rank is None:
        return False
    try:
        node = placement.worker_node(rank)
        return any(n["NodeID"] == node and n["Alive"] for n in ray.nodes())
    except Exception:  # noqa: BLE001 - a placement group being rescheduled, a rank it has no bundle for: restart
        return False


def replace_worker(driver: Any, lost: RunLost, decision: Decision, dispatch: Dispatcher) -> None:
    """Replace worker `lost.target` of `driver` (a `_Driver`) and re-issue its queued calls through
    `dispatch`; or, where the failure policy's `decision` is to fail (past --max-failures), count the
    loss as a replacement and stop the run with the decision's line."""
    rank = lost.target
    assert rank is not None and driver.shards is not None
    state, config, work = driver.state, driver.config, dispatch.work
    now = time.time() - driver.run_start
    event = state.ledger.record_replacement(lost, driver.steps_done, now)
    if decision.action == FAIL:
        raise RunFailed(decision.reason)
    ray.kill(driver.workers[rank], no_restart=True)  # a hung worker must not push again
    lost_calls = dispatch.take(rank)
    # ray.kill returns before the process is gone, and a dying worker may still push a round or two:
    # read the shards' clocks only once its calls have all ended (they fail once it is dead).
    discard([ref for ref, _ in lost_calls], config.collective_timeout_s)  # (read: no "Unhandled error" each)

    shards = driver.shards.shards
    counters = driver._shard_call([s.counters.remote() for s in shards])
    dead_clock = min(c["clocks"][rank] for c in counters)
    segments = [entry[2] for _, entry in lost_calls if entry[0] == "segment"]
    if driver.ps_mode == "rounds":
        # Rounds up to the dead worker's clock are done (its gradient counts); its units from there on are redone.
        first_step = dead_clock + driver.step_offset
        done = [u for seg in segments for u in seg if u[0] * driver.steps_per_epoch + u[1] < first_step]
        event["rows_lost"] = len(done)
        if done:
            work.complete(done)
            driver.steps_done = state.steps_done = work.steps_done
        driver.confirmed_clock[rank] = dead_clock
    elif driver.ps_mode == "sandblaster":
        # Nothing to repair on the shards: each portion counts once whoever pushes it, the coordinator
        # hands the dead worker's outstanding ones out again (below), and the replacement redoes its
        # lost iterations (a finished one returns its record at once).
        event["updates_repeated"] = 0
    else:
        confirmed = driver.confirmed_clock[rank]
        driver._shard_call([s.rebase_clock.remote(rank, confirmed) for s in shards])
        event["updates_repeated"] = max(c["clocks"][rank] for c in counters) - confirmed

    if driver.impl.reissues_lost_work:  # Sandblaster: the dead worker's outstanding portions go out again
        ray.get(driver.portion_scheduler.worker_lost.remote(rank), timeout=config.hang_timeout_s)
    worker = start_worker(config, driver.placement, rank, driver.run_start)
    driver.workers[rank] = worker
    driver.actors.append(worker)
    bounds = driver.shards.bounds
    setup = worker.setup.remote("", shards, bounds, driver.portion_scheduler, driver.phase_config)
    dispatch.track(setup, ("setup", rank, event))
    for _, (kind, _, payload) in lost_calls:  # made on the replacement, now `driver.workers[rank]`
        if kind == "segment":
            if driver.impl.independent_workers:  # shared plan: back to the queue, for whoever is free
                work.requeue(payload)
                continue
            units = payload
            if driver.ps_mode == "rounds":
                units = [u for u in payload if u[0] * driver.steps_per_epoch + u[1] >= first_step]
            if units:
                dispatch.call("segment", rank, units)
        elif kind in ("eval", "state"):
            dispatch.call(kind, rank, payload)
        # "setup": an earlier replacement that died before it was set up; the new one has its own
    driver.emit(
        Failure(len(state.ledger.events), lost.kind, rank, driver.steps_done, driver.steps_done,
                config.max_failures, replaced=True)
    )  # fmt: skip


def replacement_ready(driver: Any, event: dict[str, Any]) -> None:
    """The replacement is set up: the failure cost the time from its detection to now."""
    event["time_lost_s"] = time.time() - driver.run_start - event["wall_time"]
