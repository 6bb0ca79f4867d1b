"""Fault injection (`--chaos`): kill or hang a worker, kill a parameter-server shard or a node, at a step.

The driver calls `ChaosMonkey.strike` whenever the completed step count moves; each event fires
once per run (a recovery that goes back to before its step does not fire it again). Kills are real:
`ray.kill` ends the actor's process, exactly as a crash would, and the run must notice on its own.
"""

from __future__ import annotations

from typing import Any

import ray

from distrain.config import ChaosEvent


class ChaosMonkey:
    def __init__(self, events: list[ChaosEvent]) -> None:
        self.waiting = list(events)
        self.fired: list[ChaosEvent] = []

    def strike(self, steps_done: int, workers: list[Any], shards: list[Any]) -> list[ChaosEvent]:
        """Inject every event due at `steps_done`; returns those injected."""
        due = [e for e in self.waiting if e.step <= steps_done]
        for event in due:
            self.waiting.remove(event)
            self.fired.append(event)
            if event.kind == "kill-worker":
                ray.kill(workers[len(workers) - 1 if event.target is None else event.target], no_restart=True)
            elif event.kind == "hang-worker":
                # Queued behind the worker's current segments: from then on it answers nothing.
                workers[len(workers) - 1 if event.target is None else event.target].hang.remote()
            elif event.kind == "kill-ps":
                ray.kill(shards[event.target or 0], no_restart=True)
            elif event.kind == "kill-node":
                kill_node_of(workers)
        return due


def kill_node_of(workers: list[Any]) -> None:
    """End the raylet of the node hosting the last worker that is not on the driver's node: every
    process there dies with it (the driver's node, the head of a simulated cluster, is never hit)."""
    import os
    import signal

    here = ray.get_runtime_context().get_node_id()
    hosts = [ray.get(w.describe.remote())["node_id"] for w in workers]
    away = [n for n in hosts if n != here]
    if not away:
        return  # every worker shares the driver's node: there is no node to lose without the driver
    node_id = away[-1]
    for node in ray.nodes():
        if node["NodeID"] == node_id and node["Alive"]:
            pid = _raylet_pid(node)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            return


def _raylet_pid(node: dict[str, Any]) -> int | None:
    """The raylet process of a node on this machine (a simulated cluster), found by its socket name."""
    import psutil

    socket = node.get("RayletSocketName", "")
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if any(socket and socket in part for part in cmdline) and any("raylet" in part for part in cmdline[:1]):
            return int(proc.pid)
    return None
