"""What `distrain run` shows while it runs: the preparing line, the live bar, a line per finished epoch,
and each failure, membership change and straggler as it happens (the closing table: run_summary.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
from rich.spinner import Spinner
from rich.table import Column, Table
from rich.text import Text

from distrain.commands import console as consoles
from distrain.config.layout_section import grid_text, layout_of
from distrain.orchestrator import interrupts
from distrain.run_progress import Heartbeat, RunClock, clock_text, heartbeat_seconds

if TYPE_CHECKING:
    from distrain.config import RunConfig


def short_strategy(strategy: str) -> str:
    """A strategy as tables show it: its name, or a plugin's file and class (not the whole path)."""
    return strategy.rpartition("/")[2]


def describe_task(cfg: RunConfig) -> str:
    """ "cnn on digits" for the built-in task, else the task's class name."""
    if not cfg.task:
        return f"{cfg.model} on {cfg.dataset}"
    return cfg.task.rpartition(":")[2]


class RunDisplay:
    """What `distrain run` shows while it runs.

    On a terminal: at once, a line saying what the run is doing while it prepares (checking the
    settings, loading Ray and torch, the run's checks, Ray's start, placing and starting the workers),
    which goes when training starts or an error is shown; then a live bar (epoch, step, the run's
    elapsed time and the time left; under it loss, samples/s, the last test figures) with a line per
    finished epoch kept above it. Otherwise (logs, CI, pipes, `ray job submit`): the same line per
    finished epoch, and a `still ...` line whenever nothing was printed for DISTRAIN_PROGRESS_EVERY_S
    seconds (run_progress.py), so neither a long start nor a long epoch is silent.

    Both show the summary's steady-state samples/s (orchestrator/throughput.py) over the rows so far,
    and the elapsed time as the summary counts it: from the run's start (a resumed run's goes on).
    """

    def __init__(
        self,
        cfg: RunConfig | None = None,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
        every_s: float | None = None,
        run_dir: str = "",
    ) -> None:
        """`cfg` may come later (`configured`): the display starts before the settings are checked,
        which loads torch; `run_dir` is the one asked for, if any, until then."""
        self.cfg: Any = None
        self.console = console or consoles.out
        self.live = self.console.is_terminal
        self.clock = clock
        self.every_s = heartbeat_seconds() if every_s is None else every_s
        self.run_clock = RunClock(clock)
        one_line = Column(no_wrap=True)  # the bar narrows (down to nothing) before a figure wraps
        self.progress = _TwoLineProgress(
            TextColumn("[bold]epoch {task.fields[epoch]}", table_column=one_line),
            BarColumn(bar_width=None, table_column=Column(ratio=1, min_width=0)),
            TextColumn("step {task.completed:.0f}/{task.total:.0f}", table_column=one_line),
            _RunTimeColumn(self.run_clock, table_column=one_line),
            console=self.console,
            disable=not self.live,
            expand=True,
            transient=True,  # at the end only the epoch lines stay, above the summary
        )
        self.task: Any = None
        self.started: Any = None  # the RunStarted event
        self.latest: Any = None  # the last Progress event
        self.next_line = 0  # the epoch whose line is printed next
        self.evaluations: dict[int, Any] = {}  # epoch -> its evaluation's Progress event, until printed
        self.where = f"run {run_dir}" if run_dir else "the run"
        self.stage = "checking the settings"
        if cfg is not None:
            self.configured(cfg)
        self.since = clock()  # preparing since
        self.preparing: Live | None = None  # the terminal's line while the run prepares
        self.spinner = Spinner("dots")
        self.lock = threading.Lock()  # the heartbeat's thread and the events' take turns
        self.last_said = self.since
        self.heartbeat = Heartbeat(self.tick)

    def __enter__(self) -> RunDisplay:
        if self.live:
            self.preparing = Live(
                get_renderable=self._preparing_line, console=self.console, transient=True, refresh_per_second=4
            )
            self.preparing.start(refresh=True)  # at once, not at the first auto refresh
        elif self.every_s:
            self.heartbeat.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.heartbeat.stop()
        self._prepared()
        self.progress.__exit__(*exc)

    def configured(self, cfg: RunConfig) -> RunConfig:
        """The run's settings, checked; returns them."""
        self.cfg = cfg
        self.where = f"run {cfg.run_dir}" if cfg.run_dir else self.where
        self.stage = "loading Ray and torch"
        return cfg

    def _grid(self) -> str:
        """The run's workers as its grid says them: "2 workers", "2 replicas x 2 shards"."""
        return grid_text(layout_of(self.cfg.to_dict(), self.cfg.worker_slots))

    def _prepared(self) -> None:
        if self.preparing is not None:
            self.preparing.stop()
            self.preparing = None

    def _preparing_line(self) -> Any:
        line = Table.grid(padding=(0, 1))
        line.add_row(
            self.spinner, Text(f"preparing {self.where}: {self.stage}  {clock_text(self.clock() - self.since)}")
        )
        return line

    def say(self, text: str) -> None:
        """A line of the command's own (e.g. --strategy auto's choice), above the preparing line."""
        with self.lock:
            self._say(text)

    def _say(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)
        self.last_said = self.clock()

    def tick(self) -> None:
        """Not a terminal: a `still ...` line when nothing was said for `every_s` (the heartbeat's thread)."""
        with self.lock:
            if self.every_s and self.clock() - self.last_said >= self.every_s:
                self._say(self._still_line())

    def _still_line(self) -> str:
        if self.started is None:
            return f"still preparing {self.where}: {self.stage} ({clock_text(self.clock() - self.since)} so far)"
        event, total = self.latest, self.started.total_steps
        if event is None:
            where = f"step {self.started.start_step}/{total}"
        else:
            where = (
                f"epoch {event.epoch + 1}/{event.epochs}  step {event.steps_done}/{total}  loss {event.loss:.4f}"
                f"  {_speed(event.samples_per_s)} samples/s"
            )
        return f"still training: {where}  {_run_times(self.run_clock.elapsed(), self.run_clock.left())}"

    def on_event(self, event: Any) -> None:
        interrupts.check()  # a signal whose first raise some library code swallowed still ends the run
        with self.lock:
            self._on_event(event)

    def _on_event(self, event: Any) -> None:
        from distrain.orchestrator.membership import MembershipChanged
        from distrain.orchestrator.recovery import Failure
        from distrain.orchestrator.run import Notice, Preparing, RunStarted, StragglersChanged, WorkersStarting
        from distrain.orchestrator.run import Progress as RunProgress

        if isinstance(event, Preparing):
            self.stage = event.stage
            if event.run_dir is not None:
                self.where = f"run {event.run_dir}"
            return
        if isinstance(event, Notice):
            self._say(f"note: {event.text}")
            return
        if isinstance(event, WorkersStarting):
            self.stage = f"starting workers {event.started}/{event.total}"
            if not self.live:
                self._say(self.stage)
            return
        if isinstance(event, MembershipChanged):
            self._say(membership_line(event, self.cfg.worker_range, self.cfg.replica_size))
            return
        if isinstance(event, StragglersChanged):
            slow = ", ".join(f"worker {w} ({r:.1f}x the others' step time)" for w, r in sorted(event.slow.items()))
            self._say(f"step {event.step}: stragglers: {slow or 'none now'}")
            return

        if isinstance(event, Failure):
            bound = "no limit" if event.max_failures == -1 else f"of at most {event.max_failures}"
            self._say(f"failure {event.number} ({bound}): {event.what} at step {event.at_step}; {event.then}")
            if self.started is not None and not event.replaced:  # epochs after the checkpoint are redone
                self.next_line = min(self.next_line, event.restored_step // self.started.steps_per_epoch)
        elif isinstance(event, RunStarted):
            self._prepared()
            self._say(
                f"run dir {event.run_dir}  |  {short_strategy(self.cfg.strategy)} x {self._grid()} "
                f"on {event.nodes} node(s)  |  {describe_task(self.cfg)} ({event.num_params:,} params)"
                f"  |  {event.total_steps} steps"
            )
            self.started = event
            self.next_line = event.start_step // event.steps_per_epoch
            self.run_clock.started(event.elapsed_s)
            if self.task is None:  # a resumed run's next attempt starts again: the same bar
                self.task = self.progress.add_task(
                    "train", total=event.total_steps, completed=event.start_step, epoch="-", loss="-", speed="-", acc=""
                )
                self.progress.start()
        elif isinstance(event, RunProgress):
            self.latest = event
            self.run_clock.progress(event.elapsed_s, event.steps_done, event.total_steps)
            fields: dict[str, Any] = {
                "epoch": f"{event.epoch + 1}/{event.epochs}",
                "loss": f"{event.loss:.4f}",
                "speed": _speed(event.samples_per_s),
                "acc": test_figures(event),
            }
            if self.task is not None:
                self.progress.update(self.task, completed=event.steps_done, **fields)
            if self.started is not None:
                self._epoch_lines(event)

    def _epoch_lines(self, event: Any) -> None:
        """Print each finished epoch's line, in order (on a terminal above the bar, which keeps them): an
        epoch that is evaluated once its evaluation is in (with the validation accuracy), any other once its
        last step is done (so --eval-every 0 still shows)."""
        from distrain.orchestrator.run import evaluates

        spe, total = self.started.steps_per_epoch, self.started.total_steps
        last_epoch = (total - 1) // spe
        if event.evaluated:
            self.evaluations[event.epoch] = event
        while self.next_line <= last_epoch:
            epoch = self.next_line
            end = min((epoch + 1) * spe, total)
            evaluated = evaluates(epoch, last_epoch, self.cfg.eval_every)
            if evaluated:
                shown = self.evaluations.pop(epoch, None)
                if shown is None:
                    return
            elif event.steps_done >= end:
                shown = event
            else:
                return
            acc = f"  {test_figures(shown)}" if evaluated else ""
            left = self.run_clock.left_at(shown.elapsed_s, end, total) if end < total else None
            self._say(
                f"epoch {epoch + 1}/{shown.epochs}  step {end}/{total}  loss {shown.loss:.4f}{acc}"
                f"  {_speed(shown.samples_per_s)} samples/s  {_run_times(shown.elapsed_s, left)}"
            )
            self.next_line += 1


class _TwoLineProgress(Progress):
    """The bar with the run's position and times, and under it the figures (loss, samples/s, the last
    evaluation): one line of all of it would be cut short on an 80-column terminal."""

    def get_renderables(self) -> Any:
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            figures = f"loss {task.fields['loss']}  {task.fields['speed']} samples/s  {task.fields['acc']}"
            yield Text(figures.rstrip(), no_wrap=True, overflow="ellipsis")


class _RunTimeColumn(ProgressColumn):
    """The bar's elapsed run time (from the run's start, as the epoch lines and the summary count it,
    not from the bar's) and the time left."""

    def __init__(self, run_clock: RunClock, table_column: Column | None = None) -> None:
        super().__init__(table_column)
        self.run_clock = run_clock

    def render(self, task: Any) -> Text:
        return Text(_run_times(self.run_clock.elapsed(), self.run_clock.left()))


def _run_times(elapsed_s: float, left_s: float | None) -> str:
    return f"elapsed {clock_text(elapsed_s)}" + ("" if left_s is None else f"  eta {clock_text(left_s)}")


def test_figures(event: Any) -> str:
    """The last evaluation, shortly: validation accuracy for classification, else every validation figure the
    task reports; then the test set's, where it was scored (at the end, or every epoch with --test-every-epoch)."""
    figures = event.figures or ({} if event.val_accuracy is None else {"val_accuracy": event.val_accuracy})
    shown = []
    for split in ("val", "test"):
        mine = {k.removeprefix(f"{split}_"): v for k, v in figures.items() if k.startswith(f"{split}_")}
        if "accuracy" in mine:
            shown.append(f"{split} acc {mine['accuracy']:.4f}")
        else:
            shown += [f"{split} {name} {value:.4g}" for name, value in mine.items()]
    return "  ".join(shown)


def _speed(samples_per_s: float | None) -> str:
    return "-" if samples_per_s is None else f"{samples_per_s:,.0f}"


def membership_line(event: Any, worker_range: tuple[int, int], per: int = 1) -> str:
    """One line per join or leave of an elastic run: who, why, how many now, what is redone. `per`: the
    workers of a replica (--fsdp D), whose range counts replicas."""
    low, high = worker_range
    verb = "joined" if event.change == "join" else "left"
    redone = f"; its {event.units_redone} unit(s) go to the others" if event.units_redone else ""
    now = f"{event.members}" if per == 1 else f"{event.members} workers, {event.members // per} replicas"
    return f"step {event.step}: worker {event.rank} {verb} ({event.cause}){redone}; {now} of {low}..{high}"
