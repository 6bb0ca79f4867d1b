"""`distrain strategies`: the built-in strategies, each with what it does, its transports and options."""

from __future__ import annotations

from distrain.commands import console as consoles


def list_strategies() -> None:
    from distrain.compression.spec import FLAG as CODEC_FLAG
    from distrain.fields import fields_of
    from distrain.strategies import STRATEGIES

    out = consoles.out
    for name, text in STRATEGIES.describe().items():
        cls = STRATEGIES.get(name)
        flags = " ".join(info.flag for info in fields_of(cls.Options))
        out.print(f"{name:<11} {text}", highlight=False)
        out.print(f"{'':<11}   transports: {', '.join(cls.transports)}" + (f"; options: {flags}" if flags else ""),
                  highlight=False)  # fmt: skip
        if cls.compresses:
            out.print(f"{'':<11}   {CODEC_FLAG} applies to: {cls.compresses}", highlight=False)
