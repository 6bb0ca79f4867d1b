"""How `distrain.fit(task=...)` records a task object so that workers, `--resume` and `--config` build the
same task: its import path and constructor arguments where those say everything, else the object itself
kept in the run directory's task.pkl (api._task_reference, trainers/task_call.py, orchestrator/tasks.py).
No Ray: the run itself is replaced by a function that keeps the config it is given."""

from __future__ import annotations

import pickle
import sys
import textwrap
from pathlib import Path

import pytest

import distrain
from distrain.api import _task_reference, importable_path
from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.orchestrator import tasks
from distrain.orchestrator.checkpoint import LATEST
from distrain.orchestrator.resume import resume_config
from distrain.trainers.task_call import constructor_arguments


class Sized(distrain.Task):
    def __init__(self, n: int = 2048, noise: float = 0.05, *, tags: list | None = None):
        self.n, self.noise, self.tags = n, noise, tags


class Deeper(Sized):
    """Calls its parent's constructor: the record is of the outer call, the one the user wrote."""

    def __init__(self, width: int, n: int = 64):
        super().__init__(n, noise=0.5)
        self.width = width


class NoConstructor(distrain.Task):
    pass


class PositionalOnly(distrain.Task):
    def __init__(self, n, /):
        self.n = n


class Packed(distrain.Task):
    def __init__(self, *sizes: int, **options: object):
        self.sizes, self.options = sizes, options


def test_an_instance_records_its_arguments_by_name_with_the_defaults_it_ran_with():
    assert constructor_arguments(Sized(512)) == {"n": 512, "noise": 0.05, "tags": None}
    assert constructor_arguments(Sized(noise=0.2, tags=["a"])) == {"n": 2048, "noise": 0.2, "tags": ["a"]}
    assert constructor_arguments(Deeper(3)) == {"width": 3, "n": 64}
    assert constructor_arguments(NoConstructor()) == {}
    assert constructor_arguments(Packed(lr=0.1)) == {"lr": 0.1}


@pytest.mark.parametrize(
    "make",
    [
        lambda: Sized((1, 2)),  # a tuple would read back from YAML as a list
        lambda: Sized(Path("x")),  # not YAML
        lambda: PositionalOnly(3),  # cannot be passed by name
        lambda: Packed(1, 2),  # *args
    ],
)
def test_arguments_yaml_cannot_hold_or_names_cannot_pass_are_not_recorded(make):
    assert constructor_arguments(make()) is None


def test_an_attribute_changed_after_construction_makes_the_arguments_unknown():
    task = Sized(512)
    task.noise = 0.3  # Sized(512) would be a different task now
    assert constructor_arguments(task) is None
    bare = NoConstructor()
    bare.n = 3
    assert constructor_arguments(bare) is None
    cached = Sized(512)
    cached.cache = object()  # new non-plain state (a cache, data) does not count
    assert constructor_arguments(cached) == {"n": 512, "noise": 0.05, "tags": None}


def test_fit_records_an_importable_instance_as_its_path_and_arguments():
    path, args, shipped = _task_reference(Sized(512, noise=0.1))
    assert path == f"{__name__}:Sized" and args == {"n": 512, "noise": 0.1, "tags": None} and shipped is None
    assert _task_reference(Sized) == (f"{__name__}:Sized", None, None)  # a class: built with no arguments


def test_an_object_that_arguments_cannot_rebuild_is_shipped():
    class Local(distrain.Task):  # like a notebook's class: no import path
        def __init__(self, n=1):
            self.n = n

    task = Local(5)
    assert _task_reference(task) == ("object:test_an_object_that_arguments_cannot_rebuild_is_shipped.<locals>.Local",
                                     None, task)  # fmt: skip
    mutated = Sized(512)
    mutated.n = 7
    assert _task_reference(mutated) == ("object:Sized", None, mutated)
    path, args, built = _task_reference(Local)  # a class that cannot be imported: its default instance
    assert path.startswith("object:") and args is None and isinstance(built, Local) and built.n == 1


def test_a_lone_module_file_is_recorded_by_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "lone_task_module.py").write_text("import distrain\n\nclass T(distrain.Task):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lone_task_module", raising=False)
    import lone_task_module

    try:
        assert importable_path(lone_task_module.T) == f"{tmp_path.resolve() / 'lone_task_module.py'}:T"
    finally:
        del sys.modules["lone_task_module"]
    assert importable_path(Sized) == f"{__name__}:Sized"  # a package's module: by name
    package = tmp_path / "lone_task_package"
    package.mkdir()
    (package / "__init__.py").write_text("import distrain\n\nclass P(distrain.Task):\n    pass\n")
    import lone_task_package

    try:
        assert importable_path(lone_task_package.P) == "lone_task_package:P"  # a package: by name
    finally:
        del sys.modules["lone_task_package"]


def test_a_shipped_object_of_a_lone_module_unpickles_without_that_module(tmp_path, monkeypatch):
    """Its class travels by value: neither a worker nor a later --resume needs the file on its path."""
    (tmp_path / "lone_shipped_module.py").write_text(
        "import distrain\n\nclass T(distrain.Task):\n    def __init__(self, n):\n        self.n = n\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import lone_shipped_module

    task = lone_shipped_module.T(5)
    task.n = 6
    data = tasks.task_bytes(task)
    del sys.modules["lone_shipped_module"]
    monkeypatch.undo()  # the folder is off sys.path again
    loaded = pickle.loads(data)
    assert type(loaded).__name__ == "T" and loaded.n == 6 and "lone_shipped_module" not in sys.modules


def test_fit_builds_the_config_from_the_instance(monkeypatch):
    seen = {}

    def fake_run(config, *args, **kwargs):
        seen["config"] = config
        raise SystemExit

    monkeypatch.setattr("distrain.orchestrator.run.run_training", fake_run)
    with pytest.raises(SystemExit):
        distrain.fit(task=Sized(512), progress=False)
    config = seen["config"]
    assert config.task == f"{__name__}:Sized" and config.task_args == {"n": 512, "noise": 0.05, "tags": None}
    assert "_task_object" not in config.__dict__  # workers build it from the path: nothing shipped
    with pytest.raises(ConfigError, match="constructor"):
        distrain.fit(task=Sized(512), task_args={"n": 3}, progress=False)


def _recorded_run(tmp_path: Path, task: object) -> Path:
    """A run directory as a run of a shipped task object leaves it: config.yaml, checkpoints/, task.pkl."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / LATEST).write_text('{"name": "step-00000004.pt", "global_step": 4}\n')  # for --resume
    config = RunConfig.resolve(None, {"task": f"object:{type(task).__qualname__}", "run_dir": str(run_dir)})
    (run_dir / "config.yaml").write_text(config.to_yaml())
    tasks.attach_task_object(config, task)
    tasks.save_task_object(config, run_dir)
    return run_dir


def test_resume_loads_the_shipped_object_from_task_pkl(tmp_path):
    mutated = Sized(300)
    mutated.noise = 0.7
    run_dir = _recorded_run(tmp_path, mutated)
    config = resume_config(run_dir, {"epochs": 4})
    rebuilt = tasks.build_task(config)
    assert isinstance(rebuilt, Sized) and (rebuilt.n, rebuilt.noise) == (300, 0.7) and config.epochs == 4


def test_resume_without_a_loadable_task_pkl_is_one_line(tmp_path):
    run_dir = _recorded_run(tmp_path, Sized(300))
    (run_dir / "task.pkl").write_bytes(pickle.dumps(1)[:-1])  # truncated
    with pytest.raises(ConfigError, match="cannot load the run's Sized task from task.pkl"):
        resume_config(run_dir, {})
    (run_dir / "task.pkl").unlink()
    with pytest.raises(ConfigError, match="task.pkl, which holds it, is missing"):
        resume_config(run_dir, {})


def test_a_config_yaml_of_a_shipped_object_is_refused_in_one_line(tmp_path):
    config = RunConfig.resolve(None, {"task": "object:Sized"})
    with pytest.raises(ConfigError, match="cannot rebuild"):
        tasks.build_task(config)


# The own-task example: docs/tasks.md's task file, which the README repeats word for word; it and its
# fit-then-resume snippet are run for real in tests/integration/test_user_task_acceptance.py
# (test_readme_fit_then_resume_trains_the_same_task).
ROOT = Path(__file__).resolve().parents[2]
TASKS_PAGE, README = ROOT / "docs" / "tasks.md", ROOT / "README.md"


def task_file_in(page: Path) -> str:
    """The page's `# my_task.py` code block."""
    text = page.read_text()
    start = text.index("```python\n# my_task.py\n") + len("```python\n")
    return textwrap.dedent(text[start : text.index("```", start)])


def readme_task_file() -> str:
    """The example task file, as docs/tasks.md gives it."""
    return task_file_in(TASKS_PAGE)


def test_the_readme_repeats_the_docs_task_file_word_for_word():
    assert task_file_in(README) == task_file_in(TASKS_PAGE) and "class Regression(distrain.Task)" in readme_task_file()
