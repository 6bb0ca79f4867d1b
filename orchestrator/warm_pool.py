"""Warm workers: a completed run's worker processes, kept for the next run in the same Ray session.

Starting a worker actor is most of a small run's start-up: a fresh process imports torch (and
torch._dynamo, which every optimizer's first step imports) before it can build its replica, about
4 CPU-seconds each. A notebook that calls `fit` again, a script that runs a sweep of runs, or a test
suite that shares one cluster pays that again for every run. Here the driver keeps the workers of a
run that completed, each stripped of its replica (`TrainWorker.retire`), and the next run on the same
node takes them (`TrainWorker.rebuild` builds the new replica as a fresh actor would).

What makes a kept process safe to reuse:
- Only a completed run's workers are kept, and only those that retired cleanly: a failed, killed or
  interrupted run's actors are killed as before.
- A warm worker asks for no CPU of its own and is pinned to its bundle's node: the run's placement
  group still holds the run's CPUs, so the books are as before, and the process outlives the group.
  GPU workers are never kept (a GPU is granted to an actor for its lifetime).
- `rebuild` restores torch's global RNG to its state at process start and imports a task file again.
- Runs on a Ray that distrain started for them (`distrain run` without `--address`) keep nothing: that
  Ray ends with the run.

`DISTRAIN_WARM_WORKERS` caps how many idle workers the driver keeps (default 8; 0 turns this off).
"""

from __future__ import annotations

import os
from typing import Any

import ray

WARM_ENV = "DISTRAIN_WARM_WORKERS"
DEFAULT_CAPACITY = 8
PING_TIMEOUT_S = 5.0  # a kept worker that does not answer this soon is dead or hung: killed, not used

_idle: dict[str, list[Any]] = {}  # node id -> idle workers' handles
_session: str | None = None  # the Ray session those handles belong to
_taken = 0  # workers handed out again in this process (for tests and the start-up notice)


def capacity() -> int:
    try:
        return max(0, int(os.environ.get(WARM_ENV, DEFAULT_CAPACITY)))
    except ValueError:
        return DEFAULT_CAPACITY


def applies(uses_gpus: bool, ray_ends_with_run: bool) -> bool:
    """Whether a run's workers start warm-able (zero-CPU actors pinned to their bundle's node)."""
    return capacity() > 0 and not uses_gpus and not ray_ends_with_run


def _current_session() -> str:
    """This process's Ray session: handles from an earlier `ray.init` are dead and must not be used."""
    return ray.get_runtime_context().get_job_id() + "@" + ray._private.worker.global_worker.node.session_name


def _idle_here() -> dict[str, list[Any]]:
    global _session
    session = _current_session()
    if session != _session:
        _idle.clear()
        _session = session
    return _idle


def take(node_id: str) -> Any | None:
    """An idle worker on `node_id` that still answers, or None (the caller starts a fresh one)."""
    global _taken
    idle = _idle_here().get(node_id, [])
    while idle:
        worker = idle.pop()
        try:
            ray.get(worker.alive.remote(), timeout=PING_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            ray.kill(worker, no_restart=True)
            continue
        _taken += 1
        return worker
    return None


def keep(workers: list[Any], nodes: list[str]) -> list[Any]:
    """Keep `workers` (retired, on `nodes`) idle, as many as there is room for; returns those kept
    (the caller kills the rest)."""
    idle = _idle_here()
    room = capacity() - sum(len(v) for v in idle.values())
    kept = workers[: max(0, room)]
    for worker, node in zip(kept, nodes, strict=False):
        idle.setdefault(node, []).append(worker)
    return kept


def idle_count() -> int:
    return sum(len(v) for v in _idle_here().values()) if ray.is_initialized() else 0


def taken() -> int:
    return _taken


def release() -> None:
    """Kill every idle worker (their memory back to the node)."""
    for workers in _idle.values():
        for worker in workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - gone with its session already
                pass
    _idle.clear()
