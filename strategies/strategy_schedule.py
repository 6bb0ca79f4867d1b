"""`--schedule "name[:epochs],..."`: strategies run in sequence, switching at epoch marks.

E.g. "bsp:2,local-sgd" (post-local SGD, Lin et al. ICLR'20): BSP for 2 epochs, then local SGD to
--epochs. Every entry but the last names its epochs; the last may omit them (it runs to --epochs) or
name them, in which case the entries must add up to --epochs exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from distrain.errors import ConfigError


@dataclass(frozen=True)
class Phase:
    strategy: str
    start_epoch: int
    end_epoch: int  # exclusive


def parse_schedule(text: str, epochs: int) -> list[Phase]:
    from distrain.strategies.strategy_names import STRATEGIES

    entries = [e.strip() for e in text.split(",")]
    usage = "write it as name[:epochs],... e.g. bsp:2,local-sgd"
    phases: list[Phase] = []
    start = 0
    for i, entry in enumerate(entries):
        name, sep, count_text = (p.strip() for p in entry.partition(":"))
        if not name:
            raise ConfigError(f"--schedule {text!r} has an empty entry; {usage}")
        if name not in STRATEGIES.names():
            raise ConfigError(
                f"--schedule {text!r}: unknown strategy {name!r}; choose from: {', '.join(STRATEGIES.names())}"
            )
        last = i == len(entries) - 1
        if sep:
            try:
                count = int(count_text)
            except ValueError:
                raise ConfigError(f"--schedule {text!r}: {entry!r} needs a whole number of epochs; {usage}") from None
            if count < 1:
                raise ConfigError(f"--schedule {text!r}: {entry!r} must run >= 1 epoch")
        elif last:
            count = epochs - start
            if count < 1:
                raise ConfigError(
                    f"--schedule {text!r} leaves no epochs for {name!r} within --epochs {epochs}; "
                    "raise --epochs or shorten the earlier entries"
                )
        else:
            raise ConfigError(f"--schedule {text!r}: {entry!r} needs epochs (only the last may omit them); {usage}")
        if start + count > epochs:
            raise ConfigError(
                f"--schedule {text!r} exceeds --epochs {epochs} (its entries up to {entry!r} need "
                f"{start + count}); raise --epochs or shorten the schedule"
            )
        phases.append(Phase(name, start, start + count))
        start += count
    if start != epochs:
        raise ConfigError(
            f"--schedule {text!r} covers {start} epochs but --epochs is {epochs}; "
            "make them match or let the last entry omit its epochs"
        )
    return phases
