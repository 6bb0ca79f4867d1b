"""Import paths for users' own code: `module:Name` or `path/to/file.py:Name`.

Used wherever distrain accepts a name it would otherwise look up in a registry (`--task`, and later
`--strategy`). A problem with the path (no such file or module, a module that raises on import, no
such attribute) is the user's to fix, so it becomes one `ConfigError` line that names the path; an
exception raised *by* the user's module keeps its message. Nothing here imports torch or Ray.

A file path is resolved to an absolute one before it is recorded (`absolute_import_path`), so a Tune
trial running in its own working directory, or a worker on another node with the same file tree,
loads the same file. On a cluster joined with `--address`, the file's folder is shipped to the
nodes (orchestrator/code_shipping.py) and a worker loads the shipped copy instead.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from distrain.errors import ConfigError


def is_import_path(text: str) -> bool:
    """`module:Name` or `file.py:Name` (a registry name has no colon)."""
    return ":" in text


def split_import_path(text: str, flag: str) -> tuple[str, str]:
    where, sep, name = text.rpartition(":")
    if not sep or not where or not name or not name.replace("_", "a").replace(".", "a").isalnum():
        raise ConfigError(f"{flag} {text!r} must be module:Name or path/to/file.py:Name")
    return where, name


def absolute_import_path(text: str, flag: str) -> str:
    """The same import path with a file part made absolute (module paths are left as they are)."""
    where, name = split_import_path(text, flag)
    if where.endswith(".py"):
        return f"{Path(where).expanduser().resolve()}:{name}"
    return text


# The modules a task file is imported as (one per file, `_module_from_file`).
USER_MODULE_PREFIX = "distrain_user_"
SHIPPED_CODE_ENV = "DISTRAIN_SHIPPED_CODE"  # JSON {driver folder: shipped package name}, set in the workers


def shipped_copy(path: Path) -> Path:
    """Where a worker of a shipped job finds the driver's file `path` (unchanged elsewhere)."""
    mapping = os.environ.get(SHIPPED_CODE_ENV)
    if not mapping:
        return path
    for folder, name in json.loads(mapping).items():
        try:
            rel = path.relative_to(folder)
        except ValueError:
            continue
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            return Path(list(spec.submodule_search_locations)[0]) / rel
    return path


def check_import_path_exists(text: str, flag: str) -> None:
    """A missing file or top-level module, found without importing anything (flag errors stay fast)."""
    where, _ = split_import_path(text, flag)
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not shipped_copy(path).is_file():
            raise ConfigError(f"{flag} {text!r}: no file {str(path)!r}")
    elif importlib.util.find_spec(where.split(".")[0]) is None:
        raise ConfigError(f"{flag} {text!r}: no module named {where.split('.')[0]!r}")


def _module_from_file(path: Path, flag: str, text: str) -> Any:
    # In a worker on a cluster, the copy of the file that `--address` shipped (the driver's path need
    # not exist on this node); elsewhere the path itself.
    path = shipped_copy(path)
    if not path.is_file():
        raise ConfigError(f"{flag} {text!r}: no file {str(path)!r}")
    # One module per file, under a stable name, so importing it twice in a process (fit() twice in a
    # notebook, a worker that builds the task again) reuses it and classes stay identical. (A warm worker
    # drops these modules before it builds the next run's task: orchestrator/worker.py, `rebuild`.)
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"{USER_MODULE_PREFIX}{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{flag} {text!r}: {str(path)!r} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    # The file's own folder on the path, as `python file.py` would have it: its sibling modules import.
    folder = str(path.resolve().parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[module_name]
        raise ConfigError(f"{flag} {text!r}: importing {path.name} raised {type(e).__name__}: {e}") from None
    return module


def is_lone_module(module: Any) -> bool:
    """A module that is one top-level .py file, not a package or part of one (`my_task`, imported from
    the folder of a notebook or script): other processes find it by its file, not by its name."""
    spec = getattr(module, "__spec__", None)
    is_package = spec is None or bool(spec.submodule_search_locations)
    file = str(getattr(module, "__file__", None) or "")
    return module.__name__ != "__main__" and "." not in module.__name__ and file.endswith(".py") and not is_package


def load_object(text: str, flag: str) -> Any:
    """The object an import path names (one `ConfigError` line for any problem with the path)."""
    where, name = split_import_path(text, flag)
    if where.endswith(".py"):
        module = _module_from_file(Path(where).expanduser(), flag, text)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name and where.startswith(e.name):
                raise ConfigError(f"{flag} {text!r}: no module named {e.name!r}") from None
            raise ConfigError(f"{flag} {text!r}: importing {where} raised ModuleNotFoundError: {e}") from None
        except BaseException as e:
            raise ConfigError(f"{flag} {text!r}: importing {where} raised {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in name.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{flag} {text!r}: {where} has no attribute {name!r}") from None
    return obj
