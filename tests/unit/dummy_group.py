"""A `WorkerGroup` (orchestrator/controller/group.py) in plain Python, for driving the controller
without Ray or torch.distributed: each worker "trains" a unit by adding one to its model's single
weight, so the model's value is the number of steps applied since the start (what a restore point
and a checkpoint carry), and every row is a deterministic function of its unit.

Faults are scripted: `die` kills a worker as it reaches a global step (its later calls raise
`RunLost`, as a dead actor's do), `shard_dies_at` kills the parameter-server shards there, the chaos
faults of `--chaos` kill or hang a worker through the same books, `interrupt_at` raises
KeyboardInterrupt from the wait once that many steps are done (SIGINT reaching the driver),
`placed` says which slots an elastic run has room for from which step on, and `drain` which slots'
node is drained (preempted) from which step on.

An elastic run over the collective transport trains in lock-step blocks: the block's segment calls run
together, round by round (`_run_block`), the model's weight then counting the group's updates; a
member that dies in a round breaks it for everyone (the survivors return the rounds before it and
`broken`, as strategies/elastic_group.py's `GroupBroken` does), and a re-form gives every member the
source's weight (its digest: the weight).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from distrain.config import RunConfig
from distrain.orchestrator.chaos import ChaosMonkey
from distrain.orchestrator.checkpoint_schedule import CheckpointSchedule
from distrain.orchestrator.controller.group import PhaseSetup
from distrain.orchestrator.recovery import RunLost
from distrain.orchestrator.resume import steps_per_epoch
from distrain.strategies.strategy_lookup import strategy_class


def empty_rows() -> dict[str, list[Any]]:
    """A segment's result: the metrics rows' columns, no row yet."""
    columns = ("worker", "step", "slice", "epoch", "loss", "lr", "samples", "compute_s", "comm_s", "wall_time")
    return {column: [] for column in (*columns, "clock")}


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
    outcome: Any = None  # an elastic collective block's segment: its result, computed with the block's others
    splits: tuple[str, ...] = ("val",)  # an evaluation's: what it scores


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
    drain: dict[int, int] = field(default_factory=dict)  # elastic: slot -> steps done before its node drains
    room_again: bool = False  # elastic: a slot given back is placed again at once (else never again)

    def __post_init__(self) -> None:
        self.workers: dict[int, Worker] = {}
        self.incarnations: Counter[int] = Counter()
        self.calls: dict[int, Call] = {}
        self.ids = itertools.count()
        self.log: list[tuple[str, Any]] = []  # what the controller asked, in order
        self.evaluations: list[tuple[int, tuple[str, ...]]] = []  # (epoch, splits) of each evaluation call
        self.trained: Counter[tuple[int, int]] = Counter()  # (global step, slice) -> times trained
        self.units_by_rank: Counter[int] = Counter()  # units each slot's workers trained
        self.steps_done = 0  # the most global steps any worker has completed
        self.shards = False
        self.shards_dead = False
        self.clocks: list[int] = [0] * self.config.num_worker_actors
        self.spe = steps_per_epoch(self.config)
        self.restarts = 0
        self.joining: dict[int, Worker] = {}  # elastic collective: slot -> a worker built, not a member yet
        self.blocks = self.config.elastic and self.config.transport == "collective"

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
        self.placed[rank] = self.steps_done if self.room_again else self.steps_done + 10**9

    def node_of(self, rank: int) -> str:
        return f"node-{rank}" if rank in self.drain else "node-0"

    def draining_nodes(self) -> set[str]:
        return {f"node-{rank}" for rank, at in self.drain.items() if self.steps_done >= at}

    def start(self, ranks: list[int]) -> None:
        self.log.append(("start", list(ranks)))
        for rank in ranks:
            self.incarnations[rank] += 1
            self.workers[rank] = Worker(rank, self.incarnations[rank])

    def describe(self, ranks: list[int], timeout: float) -> list[dict[str, Any]]:
        val_is_test = self.config.val_fraction == 0  # the built-in task without a validation split of its own
        info = {"steps_per_epoch": self.spe, "num_params": 1, "node_id": "node-0", "val_is_test": val_is_test}
        return [dict(info) for _ in ranks]

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

    def channel_state(self, rank: int, timeout: float | None) -> dict[str, Any]:
        """As a segment ships it: the residual (rank, steps its worker applied)."""
        worker = self._alive(rank)
        self.log.append(("channel_state", rank))
        return {"grads": {"residual": torch.tensor([rank, int(worker.value)])}} if self.config.compress else {}

    def submit(
        self,
        kind: str,
        rank: int,
        payload: Any,
        whole_test_set: bool = False,
        shares: tuple[int, ...] | None = None,
        splits: tuple[str, ...] = ("val",),
    ) -> int:
        handle = next(self.ids)
        self.calls[handle] = Call(kind, rank, payload, self.workers[rank], splits=splits)
        self.log.append((kind, rank))
        if kind == "eval":
            self.evaluations.append((payload, splits))
        return handle

    def set_up(self, rank: int, phase: RunConfig, rendezvous: str = "") -> int:
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
        if self.blocks:
            self._run_block()
        dead = [h for h in sorted(handles) if not self.calls[h].worker.alive]
        oldest: dict[int, int] = {}
        for h in sorted(self.calls):
            oldest.setdefault(id(self.calls[h].worker), h)
        live = [h for h in sorted(handles) if h in oldest.values() and h not in dead and self._can_run(self.calls[h])]
        return (dead + live)[:num_returns]

    def _can_run(self, call: Call) -> bool:
        if call.worker.hung:
            return False
        if call.outcome is not None:  # its block has run
            return True
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
        if call.kind in ("setup", "describe"):
            return None
        if call.kind == "reform":
            return self._reformed(call)
        if call.outcome is not None:
            return call.outcome
        if call.kind == "state":
            return self.state(rank, timeout)
        if call.kind == "eval":
            # the validation loss: the steps this worker applied; the test set's: ten times that
            scored = {"val": (worker.value, 1.0), "test": (10.0 * worker.value, 1.0)}
            return ({s: {"loss": scored[s], "correct": (1.0, 1.0)} for s in call.splits}, 0.01)
        return self._segment(worker, call.payload)

    def _segment(self, worker: Worker, units: list[tuple[int, int, int]]) -> dict[str, list[Any]]:
        rows = empty_rows()
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
            self._train(worker, (epoch, step, slice_), rows)
        end = rows["step"][-1] + 1 if rows["step"] else 0
        if self.config.compress and CheckpointSchedule.of_run(self.config, self.spe).taken_after(end):
            # as TrainWorker ships its channel's state with a segment that ends at a checkpoint: the rank's own
            rows["channel_state"] = [{"step": end, "state": {"grads": {"residual": torch.tensor([worker.rank, end])}}}]
        return rows

    def _train(self, worker: Worker, unit: tuple[int, int, int], rows: dict[str, list[Any]]) -> None:
        """Book `worker`'s training of `unit` and append its row to `rows`."""
        epoch, step, slice_ = unit
        global_step = epoch * self.spe + step
        self.trained[(global_step, slice_)] += 1
        self.units_by_rank[worker.rank] += 1
        self.steps_done = max(self.steps_done, global_step + 1)
        self.clocks[worker.rank] += 1
        values = [worker.rank, global_step, slice_, epoch, 1.0 / (1 + global_step), 0.1, 32]
        values += [0.01, 0.0, float(global_step), None if self.clockless else self.clocks[worker.rank]]
        for column, value in zip(rows, values, strict=True):
            rows[column].append(value)

    def _run_block(self) -> None:
        """The elastic collective block submitted last (its segment calls not run yet), in lock-step
        rounds: each round every member applies the round's one update (a placeholder unit, slice -1,
        trains nothing but takes part); a member due to die in a round (or killed before it) breaks
        that round and the rest for every member."""
        block = [call for call in self.calls.values() if call.kind == "segment" and call.outcome is None]
        if not block:
            return
        for call in block:
            call.outcome = empty_rows()
        for i in range(len(block[0].payload)):
            for call in block:
                epoch, step, slice_ = call.payload[i]
                due = self.die.get(call.worker.rank)
                if slice_ >= 0 and due is not None and epoch * self.spe + step >= due:
                    del self.die[call.worker.rank]
                    call.worker.alive = False
            if not all(call.worker.alive for call in block):  # the round's all-reduce fails on every survivor
                for call in block:
                    call.outcome["broken"] = [{"rounds": i}]
                return
            for call in block:
                call.worker.value += 1
                if call.payload[i][2] >= 0:
                    self._train(call.worker, call.payload[i], call.outcome)

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

    def end_process(self, rank: int) -> None:
        self.log.append(("end_process", rank))
        self.workers[rank].alive = False

    def host_alive(self, rank: int | None) -> bool:
        return rank is not None

    # ------------------------------------------------------------------ a collective group re-formed (elastic)
    def start_joiner(self, rank: int) -> int:
        self.log.append(("start_joiner", rank))
        self.incarnations[rank] += 1
        self.joining[rank] = worker = Worker(rank, self.incarnations[rank])
        handle = next(self.ids)
        self.calls[handle] = Call("describe", rank, None, worker)
        return handle

    def admit(self, rank: int, handle: int, phase: RunConfig, timeout: float) -> bool:
        worker = self.joining.pop(rank)
        self.calls.pop(handle, None)
        if not worker.alive:
            return False
        self.log.append(("admit", rank))
        self.workers[rank] = worker
        return True

    def rendezvous_address(self, rank: int) -> str:
        self._alive(rank)
        return f"dummy://{rank}/{next(self.ids)}"

    def reform(self, rank: int, address: str, index: int, size: int, source: int) -> int:
        """The state comes from group rank `source` of the members (group ranks in `members()` order)."""
        self.log.append(("reform", (rank, self.members()[source])))
        handle = next(self.ids)
        self.calls[handle] = Call(
            "reform", rank, (self.workers[self.members()[source]], self.workers[rank].value), self.workers[rank]
        )
        return handle

    def _reformed(self, call: Call) -> dict[str, Any]:
        source, before = call.payload
        call.worker.value = source.value
        return {"before": f"{before:g}", "after": f"{source.value:g}", "seconds": 0.0}

    def probe(self, rank: int, timeout: float) -> RunLost | None:
        worker = self.workers[rank]
        if not worker.alive:
            return RunLost("worker", rank, "ActorDiedError")
        return RunLost("hang", rank, "no answer before the re-form") if worker.hung else None

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
        self.joining.clear()
        self.shards, self.shards_dead = False, False
