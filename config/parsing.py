"""Reading the values written on a command line or in YAML: --optimizer-arg, --straggler, --target,
--workers N|MIN..MAX, --chaos, and `overlay` (flags over a file, a trial's values over a sweep's base).
Each problem is one `ConfigError` line naming the flag and its syntax. No torch, no Ray."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import yaml

from distrain.config.sections import DECAY_DEPENDENT_FIELDS, OPTIMIZER_DEPENDENT_FIELDS
from distrain.config.strategy_options import strategy_dependent_fields
from distrain.errors import ConfigError


def parse_optimizer_args(specs: list[str]) -> dict[str, Any]:
    """["KEY=VALUE", ...] (--optimizer-arg) -> {key: value}, each value read as YAML (0.9, [0.9, 0.99], true)."""
    args: dict[str, Any] = {}
    for spec in specs:
        key, sep, text = spec.partition("=")
        key = key.strip()
        try:
            value = yaml.safe_load(text) if sep else None
        except yaml.YAMLError:
            sep = ""
        if not sep or not key.isidentifier() or text.strip() == "":
            raise ConfigError(f"--optimizer-arg {spec!r} must be KEY=VALUE, e.g. betas=[0.9,0.99] or nesterov=true")
        args[key] = value
    return args


@dataclass(frozen=True)
class Slowdown:
    """An injected straggler (--straggler): `seconds` added to each of the worker's steps (RANK:SECONDS), or its
    compute stretched to `factor` times as long (RANK:xF). The factor form models a slower machine: its
    delay shrinks with a smaller batch, where a fixed delay per step would not."""

    seconds: float = 0.0
    factor: float = 1.0

    def extra_s(self, compute_s: float) -> float:
        """Seconds to add after a unit of work that took `compute_s`."""
        return self.seconds + (self.factor - 1.0) * compute_s


def parse_stragglers(specs: list[str], workers: int) -> dict[int, Slowdown]:
    """["RANK:SECONDS" or "RANK:xF", ...] -> {rank: its Slowdown}."""
    slowdowns: dict[int, Slowdown] = {}
    for spec in specs:
        rank_text, sep, value_text = spec.partition(":")
        factor = value_text.strip().lower().startswith("x")
        try:
            rank, value = int(rank_text), float(value_text.strip()[1:] if factor else value_text)
        except ValueError:
            rank, value = -1, -1.0
        ok = value >= 1 if factor else value >= 0
        if not sep or not 0 <= rank < workers or not (ok and math.isfinite(value)):
            raise ConfigError(
                f"--straggler {spec!r} must be RANK:SECONDS (SECONDS >= 0 added to each step) or RANK:xF (compute "
                f"takes F >= 1 times as long), with 0 <= RANK < {workers}"
            )
        slowdowns[rank] = Slowdown(factor=value) if factor else Slowdown(seconds=value)
    return slowdowns


def parse_worker_weights(text: str, workers: int) -> tuple[float, ...]:
    """ "3,1" (--worker-weights) -> (3.0, 1.0): one positive number per worker; "" -> () (equal shares)."""
    if not str(text).strip():
        return ()
    parts = [p.strip() for p in str(text).split(",")]
    try:
        weights = tuple(float(p) for p in parts)
    except ValueError:
        weights = ()
    if not weights or not all(w > 0 and math.isfinite(w) for w in weights):
        raise ConfigError(f"--worker-weights {text!r} must be positive numbers separated by commas, e.g. 3,1")
    if len(weights) != workers:
        raise ConfigError(
            f"--worker-weights {text!r} gives {len(weights)} weights for {workers} workers; give one per worker"
        )
    return weights


TARGET_SYNTAX = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=)\s*(\S+)\s*$")


@dataclass(frozen=True)
class Target:
    """A quality target: the first evaluation at which `metric op value` holds is its time to target."""

    metric: str  # an evaluation column, e.g. val_accuracy, val_loss, test_perplexity
    op: str  # ">=" or "<="
    value: float

    def reached(self, x: float | None) -> bool:
        if x is None or math.isnan(x):
            return False
        return x >= self.value if self.op == ">=" else x <= self.value

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


def parse_target(text: str) -> Target:
    """ "val_accuracy>=0.95", "loss<=0.3" (a name without the val_ or test_ prefix of the metrics file is a
    validation metric: targets select on validation)."""
    match = TARGET_SYNTAX.match(text)
    value = math.nan
    if match:
        try:
            value = float(match.group(3))
        except ValueError:
            pass
    if not match or not math.isfinite(value):
        raise ConfigError(f"--target {text!r} must be METRIC>=VALUE or METRIC<=VALUE, e.g. val_accuracy>=0.95")
    name = match.group(1)
    metric = name if name.startswith(("val_", "test_")) else f"val_{name}"
    return Target(metric, match.group(2), value)


MAXIMISED = ("accuracy", "acc", "f1", "precision", "recall", "auc", "r2", "score", "iou", "bleu")


@dataclass(frozen=True)
class Monitor:
    """--checkpoint-best: the evaluation column compared, and which way is better."""

    metric: str  # e.g. val_loss
    mode: str  # "min" or "max"

    def better(self, new: float | None, best: float | None) -> bool:
        if new is None or math.isnan(new):
            return False
        if best is None:
            return True
        return new < best if self.mode == "min" else new > best

    def __str__(self) -> str:
        return f"{self.mode}:{self.metric}"


def parse_monitor(text: str) -> Monitor:
    """ "val_loss" (lower is better), "val_accuracy" (accuracy-like names: higher), "max:val_f1", "min:loss"
    (a name without a prefix is a validation metric, as for --target)."""
    mode, sep, name = text.strip().partition(":")
    if not sep:
        mode, name = "", mode
    if mode not in ("", "min", "max") or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ConfigError(f"--checkpoint-best {text!r} must be METRIC, min:METRIC or max:METRIC, e.g. val_loss")
    metric = name if name.startswith(("val_", "test_")) else f"val_{name}"
    if not mode:
        base = metric.split("_", 1)[1]
        mode = "max" if base in MAXIMISED or base.endswith(MAXIMISED) else "min"
    return Monitor(metric, mode)


WORKER_RANGE = re.compile(r"^\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*$")


def parse_workers(value: Any) -> tuple[int, int]:
    """--workers as (MIN, MAX): N -> (N, 0), a fixed size; "MIN..MAX" -> (MIN, MAX), an elastic range
    (MIN == MAX is a fixed size too). The CLI's string and YAML's int or string go through here alike."""
    if isinstance(value, tuple | list) and len(value) == 2:  # (min, max) as `worker_range` gives it
        low, high = int(value[0]), int(value[1])
        return parse_workers(f"{low}..{high}") if high else parse_workers(low)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    shape = f"--workers must be an integer, got {value!r} (or a range MIN..MAX, e.g. 2..4)"
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError(f"--workers must be >= 1, got {value}")
        return value, 0
    text = str(value).strip() if isinstance(value, str) else ""
    if text.lstrip("-").isdigit():
        return parse_workers(int(text))
    match = WORKER_RANGE.match(text)
    if not match:
        raise ConfigError(shape)
    low, high = int(match.group(1)), int(match.group(2))
    if low < 1:
        raise ConfigError(f"--workers {text}: MIN must be >= 1, got {low}")
    if low > high:
        raise ConfigError(f"--workers {text}: MIN ({low}) is above MAX ({high}); write MIN..MAX with MIN <= MAX")
    return low, (high if high > low else 0)


def format_workers(workers: int, max_workers: int) -> int | str:
    """How --workers is written back (config.yaml, summaries): N, or "MIN..MAX"."""
    return f"{workers}..{max_workers}" if max_workers else workers


CHAOS_KINDS = ("kill-worker", "kill-ps", "hang-worker", "kill-node")


@dataclass(frozen=True)
class ChaosEvent:
    """One injected fault: `kind` at global step `step`, on worker/shard `target` (None: the default one)."""

    kind: str
    step: int
    target: int | None


def parse_chaos(specs: list[str], workers: int, ps_shards: int | None) -> list[ChaosEvent]:
    """["kill-worker@STEP[:RANK]", "kill-ps@STEP[:SHARD]", ...] -> events sorted by step."""
    events = []
    for spec in specs:
        kind, _, rest = spec.partition("@")
        step_text, sep, target_text = rest.partition(":")
        try:
            step, target = int(step_text), (int(target_text) if sep else None)
        except ValueError:
            step, target = -1, None
        if kind not in CHAOS_KINDS or step < 1 or (target is not None and target < 0):
            raise ConfigError(
                f"--chaos {spec!r} must be KIND@STEP[:TARGET] with STEP >= 1, KIND one of: {', '.join(CHAOS_KINDS)}"
            )
        if kind == "kill-ps" and ps_shards is None:
            raise ConfigError(f"--chaos {spec!r} needs the parameter-server transport; add --transport ps")
        limit = ps_shards if kind == "kill-ps" else workers
        if kind == "kill-node" and target is not None:
            raise ConfigError(f"--chaos {spec!r}: kill-node takes no target; write kill-node@STEP")
        if target is not None and target >= (limit or 0):
            raise ConfigError(f"--chaos {spec!r}: target {target} does not exist (0 <= TARGET < {limit})")
        events.append(ChaosEvent(kind, step, target))
    return sorted(events, key=lambda e: e.step)


def overlay(values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """`given` over `values` (flags over a file, a trial's values over a sweep's base).

    What `values` resolved for its own strategy or optimizer (transport, strategy parameters,
    momentum) was resolved for that choice; a different one given here starts from its own
    defaults unless those fields are given too. A data set that reads no files drops the old
    --data-dir; one that does keeps it (mnist and cifar10 may well share a directory)."""
    merged = dict(values)
    given = dict(given)
    if "strategy" in given and given["strategy"] != merged.get("strategy", given["strategy"]):
        for name in strategy_dependent_fields():
            merged.pop(name, None)
    if "optimizer" in given and str(given["optimizer"]).lower() != str(merged.get("optimizer", "sgd")).lower():
        for name in OPTIMIZER_DEPENDENT_FIELDS:  # momentum and constructor arguments were the old optimizer's
            merged.pop(name, None)
    elif isinstance(merged.get("optimizer_args"), dict) and isinstance(given.get("optimizer_args"), dict):
        given["optimizer_args"] = merged["optimizer_args"] | given["optimizer_args"]  # flags add to the file's
    if "lr_decay" in given and given["lr_decay"] != merged.get("lr_decay", "none"):
        for name in DECAY_DEPENDENT_FIELDS:
            merged.pop(name, None)
    if given.get("dataset", merged.get("dataset")) != merged.get("dataset"):
        from distrain.trainers.builtin_names import DATASET_READS_FILES

        if DATASET_READS_FILES.get(given["dataset"]) is False:
            merged.pop("data_dir", None)
    merged.update(given)
    return merged
