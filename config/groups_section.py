"""Resource groups (--worker-group NAME:COUNT:BATCH[:RESOURCE=AMOUNT,...], YAML resources.worker_groups;
docs/heterogeneous.md): workers of a known kind, each group with its own batch and its own resources.

A run's groups replace --workers, --batch-size and --gpus-per-worker: ranks are dealt group by group in
the order given, the global batch is the sum of COUNT x BATCH (x --accumulate-steps), and each rank's
share of a step is its group's BATCH, through the shares --worker-weights uses (config/shares_section.py),
so the data plan and the gradient weights are those of static shares. Each rank's placement-group bundle
asks for its group's resources (CPU, GPU, and custom node resources such as fast=1), so Ray puts each
group on its kind of node (orchestrator/cluster.py `bundles`).

Every group asks for the same GPUs per worker: one device and one collective backend serve the whole run
(a GPU group beside a CPU group would need a per-rank device and gloo across them; not built, refused).
No torch, no Ray."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.errors import ConfigError

if TYPE_CHECKING:
    from distrain.config.run_config import RunConfig

FLAG = "--worker-group"
SYNTAX = "NAME:COUNT:BATCH[:RESOURCE=AMOUNT,...]"
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
RESOURCE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]*$")
# YAML's mapping form: these keys, of which name, workers and batch_size are required.
MAPPING_KEYS = ("name", "workers", "batch_size", "cpus_per_worker", "gpus_per_worker", "resources")
# The run-wide flags the groups replace, with the field each names.
REPLACED = {"workers": "--workers", "batch_size": "--batch-size", "worker_weights": "--worker-weights"}


@dataclass(frozen=True)
class WorkerGroup:
    """One resource group: `workers` ranks of `batch_size` samples a step, each asking Ray for `resources`
    (CPU and GPU as Ray names them, and custom node resources), beyond the run's defaults."""

    name: str
    workers: int
    batch_size: int
    resources: tuple[tuple[str, float], ...] = ()

    def amount(self, resource: str) -> float | None:
        return dict(self.resources).get(resource)

    def spec(self) -> str:
        """The flag's form, which config.yaml records (read back like a flag's)."""
        head = f"{self.name}:{self.workers}:{self.batch_size}"
        return head + (":" + ",".join(f"{k}={v:g}" for k, v in self.resources) if self.resources else "")


def parse_group(spec: str) -> WorkerGroup:
    """ "fast:1:48:fast=1" -> WorkerGroup("fast", 1, 48, (("fast", 1.0),))."""
    parts = str(spec).split(":", 3)
    bad = f"{FLAG} {spec!r} must be {SYNTAX}, e.g. gpu:2:96:GPU=1 or cpu:4:16:CPU=8,cpu_node=1"
    if len(parts) < 3 or not NAME.match(parts[0].strip()):
        raise ConfigError(bad)
    name = parts[0].strip()
    try:
        workers, batch = int(parts[1]), int(parts[2])
    except ValueError:
        raise ConfigError(bad) from None
    if workers < 1 or batch < 1:
        raise ConfigError(f"{FLAG} {spec!r}: COUNT and BATCH must be >= 1, got {workers} and {batch}")
    resources: dict[str, float] = {}
    for item in parts[3].split(",") if len(parts) == 4 else ():
        key, sep, text = item.partition("=")
        key = key.strip()
        try:
            amount = float(text)
        except ValueError:
            amount = math.nan
        if not sep or not RESOURCE.match(key) or not math.isfinite(amount) or key in resources:
            raise ConfigError(f"{FLAG} {spec!r}: {item!r} must be RESOURCE=AMOUNT (each resource once), e.g. fast=1")
        resources[key] = amount
    check_amounts(spec, resources)
    return WorkerGroup(name, workers, batch, tuple(resources.items()))


def check_amounts(spec: str, resources: dict[str, float]) -> None:
    """CPU > 0 (a worker's torch threads), GPU >= 0, a custom resource > 0; CPU and GPU as Ray spells them."""
    for key, amount in resources.items():
        if key in ("cpu", "gpu"):
            raise ConfigError(f"{FLAG} {spec!r}: write {key.upper()}={amount:g} (Ray's name for it), not {key}=")
        if amount < 0 or (amount == 0 and key != "GPU"):
            raise ConfigError(f"{FLAG} {spec!r}: {key}={amount:g} must be {'>= 0' if key == 'GPU' else '> 0'}")


def group_from_mapping(entry: dict[str, Any]) -> WorkerGroup:
    """YAML's {name, workers, batch_size, cpus_per_worker, gpus_per_worker, resources: {...}} form."""
    where = f"resources.worker_groups entry {entry!r}"
    unknown = sorted(set(entry) - set(MAPPING_KEYS))
    missing = [k for k in MAPPING_KEYS[:3] if k not in entry]
    if unknown or missing:
        what = f"unknown key(s) {', '.join(map(str, unknown))}" if unknown else f"no {', '.join(missing)}"
        raise ConfigError(f"{where}: {what}; its keys are {', '.join(MAPPING_KEYS)} (the first three required)")
    extra = entry.get("resources") or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{where}: resources must be a mapping of resource names to amounts, e.g. {{fast: 1}}")
    named = {"CPU": entry.get("cpus_per_worker"), "GPU": entry.get("gpus_per_worker")}
    items = [f"{k}={v}" for k, v in named.items() if v is not None]
    items += [f"{k}={v}" for k, v in extra.items()]
    if any(k in extra for k, v in named.items() if v is not None):
        raise ConfigError(f"{where}: give CPUs and GPUs once, as cpus_per_worker / gpus_per_worker")
    head = f"{entry['name']}:{entry['workers']}:{entry['batch_size']}"
    return parse_group(head + (":" + ",".join(items) if items else ""))


def normalise(value: Any) -> list[str]:
    """The groups as given (None, a list of flag strings and YAML mappings) in the flag's form."""
    if value is None or value == "":
        return []
    if isinstance(value, str | dict):
        value = [value]
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{FLAG} (resources.worker_groups) must be a list of groups, got {value!r}")
    groups = [group_from_mapping(g) if isinstance(g, dict) else parse_group(g) for g in value]
    names = [g.name for g in groups]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{FLAG}: group {twice[0]!r} is named twice; give each group its own name")
    return [g.spec() for g in groups]


def derive(values: dict[str, Any]) -> dict[str, Any]:
    """Flat config values with the groups (if any) in the flag's form and what they replace set from
    them: --workers (their COUNTs' sum), --batch-size (the largest BATCH: the largest worker's, which
    its memory estimate reads) and --gpus-per-worker (the groups' one amount). A replaced value given as
    well must agree (a config.yaml distrain wrote holds both), else the run is refused in one line."""
    values = dict(values)
    specs = normalise(values.get("worker_groups"))
    values["worker_groups"] = specs
    if not specs:
        return values
    groups = [parse_group(s) for s in specs]
    gpus = {g.amount("GPU") if g.amount("GPU") is not None else values.get("gpus_per_worker") or 0.0 for g in groups}
    if len(gpus) > 1:
        raise ConfigError(
            f"{FLAG}: the groups ask for {' and '.join(f'{x:g}' for x in sorted(gpus))} GPUs per worker; every "
            "group must ask for the same (a GPU group beside a CPU group needs per-rank devices: not built)"
        )
    derived = {
        "workers": sum(g.workers for g in groups),
        "batch_size": max(g.batch_size for g in groups),
        "worker_weights": "",
        "gpus_per_worker": float(gpus.pop()),
    }
    for name, flag in REPLACED.items():
        given = values.get(name)
        if given is None or given == "":
            continue
        if not _same(given, derived[name]):
            raise ConfigError(
                f"{FLAG} sets each group's workers and batch, so {flag} {given} cannot be combined with it; drop {flag}"
            )
    return values | derived


def _same(given: Any, derived: Any) -> bool:
    """A replaced value given as well agrees: the same number (--workers 2, "2" or 2.0; a range never
    does), or the same text."""
    if isinstance(derived, str):
        return given == derived
    try:
        return float(given) == derived
    except (TypeError, ValueError):
        return False


def groups_of(config: RunConfig) -> tuple[WorkerGroup, ...]:
    """The run's groups, in rank order (empty: no groups)."""
    return tuple(parse_group(s) for s in config.worker_groups)


def rank_groups(config: RunConfig) -> list[WorkerGroup]:
    """Each rank's group: ranks dealt group by group, in the order the groups are given."""
    return [g for g in groups_of(config) for _ in range(g.workers)]


def group_batch(config: RunConfig) -> int:
    """The groups' global batch, sum of COUNT x BATCH, times --accumulate-steps (0: no groups)."""
    return config.accumulate_steps * sum(g.workers * g.batch_size for g in groups_of(config))


def rank_shares(config: RunConfig) -> tuple[int, ...]:
    """Each rank's samples per step: its group's BATCH (x --accumulate-steps); empty without groups."""
    return tuple(config.accumulate_steps * g.batch_size for g in rank_groups(config))


def rank_bundles(config: RunConfig) -> list[dict[str, float]]:
    """Each rank's placement-group bundle: its group's CPU (else --cpus-per-worker), the run's GPUs when
    > 0, and its custom resources; empty without groups."""
    bundles = []
    for group in rank_groups(config):
        bundle = {"CPU": group.amount("CPU") or config.cpus_per_worker}
        if config.gpus_per_worker > 0:
            bundle["GPU"] = config.gpus_per_worker
        bundles.append(bundle | {k: v for k, v in group.resources if k not in ("CPU", "GPU")})
    return bundles


def recorded_group_batch(recorded: dict[str, Any]) -> int:
    """`group_batch` of a run from its flat recorded values (config.yaml); 0 for a run without groups."""
    k = int(recorded.get("accumulate_steps") or 1)
    return k * sum(g.workers * g.batch_size for g in map(parse_group, recorded.get("worker_groups") or ()))


def worker_cpus(config: RunConfig, rank: int) -> float:
    """The CPUs worker `rank`'s actor asks for, also its torch thread count: its group's CPU under
    --worker-group, else --cpus-per-worker."""
    groups = rank_groups(config)
    return (groups[rank].amount("CPU") if groups else None) or config.cpus_per_worker
