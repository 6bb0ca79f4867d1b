"""Local SGD's books on every worker, the same over plain replicas (strategies/local_sgd.py) and cut ones
(strategies/sharded_local_sgd.py): the period's τ and length, the rounds, the period's loss, AdaComm's
interval (strategies/adacomm.py), and what a checkpoint keeps of them."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from distrain.strategies.adacomm import AdaComm, TauInterval
from distrain.strategies.base import CommStats
from distrain.trainers.schedule import scaled_lr

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.strategies.local_sgd import LocalSGDOptions


class LocalPeriods:
    """Local SGD's books on every worker, over plain replicas (LocalSGD) or cut ones (ShardedLocalSGD,
    strategies/sharded_local_sgd.py): the τ in force, local steps since the last round, rounds so far,
    the period's loss and AdaComm's interval, and the small state a checkpoint keeps of them. The class
    using it makes the round its own way (`average`), from `period_statistics` to `round_closed`."""

    def init_periods(self, config: RunConfig, options: LocalSGDOptions, total_steps: int) -> None:
        assert options.tau is not None
        self.adacomm: AdaComm | None = None
        if options.adaptive_tau:
            assert options.tau_interval is not None and options.tau_max is not None
            # η_0 is the peak rate warmup climbs to, so the rate-decay variant applies after warmup.
            peak = scaled_lr(config.lr, config.global_batch_size, config.base_batch_size, config.lr_scaling)
            interval = TauInterval.parse(options.tau_interval).for_run(total_steps)
            self.adacomm = AdaComm(options.tau, options.tau_max, interval, peak)
        self.tau = options.tau
        self.pending = 0  # local steps since the last round
        self.rounds = 0
        self.loss_sum = 0.0
        self.loss_count = 0
        self.interval_start = time.perf_counter()
        self.interval_steps = 0
        self.lr = 0.0

    def average(self, trainer: Any) -> CommStats:
        """One averaging round (parameters, optimizer state vectors, `period_statistics`)."""
        raise NotImplementedError

    def book_step(self, trainer: Any, lr: float, ok: bool) -> CommStats:
        """Count a local step (taken, or skipped: `ok` False) in the period, and make the round when the
        period is full; the row's τ is the period's the step belongs to (a round may change it for the next)."""
        if self.adacomm is not None:
            self.adacomm.start(lr)
        self.lr = lr
        self.pending += 1
        self.interval_steps += 1
        # A skipped step's loss would make the period's loss (and the round's statistics) NaN.
        if ok and math.isfinite(trainer.last_loss):
            self.loss_sum += trainer.last_loss
            self.loss_count += 1
        tau = self.tau
        stats = self.average(trainer) if self.pending >= self.tau else CommStats()
        stats.period = tau
        stats.averaging_round = self.rounds
        if not ok:
            stats.nonfinite = True
        return stats

    def period_statistics(self) -> list[float]:
        """What a round carries for AdaComm: this worker's [loss sum, loss count, seconds since the interval began]."""
        return [self.loss_sum, float(self.loss_count), time.perf_counter() - self.interval_start]

    def round_closed(self, loss_sum: float, loss_count: float, mean_elapsed: float) -> None:
        """After a round, with `period_statistics` summed (or averaged) over the workers, the same on every
        worker: start the next period, and let AdaComm choose τ from the worker-averaged loss."""
        self.rounds += 1
        self.pending = 0
        self.loss_sum, self.loss_count = 0.0, 0
        if self.adacomm is not None and loss_count > 0:
            if self.adacomm.after_round(loss_sum / loss_count, self.lr, mean_elapsed, self.interval_steps):
                self.tau = self.adacomm.tau
                self.interval_start = time.perf_counter()
                self.interval_steps = 0

    def extra_state(self) -> dict[str, Any]:
        """τ in force, rounds so far and AdaComm's F_0, η_0 and highest rate: the same on every worker (they
        follow from the all-reduced statistics), so a resumed or recovered run goes on choosing τ as before."""
        state: dict[str, Any] = {"tau": self.tau, "rounds": self.rounds}
        if self.adacomm is not None:
            a = self.adacomm
            state["adacomm"] = {"tau": a.tau, "loss0": a.loss0, "lr0": a.lr0, "highest": a.highest}
        return state

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.tau, self.rounds = int(state["tau"]), int(state["rounds"])
        if self.adacomm is not None and state.get("adacomm"):
            saved = state["adacomm"]
            self.adacomm.tau, self.adacomm.loss0 = int(saved["tau"]), saved["loss0"]
            self.adacomm.lr0, self.adacomm.highest = saved["lr0"], float(saved["highest"])
