"""`--compress` as data: which codec, with which argument. Torch-free (the CLI validates flags with it).

Codecs are found, not listed: every module of this package that declares a module-level `CODECS`
literal is one, e.g. (compression/sign.py)

    CODECS = [{"name": "sign", "class": "SignCodec", "error_feedback": True, "order": 60}]

Keys: `name` (what --compress takes), `class` (the `Codec` subclass in that module), `argument`
(None, "fraction": name:FRACTION in (0, 1], or "rank": name:RANK >= 1), `error_feedback` (the sender
keeps a residual), `needs_shapes` (it compresses whole matrices, so it is built with the tensors'
shapes), `reduction` (how workers combine it, strategies/compressed_collective.py: "gather", the
default: every rank's encoding all-gathered and decoded; "sum": summed as encoded (the casts);
"rounds": the codec's encode runs the all-reduces itself (PowerSGD)), `order` (place in the lists
shown). The declaration is read from the module's source (`ast.literal_eval`), so parsing a flag
imports no codec and no torch; the codec's module is imported by `CodecSpec.build()`. A new codec is
one file in this package.
"""

from __future__ import annotations

import ast
import importlib
import math
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distrain.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from distrain.compression.base import Codec

FLAG = "--compress"  # the option's one spelling: other modules' messages name it through this
KEY = "compress"  # its key in a run's config (config.yaml) and summary.json: other modules read it through this
_DEFAULTS: dict[str, Any] = {
    "argument": None,
    "error_feedback": False,
    "needs_shapes": False,
    "reduction": "gather",
    "order": 1000,
}
_EXAMPLE = {"fraction": "0.01", "rank": "4"}


def _declared(path: Path) -> list[dict[str, Any]]:
    """The `CODECS` literal of a module's source ([] if it declares none)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(node, ast.AnnAssign):
            target = node.target
        if isinstance(target, ast.Name) and target.id == "CODECS" and node.value is not None:
            return list(ast.literal_eval(node.value))
    return []


def _discover() -> dict[str, dict[str, Any]]:
    here = Path(__file__).parent
    found: dict[str, dict[str, Any]] = {}
    for module in pkgutil.iter_modules([str(here)]):
        if module.ispkg or module.name == "spec":
            continue
        for declared in _declared(here / f"{module.name}.py"):
            entry = {**_DEFAULTS, **declared, "module": f"distrain.compression.{module.name}"}
            if entry["name"] in found:
                raise RuntimeError(f"codec {entry['name']!r} is declared twice ({found[entry['name']]['module']})")
            if entry["argument"] not in (None, "fraction", "rank"):
                raise RuntimeError(f"codec {entry['name']!r}: argument must be None, 'fraction' or 'rank'")
            found[entry["name"]] = entry
    return dict(sorted(found.items(), key=lambda kv: (kv[1]["order"], kv[0])))


REGISTRY: dict[str, dict[str, Any]] = _discover()


def _syntax(entry: dict[str, Any]) -> str:
    return entry["name"] + (f":{entry['argument'].upper()}" if entry["argument"] else "")


CODECS: tuple[str, ...] = tuple(_syntax(e) for e in REGISTRY.values())
_CHOICES = "choose " + (", ".join(CODECS[:-1]) + " or " + CODECS[-1] if len(CODECS) > 1 else CODECS[0])
# `--compress`'s help lists what is found here (so a new codec file shows up in --help and the CLI reference)
CODEC_HELP = (
    ", ".join(CODECS[:-1])
    + " or "
    + CODECS[-1]
    + " (with error feedback: "
    + ", ".join(e["name"] for e in REGISTRY.values() if e["error_feedback"])
    + ")"
)


def _missing(name: str, argument: str) -> ConfigError:
    upper = argument.upper()
    return ConfigError(
        f"{FLAG} {name}: the {argument} is missing; write {name}:{upper}, e.g. {name}:{_EXAMPLE[argument]}"
    )


@dataclass(frozen=True)
class CodecSpec:
    name: str  # a declared codec's name (see the module docstring)
    fraction: float | None = None  # codecs taking a fraction (topk), in (0, 1]
    rank: int | None = None  # codecs taking a rank (powersgd), >= 1

    def __post_init__(self) -> None:
        text = str(self)
        entry = REGISTRY.get(self.name)
        if entry is None:
            raise ConfigError(f"{FLAG}: unknown codec {self.name!r}; {_CHOICES}")
        argument = entry["argument"]
        if argument is None:
            if self.fraction is not None or self.rank is not None:
                raise ConfigError(f"{FLAG} {text}: {self.name} takes no argument; {_CHOICES}")
        elif argument == "fraction":
            if self.rank is not None:
                raise ConfigError(
                    f"{FLAG} {text}: {self.name} takes a fraction, not a rank ({self.name}:FRACTION)"
                )
            if self.fraction is None:
                raise _missing(self.name, "fraction")
            if isinstance(self.fraction, bool) or not isinstance(self.fraction, int | float):
                raise ConfigError(f"{FLAG} {text}: the fraction must be a number in (0, 1]")
            if not 0 < self.fraction <= 1:  # NaN fails this too
                raise ConfigError(f"{FLAG} {text}: the fraction must be in (0, 1]")
        else:
            if self.fraction is not None:
                raise ConfigError(f"{FLAG} {text}: {self.name} takes a rank, not a fraction ({self.name}:RANK)")
            if self.rank is None:
                raise _missing(self.name, "rank")
            if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
                raise ConfigError(f"{FLAG} {text}: the rank must be an integer >= 1")

    @property
    def error_feedback(self) -> bool:
        """Whether the sender keeps a residual (biased codecs); the casts lose too little to need one."""
        return bool(REGISTRY[self.name]["error_feedback"])

    @property
    def needs_shapes(self) -> bool:
        """Whether the codec needs the tensors' shapes (PowerSGD compresses whole matrices)."""
        return bool(REGISTRY[self.name]["needs_shapes"])

    @property
    def reduction(self) -> str:
        """How the workers combine its encodings: "gather", "sum" or "rounds" (see the module docstring)."""
        return str(REGISTRY[self.name]["reduction"])

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.name}:{self.fraction!r}"
        if self.rank is not None:
            return f"{self.name}:{self.rank!r}"
        return self.name

    def build(self, shapes: Sequence[tuple[int, ...]] | None = None) -> Codec:
        """The codec (imports its module, and torch). `shapes` cut the flat buffer into tensors; only
        codecs that declare `needs_shapes` take them."""
        entry = REGISTRY[self.name]
        cls = getattr(importlib.import_module(entry["module"]), entry["class"])
        return cls(self, shapes) if entry["needs_shapes"] else cls(self)


def codec_of(run: Any) -> CodecSpec | None:
    """The codec a run's traffic goes through (`run`: its RunConfig), or None."""
    text = getattr(run, KEY)
    return parse_codec(text) if text else None


def codec_figures(steps: Any, config: dict[str, Any]) -> dict[str, Any]:
    """summary.json: the codec and its ratio, uncompressed over sent bytes of the compressed transfers
    (None: nothing compressed yet), from the step rows (a DataFrame) and the run's flat config; nothing
    without a codec."""
    codec = config.get(KEY)
    if not codec:
        return {}
    if "bytes_uncompressed" not in steps:
        return {KEY: codec, "codec_ratio": None}
    rows = steps.dropna(subset=["bytes_uncompressed"])
    sent = rows["bytes_sent"].sum()
    return {KEY: codec, "codec_ratio": float(rows["bytes_uncompressed"].sum() / sent) if sent else None}


def codec_settings_text(config: dict[str, Any]) -> str:
    """The report's strategy column adds the codec: " + int8" (nothing without one)."""
    return f" + {config[KEY]}" if config.get(KEY) else ""


def parse_codec(text: str) -> CodecSpec | None:
    """`--compress` TEXT -> its spec; "none" -> None. A bad value raises a one-line ConfigError."""
    raw = text.strip()
    name, sep, arg = raw.partition(":")
    name = name.strip().lower()
    arg = arg.strip()
    if name == "none" and not sep:
        return None
    shown = raw.replace("\n", " ")
    entry = REGISTRY.get(name)
    if entry is None:
        raise ConfigError(f"{FLAG}: unknown codec {shown!r}; {_CHOICES}")
    argument = entry["argument"]
    if argument is None:
        if sep:
            raise ConfigError(f"{FLAG} {shown}: {name} takes no argument; {_CHOICES}")
        return CodecSpec(name)
    if not arg:
        raise _missing(name, argument)
    if argument == "fraction":
        try:
            fraction = float(arg)
        except ValueError:
            raise ConfigError(f"{FLAG} {shown}: the fraction must be a number in (0, 1]") from None
        if not math.isfinite(fraction) or not 0 < fraction <= 1:
            raise ConfigError(f"{FLAG} {shown}: the fraction must be in (0, 1]")
        return CodecSpec(name, fraction=fraction)
    if not (arg.isascii() and arg.isdigit()) or int(arg) < 1:
        raise ConfigError(f"{FLAG} {shown}: the rank must be an integer >= 1")
    return CodecSpec(name, rank=int(arg))
