"""`distrain tune`: Ray Tune sweeps in which every trial is a full distributed distrain run.

    run_sweep(spec, sweep_dir, on_event) -> Sweep        (resume_sweep(sweep_dir, on_event) to go on)

Layout of a sweep directory:
    sweep.json                 what was swept (read back by --resume)
    tune/                      Tune's experiment state (Tuner.restore reads it)
    trials/<trial_id>/         each trial's own run directory (config.yaml, metrics.parquet, summary.json)
    results.parquet, .csv      one row per trial, sorted by the objective
    best.yaml                  the best trial's RunConfig: `distrain run --config best.yaml` repeats it

Resources: each trial asks Tune for a placement group with one bundle per actor it starts
(trial_resources.trial_bundles); run_training finds that group and places its actors in it
(cluster.place) instead of reserving its own, so Tune's admission control is the whole accounting.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from distrain.config import RunConfig, Target
from distrain.errors import ResourceError
from distrain.orchestrator import address, cluster, interrupts
from distrain.orchestrator.callbacks import Callback, RunInfo
from distrain.orchestrator.files import atomic_write, atomic_write_text
from distrain.orchestrator.remote_errors import strip_ansi
from distrain.orchestrator.trial_resources import trial_bundles, trial_cpus, trial_gpus
from distrain.trainers.schedule import scaled_lr
from distrain.tuning.sweep_spec import Choice, Range, SweepSpec, flatten, sort_by_objective, trial_config

FALLBACK_TARGET = Target("val_loss", "<=", 0.0)  # a user task with neither --target nor a default_target
CONFIG_COLUMNS = ("batch_size", "lr_scaling", "warmup_epochs", "lr", "workers", "strategy")
RESERVED_KEYS = ("base", "sweep_dir")  # param_space entries that are not swept values


class _InterruptNotices(logging.Filter):
    """On Ctrl-C Tune warns that it is stopping, then that the trials it had not started yet have no
    metrics (`Failed to fetch metrics for N trial(s)`, a line per trial), then how to resume in
    Python; the CLI says all of it in one line of its own (`distrain tune --resume`). The metrics
    warning is dropped only once the stop notice was seen: outside an interruption it may mean
    something."""

    STOP = "Stop signal received"
    INTERRUPTED = "Experiment has been interrupted"
    NO_METRICS = "Failed to fetch metrics for"
    LOGGERS = ("ray.tune.tune", "ray.tune.analysis.experiment_analysis")

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith(self.STOP):
            self.stopping = True
            return False
        if message.startswith(self.INTERRUPTED):
            return False
        return not (self.stopping and message.startswith(self.NO_METRICS))


@contextlib.contextmanager
def _quiet_interrupt_notices() -> Iterator[None]:
    """_InterruptNotices on Tune's loggers for the length of one `fit`."""
    notices = _InterruptNotices()
    for name in _InterruptNotices.LOGGERS:
        logging.getLogger(name).addFilter(notices)
    try:
        yield
    finally:
        for name in _InterruptNotices.LOGGERS:
            logging.getLogger(name).removeFilter(notices)


# ---------------------------------------------------------------------- events for the display
@dataclass
class SweepStarted:
    cluster_cpus: float
    largest_trial_cpus: float  # the most any one trial reserves


@dataclass
class TrialStarted:
    trial_id: str
    params: dict[str, Any]
    cpus: float


@dataclass
class TrialEpoch:
    trial_id: str
    epoch: int  # 1-based, as reported to Tune (training_iteration)
    epochs: int
    val_accuracy: float  # on the validation split; NaN for a task without an accuracy
    val_loss: float
    elapsed_s: float
    metric: str = "val_accuracy"  # the sweep's metric (the run's target metric) and its value
    value: float = math.nan


@dataclass
class TrialEnded:
    trial_id: str
    status: str  # completed, stopped (by the scheduler or the time budget), error
    error: str = ""


SweepEvent = SweepStarted | TrialStarted | TrialEpoch | TrialEnded
_sink: Any = None  # the current process's event handler (module level: Tune pickles its callbacks)


class _Relay(tune.Callback):
    """Turns Tune's trial callbacks (in this process) into SweepEvents for the display."""

    def _emit(self, event: SweepEvent) -> None:
        if _sink is not None:
            _sink(event)

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        config = trial_config(trial.config["base"], swept(trial.config))
        self._emit(TrialStarted(trial.trial_id, swept(trial.config), trial_cpus(config)))

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        metric = result["metric"]
        self._emit(
            TrialEpoch(
                trial.trial_id,
                int(result["training_iteration"]),
                int(result["epochs"]),
                float(result.get("val_accuracy", math.nan)),
                float(result.get("val_loss", math.nan)),
                float(result["elapsed_s"]),
                metric,
                float(result[metric]),
            )
        )

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        last = trial.last_result or {}
        finished = last.get("training_iteration", 0) >= last.get("epochs", math.inf)
        self._emit(TrialEnded(trial.trial_id, "completed" if finished else "stopped"))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._emit(TrialEnded(trial.trial_id, "error", str(trial.error_file or "")))


def swept(config: dict[str, Any]) -> dict[str, Any]:
    """A trial's swept values, field by field (a strategy variant's fields in place of the variant)."""
    return flatten({k: v for k, v in config.items() if k not in RESERVED_KEYS})


def sweep_target(base: dict[str, Any]) -> Target:
    """What schedulers (ASHA) and the objectives compare trials on: the run's target metric (--target,
    else the task's default: classification's val_accuracy>=--target-accuracy): a validation metric."""
    from distrain.orchestrator.tasks import run_target

    return run_target(RunConfig.from_mapping(base)) or FALLBACK_TARGET


def tune_mode(target: Target) -> str:
    return "max" if target.op == ">=" else "min"


# ---------------------------------------------------------------------- one trial
RUN_ENDED = "_run_ended"  # the trial's queue: the run returned (its summary), after any evaluations


class TuneReporter(Callback):
    """The trial's hooks into its run: each evaluation goes to step() (and so to Tune); when Tune ends
    the trial (ASHA, the time budget) `should_stop` asks the run to stop, and it ends "stopped" with
    its final checkpoint, metrics and summary, as any run a callback stops."""

    def __init__(self, trial: DistrainTrial) -> None:
        self.trial = trial

    @property
    def should_stop(self) -> bool:  # type: ignore[override]
        return self.trial.stop_requested.is_set()

    def on_run_start(self, info: RunInfo) -> None:
        self.trial.last_epoch = (info.total_steps - 1) // info.steps_per_epoch

    def on_epoch_end(self, epoch: int, metrics: dict[str, float]) -> None:
        trial = self.trial
        target = trial.target
        elapsed = time.time() - trial.started
        value = metrics.get(target.metric, math.nan)
        if trial.reached_target_s is None and target.reached(value):
            trial.reached_target_s = elapsed
        trial.results.put(
            {k: v for k, v in metrics.items() if k.startswith(("val_", "test_"))}
            | {
                target.metric: value,
                "metric": target.metric,
                "epoch": epoch,
                "epochs": trial.last_epoch + 1,
                "elapsed_s": elapsed,
                "time_to_target_s": trial.reached_target_s if trial.reached_target_s is not None else math.nan,
                "run_dir": str(trial.run_config.run_dir),
                "reserved_cpus": trial.reserved_cpus,
            }
        )


class DistrainTrial(tune.Trainable):
    """One trial = one run_training call in a thread of Tune's trial actor; step() hands Tune each
    epoch's evaluation (TuneReporter). A class trainable (not a function) so that cleanup() can wait
    for the run to record its metrics and kill its actors before Tune ends the actor."""

    def setup(self, config: dict[str, Any]) -> None:
        # Tune suggests reuse_actors when setup takes > 10 s (importing torch on a busy machine); a
        # trial's actors are new per trial by design, so the hint is noise in the sweep's output.
        logging.getLogger("ray.tune.trainable.trainable").setLevel(logging.WARNING)
        interrupts.quiet_shutdown_exits()  # Ctrl-C of a sweep: Ray's SIGTERM to this actor, no stack dump
        trials = Path(config["sweep_dir"]) / "trials"
        run_dir = trials / self.trial_id
        attempt = 1
        while run_dir.exists():  # a trial restarted by --resume starts over in a new directory
            attempt += 1
            run_dir = trials / f"{self.trial_id}-{attempt}"
        self.run_config = trial_config(config["base"], swept(config), str(run_dir))
        group = ray.util.get_current_placement_group()  # what Tune reserved for this trial
        self.reserved_cpus = sum(b.get("CPU", 0.0) for b in group.bundle_specs) if group else 0.0
        self.results: queue.Queue[dict[str, Any] | BaseException] = queue.Queue()
        self.stop_requested = threading.Event()
        self.last_epoch = -1
        self.started = time.time()
        self.reached_target_s: float | None = None
        self.target = sweep_target(config["base"])
        self.thread = threading.Thread(target=self._run, name="distrain-trial", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from distrain.orchestrator.run import run_training

        try:
            result = run_training(self.run_config, callbacks=[TuneReporter(self)])
        except BaseException as e:  # handed to step(), which fails the trial with it
            self.results.put(e)
            return
        # A run can end before its last evaluation (diverged at a non-finite step): step() must not wait
        # for an epoch that never comes.
        self.results.put({RUN_ENDED: result.summary})

    def step(self) -> dict[str, Any]:
        item = self.results.get()
        if isinstance(item, BaseException):
            raise item
        if RUN_ENDED in item:  # ended before its last evaluation: its final figures, and done
            summary = item[RUN_ENDED]
            value = summary.get(f"final_{self.target.metric}")
            loss = summary.get("final_val_loss")
            return {
                "val_loss": math.nan if loss is None else loss,
                self.target.metric: math.nan if value is None else value,
                "metric": self.target.metric,
                "epoch": max(self.last_epoch, 0),
                "epochs": self.last_epoch + 1,
                "elapsed_s": time.time() - self.started,
                "time_to_target_s": math.nan,
                "run_dir": str(self.run_config.run_dir),
                "reserved_cpus": self.reserved_cpus,
                "done": True,
            }
        if item["epoch"] == self.last_epoch:
            self.thread.join()  # the run writes its final checkpoint, metrics and summary
            while not self.results.empty():
                ended = self.results.get()
                if isinstance(ended, BaseException):
                    raise ended
            item["done"] = True
        return item

    def save_checkpoint(self, checkpoint_dir: str) -> dict[str, Any]:
        """Nothing to hand Tune: a trial's model checkpoints live in its run directory, and a trial
        interrupted mid-sweep starts over when the sweep is resumed."""
        return {}

    def load_checkpoint(self, checkpoint: Any) -> None:
        pass

    def cleanup(self) -> None:
        """Tune is ending the trial (finished, stopped early, or the sweep is ending)."""
        self.stop_requested.set()
        self.thread.join(timeout=120)  # the run stops after its segments under way; its cleanup kills the actors


def _trial_resources(config: dict[str, Any]) -> tune.PlacementGroupFactory:
    run = trial_config(config["base"], swept(config))
    return tune.PlacementGroupFactory(trial_bundles(run), strategy=run.placement.upper())


TRAINABLE = tune.with_resources(DistrainTrial, _trial_resources)


# ---------------------------------------------------------------------- the sweep
def _search_space(spec: SweepSpec) -> dict[str, Any]:
    space: dict[str, Any] = {}
    for name, dim in spec.axes().items():
        if isinstance(dim, Range):
            space[name] = tune.loguniform(dim.low, dim.high) if dim.log else tune.uniform(dim.low, dim.high)
        elif spec.search == "grid":
            space[name] = tune.grid_search(list(dim.values))
        else:
            space[name] = tune.choice(list(dim.values))
    return space


def _scheduler(spec: SweepSpec) -> Any:
    if spec.scheduler == "asha":
        return ASHAScheduler(
            time_attr="training_iteration",
            max_t=spec.base_config.epochs,
            grace_period=spec.grace_period,
            reduction_factor=spec.reduction_factor,
        )
    return FIFOScheduler()


def connect(spec: SweepSpec, cluster_cpus: int = 0) -> cluster.RayConnection:
    """Reuse an initialised Ray, join --address, or start a local Ray: --cluster-cpus logical CPUs, by
    default this machine's cores (at least enough for the largest trial)."""
    base = spec.base_config
    if ray.is_initialized():
        if base.address:  # a dead --address is refused as a fresh process would refuse it
            address.reachable(base.address)
        return cluster.RayConnection(started_here=False)
    if base.address:
        return cluster.RayConnection(started_here=True, shipped=cluster.join(base.address, base.task))
    else:
        largest = math.ceil(trial_cpus(spec.largest_trial()))
        cluster.start_local_ray(cluster_cpus or max(os.cpu_count() or 1, largest))
    return cluster.RayConnection(started_here=True)


def check_fits(spec: SweepSpec) -> None:
    """The largest trial must fit the cluster, or Tune would wait for it forever."""
    total = ray.cluster_resources()
    largest = spec.largest_trial()
    cpus, gpus = trial_cpus(largest), trial_gpus(largest)
    if cpus > total.get("CPU", 0.0) + 1e-9 or gpus > total.get("GPU", 0.0) + 1e-9:
        raise ResourceError(
            f"a trial with {largest.workers} workers needs {cpus:g} CPUs and {gpus:g} GPUs (one bundle per actor "
            f"plus {trial_bundles(largest)[0]['CPU']:g} CPU for its driver) but the cluster has "
            f"{total.get('CPU', 0.0):g} CPUs and {total.get('GPU', 0.0):g} GPUs; "
            "lower --workers or --cpus-per-worker, or use a larger cluster"
        )


@dataclass
class Sweep:
    sweep_dir: Path
    results: pd.DataFrame  # one row per trial, best first
    best: RunConfig | None
    wall_time_s: float
    interrupted: bool = False  # Ctrl-C: Tune stopped the trials and saved its state (`--resume` goes on)


def save_spec(spec: SweepSpec, sweep_dir: Path) -> None:
    dims = {
        name: {"values": list(d.values)} if isinstance(d, Choice) else {"low": d.low, "high": d.high, "log": d.log}
        for name, d in spec.dimensions.items()
    }
    data = {k: v for k, v in spec.__dict__.items() if k != "dimensions"} | {"dimensions": dims}
    atomic_write_text(sweep_dir / "sweep.json", json.dumps(data, indent=2) + "\n")


def load_spec(sweep_dir: Path) -> SweepSpec:
    data = json.loads((sweep_dir / "sweep.json").read_text())
    dims: dict[str, Any] = {
        name: Choice(tuple(d["values"])) if "values" in d else Range(d["low"], d["high"], d["log"])
        for name, d in data.pop("dimensions").items()
    }
    return SweepSpec(dimensions=dims, **data)


def run_sweep(
    spec: SweepSpec, sweep_dir: Path, on_event: Any = None, resume: bool = False, cluster_cpus: int = 0
) -> Sweep:
    """Run (or, with resume, go on with) the sweep in sweep_dir; returns the results, best first."""
    global _sink
    sweep_dir = Path(sweep_dir).absolute()
    connection = connect(spec, cluster_cpus)
    started = time.time()
    try:
        check_fits(spec)
        if on_event is not None:
            on_event(SweepStarted(ray.cluster_resources().get("CPU", 0.0), trial_cpus(spec.largest_trial())))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            save_spec(spec, sweep_dir)
        _sink = on_event
        target = sweep_target(spec.base)
        tune_dir = sweep_dir / "tune"
        if resume:
            tuner = tune.Tuner.restore(str(tune_dir), TRAINABLE, resume_unfinished=True, resume_errored=True)
        else:
            tuner = tune.Tuner(
                TRAINABLE,
                param_space={"base": spec.base, "sweep_dir": str(sweep_dir), **_search_space(spec)},
                tune_config=tune.TuneConfig(
                    metric=target.metric,
                    mode=tune_mode(target),
                    scheduler=_scheduler(spec),
                    num_samples=spec.num_samples,
                    max_concurrent_trials=spec.max_concurrent_trials or None,
                    time_budget_s=spec.time_budget_s or None,
                    trial_dirname_creator=_trial_dirname,
                ),
                run_config=tune.RunConfig(
                    name="tune",
                    storage_path=str(sweep_dir),
                    verbose=0,
                    callbacks=[_Relay()],
                    log_to_file=True,
                    checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False),
                ),
            )
        # verbose=0 silences Tune's legacy reporter; the newer one (on by default) ignores it, and our
        # display (the _Relay callback) is the sweep's output.
        previous = os.environ.get("RAY_AIR_NEW_OUTPUT")
        os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
        try:
            with interrupts.sigint_lent() as lent, _quiet_interrupt_notices():  # Tune's Ctrl-C: stop, save
                grid = tuner.fit()
        finally:
            if previous is None:
                os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
            else:
                os.environ["RAY_AIR_NEW_OUTPUT"] = previous
        trials = [(Path(r.path).name, r.config, r.error, r.metrics or {}) for r in grid]
        table = results_table(trials, spec, sweep_dir, target)
        best = write_results(table, spec, sweep_dir)
        return Sweep(sweep_dir, table, best, time.time() - started, interrupted=lent.caught)
    finally:
        _sink = None
        connection.close()


def _trial_dirname(trial: Any) -> str:
    return trial.trial_id  # results find each trial's run directory by this id


# ---------------------------------------------------------------------- results
def results_table(
    trials: list[tuple[str, dict[str, Any] | None, Any, dict[str, Any]]],
    spec: SweepSpec,
    sweep_dir: Path,
    target: Target | None = None,
) -> pd.DataFrame:
    """One row per trial Tune knows: its config columns, then what its run recorded (its summary.json),
    and the CPUs its placement group held (from its last result to Tune)."""
    target = target or sweep_target(spec.base)
    rows = []
    for trial_id, config, error, metrics in trials:
        run_dir = _run_dir(sweep_dir / "trials", trial_id)
        recorded = run_dir / "config.yaml" if run_dir else None
        # A trial with no result yet has no config in Tune's result; its run directory recorded it.
        if config:
            params = swept(config)
            run: RunConfig | None = trial_config(spec.base, params)
        elif recorded is not None and recorded.is_file():
            run = RunConfig.from_mapping(RunConfig.load_yaml(recorded), str(recorded))
            # Flat keys, as swept() gives a running trial's: only the options its strategy reads.
            recorded_values = run.to_dict()
            params = {name: recorded_values[name] for name in spec.dimensions if name in recorded_values}
        else:
            run, params = None, {}
        row: dict[str, Any] = {"trial_id": trial_id}
        row |= {name: getattr(run, name) if run else None for name in CONFIG_COLUMNS}
        row |= {name: value for name, value in params.items() if name not in row}
        row["global_batch_size"] = run.global_batch_size if run else None
        row["scaled_lr"] = None
        if run:
            row["scaled_lr"] = scaled_lr(run.lr, run.global_batch_size, run.base_batch_size, run.lr_scaling)
        summary = _summary(run_dir)
        # stopped: by the scheduler or the time budget (the run's own status; "interrupted" in sweeps of
        # earlier versions, and when it was ended by Ctrl-C); "stopped" too when it was ended before
        # it could record anything; pending: it never started (e.g. the time budget ran out first)
        status = "error" if error is not None else summary.get("status", "interrupted" if run_dir else "pending")
        if status == "unfinished":  # the summary a checkpoint wrote: the trial ended before its own
            status = "interrupted"
        row["status"] = "stopped" if status in ("interrupted", "stopped") else status
        row["stopped_early"] = row["status"] == "stopped"
        row["epochs_completed"] = summary.get("epochs_completed", 0)
        # What the sweep selects on (validation; a run recorded before the validation split: test) ...
        row["final_accuracy"] = summary.get("final_val_accuracy", summary.get("final_test_accuracy"))
        row["final_loss"] = summary.get("final_val_loss", summary.get("final_test_loss"))
        row["metric"] = target.metric  # the sweep's metric (the run's target) and its final value
        row["final_metric"] = summary.get(f"final_{target.metric}")
        # ... and the test set's figures, reported apart (scored once, at the run's end)
        row["test_accuracy"] = summary.get("final_test_accuracy")
        row["test_loss"] = summary.get("final_test_loss")
        row["test_metric"] = summary.get(f"final_test_{target.metric.split('_', 1)[1]}")
        row["time_to_target_s"] = summary.get("time_to_target_s")
        row["samples_per_s"] = summary.get("steady_state_samples_per_s")
        row["wall_time_s"] = summary.get("wall_time_s")
        row["reserved_cpus"] = metrics.get("reserved_cpus")
        row["run_dir"] = str(run_dir) if run_dir else ""
        lines = [line.strip() for line in strip_ansi(str(error or "")).splitlines() if line.strip()]
        row["error"] = lines[-1][:300] if error is not None and lines else ""  # the exception's own message
        rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    numeric = ("final_accuracy", "final_loss", "final_metric", "test_accuracy", "test_loss", "test_metric",
               "time_to_target_s", "samples_per_s", "wall_time_s")  # fmt: skip
    for name in (*numeric, "reserved_cpus"):
        table[name] = pd.to_numeric(table[name], errors="coerce")
    return sort_by_objective(table, spec.objective, higher_is_better=target.op == ">=")


def _run_dir(trials: Path, trial_id: str) -> Path | None:
    """The trial's latest run directory (a trial restarted by --resume has -2, -3, ...)."""
    attempts = [p for p in trials.glob(f"{trial_id}*") if p.name == trial_id or p.name.startswith(trial_id + "-")]
    return max(attempts, key=lambda p: int(p.name.rpartition("-")[2]) if p.name != trial_id else 1, default=None)


def _summary(run_dir: Path | None) -> dict[str, Any]:
    if run_dir is None or not (run_dir / "summary.json").is_file():
        return {}
    return json.loads((run_dir / "summary.json").read_text())


def write_results(table: pd.DataFrame, spec: SweepSpec, sweep_dir: Path) -> RunConfig | None:
    """results.parquet and results.csv (best first) and best.yaml (the best finished trial's config)."""
    atomic_write(sweep_dir / "results.parquet", lambda tmp: table.to_parquet(tmp, index=False))
    atomic_write(sweep_dir / "results.csv", lambda tmp: table.to_csv(tmp, index=False))
    if table.empty:
        return None
    usable = table[~table["status"].isin(["error", "pending"]) & table["final_metric"].notna()]
    if usable.empty:
        return None
    row = usable.iloc[0]
    recorded = Path(row["run_dir"]) / "config.yaml" if row["run_dir"] else None
    if recorded is not None and recorded.is_file():  # exactly what the trial ran
        best = RunConfig.from_mapping(RunConfig.load_yaml(recorded) | {"run_dir": ""}, str(recorded))
    else:
        values = {name: _plain(row[name]) for name in spec.dimensions}
        # a field of a strategy variant is empty (NaN) in the rows of trials whose strategy does not read it
        best = trial_config(spec.base, {k: v for k, v in values.items() if not pd.isna(v)})
    atomic_write_text(sweep_dir / "best.yaml", best.to_yaml())
    return best


def _plain(value: Any) -> Any:
    """numpy scalars from the DataFrame back to Python values for RunConfig."""
    return value.item() if hasattr(value, "item") else value
