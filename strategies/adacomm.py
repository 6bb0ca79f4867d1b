"""AdaComm (Wang & Joshi, SysML'19): how many local steps τ to take between parameter averages.

Pure logic, no torch and no communication, so it is tested on its own. The local SGD strategy feeds
it values every worker already agrees on (all-reduced at each averaging round), so every worker
computes the same τ.

The rule (shared/reference/algorithms.md): at the start of interval l

    τ_l = ceil( τ_0 · sqrt( F_l / F_0 · r_l ) ),  clipped to [1, τ_max]

where F_0 is the worker-averaged training loss at the start and F_l the current one, and
r_l = (η_0 / η_l)^3 when the learning rate has decayed (η_l < η_0), else 1 (the paper's
learning-rate variant: a smaller rate tolerates longer periods). Averaging starts rare and becomes
frequent as the loss falls.

η_0 is the peak rate, the one warmup climbs to (trainers/schedule.py), and "decayed" means below a
rate this run has already stepped at: a rate still climbing through warmup is below η_0 too, but it
has not decayed, so it keeps r_l = 1 (the paper has no warmup). With --lr-decay cosine or step the
rate falls below the peak after warmup, and τ grows by the cubed ratio at equal loss. (A strategy
entered after the decay began, by --schedule or a resume, counts its first rate as not decayed
until the rate falls further.)

What "the loss" is here: the mean, over all workers, of the training losses of the local steps in
the averaging period that just ended (each worker's mini-batch loss before its update). F_0 is that
mean for the run's first period. Intervals are measured either in wall-clock seconds (the mean, over
workers, of the time since the interval began), in local steps, or as a share of the run's steps
("10%", the default: it becomes a step count once the run's length is known, so a short run on the
bundled data re-chooses τ about ten times, where a fixed 5 s could outlast its whole training); a new
interval (and τ) begins at the first averaging round at which the interval has run its length.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from distrain.errors import ConfigError
from distrain.strategies.declarations import ColumnPlot, StepColumns

_SECONDS = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*s\s*$")
_STEPS = re.compile(r"^\s*(\d+)\s*$")
_SHARE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")


@dataclass(frozen=True)
class TauInterval:
    """How long one AdaComm interval lasts: `seconds` of wall-clock time, `steps` local steps, or a
    `share` (0 < share <= 1) of the run's steps, which `for_run` turns into steps."""

    seconds: float | None = None
    steps: int | None = None
    share: float | None = None

    @classmethod
    def parse(cls, text: str) -> TauInterval:
        """Text "5s" -> 5 seconds; "200" -> 200 steps; "10%" -> a tenth of the run's steps."""
        if m := _SECONDS.match(text):
            seconds = float(m.group(1))
            if seconds > 0:
                return cls(seconds=seconds)
        elif m := _SHARE.match(text):
            percent = float(m.group(1))
            if 0 < percent <= 100:
                return cls(share=percent / 100)
        elif (m := _STEPS.match(text)) and int(m.group(1)) > 0:
            return cls(steps=int(m.group(1)))
        raise ConfigError(
            f"--tau-interval {text!r} must be positive wall-clock seconds like 5s, a step count like 200 "
            "or a share of the run's steps like 10%"
        )

    def for_run(self, total_steps: int) -> TauInterval:
        """The interval for a run of `total_steps` global (= local, per worker) steps: a share becomes
        that many steps, rounded up, at least 1; seconds and steps stay as they are."""
        if self.share is None:
            return self
        if total_steps < 1:
            raise ValueError("a --tau-interval given as a share needs the run's length in steps")
        return TauInterval(steps=max(1, math.ceil(self.share * total_steps)))

    def ended(self, elapsed_s: float, steps: int) -> bool:
        assert self.share is None, "call for_run() first: a share of the run is not a length yet"
        if self.seconds is not None:
            return elapsed_s >= self.seconds
        assert self.steps is not None
        return steps >= self.steps


def adacomm_tau(
    tau0: int, loss0: float, loss: float, tau_max: int, lr0: float | None = None, lr: float | None = None
) -> int:
    """τ for an interval whose starting loss is `loss` (F_l), given F_0 = `loss0` and τ_0 = `tau0`.

    With `lr0` (η_0) and `lr` (η_l) and η_l < η_0, the ratio under the root is multiplied by
    (η_0/η_l)^3. A loss that cannot form a ratio (F_0 <= 0, or either not finite) keeps τ_0.
    """
    if not (loss0 > 0 and math.isfinite(loss0) and math.isfinite(loss) and loss >= 0):
        return max(1, min(tau_max, tau0))
    ratio = loss / loss0
    if lr0 is not None and lr is not None and 0 < lr < lr0:
        ratio *= (lr0 / lr) ** 3
    return max(1, min(tau_max, math.ceil(tau0 * math.sqrt(ratio))))


class AdaComm:
    """The per-run state of the rule: F_0, η_0, the current τ and where the current interval began.

    `after_round` is called at every averaging round with the values all workers agree on and says
    whether a new interval (with a new τ) began; the caller then restarts its interval clock.
    """

    def __init__(self, tau0: int, tau_max: int, interval: TauInterval, peak_lr: float | None = None) -> None:
        self.tau0 = tau0
        self.tau_max = tau_max
        self.interval = interval
        self.tau = min(tau0, tau_max)
        self.loss0: float | None = None
        self.lr0: float | None = peak_lr  # η_0; without a peak given, the first step's rate
        self.highest = 0.0  # the highest rate stepped at so far: a rate below it has decayed

    def start(self, lr: float) -> None:
        """Called at every local step with its rate."""
        if self.lr0 is None:
            self.lr0 = lr
        self.highest = max(self.highest, lr)

    def after_round(self, mean_loss: float, lr: float, elapsed_s: float, interval_steps: int) -> bool:
        if self.loss0 is None:  # the first period's loss is F_0; interval 0 runs at τ_0
            self.loss0 = mean_loss
        self.highest = max(self.highest, lr)
        if not self.interval.ended(elapsed_s, interval_steps):
            return False
        decayed = lr < self.highest  # else still at the peak, or climbing through warmup
        self.tau = adacomm_tau(self.tau0, self.loss0, mean_loss, self.tau_max, self.lr0, lr if decayed else None)
        return True


def local_sgd_figures(rows: Any) -> dict[str, Any]:
    """summary.json: averaging rounds, bytes communicated and τ over time of a local SGD run, from its step
    rows that carry a τ (a pandas DataFrame)."""
    # τ is the same on every worker for a step (decided from all-reduced values): one value per step.
    per_step = rows.groupby("step")["tau"].first().sort_index().astype(int)
    changed = per_step[per_step.ne(per_step.shift())]
    return {
        "averaging_rounds": int(rows["averaging_round"].max()),
        "bytes_communicated": int(rows["bytes_sent"].sum()),  # all workers, over the local SGD steps
        "tau_min": int(per_step.min()),
        "tau_max": int(per_step.max()),
        "tau_final": int(per_step.iloc[-1]),
        "tau_changes": [[int(step), int(tau)] for step, tau in changed.items()],  # [first step, τ]
    }


def local_sgd_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """`distrain run`'s closing rows of a local SGD run (none for another run)."""
    from distrain.units import size_text

    if summary.get("averaging_rounds") is None:
        return []
    return [
        ("averaging rounds", str(summary["averaging_rounds"])),
        ("communicated (all workers)", size_text(summary["bytes_communicated"])),
        ("tau min / max / final", f"{summary['tau_min']} / {summary['tau_max']} / {summary['tau_final']}"),
    ]


def outer_steps_figure(steps: dict[str, list[Any]]) -> dict[str, Any]:
    """DiLoCo's `outer_steps` (plain and across cut replicas) from the rows' `averaging_round` column. A
    schedule's other phases leave the column empty (None, or NaN once it went through pandas)."""
    rounds = [r for r in steps.get("averaging_round", []) if r is not None and r == r]
    return {"outer_steps": int(max(rounds)) if rounds else 0}


# What local SGD's step rows carry (its τ, chosen by this module's rule), and what they make.
LOCAL_SGD_STEP_COLUMNS = StepColumns(
    {
        "tau": "int32",  # local steps in the averaging period this step belongs to
        "averaging_round": "int64",  # averaging rounds completed after this step
    },
    fields={"tau": "period"},  # CommStats.period: the column keeps the name runs have always had
    key="tau",
    figures=local_sgd_figures,
    closing_rows=local_sgd_rows,
    closing_place="end",
    plots=(
        ColumnPlot(
            "tau_over_time.png",
            "tau",
            "over_time",
            "Local steps between averaging (tau), as AdaComm chose them",
            "tau",
            "tau (local steps between averages) over wall time, for runs whose tau changed.",
        ),
    ),
)
