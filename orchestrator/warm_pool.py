"""Warm workers and shards: a completed run's worker and parameter-server shard processes, kept for the
next run in the same Ray session.

Starting a worker actor is most of a small run's start-up: a fresh process imports torch (and
torch._dynamo, which every optimizer's first step imports) before it can build its replica, about
4 CPU-seconds each. A notebook that calls `fit` again, a script that runs a sweep of runs, or a test
suite that shares one cluster pays that again for every run. Here the driver keeps the workers of a
run that completed, each stripped of its replica (`TrainWorker.retire`), and the next run on the same
node takes them (`TrainWorker.rebuild` builds the new replica as a fresh actor would). A parameter-server
run's shards are kept the same way (`ParameterShard.retire` / `rebuild`, which runs the constructor
again: θ, optimizer, counters, rule, clocks, a task's own scheduler; strategies/ps_shard_group.py).
Sandblaster's shards (`SandblasterShard`) are kept likewise, pooled apart from the others (`kind`):
their constructor, run again, starts the accumulators and the L-BFGS history empty.

What makes a kept process safe to reuse:
- Only a completed run's workers are kept, and only those that retired cleanly: a failed, killed or
  interrupted run's actors are killed as before.
- A warm worker asks for no CPU of its own and is pinned to its bundle's node: the run's placement
  group still holds the run's CPUs, so the books are as before, and the process outlives the group.
  GPU workers are never kept (a GPU is granted to an actor for its lifetime). A warm run's shards are
  the same: each in a bundle that holds its CPUs (a Tune trial's or elastic run's shard bundles, or,
  for a run's own placement, a one-bundle group per shard steered to the node the shard would have
  gone to: `cluster.Placement.shards`), the actor itself zero-CPU and pinned to that node.
- Each kind is pooled apart (`kind`): a shard is handed only to a shard slot, and only one started
  with the same max_concurrency (Ray fixes it when the actor is created).
- `rebuild` restores torch's global RNG to its state at process start and imports a task file again.
- Runs on a Ray that distrain started for them (`distrain run` without `--address`) keep nothing: that
  Ray ends with the run.

`DISTRAIN_WARM_WORKERS` caps how many idle processes the driver keeps, workers and shards together
(default 8; 0 turns this off for both).
"""

from __future__ import annotations

import os
from typing import Any

import ray

WARM_ENV = "DISTRAIN_WARM_WORKERS"
DEFAULT_CAPACITY = 8
PING_TIMEOUT_S = 5.0  # a kept worker that does not answer this soon is dead or hung: killed, not used

WORKER = "worker"  # the kind of a TrainWorker (a shard's kind: strategies/ps_shard_group.py `pool_kind`)

_idle: dict[tuple[str, str], list[Any]] = {}  # (kind, node id) -> idle processes' handles
_session: str | None = None  # the Ray session those handles belong to
_taken: dict[str, int] = {}  # per kind, processes handed out again in this process (tests, the notice)


def shards_apply(elastic: bool) -> bool:
    """Whether a run's PS shards may come from and go to the pool: never under --workers MIN..MAX. An
    elastic run's membership re-places workers as nodes come and go; with kept shards (zero-CPU, pinned to
    the node of a bundle they outlive) there would be one more thing moving under it. A caution: the re-join
    after a node loss in test_elastic_bsp once blamed on kept shards happens without them too. Its shards
    start fresh, as before shards were kept."""
    return not elastic


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


def _idle_here() -> dict[tuple[str, str], list[Any]]:
    global _session
    session = _current_session()
    if session != _session:
        _idle.clear()
        _session = session
    return _idle


def take(node_id: str, kind: str = WORKER) -> Any | None:
    """An idle process of `kind` on `node_id` that still answers, or None (the caller starts a fresh one)."""
    idle = _idle_here().get((kind, node_id), [])
    while idle:
        worker = idle.pop()
        try:
            ray.get(worker.alive.remote(), timeout=PING_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            ray.kill(worker, no_restart=True)
            continue
        _taken[kind] = _taken.get(kind, 0) + 1
        return worker
    return None


def keep(workers: list[Any], nodes: list[str], kind: str = WORKER) -> list[Any]:
    """Keep `workers` (retired processes of `kind`, on `nodes`) idle, as many as there is room for;
    returns those kept (the caller kills the rest)."""
    idle = _idle_here()
    room = capacity() - sum(len(v) for v in idle.values())
    kept = workers[: max(0, room)]
    for worker, node in zip(kept, nodes, strict=False):
        idle.setdefault((kind, node), []).append(worker)
    return kept


def idle_count(kind: str | None = WORKER) -> int:
    """Idle processes of `kind` (None: of every kind)."""
    if not ray.is_initialized():
        return 0
    return sum(len(v) for (k, _), v in _idle_here().items() if kind is None or k == kind)


def taken(kind: str = WORKER) -> int:
    return _taken.get(kind, 0)


def release(keep_kind: str | None = None) -> None:
    """Kill every idle process (their memory back to the node), or every one not of `keep_kind`."""
    for key in [k for k in _idle if keep_kind is None or k[0] != keep_kind]:
        for process in _idle.pop(key):
            try:
                ray.kill(process, no_restart=True)
            except Exception:  # noqa: BLE001 - gone with its session already
                pass
