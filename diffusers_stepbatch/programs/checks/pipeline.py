"""A pipeline's own `check_inputs`, its error naming the argument it is about (`InvalidArgument.argument`).

Found by what the check does, not by its words: the one argument that, put back to the pipeline's `__call__`
default, makes the check pass. An error no single argument explains (a size) stays the pipeline's `ValueError`.

>>> run_check_inputs(pipe, prompt, strength, None, negative_prompt=None)  # as pipe.check_inputs(...)
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import logging
import textwrap
import threading
from typing import Any

from ...errors import InvalidArgument
from ..registry import unhooked_class


def run_check_inputs(pipe: Any, *args: Any, **kwargs: Any) -> None:
    """Call `pipe.check_inputs(*args, **kwargs)`; its `ValueError` comes back as `InvalidArgument` when one
    argument explains it."""
    check = pipe.check_inputs
    try:
        check(*args, **kwargs)
    except InvalidArgument:
        raise
    except ValueError as exc:
        argument = culprit(pipe, inspect.signature(check).bind(*args, **kwargs))
        if argument is None:
            raise
        raise InvalidArgument(argument, str(exc)) from exc


def culprit(pipe: Any, bound: inspect.BoundArguments) -> str | None:
    """The one argument of a `check_inputs` call whose `__call__` default makes the check pass (named as
    `__call__` names it)."""
    cls = unhooked_class(pipe)  # NOTE: hook mode's class has a `__call__` of its own
    defaults = _call_defaults(cls)
    renamed = renamed_check_arguments(cls)
    regular = {name for name, p in bound.signature.parameters.items()
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for name, value in list(bound.arguments.items()):
        argument = renamed.get(name, name)
        if name not in regular or argument not in defaults or _same(value, defaults[argument]):
            continue
        default = defaults[argument]
        if _passes(pipe, inspect.BoundArguments(bound.signature, {**bound.arguments, name: default})):
            return argument
    return None


# NOTE: CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state: two threads parsing at
# once (concurrent first calls) can raise "SystemError: AST constructor recursion depth mismatch".
_PARSING = threading.Lock()


def renamed_check_arguments(cls: type) -> dict[str, str]:
    """`check_inputs` parameters that `cls.__call__` fills from one of its own parameters of another name
    (ControlNet img2img passes `control_image` as the check's `image`), read from `__call__`'s source: check
    parameter -> `__call__` parameter. Empty where the source is not there or holds other than one such call."""
    with _PARSING:
        return _renamed_check_arguments(cls)


@functools.cache
def _call_source(cls: type) -> tuple[ast.Module, set[str], list[ast.Call]] | None:
    """`cls.__call__`'s source tree, its parameter names and its `self.check_inputs(...)` calls; None where the
    source isn't there."""
    call = getattr(cls, "__call__", None)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(call)))
        call_names = set(inspect.signature(call).parameters)
    except (OSError, TypeError, ValueError, SyntaxError):
        return None
    checks = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "check_inputs" and isinstance(node.func.value, ast.Name)
              and node.func.value.id == "self"]
    return tree, call_names, checks


@functools.cache
def _renamed_check_arguments(cls: type) -> dict[str, str]:
    source = _call_source(cls)
    try:
        check_names = list(inspect.signature(getattr(cls, "check_inputs", None)).parameters)[1:]
    except (TypeError, ValueError):
        source = None
    if source is None:
        return {}
    _, call_names, calls = source
    if len(calls) != 1 or any(isinstance(arg, ast.Starred) for arg in calls[0].args) or any(
            keyword.arg is None for keyword in calls[0].keywords):
        return {}
    fed = list(zip(check_names, calls[0].args)) + [(keyword.arg, keyword.value) for keyword in calls[0].keywords]
    return {name: value.id for name, value in fed
            if isinstance(value, ast.Name) and value.id != name and value.id in call_names}


def checks_input_images(cls: type) -> bool:
    """Whether `cls.__call__` runs its image processor's `check_image_input` on its input images (FLUX.2's
    pipelines: sides of at least 64 px, aspect ratio, area), read from its source once per class."""
    with _PARSING:
        return _checks_input_images(cls)


@functools.cache
def _checks_input_images(cls: type) -> bool:
    source = _call_source(cls)
    return source is not None and any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "check_image_input"
        for node in ast.walk(source[0]))


def arguments_set_before_check(cls: type) -> tuple[dict[str, type], frozenset[str]]:
    """What `cls.__call__` does to its own parameters before its `self.check_inputs(...)` call, read from its source:
    (parameters it wraps in a list where they are a single `T`, as `if isinstance(image, PIL.Image.Image): image =
    [image]` does: name -> T; the other parameters it assigns before the check). Empty where the source isn't there."""
    with _PARSING:
        return _arguments_set_before_check(cls)


@functools.cache
def _arguments_set_before_check(cls: type) -> tuple[dict[str, type], frozenset[str]]:
    source = _call_source(cls)
    if source is None or not source[2]:
        return {}, frozenset()
    tree, call_names, checks = source
    first = min(check.lineno for check in checks)
    before = [node for node in ast.walk(tree) if getattr(node, "lineno", first) < first]
    module = inspect.getmodule(getattr(cls, "__call__", None))
    wrapped = {}
    for node in before:
        name, single = _wrapped_in_list(node, module)
        if name in call_names and single is not None:
            wrapped[name] = single
    assigned = {target.id for node in before if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for target in ast.walk(target) if isinstance(target, ast.Name)}
    return wrapped, frozenset(assigned & call_names - set(wrapped))


def _wrapped_in_list(node: ast.AST, module: Any) -> tuple[str | None, type | None]:
    """(X, T) for `if isinstance(X, T): X = [X]` (no else), resolved in the pipeline's module; else (None, None)."""
    if not (isinstance(node, ast.If) and not node.orelse and len(node.body) == 1
            and isinstance(node.test, ast.Call) and isinstance(node.test.func, ast.Name)
            and node.test.func.id == "isinstance" and len(node.test.args) == 2
            and isinstance(node.test.args[0], ast.Name)):
        return None, None
    name, body = node.test.args[0].id, node.body[0]
    if not (isinstance(body, ast.Assign) and [getattr(t, "id", None) for t in body.targets] == [name]
            and isinstance(body.value, ast.List) and len(body.value.elts) == 1
            and getattr(body.value.elts[0], "id", None) == name):
        return None, None
    single = _resolved(node.test.args[1], vars(module) if module is not None else {})
    return name, single if isinstance(single, type) else None


def _resolved(expression: ast.AST, names: dict[str, Any]) -> Any:
    """The object a dotted name (`PIL.Image.Image`) stands for in `names`, or None."""
    if isinstance(expression, ast.Name):
        return names.get(expression.id)
    if isinstance(expression, ast.Attribute):
        return getattr(_resolved(expression.value, names), expression.attr, None)
    return None


def _passes(pipe: Any, trial: inspect.BoundArguments) -> bool:
    try:
        with check_logs_muted(pipe):  # a trial, not the call's check
            pipe.check_inputs(*trial.args, **trial.kwargs)
    except Exception:  # noqa: BLE001 - still failing (or failing otherwise): not this argument alone
        return False
    return True


class _MutedThreads(logging.Filter):
    """Drops the records of a thread inside `check_logs_muted` (state per thread: no filter list changes per call,
    which a thread logging at the same moment could iterate past)."""

    state = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.state, "depth", 0)


_MUTING = _MutedThreads()


@contextlib.contextmanager
def check_logs_muted(pipe: Any):
    """Drop what this thread logs on the logger of the module that defines the pipeline's `check_inputs` (its
    warnings, e.g. a size it will round): for a check that the pipeline's own call runs again, and logs, later.

    >>> with check_logs_muted(pipe):
    ...     run_check_inputs(pipe, **values)
    """
    check = getattr(unhooked_class(pipe), "check_inputs", None)
    logging.getLogger(getattr(check, "__module__", None) or "diffusers").addFilter(_MUTING)  # once per logger
    state = _MutedThreads.state
    state.depth = getattr(state, "depth", 0) + 1
    try:
        yield
    finally:
        state.depth -= 1


def _call_defaults(cls: type) -> dict[str, Any]:
    parameters = inspect.signature(cls.__call__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not p.empty}


def _same(value: Any, default: Any) -> bool:
    if value is default:
        return True
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - tensors, arrays: not a plain default
        return False
