"""Surviving failures: what counts as a lost actor, how many losses a run takes, what each one cost.

A dead or hung *worker* under the parameter-server transport is replaced in place, and the group
goes on (orchestrator/replacement.py). Every other loss (a worker of a collective group, a
parameter-server shard, a worker whose node is gone) takes the restart path below. Which one, and
when the run fails instead, is decided by orchestrator/failure_policy.py alone.

The restart path serves every transport and every kind of loss: kill what is left of the attempt,
start fresh actors (same ranks, same shard bounds), restore all of them from the latest checkpoint,
drop the metrics rows recorded after that checkpoint, and go on from its step. Because the data order is a pure function
of (seed, epoch, step) and every rule of every synchronous strategy is deterministic, a BSP run
(all-reduce or parameter server) that recovers ends with exactly the parameters of the run that never
failed; async and SSP redo the lost steps and lose no update that the checkpoint holds.

Restarting every actor, not just the dead one, is what makes this exact: a collective group cannot
take in a new member without being rebuilt anyway, and a shard restored to an older snapshot needs
the workers to redo the steps after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from distrain.orchestrator.failure_policy import LedgerView, Loss, describe_loss
from distrain.strategies.elastic_group import PEER_LOST_MARKERS


class RunLost(Exception):
    """An actor of the run died or hung: the attempt is over, the run may go on from a checkpoint."""

    def __init__(self, kind: str, target: int | None, detail: str) -> None:
        super().__init__(f"{describe_loss(kind, target)}: {detail}")
        self.kind = kind  # "worker", "shard", "hang", "node"
        self.target = target  # worker rank or shard index, when known
        self.detail = detail

    @property
    def loss(self) -> Loss:
        """What was lost, as the failure policy (orchestrator/failure_policy.py) takes it."""
        return Loss(self.kind, self.target, self.detail)


@dataclass
class Failure:
    """Progress-display event: a failure was seen and the run restarts from `restored_step`."""

    number: int
    kind: str
    target: int | None
    at_step: int
    restored_step: int
    max_failures: int
    replaced: bool = False  # the worker was replaced in place (PS transport); nothing restarted
    from_start: bool = False  # no checkpoint (nor --init-from) to restore: the run restarts from scratch

    @property
    def what(self) -> str:
        return describe_loss(self.kind, self.target)

    @property
    def then(self) -> str:
        """What happens next, in words: "replaced in place ...", "restarting from the start", ..."""
        if self.replaced:
            return "replaced in place; the others go on"
        if self.from_start:
            return "restarting from the start (no checkpoint was taken yet)"
        return f"restarting from the checkpoint at step {self.restored_step}"


def classify(error: BaseException, rank: int, transport: str) -> RunLost | None:
    """The loss `error` (raised by a call to worker `rank`) means, or None if it is not one.

    None means the worker's own code raised (reading data, a model, a bug): that error is
    deterministic, so retrying it would only fail again (--max-failures times, or forever with -1);
    the failure policy (USER_CODE) ends the run as failed with that first error."""
    if isinstance(error, ray.exceptions.GetTimeoutError):
        return RunLost("hang", rank, "no answer within --hang-timeout-s")
    # First: a worker's task that failed on a dead shard is a RayTaskError that is *also* an instance
    # of its cause's class (Ray's as_instanceof_cause), so it must not be taken for the worker's death.
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause
        if isinstance(cause, ray.exceptions.RayActorError):  # the worker's call to a shard hit a dead shard
            return RunLost("shard", None, "a parameter-server shard died")
        if isinstance(cause, ray.exceptions.GetTimeoutError):
            return RunLost("hang", None, "a parameter-server wait passed its timeout")
        # The worker's own link to Ray broke (its node's raylet is going away, e.g. the node was removed):
        # Ray's client raises an OSError from its own code (`ray._raylet.check_status`) in whatever call
        # the worker was making. Not the user's error: the worker is as good as lost.
        if isinstance(cause, OSError) and raised_inside_ray(error.traceback_str):
            return RunLost("worker", rank, f"its link to Ray broke ({cause})")
        # Only the error types torch.distributed raises (RuntimeError, DistBackendError, OSError) can
        # mean a lost peer; a ValueError that happens to say "timeout" is the worker's own, deterministic.
        text = str(cause).lower()
        transient = isinstance(cause, RuntimeError | OSError)
        if transport == "collective" and transient and any(m in text for m in PEER_LOST_MARKERS):
            return RunLost("worker", None, "a peer of the collective group went away")
        return None  # the worker's own code raised: it would again, so the run fails (never retried)
    if isinstance(error, ray.exceptions.RayActorError):  # the worker itself died (ActorDiedError is one)
        if error.actor_init_failed:  # its constructor raised: deterministic too, not a lost actor
            return None
        return RunLost("worker", rank, type(error).__name__)
    return None


def raised_inside_ray(traceback_str: str) -> bool:
    """Whether a remote traceback's innermost frame is Ray's own code (its Cython core or internals)."""
    frames = [line.strip() for line in traceback_str.splitlines() if line.strip().startswith("File ")]
    return bool(frames) and any(mark in frames[-1] for mark in ("ray/includes/", "ray/_raylet", "ray/_private/"))


@dataclass
class RestorePoint:
    """The newest checkpoint of this run, kept in memory so recovery does not read it back."""

    payload: dict[str, Any] | None  # checkpoint payload (model, optimizer, global_step, ps, ...) or None: start
    global_step: int
    wall_time: float  # run seconds at which the checkpoint's step was complete
    path: Path | None = None


@dataclass
class FailureLedger:
    """Failures seen so far, their cost, and the --max-failures bound."""

    max_failures: int
    events: list[dict[str, Any]] = field(default_factory=list)

    def view(self, point: RestorePoint, run_dir: Path | None = None) -> LedgerView:
        """What the failure policy decides on: the count so far, the bound, the checkpoint and the run
        directory to name."""
        checkpoint = str(point.path) if point.path else None
        return LedgerView(len(self.events), self.max_failures, checkpoint, str(run_dir) if run_dir else None)

    def record(self, lost: RunLost, at_step: int, point: RestorePoint, now: float) -> dict[str, Any]:
        """Count `lost`, restarted from `point` (or, past --max-failures, recorded as the run stops)."""
        event = {
            "action": "restarted",
            "kind": lost.kind,
            "target": lost.target,
            "detail": lost.detail,
            "wall_time": now,
            "at_step": at_step,
            "restored_step": point.global_step,
            "updates_lost": max(0, at_step - point.global_step),  # global steps to redo
            "time_lost_s": None,  # filled in once the run is going again (see `resumed`)
        }
        self.events.append(event)
        return event

    def record_replacement(self, lost: RunLost, at_step: int, now: float) -> dict[str, Any]:
        """Count a worker replaced in place (PS transport): nothing is rolled back, so nothing is lost
        but the dead worker's rows (`rows_lost`) and the pushes the replacement redoes (`updates_repeated`),
        filled in by the replacement; `time_lost_s` once the replacement is set up."""
        event = {
            "action": "replaced",
            "kind": lost.kind,
            "target": lost.target,
            "detail": lost.detail,
            "wall_time": now,
            "at_step": at_step,
            "restored_step": None,
            "updates_lost": 0,
            "updates_repeated": 0,
            "rows_lost": 0,
            "time_lost_s": None,
        }
        self.events.append(event)
        return event

    def resumed(self, point: RestorePoint, now: float) -> None:
        """The run is going again: the failure cost the time since its checkpoint's step, restart included."""
        if self.events and self.events[-1]["time_lost_s"] is None:
            self.events[-1]["time_lost_s"] = now - point.wall_time

    def summary(self) -> dict[str, Any]:
        lost = [e["time_lost_s"] for e in self.events if e["time_lost_s"] is not None]
        return {
            "failures": len(self.events),
            "failure_events": list(self.events),
            "time_lost_s": float(sum(lost)),
            "updates_lost": int(sum(e["updates_lost"] for e in self.events)),
            "replacements": sum(1 for e in self.events if e.get("action") == "replaced"),
            "updates_repeated": int(sum(e.get("updates_repeated", 0) for e in self.events)),
            "rows_lost": int(sum(e.get("rows_lost", 0) for e in self.events)),
        }


def discard(refs: list[Any], timeout: float) -> None:
    """Read, and drop, the results of calls nobody needs any more (a failed attempt's queued segments,
    evaluations and states; a replaced worker's calls). Ray prints every error result dropped unread
    as an "Unhandled error" with a whole remote traceback, while the failure has its one line in the
    display already (a call killed with its actor is never reported; one that failed on a dead shard
    is). Their actors are dead or being killed, so the calls end at once; `timeout` only bounds it."""
    if not refs:
        return
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayError:
            pass


def kill_all(actors: list[Any]) -> None:
    """Kill every actor of a failed attempt (dead ones included: ray.kill on those is a no-op)."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone is what we want
            pass
    actors.clear()
