"""Config files in and out: config.yaml as distrain writes it (one commented block per section, each
strategy's options nested under its name), and reading any config file back into flat keys: nested
sections, and the flat files of earlier versions alike (`flatten`). A key given twice in one mapping is
refused; so is anything that is not a mapping of keys, each in one line naming the file."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from distrain.config.parsing import format_workers
from distrain.config.sections import NESTED_NAME, SECTION_CLASSES
from distrain.errors import ConfigError
from distrain.fields import fields_of

if TYPE_CHECKING:
    from distrain.config.run_config import RunConfig

# The first line of every config.yaml distrain writes (runs, sweeps' best.yaml).
RECORDED_HEADER = "# distrain run configuration: `distrain run --config THIS_FILE` repeats the run."
# Before --momentum became the choice of optimizers that read it, every run recorded its 0.9 default;
# recorded adam/adagrad runs with that value still load (config.yaml starts with RECORDED_HEADER).
LEGACY_MOMENTUM = (0.9, ("adam", "adagrad"))


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, again: int) -> None:
        super().__init__(key)
        self.key, self.first, self.again = key, first, again


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is refused: PyYAML keeps the last
    one silently, so `workers: 2` further down a file would quietly undo an earlier `workers: 8`."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` merges; it is not a key
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: the base class reports it as malformed YAML
                continue
        return super().construct_mapping(node, deep=deep)


def flatten(mapping: dict[str, Any]) -> dict[str, Any]:
    """A config mapping as flat keys: nested sections (what config.yaml holds now) are opened; flat keys
    (what config files written before the sections held, and what flags give) stay as they are."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if key in SECTION_CLASSES and isinstance(value, dict):
            for name, inner in value.items():
                if key == "strategy" and isinstance(inner, dict):  # one strategy's own options
                    for option, v in inner.items():
                        if option in flat and flat[option] != v:
                            raise ConfigError(
                                f"option {option!r} is given twice with different values ({flat[option]!r}, {v!r}); "
                                "strategies of one run share an option's value: keep one"
                            )
                        flat[option] = v
                    continue
                flat[NESTED_NAME.get(key, name) if name == "name" else name] = inner
        else:
            flat[key] = value
    return flat


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML config file into a flat mapping (validated when merged into a RunConfig)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory; pass a YAML file to --config")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found; pass an existing YAML file to --config")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(p)!r} is not a text (UTF-8 YAML) file; pass a YAML file") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {e.strerror or e}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        lines = f"line {e.first}" if e.first == e.again else f"lines {e.first} and {e.again}"
        raise ConfigError(f"key {e.key!r} appears twice in {str(p)!r} ({lines}); keep one of them") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"malformed YAML in {str(p)!r}{where}; fix the file or drop --config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{str(p)!r} must hold a mapping of config keys, got {type(data).__name__}")
    data = flatten(data)
    if RECORDED_HEADER in text.splitlines()[:20] and "val_fraction" not in data:
        # Runs recorded before the validation split trained on the whole training set: resumed, or
        # repeated with --config, they still do.
        data["val_fraction"] = 0.0
    if text.startswith(RECORDED_HEADER) and data.get("optimizer") in LEGACY_MOMENTUM[1]:
        # Runs recorded before momentum became sgd-only wrote its old default for every optimizer;
        # that value was never read, and must not stop `--config` or `--resume` of such a run.
        if data.get("momentum") == LEGACY_MOMENTUM[0]:
            data["momentum"] = None
    return data


def recorded_by_distrain(path: str | os.PathLike[str]) -> bool:
    """The file is a config.yaml distrain wrote (its header line, perhaps under a comment of --strategy auto)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = [f.readline() for _ in range(20)]
    return any(line.rstrip("\n") == RECORDED_HEADER for line in head)


def to_nested(config: RunConfig) -> dict[str, dict[str, Any]]:
    """Sections as config.yaml holds them; the strategy section nests each strategy's options."""
    nested: dict[str, dict[str, Any]] = {}
    for name, section in config.sections().items():
        values: dict[str, Any] = {}
        for info in fields_of(type(section)):
            if info.name == "options":
                for strategy, options in section.options.items():
                    values[strategy] = dataclasses.asdict(options)
                continue
            if info.derived:  # written as part of the field it is given through
                continue
            key = "name" if NESTED_NAME.get(name) == info.name else info.name
            values[key] = plain(getattr(section, info.name))
        if name == "resources":
            values["workers"] = format_workers(config.workers, config.max_workers)
        nested[name] = values
    return nested


def to_yaml(config: RunConfig) -> str:
    """config.yaml: one commented block per section, each field with its help text."""
    lines = [RECORDED_HEADER]
    nested = to_nested(config)
    for name, section in config.sections().items():
        lines.append(f"\n# --- {name}: {type(section).__doc__}")
        lines.append(f"{name}:")
        for info in fields_of(type(section)):
            if info.name == "options":
                for strategy, options in section.options.items():
                    lines.append(f"  # options of the {strategy} strategy")
                    lines.append(f"  {yaml.safe_dump(strategy).strip().removesuffix('...').strip()}:")
                    for opt in fields_of(type(options)):
                        lines.append(f"    # {opt.help}")
                        dumped = yaml.safe_dump({opt.name: getattr(options, opt.name)}, sort_keys=False)
                        lines.append("    " + dumped.rstrip())
                continue
            if info.derived:
                continue
            key = "name" if NESTED_NAME.get(name) == info.name else info.name
            lines.append(f"  # {info.help}")
            dumped = yaml.safe_dump({key: nested[name][key]}, sort_keys=False, default_flow_style=True)
            lines.append("  " + dumped.strip().removeprefix("{").removesuffix("}"))
    return "\n".join(lines) + "\n"


def plain(value: Any) -> Any:
    """A tuple field as YAML writes it (a list)."""
    return list(value) if isinstance(value, tuple) else value
