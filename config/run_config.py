"""`RunConfig`: the one typed, checked description of a run, and the only thing passed down to the
orchestrator, strategies and trainers.

It is built once (flags over an optional YAML file over the defaults: `resolve`), from the sections
declared in `sections.py` (resolved by `resolve.py`) plus each strategy's own options
(`strategy_options.py`), then checked by the registered checks (`checks.py`); nothing is mutated after.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from distrain.config import groups_section, layout_section, shares_section, strategy_section, yaml_io
from distrain.config.checks import run_checks
from distrain.config.parsing import (
    ChaosEvent,
    Slowdown,
    Target,
    format_workers,
    overlay,
    parse_chaos,
    parse_stragglers,
    parse_target,
)
from distrain.config.resolve import resolve_sections
from distrain.config.section_checks import builtin_option_error
from distrain.config.sections import BUILTIN_TASK_FIELDS, COMMON_FIELDS, FIELD_SECTION
from distrain.config.strategy_options import (
    known_option_fields,
    option_fields,
    plugin_option_fields,
    strategies_named,
    strategy_options,
)
from distrain.errors import ConfigError
from distrain.fields import FieldInfo

if TYPE_CHECKING:
    from distrain.strategies.base import Strategy


class RunConfig:
    """A run, described by one frozen spec per concern (`SECTION_CLASSES`) plus the options of each
    strategy it uses (each strategy's own `Options` dataclass).

    Built from flat keys (flags, old config files) or nested sections (`from_mapping`). Building resolves
    what depends on other choices (the strategy's default transport, a strategy's default options, the
    task's absolute path) into new frozen objects, then checks every value; nothing is mutated after, and
    `replace` builds a new config. Flat reads (`config.workers`) reach into the sections; a strategy's own
    options are read through its Options only (`config.options_of("local-sgd").tau`).
    """

    def __init__(self, **values: Any) -> None:
        sections = resolve_sections(values)
        self.__dict__["_sections"] = sections
        options = strategy_options(self, values)  # resolved against the sections above
        sections["strategy"] = dataclasses.replace(sections["strategy"], options=options)
        self.validate()

    # ------------------------------------------------------------------ reading
    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("_sections")
        if sections is None or name.startswith("__"):
            raise AttributeError(name)
        section = FIELD_SECTION.get(name)
        if section is not None and name != "options":
            return getattr(sections[section], name)
        # A strategy's option is its own (issue 27): read through its Options, never as a flat field.
        owners = [n for n, options in sections["strategy"].options.items() if hasattr(options, name)]
        if owners or name in known_option_fields():
            owner = owners[0] if owners else _owner_of(name)
            raise AttributeError(
                f"{name!r} is an option of --strategy {owner}: read it as config.options_of({owner!r}).{name}"
            )
        raise AttributeError(f"RunConfig has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"RunConfig is immutable; use config.replace({name}=...)")

    def section(self, name: str) -> Any:
        """One section's frozen spec, e.g. config.section("resources").workers."""
        return self._sections[name]

    def options_of(self, strategy: str) -> Any:
        """The resolved `Options` of one strategy of this run (by its name, e.g. "local-sgd")."""
        try:
            return self._sections["strategy"].options[strategy]
        except KeyError:
            raise KeyError(f"strategy {strategy!r} is not used by this run") from None

    @property
    def strategy_name(self) -> str:
        """The run's (first) strategy's own name: "bsp", or a plugin's `name` ("easgd"), for labels."""
        return self.strategy_classes[0].name

    @property
    def strategy_classes(self) -> list[type[Strategy]]:
        return strategies_named(self.strategy, self.schedule, self.epochs)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with `changes`; a task object fit() ships (orchestrator/tasks.py) stays with it unless
        the task itself changes (the planner's calibration runs copies of the run's config)."""
        return _rebuild(self.to_dict() | changes, None if "task" in changes else self.__dict__.get("_task_object"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunConfig) and self.to_nested() == other.to_nested()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"RunConfig({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def __reduce__(self) -> Any:
        # Rebuilt from its values in another process (Ray ships configs to workers); a task object handed
        # to fit() (orchestrator/tasks.py) travels with it.
        return (_rebuild, (self.to_dict(), self.__dict__.get("_task_object")))

    def sections(self) -> dict[str, Any]:
        """Every section's frozen spec by name, in `SECTION_CLASSES` order."""
        return dict(self._sections)

    # ------------------------------------------------------------------ checks (read only)
    def validate(self) -> None:
        """Run every registered check (`checks.py`); the message of the first problem names the flag and
        the fix."""
        run_checks(self)

    def refuse_builtin_options(self, given: Iterable[str], where: str = "") -> None:
        """A user task brings its own model and data: refuse the built-in task's options that were given
        (a flag, a fit() argument, a key of a YAML file the user wrote) even at their default value, as
        `--model cnn` is, which would otherwise be ignored in silence (and recorded in config.yaml)."""
        if not self.task:
            return
        for name in BUILTIN_TASK_FIELDS:
            if name in given:
                raise builtin_option_error(self, name, where)

    @property
    def target_spec(self) -> Target | None:
        """The quality target given (--target, or --target-accuracy for the built-in task); None: the
        user task's own `default_target`, known once the task is loaded."""
        if self.target:
            return parse_target(self.target)
        if not self.task:
            return Target("val_accuracy", ">=", self.target_accuracy)
        return None

    # ------------------------------------------------------------------ derived values
    @property
    def logger_names(self) -> list[str]:
        """--loggers as a list of names, in the order given, each once."""
        return list(dict.fromkeys(n.strip().lower() for n in self.loggers.split(",") if n.strip()))

    @property
    def elastic(self) -> bool:
        """--workers MIN..MAX: membership changes while the run goes on (orchestrator/membership.py)."""
        return self.max_workers > 0

    @property
    def worker_range(self) -> tuple[int, int]:
        """(MIN, MAX) of the membership; (N, N) for a fixed size."""
        return self.workers, self.max_workers or self.workers

    @property
    def worker_slots(self) -> int:
        """Data-parallel ranks the run's books are kept for: N, or the MAX of a range. An elastic run's
        step is cut into MAX slices whoever is there to take them (each a B-sample unit), so the epoch's
        partition of samples never changes with the membership (algorithms.md, "Elastic membership")."""
        return self.max_workers or self.workers

    @property
    def global_batch_size(self) -> int:
        """Samples whose gradients make one update (the learning rate is scaled for this). An elastic
        run's is the MAX's: under the strategies that take a range each update is one worker's B samples
        whatever the membership, so the rate is the one the fixed run at MAX uses (docs/elastic.md). A
        sharded replica (--fsdp D) is D data-parallel ranks: R x D x B (D x T under a tensor-parallel
        hybrid plan, config/layout_section.py), times --accumulate-steps k. Under --worker-group: the sum of
        the groups' COUNT x BATCH (x k)."""
        return (
            groups_section.group_batch(self)
            or self.worker_slots * layout_section.data_ranks_per_replica(self) * self.unit_samples
        )

    @property
    def num_worker_actors(self) -> int:
        """Worker actors (ranks) the run has room for: --workers (an elastic run's MAX) plus any backup
        workers, times --pipeline-stages (each replica of the model is S actors, one per stage). Under a
        range the backups are among the MAX (a round applies members - b gradients)."""
        return strategy_section.replicas_per_step(self) * self.replica_size

    @property
    def replica_size(self) -> int:
        """Worker actors one replica spans: --fsdp D x --tensor-parallel T x --pipeline-stages S
        (config/layout_section.py)."""
        return math.prod(self.replica_grid)

    @property
    def replica_grid(self) -> tuple[int, int, int]:
        """(D, T, S): the FSDP shards, tensor-parallel workers and pipeline stages of one replica."""
        return layout_section.shards_per_replica(self), layout_section.tp_degree(self), strategy_section.stages(self)

    @property
    def pipelined(self) -> bool:
        return strategy_section.stages(self) > 1

    @property
    def sharded(self) -> bool:
        """--fsdp D > 1 or --tensor-parallel T > 1: each replica's parameters are cut over its workers."""
        shards, tp, _ = self.replica_grid
        return shards * tp > 1

    @property
    def samples_per_step(self) -> int:
        """Samples handed out per step: with backup workers, b x B more than the update uses (resource
        groups take no backups: their global batch)."""
        return groups_section.group_batch(self) or (
            strategy_section.replicas_per_step(self) * layout_section.data_ranks_per_replica(self) * self.unit_samples
        )

    @property
    def unit_samples(self) -> int:
        """Samples one data-parallel rank computes per update: --accumulate-steps k micro-batches of B."""
        return self.accumulate_steps * self.batch_size

    @property
    def worker_shares(self) -> tuple[int, ...] | None:
        """Each worker's samples per step under --worker-weights or --worker-group, in rank order (a
        replica's, for a pipeline's or a cut replica's workers; None: equal slices)."""
        return shares_section.worker_shares(self)

    @property
    def unequal_shares(self) -> bool:
        """Whether workers may take unequal shares of a step (--worker-weights, --worker-group, --balance
        speed): for the strategies, which do not import the config's sections."""
        return shares_section.unequal_shares(self)

    @property
    def stragglers(self) -> dict[int, Slowdown]:
        """Injected slowdowns by worker rank (--straggler)."""
        return parse_stragglers(self.straggler, self.num_worker_actors)

    @property
    def chaos_events(self) -> list[ChaosEvent]:
        return parse_chaos(self.chaos, self.worker_slots * self.replica_size, self.ps_shards)

    @property
    def uses_gpus(self) -> bool:
        return self.gpus_per_worker > 0

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Flat keys (as flags name them): every section's fields, then the options of the strategies used."""
        flat = {name: yaml_io.plain(getattr(self._sections[FIELD_SECTION[name]], name)) for name in COMMON_FIELDS}
        flat["workers"] = format_workers(self.workers, self.max_workers)  # a range is written as it is given
        for options in self._sections["strategy"].options.values():
            flat |= dataclasses.asdict(options)
        return flat

    def to_nested(self) -> dict[str, dict[str, Any]]:
        """Sections as config.yaml holds them; the strategy section nests each strategy's options."""
        return yaml_io.to_nested(self)

    def to_yaml(self) -> str:
        """config.yaml: one commented block per section, each field with its help text."""
        return yaml_io.to_yaml(self)

    @classmethod
    def field_names(cls, values: dict[str, Any] | None = None) -> list[str]:
        """Every flat key a config may hold: the sections' fields and the strategies' options (the
        built-in strategies', and those of a strategy `values` names by import path)."""
        names = list(COMMON_FIELDS) + list(option_fields())
        if values is not None:
            names += [n for n in plugin_option_fields(values) if n not in names]
        return names

    @classmethod
    def field_info(cls, name: str, values: dict[str, Any] | None = None) -> FieldInfo:
        """One field's type, default, help and section, for the CLI and for Tune's sweep dimensions."""
        if name in COMMON_FIELDS:
            return COMMON_FIELDS[name]
        known = known_option_fields() | (plugin_option_fields(values) if values else {})
        if name in known:
            return known[name]
        valid = list(COMMON_FIELDS) + list(known)
        raise ConfigError(f"unknown config field {name!r}; valid fields: {', '.join(valid)}")

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "configuration") -> RunConfig:
        flat = yaml_io.flatten(values)
        unknown = sorted(set(flat) - set(cls.field_names(flat)) - set(known_option_fields()))
        if unknown:
            raise ConfigError(
                f"unknown key(s) {', '.join(unknown)} in {source}; valid keys: {', '.join(cls.field_names(flat))}"
            )
        return cls(**flat)

    @classmethod
    def load_yaml(cls, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read a YAML config file into a flat mapping (validated when merged into a RunConfig)."""
        return yaml_io.load_yaml(path)

    @classmethod
    def resolve(cls, config_file: str | None, overrides: dict[str, Any]) -> RunConfig:
        """Defaults, then the YAML file, then explicit flags (those not None)."""
        values, given = cls._file_and_flags(config_file, overrides)
        config = cls.from_mapping(overlay(values, given), config_file or "configuration")
        config.refuse_builtin_options(given)
        # A config.yaml distrain wrote holds every key (a user task's run records the built-in's defaults);
        # a file the user wrote holds what they chose.
        if config_file and not yaml_io.recorded_by_distrain(config_file):
            config.refuse_builtin_options(values, config_file)
        return config

    @classmethod
    def given_values(cls, config_file: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
        """What the YAML file and the explicit flags (those not None) set, flags over the file, before
        any default: what `resolve` builds from, and what a sweep's trials start from (each trial takes
        its own strategy's defaults for the rest, e.g. diloco's inner --lr)."""
        return overlay(*cls._file_and_flags(config_file, overrides))

    @classmethod
    def _file_and_flags(
        cls, config_file: str | None, overrides: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The YAML file's keys (checked to be known) and the explicit flags (those not None)."""
        values: dict[str, Any] = {}
        source = "configuration"
        if config_file:
            values.update(cls.load_yaml(config_file))
            source = config_file
        unknown = sorted(set(values) - set(cls.field_names(values)))
        if unknown:
            raise ConfigError(
                f"unknown key(s) {', '.join(unknown)} in {source}; valid keys: {', '.join(cls.field_names(values))}"
            )
        return values, {k: v for k, v in overrides.items() if v is not None}


def _owner_of(option: str) -> str:
    """The first strategy (built-in, or imported by path so far) whose Options declare `option`."""
    from distrain.strategies import STRATEGIES
    from distrain.strategies.strategy_lookup import loaded_plugins

    classes = [STRATEGIES.get(n) for n in STRATEGIES.names()] + loaded_plugins()
    return next(c.name for c in classes if option in option_fields([c]))


def _rebuild(values: dict[str, Any], task_object: Any) -> RunConfig:
    config = RunConfig(**values)
    if task_object is not None:
        config.__dict__["_task_object"] = task_object
    return config
