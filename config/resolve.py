"""Building a config's sections from flat values (flags, YAML keys): each value coerced to its field's
type, and what depends on other choices resolved into the frozen sections: the strategy a --schedule
starts with, the strategy's run defaults and default transport, the number of shards, the absolute
import paths of a --task and of a strategy plugin. No torch, no Ray."""

from __future__ import annotations

from typing import Any

from distrain.config import groups_section
from distrain.config.parsing import parse_workers
from distrain.config.sections import COMMON_FIELDS, OPTIMIZER_NAMES, SECTION_CLASSES
from distrain.config.strategy_options import strategies_named
from distrain.errors import ConfigError
from distrain.fields import coerce, fields_of


def resolve_sections(values: dict[str, Any]) -> dict[str, Any]:
    """The sections of a config from flat `values`: each value checked against its field's type, and
    what depends on other choices resolved (the strategy a schedule starts with, the transport, the
    number of shards, the task's and a strategy plugin's absolute paths)."""
    from distrain.plugins import absolute_import_path, check_import_path_exists, is_import_path, split_import_path

    values = groups_section.derive(values)  # --worker-group sets --workers, --batch-size, --gpus-per-worker
    workers_given = values.get("workers")
    max_given = values.pop("max_workers", None)  # a rebuilt config's (to_dict writes the range into `workers`)
    workers, max_workers = parse_workers(COMMON_FIELDS["workers"].default if workers_given is None else workers_given)
    if max_given:
        workers, max_workers = parse_workers((workers, max_given))
    values["workers"] = workers
    v = {name: coerce(info.kind, values.get(name, info.default), info.flag) for name, info in COMMON_FIELDS.items()}
    v["max_workers"] = max_workers
    if v["schedule"]:
        if v["epochs"] < 1:
            raise ConfigError(f"--epochs must be >= 1, got {v['epochs']}")
        from distrain.strategies.strategy_schedule import parse_schedule

        # The first entry is the run's strategy (and names the run directory).
        v["strategy"] = parse_schedule(v["schedule"], v["epochs"])[0].strategy
    if is_import_path(v["strategy"]):
        # Recorded absolute, so Tune trials (own working directories) and --config repeats load the same file.
        v["strategy"] = absolute_import_path(v["strategy"], "--strategy")
    phases = strategies_named(v["strategy"], v["schedule"], v["epochs"])
    strategy = phases[0]
    for name, default in strategy.run_defaults.items():
        if values.get(name) is None:
            v[name] = coerce(COMMON_FIELDS[name].kind, default, COMMON_FIELDS[name].flag)
    if not v["transport"]:
        v["transport"] = strategy.transports[0]
    if v["transport"] not in ("collective", "ps"):
        raise ConfigError(f"unknown --transport {v['transport']!r}; choose collective or ps")
    if v["transport"] not in strategy.transports:
        raise ConfigError(
            f"--transport {v['transport']} cannot carry --strategy {v['strategy']}; "
            f"it runs on: {', '.join(strategy.transports)}"
        )
    if v["schedule"] and v["transport"] != strategy.transports[0]:
        raise ConfigError(
            f"--transport {v['transport']} cannot be combined with --schedule: each phase runs on its "
            "strategy's default transport; drop --transport"
        )
    if v["transport"] == "ps" or any(s.transports[0] == "ps" for s in phases):
        if v["ps_shards"] is None:  # --fsdp D, --tensor-parallel T: one PS shard per worker of a replica
            d, t = (v[k] if isinstance(v[k], int) and v[k] > 1 else 1 for k in ("fsdp", "tensor_parallel"))
            v["ps_shards"] = d * t  # (strategies/sharded_ps.py; config/layout_section.py `ps_shards_needed`)
        if v["ps_shards"] < 1:
            raise ConfigError(f"--ps-shards must be >= 1, got {v['ps_shards']}")
    elif v["ps_shards"] is not None:
        raise ConfigError("--ps-shards needs the parameter-server transport; add --transport ps or drop it")
    if v["task"] and not v["task"].startswith("object:"):  # object: a task object handed to distrain.fit
        split_import_path(v["task"], "--task")
        v["task"] = absolute_import_path(v["task"], "--task")
        check_import_path_exists(v["task"], "--task")
    if v["optimizer"].lower() in OPTIMIZER_NAMES:  # any case; an unknown name is reported as given
        v["optimizer"] = v["optimizer"].lower()
    return {
        section: cls(**{info.name: v[info.name] for info in fields_of(cls) if info.name != "options"})
        for section, cls in SECTION_CLASSES.items()
    }
