"""The config's checks, registered by their owners: each is a function of the built `RunConfig` that
raises a `ConfigError` whose one line names the flag and the fix, and reads only.

`RunConfig.validate` runs them stage by stage (`STAGES`), in the order each stage's were registered, so
no one method needs to know every option: a section's checks of its own values are declared with the
sections (`section_checks.py`, stage "values"), those across sections by the section that owns them
(`strategy_section.py`, "across"), a strategy's in its `Options.check`. The "last" stage runs after all the
others (the optimizer's constructor, which loads torch: every other mistake is found without it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distrain.config.run_config import RunConfig

Check = Callable[["RunConfig"], None]

STAGES = ("values", "across", "last")
_CHECKS: dict[str, dict[str, Check]] = {stage: {} for stage in STAGES}  # by owner-qualified name


def config_check(fn: Check | None = None, *, stage: str = "values") -> Check | Callable[[Check], Check]:
    """Register `fn` as a check of every config (a decorator, bare or as `config_check(stage="across")`).
    Registering a function of the same module and name again replaces it (a module reloaded)."""
    if stage not in STAGES:
        raise ValueError(f"unknown check stage {stage!r}; one of {STAGES}")

    def register(check: Check) -> Check:
        _CHECKS[stage][f"{check.__module__}.{check.__qualname__}"] = check
        return check

    return register(fn) if fn is not None else register


def registered() -> list[Check]:
    """Every check, in the order `validate` runs them."""
    return [check for stage in STAGES for check in _CHECKS[stage].values()]


# Called with a config whose torch-free stages passed, before the "last" stage loads torch: `distrain run`
# begins its local Ray there (orchestrator/ray_start.py), so that it comes up while torch loads.
_before_torch: list[Check] = []


@contextlib.contextmanager
def before_torch(fn: Check) -> Iterator[None]:
    """Call `fn` with each config that passed every check but the last stage's, for the block's length."""
    _before_torch.append(fn)
    try:
        yield
    finally:
        _before_torch.remove(fn)


def run_checks(config: RunConfig) -> None:
    for stage in STAGES:
        if stage == "last":
            for fn in list(_before_torch):
                fn(config)
        for check in _CHECKS[stage].values():
            check(config)
