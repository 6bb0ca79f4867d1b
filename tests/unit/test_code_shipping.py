"""What `--address` ships of a user's task (orchestrator/code_shipping.py), without Ray."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from distrain.orchestrator import code_shipping
from distrain.plugins import load_object


def _project(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "data" / "big.bin").write_bytes(b"x" * 4096)
    (root / "data" / "loader.py").write_text("X = 1\n")  # no __init__.py: a data folder, not a package
    (root / "utils").mkdir()
    (root / "utils" / "__init__.py").write_text("")
    (root / "utils" / "maths.py").write_text("def two():\n    return 2\n")
    (root / "utils" / "table.csv").write_text("a,b\n")
    (root / "notes.txt").write_text("not code\n")
    (root / "helper.py").write_text("WHERE = __file__\n")
    (root / "my_task.py").write_text("import helper\nfrom utils.maths import two\nclass T:\n    where = helper.WHERE\n")
    return root / "my_task.py"


def test_a_file_task_ships_its_folders_python_sources_only(tmp_path):
    task = _project(tmp_path / "proj")
    shipment = code_shipping.ship(f"{task}:T")
    try:
        [package] = shipment.runtime_env["py_modules"]
        shipped = sorted(str(p.relative_to(package)) for p in Path(package).rglob("*") if p.is_file())
        assert shipped == ["__init__.py", "helper.py", "my_task.py", "utils/__init__.py", "utils/maths.py"]
        assert Path(package, "__init__.py").read_text() == ""  # ours, not the user's
        mapping = json.loads(shipment.runtime_env["env_vars"][code_shipping.ENV_VAR])
        assert mapping == {str(task.parent): Path(package).name}
    finally:
        shipment.close()
    assert not Path(package).exists()  # the temporary copy goes once ray.init has uploaded it


def test_a_worker_loads_the_shipped_copy_not_the_drivers_path(tmp_path, monkeypatch):
    """As on another node: the env var maps the driver's folder to the shipped package, found on
    sys.path (Ray puts py_modules there); the file and its sibling modules load from the copy."""
    task = _project(tmp_path / "driver" / "proj")
    shipment = code_shipping.ship(f"{task}:T")
    node = tmp_path / "node"
    [package] = shipment.runtime_env["py_modules"]
    import shutil

    shutil.copytree(package, node / Path(package).name)
    shipment.close()
    monkeypatch.setenv(code_shipping.ENV_VAR, shipment.runtime_env["env_vars"][code_shipping.ENV_VAR])
    monkeypatch.syspath_prepend(str(node))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))  # helper, utils: imported fresh, then forgotten
    cls = load_object(f"{task}:T", "--task")
    assert Path(sys.modules[cls.__module__].__file__).parent == node / Path(package).name
    assert Path(cls.where).is_relative_to(node)


def test_without_the_env_var_the_path_is_used_as_it_is(tmp_path, monkeypatch):
    monkeypatch.delenv(code_shipping.ENV_VAR, raising=False)
    assert code_shipping.shipped_copy(tmp_path / "a.py") == tmp_path / "a.py"


def test_module_tasks_ship_only_what_is_not_installed(tmp_path, monkeypatch):
    assert code_shipping.ship("numpy.random:Generator").runtime_env is None  # installed
    assert code_shipping.ship("distrain.examples.char_lm:CharLM").runtime_env is None  # the cluster has distrain
    assert code_shipping.ship("").runtime_env is None  # built-in task
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "single_mod.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert code_shipping.ship("mypkg.tasks:T").runtime_env == {"py_modules": [str(tmp_path / "mypkg")]}
    assert code_shipping.ship("single_mod:T").runtime_env == {"py_modules": [str(tmp_path / "single_mod.py")]}
