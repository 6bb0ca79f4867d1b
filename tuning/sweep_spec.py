"""What a `distrain tune` sweep varies, parsed and checked without Ray (so bad input fails before any trial).

A dimension is a RunConfig field with either a list of values ("16,32,64": a grid axis, or a random
choice) or a real range ("0.01:0.5" uniform, "0.01:0.5:log" log-uniform; random search only). Every
value is checked by building the RunConfig a trial would run and making `distrain run`'s own checks
on it (run_checks: the data set holds a global batch, ...), so a sweep never starts a trial that
`distrain run` would refuse.

A strategy's own fields (staleness, tau, ...: those it lists in `reads`) go only to the trials that
run a strategy reading them: `--strategies bsp,ssp --staleness 0,2` is one bsp trial and two ssp
trials. Such a sweep has one axis of strategy variants ({"strategy": "ssp", "staleness": 2}, ...)
in place of the strategy axis and those fields' axes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from distrain.config import COMMON_FIELDS, RunConfig, known_option_fields, option_fields, overlay
from distrain.errors import ConfigError, ResourceError
from distrain.orchestrator.run_checks import check_init_from, check_runnable
from distrain.orchestrator.trial_resources import trial_cpus, trial_gpus
from distrain.strategies import STRATEGIES
from distrain.strategies.strategy_lookup import strategy_class
from distrain.units import parse_worker_counts

SEARCHES = ("grid", "random")
SCHEDULERS = ("none", "asha")
# final_metric: the final value of the run's target metric (--target, or the task's default), best
# first in the target's direction; final_accuracy is its older name (classification's target metric).
OBJECTIVES = ("time_to_target", "final_metric", "final_accuracy")
# Fields a sweep sets itself (per trial) and so cannot vary.
NOT_SWEEPABLE = ("run_dir", "address", "eval_every")
GRID_LIMIT = 10_000  # combinations checked one by one before the sweep starts
VARIANTS = "strategy_variant"  # the axis of (strategy, its own fields' values) in a trial's Tune config


@dataclass(frozen=True)
class Choice:
    values: tuple[Any, ...]


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    log: bool


Dimension = Choice | Range


# A trial's placement group is reserved whole when Tune starts it, so its membership cannot change.
TUNE_REFUSES_RANGE = "tune runs each trial in a fixed placement group, so it takes worker counts (2,4), not ranges"


def _field_kind(name: str) -> str:
    try:
        info = RunConfig.field_info(name)
    except ConfigError:
        valid = ", ".join([*COMMON_FIELDS, *known_option_fields()])
        raise ConfigError(f"unknown config field {name!r} to sweep; valid fields: {valid}") from None
    if name in NOT_SWEEPABLE:
        raise ConfigError(f"{name} is set by the sweep itself and cannot be swept; drop it")
    return info.kind.removesuffix(" | None")


def _value(kind: str, text: str, flag: str) -> Any:
    text = text.strip()
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not {'an integer' if kind == 'int' else 'a number'}") from None
    if kind == "bool":
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"{flag}: {text!r} is not true or false")
    if kind == "str":
        return text
    raise ConfigError(f"{flag} cannot be swept (a {kind} field)")


def parse_dimension(name: str, text: str, flag: str | None = None) -> Dimension:
    """'16,32,64' -> Choice; 'LOW:HIGH' or 'LOW:HIGH:log' -> Range (real-valued fields only)."""
    flag = flag or f"--param {name}"
    kind = _field_kind(name)
    text = (text or "").strip()
    if name == "workers" and ".." in text:
        raise ConfigError(f"{flag} {text!r}: {TUNE_REFUSES_RANGE}")
    if not text:
        raise ConfigError(f"{flag} is empty; give values like 16,32,64 or a range like 0.01:0.5:log")
    if name == "workers":  # one grammar for worker counts: the comma list `plan` reads too
        return Choice(tuple(parse_worker_counts(text, flag)))
    if ":" in text and kind != "str":
        parts = text.split(":")
        if kind != "float":
            raise ConfigError(f"{flag} {text!r}: ranges apply to real-valued fields; list the values instead (a,b,c)")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2].strip() not in ("log", "lin")):
            raise ConfigError(f"{flag} {text!r} is not a range; write LOW:HIGH or LOW:HIGH:log")
        low, high = (_value("float", p, flag) for p in parts[:2])
        log = len(parts) == 3 and parts[2].strip() == "log"
        if low >= high:
            raise ConfigError(f"{flag} {text!r}: the range's low end must be below its high end")
        if log and low <= 0:
            raise ConfigError(f"{flag} {text!r}: a log range needs a positive low end")
        return Range(low, high, log)
    items = [t for t in text.split(",")]
    if any(not t.strip() for t in items):
        raise ConfigError(f"{flag} {text!r} has an empty value; write values like 16,32,64")
    values = tuple(dict.fromkeys(_value(kind, t, flag) for t in items))  # duplicates would repeat trials
    return Choice(values)


def parse_param(spec: str) -> tuple[str, Dimension]:
    """--param NAME=VALUES for any other RunConfig field, e.g. momentum=0.8,0.9 or staleness=0,2,8."""
    name, sep, text = spec.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not name:
        raise ConfigError(f"--param {spec!r} must be NAME=VALUES, e.g. momentum=0.8,0.9")
    return name, parse_dimension(name, text, f"--param {name}")


def plugin_strategies(dimension: Dimension) -> Dimension:
    """A --strategies list with strategies named by import path made absolute and imported, so that
    their options are fields `--param` can sweep."""
    from distrain.plugins import absolute_import_path, is_import_path

    if not isinstance(dimension, Choice):
        return dimension
    values = tuple(absolute_import_path(v, "--strategies") if is_import_path(str(v)) else v for v in dimension.values)
    for value in values:
        strategy_class(str(value))
    return Choice(values)


def flatten(point: dict[str, Any]) -> dict[str, Any]:
    """A trial's swept values as field -> value: a strategy variant's fields in place of the variant."""
    values = {k: v for k, v in point.items() if k != VARIANTS}
    return values | dict(point.get(VARIANTS) or {})


def sweep_base(config_file: str | None, flags: dict[str, Any]) -> dict[str, Any]:
    """The sweep's base: only what the --config file and the sweep's flags set, as resolved (the task's
    and data's paths absolute: trials run in Tune's own working directories). Defaults stay out, so
    each trial takes its own strategy's (`Strategy.run_defaults`: diloco's inner --lr 0.01, not bsp's
    0.05) unless the sweep sets the value; a trial is what `distrain run` with the same file and flags
    plus the trial's values runs."""
    resolved = RunConfig.resolve(config_file, flags)  # every check `distrain run` makes on them
    for name in ("data_dir", "init_from"):
        if getattr(resolved, name):
            resolved = resolved.replace(**{name: str(Path(getattr(resolved, name)).absolute())})
    values = resolved.to_dict()
    return {name: values.get(name, value) for name, value in RunConfig.given_values(config_file, flags).items()}


def trial_config(base: dict[str, Any], params: dict[str, Any], run_dir: str = "") -> RunConfig:
    """The RunConfig one trial runs: the base with the trial's values (flags over a file, as in
    RunConfig.resolve: a different strategy or optimizer starts from its own defaults)."""
    values = overlay(base, flatten(params))
    values["run_dir"] = run_dir
    values["eval_every"] = 1  # schedulers compare trials on every epoch's validation figures
    return RunConfig.from_mapping(values)


@dataclass
class SweepSpec:
    base: dict[str, Any]  # a validated RunConfig as a mapping
    dimensions: dict[str, Dimension]
    search: str = "grid"
    num_samples: int = 1
    scheduler: str = "none"
    grace_period: int = 1
    reduction_factor: float = 2.0
    max_concurrent_trials: int = 0  # 0: as many as the cluster holds
    time_budget_s: float = 0.0  # 0: no limit
    objective: str = "time_to_target"
    notes: list[str] = field(default_factory=list)

    @property
    def base_config(self) -> RunConfig:
        """The base resolved on its own (the defaults of its strategy, bsp unless it names one)."""
        return RunConfig.from_mapping(self.base)

    def validate(self) -> None:
        if self.search not in SEARCHES:
            raise ConfigError(f"unknown --search {self.search!r}; choose one of: {', '.join(SEARCHES)}")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"unknown --scheduler {self.scheduler!r}; choose one of: {', '.join(SCHEDULERS)}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"unknown --objective {self.objective!r}; choose one of: {', '.join(OBJECTIVES)}")
        if self.num_samples < 1:
            raise ConfigError(f"--num-samples must be >= 1, got {self.num_samples}")
        if self.max_concurrent_trials < 0:
            raise ConfigError(f"--max-concurrent-trials must be >= 0, got {self.max_concurrent_trials}")
        if not (self.time_budget_s >= 0 and math.isfinite(self.time_budget_s)):
            raise ConfigError(f"--time-budget must be >= 0 seconds, got {self.time_budget_s}")
        if self.grace_period < 1:
            raise ConfigError(f"--grace-period must be >= 1 epoch, got {self.grace_period}")
        epochs = self.base_config.epochs
        if self.scheduler == "asha" and self.grace_period > epochs:
            raise ConfigError(f"--grace-period ({self.grace_period}) exceeds --epochs ({epochs})")
        if self.search == "grid":
            for name, dim in self.dimensions.items():
                if isinstance(dim, Range):
                    raise ConfigError(
                        f"--{name.replace('_', '-')} is a range, which grid search cannot enumerate; "
                        "list values (a,b,c) or add --search random"
                    )
        self.axes()  # refuses a strategy field that no swept strategy reads
        checked: set[tuple[Any, ...]] = set()
        for config in self.sample_configs():  # building each one is RunConfig's check
            if config.elastic:  # the base config's (--config), as a swept value is refused when parsed
                given = f"{config.workers}..{config.max_workers}"
                raise ConfigError(f"--workers {given} (the base config's): {TUNE_REFUSES_RANGE}")
            key = _runnable_key(config)
            if key not in checked:  # run's own checks, once per distinct set of what they read
                checked.add(key)
                check_init_from(config, check_runnable(config))

    def strategy_fields(self) -> list[str]:
        """Swept strategy fields that go only to the trials whose strategy reads them: all of them when
        the strategy is swept too (with one strategy, RunConfig refuses a field it does not read)."""
        if not isinstance(self.dimensions.get("strategy"), Choice):
            return []
        options = known_option_fields()
        return [name for name in self.dimensions if name in options]

    def axes(self) -> dict[str, Dimension]:
        """What Tune varies: the dimensions, with the strategy and its fields as one axis of variants
        when they are swept together (so a strategy never gets a field it does not read)."""
        fields = self.strategy_fields()
        if not fields:
            return dict(self.dimensions)
        strategies = self.dimensions["strategy"].values  # type: ignore[union-attr]
        reads = {name: set(option_fields([strategy_class(name)])) for name in strategies}
        for name in fields:
            if not any(name in r for r in reads.values()):
                users = [n for n in STRATEGIES.names() if name in option_fields([STRATEGIES.get(n)])]
                raise ConfigError(
                    f"--{name.replace('_', '-')} is not used by any of --strategies {','.join(strategies)}; "
                    f"drop it or add a strategy that reads it ({', '.join(users)})"
                )
        variants = []
        for strategy in strategies:
            own = [name for name in fields if name in reads[strategy]]
            spans = [self.dimensions[name].values for name in own]  # type: ignore[union-attr]
            for combo in itertools.product(*spans):
                variants.append({"strategy": strategy} | dict(zip(own, combo, strict=True)))
        axes = {name: dim for name, dim in self.dimensions.items() if name != "strategy" and name not in fields}
        return {VARIANTS: Choice(tuple(variants))} | axes

    def grid_size(self) -> int:
        size = 1
        for dim in self.axes().values():
            size *= len(dim.values) if isinstance(dim, Choice) else 1
        return size

    def num_trials(self) -> int:
        return self.grid_size() * self.num_samples if self.search == "grid" else self.num_samples

    def sample_configs(self) -> list[RunConfig]:
        """Configs that cover every value a trial can take: every combination of the listed values and
        the ranges' ends (each value on its own past GRID_LIMIT combinations). Raises on the first
        invalid one."""
        axes = self.axes()
        names = list(axes)
        spans = [d.values if isinstance(d, Choice) else (d.low, d.high) for d in axes.values()]
        if math.prod(len(s) for s in spans) <= GRID_LIMIT:
            points = [dict(zip(names, combo, strict=True)) for combo in itertools.product(*spans)]
        else:
            points = [{name: v} for name, span in zip(names, spans, strict=True) for v in span]
        return [trial_config(self.base, p) for p in points or [{}]]

    def check_cluster_cpus(self, cluster_cpus: int) -> None:
        """--cluster-cpus sizes the local Ray this sweep starts: >= 0 (0: this machine's cores), and it
        must hold the largest trial (refused here, before Ray starts, rather than by check_fits after)."""
        if cluster_cpus < 0:
            raise ConfigError(f"--cluster-cpus must be >= 0 (0: this machine's cores), got {cluster_cpus}")
        if not cluster_cpus:
            return
        if self.base.get("address"):
            raise ConfigError("--cluster-cpus sizes a local Ray; drop it with --address (that cluster has its own)")
        largest = self.largest_trial()
        if trial_cpus(largest) > cluster_cpus + 1e-9:
            raise ResourceError(
                f"a trial with {largest.workers} workers needs {trial_cpus(largest):g} CPUs but --cluster-cpus is "
                f"{cluster_cpus}; raise --cluster-cpus, or lower --workers or --cpus-per-worker"
            )

    def largest_trial(self) -> RunConfig:
        """The sampled config needing the most CPUs (then GPUs): it must fit the cluster."""
        return max(self.sample_configs(), key=lambda c: (trial_cpus(c), trial_gpus(c)))


def _runnable_key(config: RunConfig) -> tuple[Any, ...]:
    """Everything run_checks reads: trials that agree on it pass or fail those checks together."""
    return (
        config.dataset, config.data_dir, config.samples_per_step, config.model, config.transport,
        config.ps_shards, config.init_from, config.val_fraction,
    )  # fmt: skip


def sort_by_objective(table: pd.DataFrame, objective: str, higher_is_better: bool = True) -> pd.DataFrame:
    """time_to_target: the trials that reached the target, fastest first, then the rest by the final
    value of the target metric (`final_metric`, else `final_accuracy`); final_metric (final_accuracy):
    best first, highest or lowest as the target says. Trials that failed or never ran last."""
    column = "final_metric" if "final_metric" in table else "final_accuracy"
    value = pd.to_numeric(table[column], errors="coerce")
    key = pd.DataFrame(
        {
            "error": table["status"].isin(["error", "pending"]),
            "missed": table["time_to_target_s"].isna() if objective == "time_to_target" else False,
            "time": table["time_to_target_s"] if objective == "time_to_target" else 0.0,
            "metric": -value if higher_is_better else value,  # NaN (no result) sorts last
        }
    )
    order = key.sort_values(["error", "missed", "time", "metric"], na_position="last", kind="stable").index
    return table.loc[order].reset_index(drop=True)
