"""Fault injection (`--chaos`): kill or hang a worker, kill a parameter-server shard or a node, at a step.

`kill-worker@30` means: once 30 global steps are done, before step 31 starts. The driver holds work
at the step of the next waiting event (`WorkPlan.hold`: no unit at or past it is handed out), so the
step count stops exactly there; `ChaosMonkey.strike` then injects the event and the hold moves on to
the next one. Each event fires once per run (a recovery that goes back to before its step does not
fire it again). Kills are real: `ray.kill` ends the actor's process, exactly as a crash would (the
strike returns once it is dead, so nothing handed out after it runs there), and the run must notice
on its own.

An event that cannot fire is refused before anything starts where that is known up front (a step
past the run's last, a `kill-node` on a one-node cluster: `refuse_unreachable`, `refuse_on_cluster`);
otherwise (every worker placed on the driver's node, a run resumed past the event's step, a run that
stopped before it) it is recorded as not fired, with the reason. Every event is in summary.json's
`chaos` list with its requested step and the step it fired at.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import ray

from distrain.config import ChaosEvent
from distrain.errors import ConfigError, ResourceError


def spec_of(event: ChaosEvent) -> str:
    """The event as the user wrote it (KIND@STEP[:TARGET])."""
    return f"{event.kind}@{event.step}" + ("" if event.target is None else f":{event.target}")


def refuse_unreachable(events: list[ChaosEvent], total_steps: int, start_step: int = 0) -> None:
    """Refuse, before anything starts, an event the run can never reach: a fault strikes after STEP
    steps and before the next one, so STEP must lie in [start_step + 1, total_steps - 1]."""
    for event in events:
        if event.step >= total_steps:
            raise ConfigError(
                f"--chaos {spec_of(event)!r}: step {event.step} is not before the end of the run "
                f"({total_steps} steps; a fault strikes after STEP steps, before the next one); "
                "lower STEP or raise --epochs / --max-steps"
            )
        if event.step <= start_step:
            raise ConfigError(
                f"--chaos {spec_of(event)!r}: the run starts at step {start_step} (--init-from), "
                f"so step {event.step} is never reached; use a STEP above {start_step}"
            )


def refuse_on_cluster(events: list[ChaosEvent]) -> None:
    """`kill-node` never kills the driver's node: on a one-node cluster it could never fire."""
    if any(e.kind == "kill-node" for e in events):
        alive = sum(1 for node in ray.nodes() if node["Alive"])
        if alive < 2:
            spec = spec_of(next(e for e in events if e.kind == "kill-node"))
            raise ResourceError(
                f"--chaos {spec!r} needs a cluster of 2 or more nodes (the driver's node is never killed), "
                f"this one has {alive}; connect to one with --address, or drop it"
            )


class Faults(Protocol):
    """How a fault is done to an actor: `RayFaults` for real ones, a test's for its fake workers."""

    def kill(self, actor: Any) -> None: ...

    def hang(self, actor: Any) -> None: ...

    def kill_node(self, workers: list[Any]) -> tuple[str | None, str | None]:
        """Kill the node of one of `workers`: (the node, None) or (None, why it could not be)."""


class RayFaults:
    def kill(self, actor: Any, wait_s: float = 30.0) -> None:
        """End the actor's process, exactly as a crash would, and return once it is dead: `ray.kill` is
        asynchronous, and a call the driver sends right after the strike (the held step's block) could
        otherwise still run on it. (Seen: a killed collective member completed the next step's all-reduce
        with the others and died before its rows came back, so a unit had no row.)"""
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return  # dead (or past waiting for: the run finds it as it would find a crash)
            time.sleep(0.02)

    def hang(self, actor: Any) -> None:
        actor.hang.remote()

    def kill_node(self, workers: list[Any]) -> tuple[str | None, str | None]:
        return kill_node_of(workers)


class ChaosMonkey:
    def __init__(self, events: list[ChaosEvent]) -> None:
        self.events = list(events)
        self.waiting = list(range(len(self.events)))  # indices into `events`, in step order
        self.records: list[dict[str, Any]] = [
            {
                "event": spec_of(e),
                "kind": e.kind,
                "target": e.target,
                "requested_step": e.step,
                "fired_step": None,
                "fired": False,
                "reason": None,
                "node": None,  # kill-node: the node hit
            }
            for e in self.events
        ]

    def next_step(self) -> int | None:
        """The step the driver holds work at: that of the next event still waiting to fire."""
        return min((self.events[i].step for i in self.waiting), default=None)

    def skip_reached(self, start_step: int) -> None:
        """A resumed run starts at `start_step`: events at or before it are past (not fired here)."""
        for i in [i for i in self.waiting if self.events[i].step <= start_step]:
            self._not_fired(i, f"the run was resumed from step {start_step}, past it")

    def strike(
        self, steps_done: int, workers: list[Any], shards: list[Any], faults: Faults | None = None
    ) -> list[ChaosEvent]:
        """Inject every event due at `steps_done` into `workers` (None: a slot with no worker) and
        `shards`, by `faults` (Ray's, unless a test's worker group brings its own); returns those injected."""
        faults = faults or RayFaults()
        due = [i for i in self.waiting if self.events[i].step <= steps_done]
        injected = []
        for i in due:
            self.waiting.remove(i)
            event, record = self.events[i], self.records[i]
            reason = self._inject(event, record, workers, shards, faults)
            if reason is not None:
                record["reason"] = reason
                continue
            record["fired"], record["fired_step"] = True, steps_done
            injected.append(event)
        return injected

    def _inject(
        self, event: ChaosEvent, record: dict[str, Any], workers: list[Any], shards: list[Any], faults: Faults
    ) -> str | None:
        """Inject `event`; returns why it could not be, or None."""
        if event.kind in ("kill-worker", "hang-worker"):
            rank = len(workers) - 1 if event.target is None else event.target
            record["target"] = rank
            if workers[rank] is None:  # an elastic run's slot with no worker now
                return f"worker {rank} is not a member of the run at that step"
            if event.kind == "kill-worker":
                faults.kill(workers[rank])
            else:  # from then on it answers nothing (the driver holds its work, so nothing runs before it)
                faults.hang(workers[rank])
        elif event.kind == "kill-ps":
            index = event.target or 0
            record["target"] = index
            if index >= len(shards):  # a --schedule phase without the parameter-server transport
                return "no parameter-server shard is running at that step"
            faults.kill(shards[index])
        elif event.kind == "kill-node":
            record["node"], reason = faults.kill_node([w for w in workers if w is not None])
            return reason
        return None

    def _not_fired(self, index: int, reason: str) -> None:
        self.waiting.remove(index)
        self.records[index]["reason"] = reason

    def summary(self, steps_done: int) -> list[dict[str, Any]]:
        """Every event: requested step, the step it fired at (None: not fired) and why not."""
        records = [dict(r) for r in self.records]
        for i in self.waiting:
            records[i]["reason"] = f"the run stopped at step {steps_done}, before it"
        return records


def kill_node_of(workers: list[Any]) -> tuple[str | None, str | None]:
    """Kill the node hosting the last worker that is not on the driver's node (the driver's node, the
    head of a simulated cluster, is never hit): its raylet and every process it started. The raylet
    alone is not enough: a worker that is idle when its raylet dies goes on answering direct calls.
    Returns that node's id, and why it was not killed (None: it was)."""
    import psutil

    here = ray.get_runtime_context().get_node_id()
    hosts = [ray.get(w.describe.remote())["node_id"] for w in workers]
    away = [n for n in hosts if n != here]
    if not away:
        return None, "every worker runs on the driver's node, which is never killed (try --placement spread)"
    node_id = away[-1]
    for node in ray.nodes():
        if node["NodeID"] == node_id and node["Alive"]:
            raylet = _raylet(node)
            if raylet is None:
                return node_id, "its raylet is not on this machine (kill-node works on simulated clusters)"
            for proc in [raylet, *raylet.children(recursive=True)]:
                try:
                    proc.kill()  # SIGKILL, as a power cut would
                except psutil.NoSuchProcess:
                    pass
            _wait_until_dead(node_id)
            return node_id, None
    return node_id, "the node is already gone"


def _wait_until_dead(node_id: str, timeout_s: float = 60.0) -> None:
    """Return once Ray has marked the node dead (its health checks take a few seconds): a restart that
    reserved its placement group before that could be handed a bundle on the dead node, and lose its
    first attempt waiting for workers that never start."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            return
        time.sleep(0.1)


def _raylet(node: dict[str, Any]) -> Any:
    """The raylet process (psutil) of a node on this machine (a simulated cluster), found by its socket
    name (matched whole: the head's ".../raylet" is a prefix of the next node's ".../raylet.1")."""
    import psutil

    socket = node.get("RayletSocketName", "")
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if socket and any(part.endswith("=" + socket) or part == socket for part in cmdline[1:]):
            if "raylet" in cmdline[0]:
                return proc
    return None
