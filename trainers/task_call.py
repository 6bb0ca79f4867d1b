"""How a task object was built, so that a run can record it and build the same task again.

`distrain.fit(task=Regression(n=512))` hands over an object, but workers, `--resume` and a `--config`
repeat build the task from config.yaml: its class's import path and keyword arguments (`task_args`).
Every `distrain.Task` subclass therefore records the arguments of its constructor call
(`Task.__init_subclass__` wraps each subclass's `__init__` with `recording_init`), and
`constructor_arguments` turns that record into keyword arguments when they say everything about the
object: every argument has a name and a plain YAML value (it reads back equal, so config.yaml holds it),
and no plain-valued attribute changed after the constructor returned (`task.n = 5` later would make
the rebuilt task a different one). Otherwise it returns None and the caller keeps the object itself.
No torch, no Ray.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RECORD = "_distrain_call"  # the instance attribute holding its `Call` (None while the constructor runs)


@dataclass(frozen=True)
class Call:
    """One constructor call: its arguments, and the plain attributes the object had when it returned."""

    init: Callable[..., None]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    attributes: dict[str, Any]


def recording_init(init: Callable[..., None]) -> Callable[..., None]:
    """`init` that also records its call on the object. Only the outermost call records (a subclass's
    `__init__` calling `super().__init__(...)` runs this twice): it is the one the user wrote."""
    if getattr(init, "_distrain_records", False):
        return init

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        state = getattr(self, "__dict__", None)
        outermost = state is not None and RECORD not in state
        if outermost:
            state[RECORD] = None  # under way: inner calls leave it alone
        try:
            init(self, *args, **kwargs)
        except BaseException:
            if outermost:
                state.pop(RECORD, None)
            raise
        if outermost:
            state[RECORD] = Call(init, args, dict(kwargs), plain_attributes(self))

    __init__._distrain_records = True  # type: ignore[attr-defined]
    return __init__


def constructor_arguments(task: Any) -> dict[str, Any] | None:
    """The keyword arguments that build `task` again (`type(task)(**them)`), or None when they cannot
    be known or written to config.yaml: no recorded call, positional-only or `*args` arguments,
    a value that is not plain YAML, or a plain attribute changed since construction. Defaults the call
    left out are included where YAML holds them, so a later edit of a default in the file does not
    change what `--resume` builds."""
    call = getattr(task, "__dict__", {}).get(RECORD)
    if not isinstance(call, Call):
        no_constructor = type(task).__init__ is object.__init__  # no arguments, and no attributes from one
        return {} if no_constructor and not plain_attributes(task) else None
    try:
        bound = inspect.signature(call.init).bind(task, *call.args, **call.kwargs)
    except TypeError:
        return None
    params = list(bound.signature.parameters.values())[1:]  # after self
    arguments: dict[str, Any] = {}
    for param in params:
        given = param.name in bound.arguments
        value = bound.arguments.get(param.name, param.default)
        if param.kind is param.VAR_KEYWORD:
            arguments.update(value if given else {})
        elif param.kind is param.VAR_POSITIONAL:
            if given and value:
                return None
        elif param.kind is param.POSITIONAL_ONLY:
            if given:
                return None
        elif given:
            arguments[param.name] = value
        elif value is not param.empty and is_plain(value):
            arguments[param.name] = value
    if not all(is_plain(v) for v in arguments.values()):
        return None
    if plain_attributes(task) != call.attributes:
        return None
    return arguments


def is_plain(value: Any) -> bool:
    """A value YAML writes and reads back equal and of the same type: None, bool, int, float, str, and
    lists and str-keyed dicts of them (a tuple would come back a list)."""
    if value is None or isinstance(value, bool | int | float | str):
        return type(value) in (type(None), bool, int, float, str)  # not a subclass (an IntEnum, say)
    if type(value) is list:
        return all(is_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and is_plain(v) for k, v in value.items())
    return False


def plain_attributes(obj: Any) -> dict[str, Any]:
    """The object's settings-like attributes (plain values; lists and dicts of at most 100 entries, not
    data), copied: what a later `task.n = 5` would change."""
    import copy

    state = getattr(obj, "__dict__", {})
    small = {k: v for k, v in state.items() if k != RECORD and not (isinstance(v, list | dict) and len(v) > 100)}
    return {k: copy.deepcopy(v) for k, v in small.items() if is_plain(v)}
