"""`--compress` as data: which codec, with which argument. Torch-free (the CLI validates flags with it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distrain.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from distrain.compression.base import Codec

CODECS: tuple[str, ...] = ("fp16", "bf16", "int8", "topk:FRACTION", "powersgd:RANK")
_CHOICES = "choose fp16, bf16, int8, topk:FRACTION or powersgd:RANK"
_PLAIN = ("fp16", "bf16", "int8")


@dataclass(frozen=True)
class CodecSpec:
    name: str  # "fp16" | "bf16" | "int8" | "topk" | "powersgd"
    fraction: float | None = None  # topk only, in (0, 1]
    rank: int | None = None  # powersgd only, >= 1

    def __post_init__(self) -> None:
        text = str(self)
        if self.name in _PLAIN:
            if self.fraction is not None or self.rank is not None:
                raise ConfigError(f"--compress {text}: {self.name} takes no argument; {_CHOICES}")
        elif self.name == "topk":
            if self.rank is not None:
                raise ConfigError(f"--compress {text}: topk takes a fraction, not a rank (topk:FRACTION)")
            if self.fraction is None:
                raise ConfigError("--compress topk: the fraction is missing; write topk:FRACTION, e.g. topk:0.01")
            if isinstance(self.fraction, bool) or not isinstance(self.fraction, int | float):
                raise ConfigError(f"--compress {text}: the fraction must be a number in (0, 1]")
            if not 0 < self.fraction <= 1:  # NaN fails this too
                raise ConfigError(f"--compress {text}: the fraction must be in (0, 1]")
        elif self.name == "powersgd":
            if self.fraction is not None:
                raise ConfigError(f"--compress {text}: powersgd takes a rank, not a fraction (powersgd:RANK)")
            if self.rank is None:
                raise ConfigError("--compress powersgd: the rank is missing; write powersgd:RANK, e.g. powersgd:4")
            if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
                raise ConfigError(f"--compress {text}: the rank must be an integer >= 1")
        else:
            raise ConfigError(f"--compress: unknown codec {self.name!r}; {_CHOICES}")

    @property
    def error_feedback(self) -> bool:
        """Whether the sender keeps a residual (biased codecs); the casts lose too little to need one."""
        return self.name in ("int8", "topk", "powersgd")

    @property
    def needs_shapes(self) -> bool:
        """Whether the codec needs the tensors' shapes (PowerSGD compresses whole matrices)."""
        return self.name == "powersgd"

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.name}:{self.fraction!r}"
        if self.rank is not None:
            return f"{self.name}:{self.rank!r}"
        return self.name

    def build(self, shapes: Sequence[tuple[int, ...]] | None = None) -> Codec:
        """The codec (imports torch). `shapes` cut the flat buffer into tensors; only PowerSGD uses them."""
        if self.name in ("fp16", "bf16"):
            from distrain.compression.cast import CastCodec

            return CastCodec(self)
        if self.name == "int8":
            from distrain.compression.int8 import Int8Codec

            return Int8Codec(self)
        if self.name == "topk":
            from distrain.compression.topk import TopKCodec

            return TopKCodec(self)
        from distrain.compression.powersgd import PowerSGDCodec

        return PowerSGDCodec(self, shapes)


def parse_codec(text: str) -> CodecSpec | None:
    """`--compress` TEXT -> its spec; "none" -> None. A bad value raises a one-line ConfigError."""
    raw = text.strip()
    name, sep, arg = raw.partition(":")
    name = name.strip().lower()
    arg = arg.strip()
    if name == "none" and not sep:
        return None
    shown = raw.replace("\n", " ")
    if name in _PLAIN:
        if sep:
            raise ConfigError(f"--compress {shown}: {name} takes no argument; {_CHOICES}")
        return CodecSpec(name)
    if name == "topk":
        if not arg:
            raise ConfigError("--compress topk: the fraction is missing; write topk:FRACTION, e.g. topk:0.01")
        try:
            fraction = float(arg)
        except ValueError:
            raise ConfigError(f"--compress {shown}: the fraction must be a number in (0, 1]") from None
        if not math.isfinite(fraction) or not 0 < fraction <= 1:
            raise ConfigError(f"--compress {shown}: the fraction must be in (0, 1]")
        return CodecSpec("topk", fraction=fraction)
    if name == "powersgd":
        if not arg:
            raise ConfigError("--compress powersgd: the rank is missing; write powersgd:RANK, e.g. powersgd:4")
        if not (arg.isascii() and arg.isdigit()) or int(arg) < 1:
            raise ConfigError(f"--compress {shown}: the rank must be an integer >= 1")
        return CodecSpec("powersgd", rank=int(arg))
    raise ConfigError(f"--compress: unknown codec {shown!r}; {_CHOICES}")
