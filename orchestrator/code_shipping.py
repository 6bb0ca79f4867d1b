"""Ship a user's task code to a Ray cluster's nodes through Ray's runtime_env.

Workers build the task themselves by importing `--task` (orchestrator/tasks.py). On the local Ray
distrain starts, they share the driver's disk and import the recorded path as it is: nothing is
shipped. With `--address` the nodes may not have the file, so `connect` passes what this module
builds to `ray.init(runtime_env=...)`, and every process of the job (workers, PS shards, Tune trial
drivers) gets it:

- `path/to/file.py:Name`: the file's folder, but only its Python source: the `.py` files in it and
  the packages below it (sub-folders with an `__init__.py`, their `.py` files), copied into a temporary
  package with a unique name and shipped as `py_modules`. A data folder next to the task file
  (anything without an `__init__.py`, any non-Python file) is never uploaded, so it cannot blow Ray's
  upload limit or a run's start time by accident. The environment variable `DISTRAIN_SHIPPED_CODE`
  maps the driver's folder to that package; `plugins.load_object` then loads the file from the
  package's copy on the node (same relative path, its sibling modules importable), never from the
  driver's absolute path, which need not exist there.
- `module:Name`: nothing when the module's top-level package is installed (it has a distribution:
  the cluster installs it like distrain itself); otherwise (found on the driver's sys.path, e.g. via
  PYTHONPATH) that package's folder, or the single module file, as `py_modules`: the workers import
  it by name.

`py_modules` and `env_vars` (rather than `working_dir`) leave the workers' working directory alone and
merge with the runtime_env of a `ray job submit --working-dir .` job, which Ray would refuse for a
second `working_dir`. config.yaml keeps `task` (absolute) and `address`: a repeat ships again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distrain.plugins import SHIPPED_CODE_ENV as ENV_VAR
from distrain.plugins import shipped_copy as shipped_copy  # where a worker finds a shipped file

PACKAGE_PREFIX = "distrain_code_"


@dataclass
class Shipment:
    """The runtime_env for ray.init (None: nothing to ship) and what it uploaded, for the record."""

    runtime_env: dict[str, Any] | None = None
    shipped: list[str] = field(default_factory=list)  # what was shipped, for the record
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def close(self) -> None:
        """The temporary copy can go once ray.init has uploaded it."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def ship(task: str) -> Shipment:
    """What a run with `--task task` on a remote cluster must upload (an empty task: nothing)."""
    if not task or ":" not in task or task.startswith("object:"):
        return Shipment()
    where = task.rpartition(":")[0]
    if where.endswith(".py"):
        return _ship_folder(Path(where).resolve().parent)
    return _ship_module(where.split(".")[0])


def _ship_folder(folder: Path) -> Shipment:
    name = PACKAGE_PREFIX + hashlib.sha1(str(folder).encode()).hexdigest()[:12]
    tmp = tempfile.TemporaryDirectory(prefix="distrain-ship-")
    package = Path(tmp.name) / name
    _copy_sources(folder, package)
    # Our own empty __init__ makes the copy importable by name without running the user's one.
    (package / "__init__.py").write_text("")
    env = {"py_modules": [str(package)], "env_vars": {ENV_VAR: json.dumps({str(folder): name})}}
    return Shipment(env, [f"{folder} (Python sources, as {name})"], tmp)


def _copy_sources(folder: Path, to: Path) -> None:
    """The .py files of `folder` and, recursively, of its packages (sub-folders with __init__.py)."""
    to.mkdir(parents=True)
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(".") or entry.name == "__pycache__":
            continue
        if entry.is_file() and entry.suffix == ".py":
            shutil.copy2(entry, to / entry.name)
        elif entry.is_dir() and (entry / "__init__.py").is_file():
            _copy_sources(entry, to / entry.name)


def _ship_module(top: str) -> Shipment:
    if top == "distrain" or top in importlib.metadata.packages_distributions():
        return Shipment()  # installed: the nodes have it as they have distrain
    spec = importlib.util.find_spec(top)
    if spec is None:
        return Shipment()  # not importable here either; the driver's task check says so
    if spec.submodule_search_locations:
        path = list(spec.submodule_search_locations)[0]
    elif spec.origin and spec.origin.endswith(".py"):
        path = spec.origin
    else:
        return Shipment()  # built-in or compiled: nothing to upload
    return Shipment({"py_modules": [os.fspath(path)]}, [f"{path} (module {top})"])
