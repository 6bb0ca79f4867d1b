"""A parameter-server shard: one contiguous slice of θ, its optimizer state, a version, worker clocks.

Hosted as a Ray *async* actor (see `strategies/ps_shard_group.py`). Every consistency rule is enforced here,
with one `asyncio.Condition`: a worker's combined push-then-pull call waits on it, and every update
notifies it. No worker ever polls.

Rules (`ConsistencyRule`, definitions in shared/reference/algorithms.md):
- "rounds" (BSP over the PS): round t collects one gradient tagged t from each of the N workers, then
  applies their mean in one optimizer step and opens round t+1; each push returns θ_{t+1}.
  With backup workers (k-of-n, Chen et al. 2016) N + b workers push, the round closes on the first
  N gradients tagged t (mean over those N, summed in rank order), and a gradient tagged with a
  closed round is dropped and counted; its pusher gets the current θ at once and skips ahead.
  Shards decide independently (as TensorFlow's SyncReplicasOptimizer's accumulators do): a worker
  late at one shard may be on time at another. Not so across cut replicas (--fsdp D, rule.parts = D):
  a client (a replica) pushes piece d of its gradient to shard d alone, so shards deciding apart would
  apply different replicas' gradients to different chunks of one model. There one `RoundReferee` (held by
  shard 0, asked by every shard) decides each round once: a replica counts when all D of its pieces have
  arrived, the first N such close the round, and every shard applies those N and drops the others.
  Under a range across cut replicas the referee decides every round too (k = members - b of the round's
  members, b = 0 without backups), from shard 0's members: the driver tells shard 0 of a change first
  (orchestrator/controller/ray_group.py), its referee decides again, and the other shards apply only
  its answers (a leaver's piece stays at shard d until then: a decision taken before the leave may
  count it; a round closed by the change alone is learnt from shard 0, `_catch_up`).
  Under --workers MIN..MAX (`set_round_members`) a round closes on the pushes of the ranks that are
  members *of that round*: the driver's current members, each from the round it entered at (a joiner,
  or a member fed again after it had no work, enters at a round boundary the driver names); under
  k-of-n on the first k = members - b of them. Its rate is rescaled for the round's global batch
  (`_round_rate`), and a leaver's gradient still waiting in the open round is taken out.
- "portion-rounds" (backup tasks): round t is split into P portions, computed by whoever is free (the
  orchestrator's scheduler hands them out, in chunks of portions in a row, and re-issues the last
  outstanding ones). A shard keeps the first gradient of each chunk of the open round (a chunk's
  gradient is the mean over its portions' samples), drops copies and stale rounds, and applies the
  mean of the chunk gradients weighted by their portions (= the global batch's mean gradient) once
  all P portions have arrived.
- "bounded" (SSP, and async as SSP with no bound): each gradient is applied on arrival at rate
  η/N (the global-batch rate split over the N contributions, so N pushes move θ as one BSP step
  would), optionally divided by its staleness τ = t_apply - t_read (τ > 1). The pull that follows
  a push from a worker at clock c waits while c - min_j c_j > s.

A push may carry no gradient (None): the worker's step was skipped under --on-nonfinite skip. It
counts as taking part (a round or portion closes with it, the clock advances) but contributes
nothing: a round applies the mean of the gradients it did get, and none at all means no update.

A task's own scheduler (`Task.configure_optimizers`) steps once per update applied here (`_apply`), as
a replica's steps once per optimizer step: a round that closes empty (every gradient skipped, or an
elastic round without members) moves the version but applies no update, so it does not move the rates,
as a skipped step does not on a replica. Its position is therefore its own counter, not the version:
`snapshot` and `restore` carry it, and a run going on from a checkpoint gives it back with the
counters (`set_counters`).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from distrain.actor_process import freeze_loaded_libraries
from distrain.strategies.consistency import ConsistencyRule  # noqa: F401 - the shards' rules, re-exported
from distrain.trainers.optim_state import (
    FlatOptimizerState,
    export_flat_state,
    import_flat_state,
    make_optimizer,
)
from distrain.trainers.schedule import scaled_lr

# torch's global RNG as this process started (a warm shard's `rebuild` puts it back: a fresh one's draws).
_START_RNG = torch.get_rng_state()


def decoded(grad: Any) -> np.ndarray | None:
    """A pushed gradient slice: as sent, or, under --compress, a (codec, Encoded) pair decoded here."""
    if grad is None or isinstance(grad, np.ndarray):
        return grad
    codec, encoded = grad
    return _codec(codec).decode(encoded).numpy()


@functools.cache
def _codec(text: str) -> Any:
    from distrain.compression import parse_codec

    spec = parse_codec(text)
    assert spec is not None
    return spec.build()


@dataclass
class OptimizerSpec:
    name: str
    momentum: float | None
    weight_decay: float | None
    args: dict[str, Any] = field(default_factory=dict)  # --optimizer-arg: further constructor arguments
    # A user task's run config: the shard builds the task and, where it defines `configure_optimizers`
    # (declared element-wise: orchestrator/run_checks.py refuses the rest), steps its slice with that.
    task_config: Any = None
    task_builder: Any = None  # config -> task (orchestrator/tasks.py's build_task, passed down)


@dataclass
class Reply:
    """What a push-pull (or a pull) returns to the worker for this shard."""

    theta: np.ndarray
    version: int  # updates applied to this shard so far: the read version of the next gradient
    applied_version: int  # version at which this push's gradient was applied (-1 for a plain pull)
    lag: int  # t_apply - t_read of this push (0 for a plain pull)
    wait_s: float  # seconds the call spent blocked by the consistency rule
    clock: int  # the worker's clock after this push
    min_clock: int  # slowest worker's clock when the pull completed
    dropped: bool = False  # the gradient was late (k-of-n) and not applied


class RoundReferee:
    """Decides k-of-n rounds for every shard when each client's gradient comes in `parts` pieces, piece d
    to shard d (cut replicas: strategies/sharded_ps.py). A shard reports each piece it took for the open
    round (`agree`) and gets back the round's clients: a client is complete once all its pieces are
    reported, and the first `accept` complete clients, in the order they completed, are the round's, the
    same answer to every shard. A client in the answer has had its piece reported by every shard before
    the decision, so every shard holds the gradients it is told to apply.

    Elastic rounds (--workers MIN..MAX, `members_of` given): a round's clients are the first
    max(1, members - `backups`) complete clients among the members *of that round* (`members_of(round)`,
    shard 0's view, which is the first to hear of a change: orchestrator/controller/ray_group.py), and a
    piece from a client that is no member of its round is answered None at once (not counted: a
    leaver's push still on its way). A membership change (`members_changed`) takes the leavers' pieces
    out of the open rounds and decides again: the round may close now, and a round without a member
    closes empty ([]) while some member is entered at a later one.

    Only the newest decision is ever asked about again: a shard asks about round t while its version is t,
    and round t + 1 can be decided only once every shard has taken a piece of it (so has applied round t).
    """

    KEEP = 4  # decided rounds kept (only the newest is needed; a few more cost nothing)

    def __init__(
        self,
        accept: int,
        parts: int,
        members_of: Callable[[int], set[int] | None] | None = None,
        backups: int = 0,
        has_members: Callable[[], bool] | None = None,
    ) -> None:
        """`members_of(round)`: elastic, that round's members (None: every client, a fixed `accept`);
        `has_members()`: whether any member is in the rounds at all (an empty round closes only then)."""
        self.accept, self.parts = accept, parts
        self.members_of, self.backups, self.has_members = members_of, backups, has_members
        self.pieces: dict[int, dict[int, set[int]]] = {}  # open rounds: client -> the pieces reported
        self.complete: dict[int, list[int]] = {}  # open rounds: clients complete, in the order they completed
        self.decided: dict[int, list[int]] = {}  # round -> its clients (sorted)
        self.changed = asyncio.Condition()

    async def agree(self, round_: int, client: int, part: int) -> list[int] | None:
        """Piece `part` of `client`'s gradient for `round_` is at its shard; the round's clients once decided
        (elastic: None at once for a client that is no member of the round)."""
        async with self.changed:
            if round_ not in self.decided:
                members = self._members(round_)
                if members is not None and client not in members:
                    return None
                pieces = self.pieces.setdefault(round_, {}).setdefault(client, set())
                pieces.add(part)
                if len(pieces) == self.parts:
                    self.complete.setdefault(round_, []).append(client)
                    self._decide(round_)
                await self.changed.wait_for(lambda: round_ in self.decided)
            return self.decided[round_]

    def decision(self, round_: int) -> list[int] | None:
        """`round_`'s clients if it is decided, else None (never waits)."""
        return self.decided.get(round_)

    async def members_changed(self, open_round: int) -> None:
        """Elastic: the members changed (the holder's `members_of` answers the new ones). The leavers' pieces
        stop counting in the open rounds, and the rounds from `open_round` (the holder's) are decided again:
        one may close now, and rounds without a member close empty while a later round has one."""
        async with self.changed:
            self._members_changed(open_round)

    def _members_changed(self, open_round: int) -> None:
        for round_ in sorted(self.pieces):
            members = self._members(round_) or set()
            for client in [c for c in self.pieces[round_] if c not in members]:
                del self.pieces[round_][client]
            if round_ in self.complete:
                self.complete[round_] = [c for c in self.complete[round_] if c in members]
        round_ = open_round
        while True:
            if round_ in self.decided:
                round_ += 1
                continue
            if not self._decide(round_):
                break
            round_ += 1
        self.changed.notify_all()

    def _members(self, round_: int) -> set[int] | None:
        return None if self.members_of is None else self.members_of(round_)

    def _decide(self, round_: int) -> bool:
        """Close `round_` if its clients are there (elastic: or it has no member); True if it closed."""
        done = self.complete.get(round_, [])
        members = self._members(round_)
        if members is None:
            if len(done) < self.accept:
                return False
            chosen = done[: self.accept]
        elif not members:  # no member of this round: it closes empty while some member is entered later
            if self.has_members is None or not self.has_members():
                return False
            chosen = []
        else:
            need = max(1, len(members) - self.backups)
            counted = [c for c in done if c in members]
            if len(counted) < need:
                return False
            chosen = counted[:need]
        self.decided[round_] = sorted(chosen)
        self.pieces.pop(round_, None)
        self.complete.pop(round_, None)
        for old in [r for r in self.decided if r <= round_ - self.KEEP]:
            del self.decided[old]
        self.changed.notify_all()
        return True

    async def clear(self) -> None:
        """Forget every round (the shards were restored: their rounds start again)."""
        async with self.changed:
            self.pieces.clear()
            self.complete.clear()
            self.decided.clear()


class ParameterShard:
    def __init__(
        self,
        shard_id: int,
        num_workers: int,
        rule: ConsistencyRule,
        optimizer: OptimizerSpec,
        theta: np.ndarray,
        optimizer_state: dict[str, Any] | None = None,
        referee: Any = None,
    ) -> None:
        """`referee` (rules with `parts` > 1 only): shard 0's actor handle, which decides the rounds for
        every shard (`RoundReferee`); shard 0 itself holds the referee and takes None."""
        freeze_loaded_libraries()  # `retire`'s garbage collection then scans only the runs' objects
        torch.set_num_threads(1)
        self.shard_id = shard_id
        self.num_workers = num_workers
        self.rule = rule
        self.param = nn.Parameter(torch.from_numpy(np.array(theta, dtype=np.float32, copy=True)))
        self.grad_tensor = torch.zeros_like(self.param)
        self.theta = self.param.detach().numpy()  # shares memory with the parameter
        self.grad = self.grad_tensor.numpy()  # where a BSP round sums its gradients
        own = None
        if optimizer.task_config is not None:
            from distrain.trainers.own_optimizer import build_own

            own = build_own(optimizer.task_builder(optimizer.task_config), [self.param])
        self.own_optimizer, self.scheduler = own is not None, None if own is None else own[1]
        if own is not None:  # stepped at its own rates, its scheduler once per update applied here
            self.optimizer = own[0]
        else:
            self.optimizer = make_optimizer(
                optimizer.name, [self.param], 0.0, optimizer.momentum, optimizer.weight_decay, optimizer.args
            )
        if optimizer_state is not None:
            import_flat_state(self.optimizer, [self.param], FlatOptimizerState.from_dict(optimizer_state))
        self.version = 0
        self.clocks = [0] * num_workers
        # The ranks with a worker now (--workers MIN..MAX): the bound holds among their clocks only, so
        # nobody waits on an empty slot. None: every rank (a fixed-size run).
        self.members: list[int] | None = None
        self.round: dict[int, np.ndarray | None] = {}  # rounds: by worker; portions: by chunk start
        self.chunks: dict[int, int] = {}  # portion-rounds: the open round's chunks, start -> portions
        self.changed = asyncio.Condition()
        self.updates_applied = 0
        self.accept = rule.accept or num_workers
        self.dropped = [0] * num_workers  # gradients not applied, per pushing worker
        self.round_members: list[list[int]] = []  # rounds/portions: whose gradients each update averaged
        # Elastic rounds (rule.slots > 0): the round each member entered at (it is in every round from
        # then on), and the rate of the last push (a round closed by a leave applies with it).
        self.elastic_rounds = rule.mode == "rounds" and rule.slots > 0
        self.enters: dict[int, int] = {}
        self.round_lr = 0.0
        # k-of-n across cut replicas, and elastic rounds across them: one decision per round for every
        # shard (`RoundReferee`, on shard 0, deciding elastic rounds from shard 0's members).
        self.agreed = rule.mode == "rounds" and (rule.accept is not None or self.elastic_rounds) and rule.parts > 1
        self.referee = None
        if self.agreed and shard_id == 0:
            if self.elastic_rounds:
                self.referee = RoundReferee(
                    self.accept, rule.parts, self._members_of, rule.backups, lambda: bool(self.members)
                )
            else:
                self.referee = RoundReferee(self.accept, rule.parts)
        self.referee_handle = referee
        if self.agreed and shard_id != 0 and referee is None:
            raise ValueError(f"shard {shard_id}: rounds agreed across {rule.parts} shards need shard 0's handle")

    # ------------------------------------------------------------------ the one hot path
    async def push_pull(self, worker: int, clock: int, grad: Any, lr: float, read_version: int) -> Reply:
        grad = decoded(grad)
        if self.agreed:
            return await self._push_agreed(worker, clock, grad, lr)
        async with self.changed:
            dropped = False
            if self.rule.mode == "rounds":
                applied, lag, wait_s = await self._push_round(worker, clock, grad, lr)
                dropped = applied < 0
            else:
                applied, lag, wait_s = await self._push_bounded(worker, clock, grad, lr, read_version)
            return Reply(
                self.theta.copy(),
                self.version,
                applied,
                lag,
                wait_s,
                self.clocks[worker],
                self._floor(),
                dropped,
            )

    async def _push_round(self, worker: int, clock: int, grad: np.ndarray | None, lr: float) -> tuple[int, int, float]:
        if self.elastic_rounds and self.members is not None and worker not in self.members:
            self.dropped[worker] += 1  # a leaver's push still on its way: its units are redone by others
            return -1, 0, 0.0
        if clock < self.version:  # k-of-n: round `clock` closed on the first N gradients; drop this one
            self.dropped[worker] += 1
            self.clocks[worker] = self.version
            return -1, self.version - clock, 0.0
        if clock > self.version:
            raise RuntimeError(f"shard {self.shard_id}: worker {worker} pushed for round {clock} in {self.version}")
        self.round[worker] = grad
        self.clocks[worker] = clock + 1
        self.round_lr = lr
        wait_s = 0.0
        if self._round_full():
            self._apply_mean(lr)
        else:
            t0 = time.perf_counter()
            await self.changed.wait_for(lambda: self.version > clock)
            wait_s = time.perf_counter() - t0
        self.clocks[worker] = max(self.clocks[worker], self.version)
        return clock, 0, wait_s

    async def _push_agreed(self, worker: int, clock: int, grad: np.ndarray | None, lr: float) -> Reply:
        """Rounds across cut replicas: take this piece of `worker`'s gradient into the open round, ask the
        referee which clients the round counts (waiting, without the lock, until it is decided), apply
        theirs if no push here has yet, and answer as `_push_round` does (dropped: not among them). Elastic:
        a client the referee finds no member of the round is dropped at once, and only the referee's
        answers close rounds here (a leaver's piece stays until then: the answer may count it)."""
        async with self.changed:
            if clock < self.version:  # the round was applied here without this client: dropped
                self.dropped[worker] += 1
                self.clocks[worker] = self.version
                return self._reply(worker, -1, self.version - clock, 0.0, True)
            if clock > self.version:
                raise RuntimeError(f"shard {self.shard_id}: worker {worker} pushed for round {clock} in {self.version}")
            self.round[worker] = grad
            self.clocks[worker] = clock + 1
            self.round_lr = lr
        t0 = time.perf_counter()
        members = await self.agree_remote(clock, worker)
        wait_s = time.perf_counter() - t0
        async with self.changed:
            if members is None:  # elastic: no member of round `clock` (a leaver's push still on its way)
                if self.version == clock and worker in self.round and self.round[worker] is grad:
                    del self.round[worker]  # never counted: the referee answers no decision with it
                self.dropped[worker] += 1
                return self._reply(worker, -1, 0, wait_s, True)
            self._apply_decided(clock, members, lr)
            self.clocks[worker] = max(self.clocks[worker], self.version)
            if worker not in members:
                self.dropped[worker] += 1
                return self._reply(worker, -1, self.version - clock, wait_s, True)
            return self._reply(worker, clock, 0, wait_s, False)

    def _apply_decided(self, round_: int, members: list[int], lr: float) -> None:
        """Apply the referee's answer for `round_` unless this shard has already (the first to hear applies):
        the mean of those clients' pieces, the others' discarded (an empty answer closes the round empty)."""
        if self.version != round_:
            return
        missing = [m for m in members if m not in self.round]
        if missing:
            raise RuntimeError(f"shard {self.shard_id}: round {round_} counts {missing}, whose pieces are not here")
        self.round = {m: self.round[m] for m in members}
        self._apply_mean(lr)

    def _members_of(self, round_: int) -> set[int] | None:
        """Elastic rounds (the referee's view, on shard 0): the members of `round_`, None before any are set."""
        if self.members is None:
            return None
        return {r for r in self.members if self.enters.get(r, 0) <= round_}

    async def agree_remote(self, round_: int, client: int) -> list[int] | None:
        """The referee's answer for this shard's piece: its own on shard 0, else shard 0's (an actor call)."""
        if self.referee is not None:
            return await self.referee.agree(round_, client, self.shard_id)
        return await self.referee_handle.agree.remote(round_, client, self.shard_id)

    async def agree(self, round_: int, client: int, part: int) -> list[int] | None:
        """Shard 0: another shard's piece reported to the referee (`RoundReferee.agree`)."""
        assert self.referee is not None, f"shard {self.shard_id} holds no referee"
        return await self.referee.agree(round_, client, part)

    async def decision(self, round_: int) -> list[int] | None:
        """Shard 0: the referee's answer for `round_` if decided, else None (never waits)."""
        assert self.referee is not None, f"shard {self.shard_id} holds no referee"
        return self.referee.decision(round_)

    def _reply(self, worker: int, applied: int, lag: int, wait_s: float, dropped: bool) -> Reply:
        return Reply(self.theta.copy(), self.version, applied, lag, wait_s, self.clocks[worker], self._floor(), dropped)

    def _round_full(self) -> bool:
        """Whether the open round has the gradients that close it: N (k of N + b under k-of-n), or,
        elastic, those of every member of this round (k = members - b of them)."""
        if not self.elastic_rounds or self.members is None:
            return len(self.round) == self.accept
        members = self._round_members()
        pushed = sum(1 for rank in self.round if rank in members)
        return pushed > 0 and pushed >= max(1, len(members) - self.rule.backups)

    def _round_members(self) -> set[int]:
        """Elastic: the ranks the open round waits for (members that entered at this round or before)."""
        return {r for r in self.members or () if self.enters.get(r, 0) <= self.version}

    def _round_rate(self, lr: float, gradients: int) -> float:
        """Elastic: the schedule's rate is for the global batch of `slots` workers' gradients (MAX x B);
        a round of `gradients` of them has a global batch that many x B, and its rate follows under the
        --lr-scaling rule (linear: x gradients/slots; sqrt: x its root; none: the same rate)."""
        if not self.elastic_rounds:
            return lr
        return scaled_lr(lr, gradients, self.rule.slots, self.rule.lr_scaling)

    def _apply_mean(self, lr: float) -> None:
        """Apply the mean of the gradients collected for the open round and open the next one.

        Summed in key order (rank, or portion), so the result does not depend on arrival order.
        """
        keys = sorted(self.round)
        lr = self._round_rate(lr, len(keys))
        given = [key for key in keys if self.round[key] is not None]  # None: a skipped (non-finite) step
        weight = self.chunks.get  # portion-rounds: a chunk counts its portions (others, and rounds: 1)
        if given:
            np.copyto(self.grad, self.round[given[0]])
            if weight(given[0], 1) != 1:
                self.grad *= weight(given[0], 1)
            for key in given[1:]:
                if weight(key, 1) == 1:
                    self.grad += self.round[key]
                else:
                    self.grad += weight(key, 1) * self.round[key]
            self.grad /= sum(weight(key, 1) for key in given)
        self.round.clear()
        if self.chunks:  # who made up the update: every portion, whatever chunk carried it
            keys = [p for key in keys for p in range(key, key + weight(key, 1))]
        self.chunks.clear()
        self.round_members.append(keys)
        if given:
            self._apply(lr)
        else:  # every gradient of the round was skipped: the round closes with θ unchanged
            self.version += 1
        self.changed.notify_all()

    async def push_portion(
        self, worker: int, tag: int, portion: int, grad: np.ndarray | None, lr: float, count: int = 1
    ) -> bool:
        """Backup tasks: offer the chunk of `count` portions from `portion` of round `tag` (its gradient the
        mean over their samples); True if it is the copy that counts.

        Never blocks: the pusher goes on to its next portion with the θ it holds.
        """
        async with self.changed:
            if tag != self.version or portion in self.round:
                if tag > self.version:
                    raise RuntimeError(f"shard {self.shard_id}: portion of round {tag} pushed in {self.version}")
                self.dropped[worker] += count  # a copy whose twin was first, or a round already applied
                return False
            mine = range(portion, portion + count)
            if any(start < mine.stop and portion < start + n for start, n in self.chunks.items()):
                raise RuntimeError(f"shard {self.shard_id}: chunk {portion}+{count} overlaps another of round {tag}")
            self.round[portion] = grad
            self.chunks[portion] = count
            if sum(self.chunks.values()) == self.rule.per_round:
                self._apply_mean(lr)
            return True

    async def pull_at(self, worker: int, version: int) -> Reply:
        """θ once this shard has applied `version` updates (backup tasks: the round's start)."""
        async with self.changed:
            t0 = time.perf_counter()
            await self.changed.wait_for(lambda: self.version >= version)
            wait_s = time.perf_counter() - t0
            return Reply(self.theta.copy(), self.version, -1, 0, wait_s, self.clocks[worker], self._floor())

    async def stats(self) -> dict[str, Any]:
        """What the rule did: gradients dropped per worker, and who made up each applied update."""
        async with self.changed:
            return {"dropped": list(self.dropped), "round_members": [list(m) for m in self.round_members]}

    async def _push_bounded(
        self, worker: int, clock: int, grad: np.ndarray | None, lr: float, read_version: int
    ) -> tuple[int, int, float]:
        applied = self.version
        lag = applied - read_version
        rate = lr / self.num_workers
        if self.rule.staleness_lr and lag > 1:
            rate /= lag
        if grad is not None:  # None: a skipped step, which only moves the clock
            self._apply(rate, grad)
        self.clocks[worker] = clock + 1
        self.changed.notify_all()
        wait_s = 0.0
        bound = self.rule.bound
        if bound is not None and self.clocks[worker] - self._floor() > bound:
            t0 = time.perf_counter()
            await self.changed.wait_for(lambda: self.clocks[worker] - self._floor() <= bound)
            wait_s = time.perf_counter() - t0
        return applied, lag, wait_s

    def _apply(self, lr: float, grad: np.ndarray | None = None) -> None:
        """One optimizer step with `grad` (default: the shard's own buffer, where rounds sum)."""
        if grad is not None:
            # Step straight from the pushed (read-only, zero-copy) array: torch's optimizers only
            # read `.grad`, so this saves copying the slice once more.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.param.grad = torch.from_numpy(grad)
        else:
            self.param.grad = self.grad_tensor
        if not self.own_optimizer:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.version += 1
        self.updates_applied += 1

    # ------------------------------------------------------------------ reads and state
    async def pull(self, worker: int) -> Reply:
        """A read outside the step (start, evaluation): never blocks."""
        async with self.changed:
            return Reply(self.theta.copy(), self.version, -1, 0, 0.0, self.clocks[worker], self._floor())

    def node_id(self) -> str:
        """The Ray node hosting this shard (placement checks)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def snapshot(self) -> dict[str, Any]:
        async with self.changed:
            snap = {
                "shard_id": self.shard_id,
                "theta": self.theta.copy(),
                "optimizer": export_flat_state(self.optimizer, [self.param]).to_dict(),
                "version": self.version,
                "clocks": list(self.clocks),
            }
            if self.scheduler is not None:  # the task's own scheduler: its position and rates
                snap["scheduler"] = self.scheduler.state_dict()
            return snap

    def _restore_scheduler(self, state: dict[str, Any] | None) -> None:
        """The task's scheduler back at a snapshot's position (nothing when either side has none)."""
        if self.scheduler is not None and state:
            from distrain.trainers.own_optimizer import restore_scheduler

            restore_scheduler(self.scheduler, state)

    def _floor(self) -> int:
        """The least clock among the members: what the bound is measured from."""
        if self.members is None:
            return min(self.clocks)
        return min((self.clocks[r] for r in self.members), default=0)

    async def set_members(self, members: list[int]) -> None:
        """An elastic run's membership changed. A joiner's clock is raised to the others' least (it
        starts from the current θ, so it is that far along, and must not hold everyone at its old clock);
        a leaver no longer counts, which releases whoever waited on it."""
        async with self.changed:
            before = [r for r in (self.members or []) if r in members]
            floor = min((self.clocks[r] for r in before), default=None)
            for rank in members:
                if floor is not None and rank not in before:
                    self.clocks[rank] = max(self.clocks[rank], floor)
            self.members = sorted(members)
            self.changed.notify_all()

    async def set_round_members(self, members: list[int], entering: list[int], from_round: int) -> bool:
        """Elastic rounds: `members` take part in the rounds from now on, `entering` ones from round
        `from_round` (their clock is set to it: they pull θ of that round and push for it). Refused
        (False, nothing changed) when that round has closed here already; the driver then names a later
        one (orchestrator/controller/scaling.py `ElasticScaling`). A rank no longer a member loses the gradient it
        left in the open round, which may close the round now.

        Across cut replicas (`agreed`) the referee on shard 0 decides that instead: shard 0 hears first
        (orchestrator/controller/ray_group.py), its referee decides again on the new members, and every
        shard then applies the rounds the referee has decided, never closing one on its own view (a
        leaver's piece stays until then, since a decision taken before the leave may count it)."""
        async with self.changed:
            closed = self.version > from_round or (self.referee is not None and from_round in self.referee.decided)
            if entering and closed:
                return False
            for rank in entering:
                self.enters[rank] = from_round
                self.clocks[rank] = from_round
            self.members = sorted(members)
            if self.agreed:
                if self.referee is not None:
                    await self.referee.members_changed(self.version)
                    while (decided := self.referee.decision(self.version)) is not None:
                        self._apply_decided(self.version, decided, self.round_lr)
                self.changed.notify_all()
            else:
                for rank in [r for r in self.round if r not in members]:
                    del self.round[rank]
                if self.round and self._round_full():
                    self._apply_mean(self.round_lr)
                # The open round may have no member left (its only ones left, or went idle, while the others
                # were entered at the next one): it closes empty, θ unchanged, so the next one can open.
                while not self.round and self.members and not self._round_members():
                    self.round_members.append([])
                    self.version += 1
                self.changed.notify_all()
        if self.agreed and self.referee is None:
            await self._catch_up()
        return True

    async def _catch_up(self) -> None:
        """A shard other than 0 (agreed rounds): apply the rounds the referee has decided from this shard's
        open one (a membership change may have closed it without a push here to hear the answer)."""
        while True:
            async with self.changed:
                round_ = self.version
            decided = await self.referee_handle.decision.remote(round_)
            if decided is None:
                return
            async with self.changed:
                self._apply_decided(round_, decided, self.round_lr)

    async def clock_of(self, worker: int) -> int:
        """`worker`'s clock: under elastic rounds, the round it is to push for next."""
        async with self.changed:
            return self.clocks[worker]

    async def set_counters(self, version: int, clocks: list[int], scheduler: dict[str, Any] | None = None) -> None:
        """Continue a checkpointed run: its version, every worker's clock and the task's scheduler's
        position (θ and the optimizer state came with the constructor)."""
        async with self.changed:
            self.version = version
            self.clocks = list(clocks)
            self._restore_scheduler(scheduler)
            self.changed.notify_all()

    async def counters(self) -> dict[str, Any]:
        """Version and every worker's clock (the orchestrator reads them to repair a replaced worker)."""
        async with self.changed:
            return {"version": self.version, "clocks": list(self.clocks)}

    async def rebase_clock(self, worker: int, clock: int) -> int:
        """A replaced worker redoes its lost pushes from `clock` (bounded rules); returns its old clock.

        Lowering a clock never releases a waiter; the replacement's pushes move it forward again."""
        async with self.changed:
            old = self.clocks[worker]
            self.clocks[worker] = clock
            self.changed.notify_all()
            return old

    # ------------------------------------------------------------------ a warm shard (orchestrator/warm_pool.py)
    async def retire(self) -> str:
        """After a completed run: drop θ, the optimizer and every counter, keeping only the process (torch
        imported) for the next run's shard on this node. Returns this actor's node id."""
        node = self.node_id()
        self.__dict__.clear()
        gc.collect()
        return node

    async def rebuild(
        self,
        shard_id: int,
        num_workers: int,
        rule: ConsistencyRule,
        optimizer: OptimizerSpec,
        theta: np.ndarray,
        optimizer_state: dict[str, Any] | None = None,
        referee: Any = None,
    ) -> None:
        """A warm shard taken for a new run: built as a fresh actor would be, by the constructor (the
        class's own: a subclass's state too). torch's global RNG goes back to its state at process start
        (a task's own optimizer is built from a task, which may draw from it) and a task file is imported
        again (an edited one is read as it is now)."""
        from distrain.plugins import USER_MODULE_PREFIX

        for name in [m for m in sys.modules if m.startswith(USER_MODULE_PREFIX)]:
            del sys.modules[name]
        _codec.cache_clear()
        torch.set_rng_state(_START_RNG)
        given = {"referee": referee} if referee is not None else {}  # (a subclass's constructor may not take one)
        self.__init__(shard_id, num_workers, rule, optimizer, theta, optimizer_state, **given)  # type: ignore[misc]

    def alive(self) -> bool:
        return True

    async def restore(self, snapshot: dict[str, Any]) -> None:
        async with self.changed:
            np.copyto(self.theta, snapshot["theta"])
            import_flat_state(self.optimizer, [self.param], FlatOptimizerState.from_dict(snapshot["optimizer"]))
            self.version = snapshot["version"]
            self.clocks = list(snapshot["clocks"])
            self._restore_scheduler(snapshot.get("scheduler"))
            self.round.clear()
            self.chunks.clear()
            self.changed.notify_all()
        if self.referee is not None:
            await self.referee.clear()
