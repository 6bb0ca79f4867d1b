"""The run's spec layer: `RunConfig` and what builds, reads, writes and checks it. Below the orchestrator
(it imports nothing of it), above the strategies (whose `Options` it holds).

- `sections.py`: the frozen section dataclasses, each field a documented `setting`, and fixed choices;
  `strategy_section.py`: the strategy section (strategy, transport, link, codec, pipeline) and its checks;
  `layout_section.py`: the layout section (--fsdp: a replica sharded over D workers) and its checks
- `parsing.py`: values as flags and YAML write them (--workers MIN..MAX, --target, --chaos, ...), `overlay`
- `strategy_options.py`: the strategies a run uses and their own options
- `resolve.py`: flat values into the frozen sections (defaults that depend on other choices)
- `yaml_io.py`: config.yaml out, any config file in (nested, or the flat files of earlier versions)
- `checks.py`: the registry of checks; `section_checks.py` and `strategy_section.py` register theirs
- `run_config.py`: `RunConfig` itself

Everything callers import lives here under its old name (`from distrain.config import RunConfig`).
"""

from __future__ import annotations

# The checks register themselves on import (checks.py orders them by stage).
from distrain.config import layout_section as _layout_section  # noqa: F401
from distrain.config import section_checks as _section_checks  # noqa: F401
from distrain.config import shares_section as _shares_section  # noqa: F401
from distrain.config import strategy_section as _strategy_section  # noqa: F401
from distrain.config.checks import config_check
from distrain.config.parsing import (
    CHAOS_KINDS,
    ChaosEvent,
    Monitor,
    Target,
    format_workers,
    overlay,
    parse_chaos,
    parse_monitor,
    parse_optimizer_args,
    parse_stragglers,
    parse_target,
    parse_workers,
)
from distrain.config.run_config import RunConfig
from distrain.config.sections import (
    BUILTIN_TASK_FIELDS,
    COMMON_FIELDS,
    DECAY_DEPENDENT_FIELDS,
    FIELD_SECTION,
    LR_DECAYS,
    LR_SCALING_RULES,
    NESTED_NAME,
    ON_NONFINITE,
    OPTIMIZER_DEPENDENT_FIELDS,
    OPTIMIZER_NAMES,
    PLACEMENTS,
    PRECISIONS,
    REFUSED_OPTIMIZER_NAMES,
    SECTION_CLASSES,
    SKIPPED_SHARE_LIMIT,
    STRATEGY_COMMON_DEPENDENT,
    Checkpointing,
    Data,
    Faults,
    Optimization,
    Output,
    Resources,
    Stragglers,
    StrategySection,
)
from distrain.config.strategy_options import (
    known_option_fields,
    option_fields,
    strategies_named,
    strategy_dependent_fields,
)
from distrain.config.yaml_io import LEGACY_MOMENTUM, RECORDED_HEADER, flatten

__all__ = [
    "BUILTIN_TASK_FIELDS",
    "CHAOS_KINDS",
    "COMMON_FIELDS",
    "DECAY_DEPENDENT_FIELDS",
    "FIELD_SECTION",
    "LEGACY_MOMENTUM",
    "LR_DECAYS",
    "LR_SCALING_RULES",
    "NESTED_NAME",
    "ON_NONFINITE",
    "OPTIMIZER_DEPENDENT_FIELDS",
    "OPTIMIZER_NAMES",
    "PLACEMENTS",
    "PRECISIONS",
    "RECORDED_HEADER",
    "REFUSED_OPTIMIZER_NAMES",
    "SECTION_CLASSES",
    "SKIPPED_SHARE_LIMIT",
    "STRATEGY_COMMON_DEPENDENT",
    "ChaosEvent",
    "Checkpointing",
    "Data",
    "Faults",
    "Monitor",
    "Optimization",
    "Output",
    "Resources",
    "RunConfig",
    "StrategySection",
    "Stragglers",
    "Target",
    "config_check",
    "flatten",
    "format_workers",
    "known_option_fields",
    "option_fields",
    "overlay",
    "parse_chaos",
    "parse_monitor",
    "parse_optimizer_args",
    "parse_stragglers",
    "parse_target",
    "parse_workers",
    "strategies_named",
    "strategy_dependent_fields",
]
