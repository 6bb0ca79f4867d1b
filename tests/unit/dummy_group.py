"""A `WorkerGroup` (orchestrator/controller/group.py) in plain Python, for driving the controller
without Ray or torch.distributed: each worker "trains" a unit by adding one to its model's single
weight, so the model's value is the number of steps applied since the start (what a restore point
and a checkpoint carry), and every row is a deterministic function of its unit.

Faults are scripted: `die` kills a worker as it reaches a global step (its later calls raise
`RunLost`, as a dead actor's do), `shard_dies_at` kills the parameter-server shards there, the chaos
faults of `--chaos` kill or hang a worker through the same books, `interrupt_at` raises
KeyboardInterrupt from the wait once that many steps are done (SIGINT reaching the driver), and
`placed` says which slots an elastic run has room for from which step on.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from distrain.config import RunConfig
from distrain.orchestrator.chaos import ChaosMonkey
from distrain.orchestrator.controller.group import PhaseSetup
from distrain.orchestrator.recovery import RunLost
from distrain.orchestrator.resume import steps_per_epoch
from distrain.strategies.strategy_lookup import strategy_class


@dataclass
class Worker:
    rank: int
    incarnation: int  # how many workers this slot has had, this one included
    value: float = 0.0  # the model's one weight: steps applied
    alive: bool = True
    hung: bool = False


@dataclass
class Call:
    kind: str
    rank: int
    payload: Any
    worker: Worker


class Faults:
    """--chaos on the dummy's workers (orchestrator/chaos.py `Faults`)."""

    def kill(self, actor: Worker) -> None:
        actor.alive = False

    def hang(self, actor: Worker) -> None:
        actor.hung = True

    def kill_node(self, workers: list[Any]) -> tuple[str | None, str | None]:
        return None, "the dummy group has one node"


@dataclass
class DummyGroup:
    config: RunConfig
    die: dict[int, int] = field(default_factory=dict)  # rank -> its worker dies at its first unit from that step (once)
    shard_dies_at: int | None = None  # the shards die once this global step is reached
    interrupt_at: int | None = None  # KeyboardInterrupt from `wait` once this many steps are done
    placed: dict[int, int] = field(default_factory=dict)  # elastic: slot -> steps done before it is placed
    clockless: bool = False  # rows carry no clock, as backup tasks' portions do

    def __post_init__(self) -> None:
        self.workers: dict[int, Worker] = {}
        self.incarnations: Counter[int] = Counter()
        self.calls: dict[int, Call] = {}
        self.ids = itertools.count()
        self.log: list[tuple[str, Any]] = []  # what the controller asked, in order
        self.trained: Counter[tuple[int, int]] = Counter()  # (global step, slice) -> times trained
        self.units_by_rank: Counter[int] = Counter()  # units each slot's workers trained
        self.steps_done = 0  # the most global steps any worker has completed
        self.shards = False
        self.shards_dead = False
        self.clocks: list[int] = [0] * self.config.num_worker_actors
        self.spe = steps_per_epoch(self.config)
        self.restarts = 0

    # ------------------------------------------------------------------ workers
    def members(self) -> list[int]:
        return sorted(self.workers)  # a dead worker is a member until the controller learns of it

    def placed_ranks(self) -> list[int]:
        if not self.config.elastic:
            return list(range(self.config.num_worker_actors))
        return sorted(r for r, at in self.placed.items() if self.steps_done >= at)

    def ready_ranks(self) -> list[int]:  # the elastic placement's question (orchestrator/membership.py)
        return self.placed_ranks()

    def renew(self, rank: int) -> None:
        self.log.append(("renew", rank))
        self.placed[rank] = self.steps_done + 10**9  # no room again for it in this test

    def node_of(self, rank: int) -> str:
        return "node-0"

    def start(self, ranks: list[int]) -> None:
        self.log.append(("start", list(ranks)))
        for rank in ranks:
            self.incarnations[rank] += 1
            self.workers[rank] = Worker(rank, self.incarnations[rank])

    def describe(self, ranks: list[int], timeout: float) -> list[dict[str, Any]]:
        return [{"steps_per_epoch": self.spe, "num_params": 1, "node_id": "node-0"} for _ in ranks]

    def load_state(self, ranks: list[int], state: dict[str, Any], timeout: float, per_rank=None) -> None:
        self.log.append(("load_state", float(state["model"]["w"])))
        if per_rank:  # each rank's own codec state (orchestrator/channel_checkpoint.py)
            self.log.append(("load_channel", {r: per_rank[r]["channel"]["grads"]["residual"].tolist() for r in ranks}))
        for rank in ranks:
            self.workers[rank].value = float(state["model"]["w"])

    def enter_phase(self, phase, optimizer, counters, start_step, steps_per_epoch) -> PhaseSetup:
        self.log.append(("enter_phase", phase.strategy))
        rule = strategy_class(phase.strategy).implementation(phase).ps_rule(phase)
        if rule is None:
            return PhaseSetup()
        self.shards, self.shards_dead = True, False
        self.clocks = [start_step] * self.config.num_worker_actors
        return PhaseSetup(rule.mode, list(self.clocks), 0)

    def leave_phase(self, timeout: float) -> None:
        self.shards = False

    def state(self, rank: int, timeout: float | None) -> dict[str, Any]:
        worker = self._alive(rank)
        return {"model": {"w": torch.tensor([worker.value])}, "optimizer": {"vectors": {}, "scalars": {}}}

    def submit(self, kind: str, rank: int, payload: Any, whole_test_set: bool = False) -> int:
        handle = next(self.ids)
        self.calls[handle] = Call(kind, rank, payload, self.workers[rank])
        self.log.append((kind, rank))
        return handle

    def set_up(self, rank: int, phase: RunConfig) -> int:
        handle = next(self.ids)
        self.calls[handle] = Call("setup", rank, None, self.workers[rank])
        self.log.append(("setup", rank))
        return handle

    def wait(self, handles: list[int], timeout: float, num_returns: int = 1) -> list[int]:
        """Ready: a dead worker's calls first (Ray reports an actor's death at once); then each live
        worker's oldest call (an actor runs its calls in order), a collective segment only once every
        live member has trained the steps before it (the all-reduce holds the group in lock-step)."""
        if self.interrupt_at is not None and self.steps_done >= self.interrupt_at:
            self.interrupt_at = None
            raise KeyboardInterrupt
        dead = [h for h in sorted(handles) if not self.calls[h].worker.alive]
        oldest: dict[int, int] = {}
        for h in sorted(self.calls):
            oldest.setdefault(id(self.calls[h].worker), h)
        live = [h for h in sorted(handles) if h in oldest.values() and h not in dead and self._can_run(self.calls[h])]
        return (dead + live)[:num_returns]

    def _can_run(self, call: Call) -> bool:
        if call.worker.hung:
            return False
        if call.kind != "segment" or self.config.transport != "collective":
            return True
        epoch, step, _ = call.payload[0]
        first = epoch * self.spe + step
        return all(w.value >= first for w in self.workers.values() if w.alive)

    def result(self, handle: int, rank: int, timeout: float | None = None) -> Any:
        call = self.calls.pop(handle)
        worker = call.worker
        if not worker.alive:
            raise RunLost("worker", rank, "ActorDiedError")
        if call.kind == "setup":
            return None
        if call.kind == "state":
            return self.state(rank, timeout)
        if call.kind == "eval":
            return ({"loss": (worker.value, 1.0), "correct": (1.0, 1.0)}, 0.01)
        return self._segment(worker, call.payload)

    def _segment(self, worker: Worker, units: list[tuple[int, int, int]]) -> dict[str, list[Any]]:
        rows: dict[str, list[Any]] = {c: [] for c in ("worker", "step", "slice", "epoch", "loss", "lr", "samples")}
        rows |= {c: [] for c in ("compute_s", "comm_s", "wall_time", "clock")}
        for epoch, step, slice_ in units:
            global_step = epoch * self.spe + step
            if self.config.transport == "collective" and any(not w.alive for w in self.workers.values()):
                raise RunLost("worker", None, "a peer of the collective group went away")
            if self.shards and self.shards_dead:
                raise RunLost("shard", None, "a parameter-server shard died")
            if worker.rank in self.die and global_step >= self.die[worker.rank]:
                del self.die[worker.rank]
                worker.alive = False
                raise RunLost("worker", worker.rank, "ActorDiedError")
            if self.shard_dies_at is not None and global_step >= self.shard_dies_at and self.shards:
                self.shard_dies_at, self.shards_dead = None, True
                raise RunLost("shard", None, "a parameter-server shard died")
            worker.value += 1
            self.trained[(global_step, slice_)] += 1
            self.units_by_rank[worker.rank] += 1
            self.steps_done = max(self.steps_done, global_step + 1)
            self.clocks[worker.rank] += 1
            values = [worker.rank, global_step, slice_, epoch, 1.0 / (1 + global_step), 0.1, 32]
            values += [0.01, 0.0, float(global_step), None if self.clockless else self.clocks[worker.rank]]
            for column, value in zip(rows, values, strict=True):
                rows[column].append(value)
        end, every = (rows["step"][-1] + 1 if rows["step"] else 0), self.config.checkpoint_steps
        total = self.config.epochs * self.spe
        total = min(total, self.config.max_steps) if self.config.max_steps else total
        if self.config.compress and end and ((every and end % every == 0) or end == total):
            # as TrainWorker ships its channel's state with a segment that ends at a checkpoint: the rank's own
            rows["channel_state"] = [{"step": end, "state": {"grads": {"residual": torch.tensor([worker.rank, end])}}}]
        return rows

    def _alive(self, rank: int) -> Worker:
        worker = self.workers[rank]
        if not worker.alive:
            raise RunLost("worker", rank, "ActorDiedError")
        return worker

    def discard(self, handles: list[int], timeout: float) -> None:
        for handle in handles:
            self.calls.pop(handle, None)

    def kill(self, rank: int) -> None:
        self.log.append(("kill", rank))
        self.workers[rank].alive = False
        del self.workers[rank]

    def host_alive(self, rank: int | None) -> bool:
        return rank is not None

    # ------------------------------------------------------------------ shards
    def has_shards(self) -> bool:
        return self.shards

    def shard_counters(self) -> list[dict[str, Any]]:
        if self.shards_dead:
            raise RunLost("shard", None, "a parameter-server shard died")
        return [{"version": max(self.clocks), "clocks": list(self.clocks)}]

    def rebase_clock(self, rank: int, clock: int) -> None:
        self.log.append(("rebase_clock", (rank, clock)))
        self.clocks[rank] = clock

    def set_members(self, members: list[int]) -> None:
        self.log.append(("set_members", list(members)))

    def set_round_members(self, members: list[int], entering: list[int], start: int) -> bool:
        return True

    def worker_lost(self, rank: int, timeout: float) -> None:
        pass

    def mark_slow(self, ranks: list[int]) -> None:
        pass

    def strike(self, chaos: ChaosMonkey, steps_done: int) -> None:
        slots = [self.workers.get(r) for r in range(self.config.num_worker_actors)]
        chaos.strike(steps_done, slots, [], faults=Faults())

    # ------------------------------------------------------------------ the end
    def actor_figures(self, config: RunConfig) -> dict[str, Any] | None:
        return {}

    def shard_nodes(self) -> list[str]:
        return []

    def shutdown(self) -> None:
        self.log.append(("shutdown", None))

    def kill_all(self) -> None:
        self.log.append(("kill_all", None))
        for worker in self.workers.values():
            worker.alive = False

    def restart(self) -> None:
        self.log.append(("restart", None))
        self.restarts += 1
        self.workers.clear()
        self.shards, self.shards_dead = False, False
