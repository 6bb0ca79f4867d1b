"""A parameter-server shard: one contiguous slice of θ, its optimizer state, a version, worker clocks.

Hosted as a Ray *async* actor (see `orchestrator/ps.py`). Every consistency rule is enforced here,
with one `asyncio.Condition`: a worker's combined push-then-pull call waits on it, and every update
notifies it. No worker ever polls.

Rules (`ConsistencyRule`, definitions in shared/reference/algorithms.md):
- "rounds" (BSP over the PS): round t collects one gradient tagged t from each of the N workers, then
  applies their mean in one optimizer step and opens round t+1; each push returns θ_{t+1}.
- "bounded" (SSP, and async as SSP with no bound): each gradient is applied on arrival at rate
  η/N (the global-batch rate split over the N contributions, so N pushes move θ as one BSP step
  would), optionally divided by its staleness τ = t_apply - t_read (τ > 1). The pull that follows
  a push from a worker at clock c waits while c - min_j c_j > s.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from distrain.trainers.optim_state import (
    FlatOptimizerState,
    export_flat_state,
    import_flat_state,
    make_optimizer,
)


@dataclass(frozen=True)
class ConsistencyRule:
    mode: str  # "rounds" | "bounded"
    staleness: int | None = None  # bounded mode: max clock lead; None = unbounded (async)
    staleness_lr: bool = False  # bounded mode: divide η by the gradient's staleness

    @classmethod
    def bsp(cls) -> ConsistencyRule:
        return cls("rounds")

    @classmethod
    def ssp(cls, staleness: int, staleness_lr: bool = False) -> ConsistencyRule:
        return cls("bounded", staleness, staleness_lr)

    @classmethod
    def asynchronous(cls, staleness_lr: bool = False) -> ConsistencyRule:
        return cls("bounded", None, staleness_lr)


@dataclass
class OptimizerSpec:
    name: str
    momentum: float
    weight_decay: float


@dataclass
class Reply:
    """What a push-pull (or a pull) returns to the worker for this shard."""

    theta: np.ndarray
    version: int  # updates applied to this shard so far: the read version of the next gradient
    applied_version: int  # version at which this push's gradient was applied (-1 for a plain pull)
    staleness: int  # t_apply - t_read of this push (0 for a plain pull)
    wait_s: float  # seconds the call spent blocked by the consistency rule
    clock: int  # the worker's clock after this push
    min_clock: int  # slowest worker's clock when the pull completed


class ParameterShard:
    def __init__(
        self,
        shard_id: int,
        num_workers: int,
        rule: ConsistencyRule,
        optimizer: OptimizerSpec,
        theta: np.ndarray,
        optimizer_state: dict[str, Any] | None = None,
    ) -> None:
        torch.set_num_threads(1)
        self.shard_id = shard_id
        self.num_workers = num_workers
        self.rule = rule
        self.param = nn.Parameter(torch.from_numpy(np.array(theta, dtype=np.float32, copy=True)))
        self.grad_tensor = torch.zeros_like(self.param)
        self.theta = self.param.detach().numpy()  # shares memory with the parameter
        self.grad = self.grad_tensor.numpy()  # where a BSP round sums its gradients
        self.optimizer = make_optimizer(optimizer.name, [self.param], 0.0, optimizer.momentum, optimizer.weight_decay)
        if optimizer_state is not None:
            import_flat_state(self.optimizer, [self.param], FlatOptimizerState.from_dict(optimizer_state))
        self.version = 0
        self.clocks = [0] * num_workers
        self.round: dict[int, np.ndarray] = {}
        self.changed = asyncio.Condition()
        self.updates_applied = 0

    # ------------------------------------------------------------------ the one hot path
    async def push_pull(self, worker: int, clock: int, grad: np.ndarray, lr: float, read_version: int) -> Reply:
        async with self.changed:
            if self.rule.mode == "rounds":
                applied, staleness, wait_s = await self._push_round(worker, clock, grad, lr)
            else:
                applied, staleness, wait_s = await self._push_bounded(worker, clock, grad, lr, read_version)
            return Reply(
                self.theta.copy(),
                self.version,
                applied,
                staleness,
                wait_s,
                self.clocks[worker],
                min(self.clocks),
            )

    async def _push_round(self, worker: int, clock: int, grad: np.ndarray, lr: float) -> tuple[int, int, float]:
        if clock != self.version:
            raise RuntimeError(f"shard {self.shard_id}: worker {worker} pushed for round {clock} in {self.version}")
        self.round[worker] = grad
        self.clocks[worker] = clock + 1
        wait_s = 0.0
        if len(self.round) == self.num_workers:
            # Sum in rank order: the result does not depend on arrival order.
            np.copyto(self.grad, self.round[0])
            for rank in range(1, self.num_workers):
                self.grad += self.round[rank]
            self.grad /= self.num_workers
            self.round.clear()
            self._apply(lr)
            self.changed.notify_all()
        else:
            t0 = time.perf_counter()
            await self.changed.wait_for(lambda: self.version > clock)
            wait_s = time.perf_counter() - t0
        return clock, 0, wait_s

    async def _push_bounded(
        self, worker: int, clock: int, grad: np.ndarray, lr: float, read_version: int
    ) -> tuple[int, int, float]:
        applied = self.version
        staleness = applied - read_version
        rate = lr / self.num_workers
        if self.rule.staleness_lr and staleness > 1:
            rate /= staleness
        self._apply(rate, grad)
        self.clocks[worker] = clock + 1
        self.changed.notify_all()
        wait_s = 0.0
        bound = self.rule.staleness
        if bound is not None and self.clocks[worker] - min(self.clocks) > bound:
            t0 = time.perf_counter()
            await self.changed.wait_for(lambda: self.clocks[worker] - min(self.clocks) <= bound)
            wait_s = time.perf_counter() - t0
        return applied, staleness, wait_s

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
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.version += 1
        self.updates_applied += 1

    # ------------------------------------------------------------------ reads and state
    async def pull(self, worker: int) -> Reply:
        """A read outside the step (start, evaluation): never blocks."""
        async with self.changed:
            return Reply(self.theta.copy(), self.version, -1, 0, 0.0, self.clocks[worker], min(self.clocks))

    def node_id(self) -> str:
        """The Ray node hosting this shard (placement checks)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def snapshot(self) -> dict[str, Any]:
        async with self.changed:
            return {
                "shard_id": self.shard_id,
                "theta": self.theta.copy(),
                "optimizer": export_flat_state(self.optimizer, [self.param]).to_dict(),
                "version": self.version,
                "clocks": list(self.clocks),
            }

    async def set_counters(self, version: int, clocks: list[int]) -> None:
        """Continue a checkpointed run: its version and every worker's clock (θ came with the constructor)."""
        async with self.changed:
            self.version = version
            self.clocks = list(clocks)
            self.changed.notify_all()

    async def restore(self, snapshot: dict[str, Any]) -> None:
        async with self.changed:
            np.copyto(self.theta, snapshot["theta"])
            import_flat_state(self.optimizer, [self.param], FlatOptimizerState.from_dict(snapshot["optimizer"]))
            self.version = snapshot["version"]
            self.clocks = list(snapshot["clocks"])
            self.round.clear()
            self.changed.notify_all()
